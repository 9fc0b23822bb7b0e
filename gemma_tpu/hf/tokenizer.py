"""The one tokenizer loader: a model directory's tokenizer through transformers, refusing a directory
that has no tokenizer files (transformers would quietly build an empty placeholder)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from gemma_tpu.core.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def require_tokenizer_files(model_dir: str | Path) -> None:
    """transformers quietly builds an empty placeholder tokenizer for a directory without tokenizer
    files (training then runs on garbage ids): refuse such a directory by name."""
    d = Path(model_dir)
    if d.is_dir() and not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{d}: no tokenizer ({', '.join(TOKENIZER_FILES)})")


def tokens_named(model_dir: str | Path, candidates) -> set[str]:
    """Which of `candidates` the directory's tokenizer.json spells as a token (a JSON string of its own), found
    without decoding the file: Gemma's is ~33 MB, and a server's launch check wants only a few markers."""
    import mmap

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file() or path.stat().st_size == 0:
        return set()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return {c for c in candidates if m.find(json.dumps(c).encode()) >= 0}


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of `model_dir`; a missing or unreadable one is a one-line error naming the directory.

    Built once per process for the same tokenizer files: transformers takes 5-7 s to build the 262k-token
    Gemma tokenizer on the AVX2 EPYC (2026-11-26, hashing its files: 0.1 s), and a process often needs it for
    several directories holding the same files (evaluate's base and a checkpoint on it, a base and its copies
    in the tests). Another directory gets its own shallow copy naming it; nothing of ours changes a loaded tokenizer."""
    require_tokenizer_files(model_dir)
    d = Path(model_dir)
    if not d.is_dir():  # a hub id: transformers resolves and caches it
        return _load(str(model_dir))
    key = _content_key(d)
    tok = _LOADED.get(key)
    if tok is None:
        tok = _LOADED[key] = _load(str(d))
        _forget_oldest(_LOADED)
    if tok.name_or_path != str(d):  # the same object for the same directory each time, whatever loaded first
        named = _NAMED.get((key, str(d)))
        if named is None or named._tokenizer is not tok._tokenizer:
            named = object.__new__(type(tok))  # not copy.copy: it round-trips the Rust tokenizer through JSON (6 s)
            named.__dict__.update(tok.__dict__)
            named.name_or_path = str(d)
            _NAMED[(key, str(d))] = named
            _forget_oldest(_NAMED)
        tok = named
    return tok


def _forget_oldest(cache: dict) -> None:
    while len(cache) > 4:  # the oldest goes (a process rarely holds more than two tokenizers)
        del cache[next(iter(cache))]


# what transformers reads into the tokenizer besides tokenizer.json/.model and tokenizer_config.json
_ALSO_READ = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "vocab.json", "merges.txt")


def _content_key(d: Path) -> tuple:
    """The bytes transformers builds the tokenizer from, and config.json's model_type (it picks the class when
    tokenizer_config.json does not name one)."""
    key = []
    for f in sorted(d.iterdir()):
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in _ALSO_READ):
            h = hashlib.blake2b(digest_size=16)
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            key.append((f.name, h.hexdigest()))
    try:
        key.append(("model_type", json.loads((d / "config.json").read_text()).get("model_type")))
    except (OSError, ValueError, AttributeError):
        key.append(("model_type", None))
    return tuple(key)


_LOADED: dict[tuple, object] = {}  # content key -> the tokenizer as built, named after the first directory
_NAMED: dict[tuple, object] = {}  # (content key, directory) -> a shallow copy naming another directory


def _load(model_dir: str):
    try:
        cls = _named_class(Path(model_dir))
        if cls is None:
            from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

            cls = AutoTokenizer
        return cls.from_pretrained(model_dir)
    except Exception as e:
        raise UserError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__}: {e})") from None


def _named_class(d: Path):
    """The class AutoTokenizer would pick, where tokenizer_config.json names it and nothing can override that;
    None sends the directory through AutoTokenizer.

    Why not always AutoTokenizer: importing it imports transformers' auto-model machinery and with it
    torch._dynamo, ~2.5 s of every command's start on the AVX2 EPYC (benchmarks/startup.py), for a class the
    directory names. AutoTokenizer departs from the named class only for remote code (`auto_map`) and for model
    types it knows to name a wrong class; Gemma's are not among them, so a directory whose config.json says a
    Gemma model type (or has no config.json) gets the named class, as AutoTokenizer would give it
    (tests/test_models.py and, on the real tokenizer, tests/test_assets.py compare the two)."""
    if not d.is_dir():
        return None
    try:
        tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
        model_cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    except (OSError, ValueError):
        return None
    if not isinstance(tok_cfg, dict) or not isinstance(model_cfg, dict) or "auto_map" in tok_cfg:
        return None
    name, model_type = tok_cfg.get("tokenizer_class"), model_cfg.get("model_type")
    if not isinstance(name, str) or not (model_type is None or str(model_type).startswith("gemma")):
        return None
    import transformers  # deferred: transformers takes seconds to import

    if name not in ("TokenizersBackend", "PreTrainedTokenizerFast"):  # v5 has one class per tokenizer
        name = name.removesuffix("Fast")
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedTokenizerBase) \
            or cls.__name__ == "PythonBackend":
        return None
    return cls
