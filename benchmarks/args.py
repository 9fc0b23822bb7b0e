"""Checks of the model a benchmark is given, made in the parent before anything runs: a directory that is not there
was a traceback (the parent's, or a child's after the children before it had run)."""

from __future__ import annotations

from pathlib import Path


def check_model(spec: str, flag: str) -> None:
    """Refuse a local model/tokenizer directory that is not there, naming `flag`, in one line (`UserError`).
    embedded:NAME and shape:NAME are the children's to prepare, and an `owner/name` hub id theirs to download."""
    from gemma_tpu.hf.directory import resolve_path

    if spec.startswith(("embedded:", "shape:")):
        return
    if Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        resolve_path(spec, what=flag)
