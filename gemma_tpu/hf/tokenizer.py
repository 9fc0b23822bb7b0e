"""The one tokenizer loader: a model directory's tokenizer through transformers, refusing a directory
that has no tokenizer files (transformers would quietly build an empty placeholder)."""

from __future__ import annotations

from pathlib import Path

from gemma_tpu.core.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def require_tokenizer_files(model_dir: str | Path) -> None:
    """transformers quietly builds an empty placeholder tokenizer for a directory without tokenizer
    files (training then runs on garbage ids): refuse such a directory by name."""
    d = Path(model_dir)
    if d.is_dir() and not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{d}: no tokenizer ({', '.join(TOKENIZER_FILES)})")


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of `model_dir`; a missing or unreadable one is a one-line error naming the directory."""
    from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

    require_tokenizer_files(model_dir)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise UserError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
