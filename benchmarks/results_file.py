"""A benchmark's `--json` results file: refused before the run when it cannot be written (a directory, a folder
that is not writable, a path under a file, one of the run's inputs), where the run's minutes of measurement were
lost to a traceback at its end; then written all at once, never cut short (Ctrl-C or a full disk mid-write)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gemma_tpu.core import strict_json
from gemma_tpu.core.atomic import check_results_file, write_text_atomic
from gemma_tpu.core.errors import UserError


def check_json(path: str | Path | None, inputs: dict[str, str | Path | None] | None = None,
               results_key: str = "machine") -> None:
    """One `error:` line (exit 1) now for a --json that the end of the run could not write, or that would replace a
    file other than an earlier result of the benchmark (one holding `results_key`); nothing written."""
    try:
        check_results_file(path, inputs or {}, results_key=results_key)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None


def write_json(path: str | Path, doc: Any, indent: int = 2) -> Path:
    """`doc` as JSON at `path` (its folder made), published whole."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(out, strict_json.dumps(doc, indent=indent) + "\n")
