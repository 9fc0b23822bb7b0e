"""One error type for bad user input (`UserError`: the message names the file, line or key; entry
points print it as one line through `gemma_tpu.core.cli.cli_main`), and a checked JSON-object reader."""

from __future__ import annotations

import reprlib
from typing import Any


class UserError(Exception):
    """Bad input that the user can fix; the message names the file, line or key."""

    exit_code = 2


_SHOWN = reprlib.Repr()  # a value quoted in an error: a 5,000-item list in the wrong place made a 35 KB line, an
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 6, 6, 6  # alias of an alias (YAML's "billion
_SHOWN.maxstring = _SHOWN.maxother = 80  # laughs") a 34 MB one, a message's text given as its role a 10 KB one


def shown(value: Any) -> str:
    """`repr(value)` for an error message, cut to a line: long texts and large or deep structures elided."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 120 else text[:116] + " ..."


class SignalExit(SystemExit):
    """The exit a signal handler asks for (`SystemExit(128 + signum)`), carrying `signum` so that one
    raised where Python can only report it, not propagate it (a gc callback: jax registers one), is
    delivered again (`gemma_tpu.core.cli.cli_main`)."""

    def __init__(self, signum: int, after: str = ""):
        super().__init__(128 + signum)
        self.signum = signum
        self.after = after  # what was done before it, said in its message (`interrupted_after`)


def interrupted_after(exc: BaseException, done: str) -> BaseException:
    """The same interruption (a KeyboardInterrupt, a `SignalExit`), saying what was done before it: `cli_main`
    prints `error: interrupted after <done>` (exit 130, 143 as before). A Ctrl-C that landed while an output was
    published (the new one already in place) printed a bare 'interrupted', which read as nothing published."""
    if isinstance(exc, SignalExit):
        return SignalExit(exc.signum, after=done)
    return KeyboardInterrupt(done)


def raise_signal_exit(signum, frame):  # noqa: ARG001
    """A signal handler (for SIGTERM) that raises `SignalExit`, so that `finally` blocks and handlers run."""
    raise SignalExit(signum)


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
