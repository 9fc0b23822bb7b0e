"""Checkpoint → model: the one place where a gemma-tpu run directory becomes a Tunix model again.

The base named in the run's metadata is loaded (the local directory recorded at training time, else
its spec at the recorded hub revision), LoRA is applied with the recorded rank, alpha and targets
(and, unless the caller asks otherwise, the recorded QLoRA base quantization), and one step's params
are put in, insisting that model and checkpoint hold exactly the same tensors with the same shapes.

Users: `gemma_tpu.infer.generate.load_checkpoint` (and through it `evaluate` and the fitness chat),
and `convert.verify` (the JAX reference of a merge); `convert.source` resolves the base with
`base_dir` too, so the merger, the exporter and the model restored here read the same base.

jax and flax are imported inside the functions: the converters import this module for `base_dir`
without needing a JAX runtime at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from gemma_tpu.checkpoint.metadata import METADATA_FILE, read_metadata, resolve_step
from gemma_tpu.checkpoint.params import CheckpointParams
from gemma_tpu.core.config import LoraConfig
from gemma_tpu.core.errors import UserError
from gemma_tpu.hf.directory import resolve_path
from gemma_tpu.hf.fingerprint import check_base
from gemma_tpu.lora import apply_lora
from gemma_tpu.models import Family, load_model, resolve_model

log = logging.getLogger(__name__)


class NoBaseModel(UserError):
    """The run's metadata names no base model (a converter then asks for --base)."""


@dataclasses.dataclass
class RestoredModel:
    """A checkpoint's model with what is needed to talk to it."""

    model: Any  # Tunix nnx model, LoRA applied when the run trained LoRA
    tunix_cfg: Any
    family: Family
    tokenizer_dir: Path  # the base's directory: its tokenizer is the run's
    token_map: dict[str, str]  # FunctionGemma markers -> the tokens the run trained them on
    chat_format: str
    meta: dict  # the run's metadata (gemma_tpu_run.json)
    ckpt_dir: Path
    step: int
    max_positions: int | None = None  # the base's context length (max_position_embeddings)


def base_dir(ckpt_dir: str | Path, meta: dict, override: str | Path | None = None, weights: bool = True) -> Path:
    """The base model's local directory: `override` if given, else the local directory recorded at
    training time when it still exists, else the recorded spec (hub id / embedded:NAME) resolved at the
    recorded revision, so a hub base comes back exactly as it was trained on. `weights`: a hub snapshot must
    hold the weights (`resolve_path`); False where only its tokenizer is read."""
    if override:  # every caller's override is a --base flag: an error named model.path, a key nobody had set
        return resolve_path(str(override), what="--base", weights=weights)
    base = meta.get("base_model") or {}
    local = base.get("local_dir")
    if local and Path(local).is_dir():
        return Path(local)
    if not base.get("path"):
        raise NoBaseModel(f"{ckpt_dir}: metadata records no base model")
    return resolve_path(base["path"], base.get("revision"), weights=weights)


def lora_config(ckpt_dir: str | Path, meta: dict, step: int, holds_factors: bool) -> LoraConfig | None:
    """The run's LoRA as recorded (None for a full fine-tune), checked against what step `step` holds
    (`holds_factors`: LoRA factors, else full parameters); a missing rank/alpha/targets is an error.
    Metadata without LoRA settings (`"lora": null`, `{}` or absent; the trainer always writes them) is taken for
    what the step holds: full parameters are a full fine-tune's (it was refused as 'lora.rank is missing');
    LoRA factors, whose rank, alpha and targets nobody recorded, are refused so."""
    lora = meta.get("lora")
    where = Path(ckpt_dir) / METADATA_FILE
    if not lora:  # null, absent or {}: as `convert.inspect` says, not recorded
        if holds_factors:
            state = "absent" if "lora" not in meta else "null" if lora is None else "empty"
            raise UserError(f"{where}: lora is {state} (no LoRA settings recorded) but step {step} holds LoRA "
                            f"factors: their rank, alpha and targets are unknown")
        return None
    enabled = lora.get("enabled", True)
    if enabled != holds_factors:
        raise UserError(f"{ckpt_dir}: metadata says {'LoRA' if enabled else 'full fine-tune'} but step {step} holds "
                        f"{'LoRA factors' if holds_factors else 'full parameters'}")
    if not enabled:
        return None
    for key in ("rank", "alpha", "targets"):
        if lora.get(key) in (None, "", []):
            raise UserError(f"{ckpt_dir}: metadata lora.{key} is missing")
    try:
        rank, alpha = int(lora["rank"]), float(lora["alpha"])
    except (TypeError, ValueError):
        raise UserError(f"{ckpt_dir}: metadata lora.rank / lora.alpha are not numbers "
                        f"({lora['rank']!r}, {lora['alpha']!r})") from None
    return LoraConfig(rank=rank, alpha=alpha, targets=list(lora["targets"]),
                      base_quantization=lora.get("base_quantization"))


