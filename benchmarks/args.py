"""Checks of the model a benchmark is given, made in the parent before anything runs: a directory that is not there
was a traceback (the parent's, or a child's after the children before it had run)."""

from __future__ import annotations

from pathlib import Path


def check_model(spec: str, flag: str) -> None:
    """Refuse a local model/tokenizer directory that is not there, naming `flag`, in one line (`UserError`).
    embedded:NAME and shape:NAME are the children's to prepare. An `owner/name` that is no directory here must be a
    hub model already downloaded to this machine (the Hugging Face cache): benchmarks do not download. It was let
    through as a hub id, and each child then tried the hub on its own (a download timed as startup, or, offline, a
    child failing after the ones before it had run); a mistyped `runs/merged` went the same way."""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.hf.directory import resolve_path

    if spec.startswith(("embedded:", "shape:")):
        return
    if Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        resolve_path(spec, what=flag)
        return
    if not _downloaded(spec):
        raise UserError(f"{flag} {spec}: no such directory, nor a hub model downloaded to this machine; benchmarks do "
                        f"not download: give a local directory (e.g. `hf download {spec} --local-dir DIR`, then "
                        f"{flag} DIR)")


def _downloaded(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds `repo_id`'s config.json (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # not a valid repo id, no huggingface_hub: not downloaded
        return False


def check_input(path: str, flag: str) -> None:
    """Refuse an input file (`--data`) that is not there, naming `flag`, in one line: it was found by a child, after
    the parent had started it ('the separate child failed (exit 2); its output is above')."""
    from gemma_tpu.core.errors import UserError

    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise UserError(f"{flag} {path}: not a file")
