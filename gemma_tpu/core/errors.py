"""One error type for bad user input, and the CLI wrapper that turns it into one line.

Entry points raise `UserError` for anything the user can fix (a path, a key, a line of data).
`cli_main` prints it as `error: ...` on stderr and exits non-zero without a traceback, unless
`--debug` is on the command line or GEMMA_TPU_DEBUG=1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence


class UserError(Exception):
    """Bad input that the user can fix; the message names the file, line or key."""

    exit_code = 2


def cli_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run `main(argv)` and map `UserError` (and a few OS errors) to a one-line message."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("GEMMA_TPU_DEBUG") == "1"
    if "--debug" in args:
        args.remove("--debug")
    parser_error = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _argparse_error  # usage mistakes are one line too, not usage + exit
    try:
        return int(main(args) or 0)
    except UserError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a missing file, no permission, a full disk (ENOSPC), a file too large...
        if debug:
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    finally:
        argparse.ArgumentParser.error = parser_error


def _argparse_error(parser, message: str):
    """argparse's `error`, as a UserError: `error: python -m X: argument --y: ... (see --help)`."""
    raise UserError(f"{parser.prog}: {message} (see --help)")


def read_json_object(path, missing: str) -> dict:
    """A JSON object from `path`; a missing file, bad JSON or a non-object is a one-line UserError."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise UserError(missing)
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object")
    return obj