def check_recorded_targets(ckpt_dir: str | Path, family: Family, tunix_cfg: Any, lora: LoraConfig) -> None:
    """The run's recorded lora.targets name projections of its model (`Family.targets_to_modules`); one that does
    not (`embed_tokens`, an edited file) is refused naming the metadata file: the registry's message named
    `lora.targets` alone, which read as the config's key."""
    try:
        family.targets_to_modules(tunix_cfg, list(lora.targets))
    except UserError as e:
        raise UserError(f"{Path(ckpt_dir) / METADATA_FILE}: {e}") from None


def locate(ckpt_dir: str | Path, step: int | None = None,
           base: str | Path | None = None) -> tuple[dict, int, Path]:
    """The run's metadata, the step (the latest by default) and the base directory, checked without loading
    anything: what a caller can test before minutes of other work."""
    meta = read_metadata(ckpt_dir)
    return meta, resolve_step(ckpt_dir, step), base_dir(ckpt_dir, meta, base)


def restore_model(ckpt_dir: str | Path, step: int | None = None, dtype: str | None = None, *,
                  apply_base_quantization: bool = True, base: str | Path | None = None) -> RestoredModel:
    """The run's base with the params of one step (the latest by default).

    dtype: the model's dtype (default: the run's `model.dtype`, else float32).
    apply_base_quantization: quantize the frozen base as a QLoRA run did in training (the model as it
        was trained); False gives the dense base with the same LoRA factors (the model a merge makes).
    base: a base directory to use instead of the recorded one (`merge_orbax --base`), checked by the caller.
    The recorded base is checked against the fingerprint taken at training (`gemma_tpu.hf.fingerprint`), as the
    merge, the PEFT export and a resume check it: evaluate and chat ran a checkpoint on a base replaced since
    by another model of the same shapes without a word.
    """
    from flax import nnx

    ckpt_dir = Path(ckpt_dir)
    meta, step, base_path = locate(ckpt_dir, step, base)
    if base is None:
        check_base((meta.get("base_model") or {}).get("fingerprint"), base_path, False,
                   "merge it with convert.merge_orbax --allow-base-mismatch and load the merged directory",
                   lambda msg: log.warning("%s: %s", ckpt_dir, msg))
    stored = CheckpointParams(ckpt_dir, step)
    lora = lora_config(ckpt_dir, meta, step, stored.holds_lora_factors)
    resolved = resolve_base(ckpt_dir, meta, base_path)
    model, tunix_cfg = load_model(resolved, dtype or meta.get("dtype") or "float32")
    params = stored.read(stored.names())
    where = f"{ckpt_dir}/{step}"
    if lora is not None:
        if not apply_base_quantization:
            lora = dataclasses.replace(lora, base_quantization=None)
        check_recorded_targets(ckpt_dir, resolved.family, tunix_cfg, lora)
        model = apply_lora(model, resolved.family, tunix_cfg, lora)
        set_params(model, nnx.LoRAParam, params, where)
    else:
        set_params(model, nnx.Param, params, where)
    return RestoredModel(model, tunix_cfg, resolved.family, Path(resolved.local_dir),
                         dict(meta.get("token_map") or {}), run_chat_format(meta, resolved), meta, ckpt_dir, step,
                         resolved.max_positions)


def resolve_base(ckpt_dir: Path, meta: dict, base_path: Path):
    """The base directory resolved as the family the run recorded (a `ResolvedModel`: no weight read)."""
    recorded = (meta.get("base_model") or {}).get("family")
    return resolve_model(str(base_path), family=recorded, family_key=f"{ckpt_dir / METADATA_FILE}: base_model.family")


def run_chat_format(meta: dict, resolved) -> str:
    """The chat format the run trained on (its metadata's), else its base family's."""
    return meta.get("chat_format") or resolved.family.chat_format


def set_params(model, kind, params: dict[str, np.ndarray], where: str) -> None:
    """Copy checkpoint arrays onto the model's parameters of `kind` (cast to the model's dtype),
    insisting on a full match: every parameter present with its shape, no checkpoint tensor left over."""
    import jax.numpy as jnp
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(model, kind))
    seen = set()
    for path, leaf in flat:
        name = ".".join(str(p) for p in path)
        if name not in params:
            raise UserError(f"{where}: parameter {name} is missing from the checkpoint")
        value = params[name]
        current = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
        if tuple(value.shape) != tuple(current.shape):
            raise UserError(f"{where}: {name} has shape {value.shape}, the model expects {current.shape}")
        new = jnp.asarray(value, current.dtype)
        if hasattr(leaf, "set_value"):
            leaf.set_value(new)
        else:
            leaf.value = new
        seen.add(name)
    if not seen:
        raise UserError(f"{where}: the model has no parameters to restore")
    extra = sorted(set(params) - seen)
    if extra:
        raise UserError(f"{where}: checkpoint tensor {extra[0]} has no place in the model")
    nnx.update(model, nnx.from_flat_state(flat))
