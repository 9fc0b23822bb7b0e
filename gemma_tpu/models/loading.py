"""Resolve `model.path` to a local HF directory and load it into a Tunix model.

`model.path` is a local directory, a hub id (`org/name`, fetched with `snapshot_download`, which
honours `HF_HUB_OFFLINE`), or `embedded:NAME` (a model the project builds from a PyPI package).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from gemma_tpu.errors import UserError, read_json_object
from gemma_tpu.models.registry import Family, detect_family

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclasses.dataclass
class ResolvedModel:
    """A base checkpoint on local disk, with what we know about it."""

    spec: str  # what the user wrote
    local_dir: Path
    hf_config: dict
    family: Family
    revision: str | None = None


def resolve_path(spec: str, revision: str | None = None) -> Path:
    """Turn a local dir / hub id / embedded:NAME into a local directory."""
    if spec.startswith("embedded:"):
        from gemma_tpu import assets

        return Path(assets.resolve_embedded(spec))
    p = Path(spec).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UserError(f"model.path {spec}: not a directory")
        return p
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(
                repo_id=spec,
                revision=revision,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model"],
            )
        except Exception as e:  # network off, offline mode, gated or missing repo
            raise UserError(f"model.path {spec}: not a local directory and not downloadable from the hub "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        return Path(local)
    raise UserError(f"model.path {spec}: no such directory")


def read_hf_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    return read_json_object(path, f"{path}: missing (not a Hugging Face model directory)")


def resolve_model(spec: str, revision: str | None = None, family: str | None = None) -> ResolvedModel:
    from gemma_tpu.models.registry import get_family

    local = resolve_path(spec, revision)
    hf_config = read_hf_config(local)
    fam = get_family(family) if family else detect_family(hf_config, str(local / "config.json"))
    return ResolvedModel(spec=spec, local_dir=local, hf_config=hf_config, family=fam, revision=revision)


def safetensors_keys(model_dir: Path) -> dict[str, str]:
    """key -> file name, from the index when present, else from each file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index}: not a valid safetensors index ({e})") from None
        for fname in set(weight_map.values()):
            if not (model_dir / fname).is_file():
                raise UserError(f"{index}: shard {fname} is missing")
        return dict(weight_map)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors weights (only safetensors are loaded)")
    from safetensors import safe_open

    keys: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="np") as h:
                for k in h.keys():
                    keys[k] = f.name
        except Exception as e:
            raise UserError(f"{f}: not a readable safetensors file ({e})") from None
    return keys


def text_prefix(family: Family, keys: dict[str, str] | list[str]) -> str:
    """Which of the family's decoder prefixes this checkpoint uses."""
    for prefix in sorted(family.text_prefixes, key=len, reverse=True):
        if any(k.startswith(prefix + "layers.") for k in keys):
            return prefix
    raise UserError(f"no decoder layers found under any of {', '.join(family.text_prefixes)}")


def check_weights(resolved: ResolvedModel, tunix_cfg: Any) -> str:
    """Fail early, naming the first missing or misshapen tensor, before Tunix's loader runs."""
    keys = safetensors_keys(resolved.local_dir)
    prefix = text_prefix(resolved.family, keys)
    needed = [f"{prefix}embed_tokens.weight", f"{prefix}norm.weight"]
    for layer in range(tunix_cfg.num_layers):
        needed += [resolved.family.hf_key(prefix, layer, p) for p in resolved.family.layer_projections(tunix_cfg, layer)]
    needed += [prefix + hf for _, hf, _ in resolved.family.expanded_tensors(tunix_cfg)]  # norms, per-layer inputs
    for k in dict.fromkeys(needed):
        if k not in keys:
            raise UserError(f"{resolved.local_dir}: weight '{k}' is missing from the checkpoint")
    extra = [k for k in keys if re.match(re.escape(prefix) + r"layers\.(\d+)\.", k)
             and int(k[len(prefix) + 7:].split(".")[0]) >= tunix_cfg.num_layers]
    if extra:
        raise UserError(f"{resolved.local_dir}: weight '{extra[0]}' beyond num_hidden_layers={tunix_cfg.num_layers}")
    return prefix


def load_model(resolved: ResolvedModel, dtype: str = "float32", remat: str = "none", mesh=None):
    """Build the Tunix config from config.json and load the weights into a Tunix model."""
    import jax.numpy as jnp

    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    tunix_cfg = resolved.family.tunix_config(resolved.hf_config, jdtype)
    tunix_cfg = resolved.family.with_remat(tunix_cfg, remat)
    check_weights(resolved, tunix_cfg)
    log.info("loading %s (%s, %d layers) from %s", resolved.spec, resolved.family.name, tunix_cfg.num_layers,
             resolved.local_dir)
    model = resolved.family.create_model(str(resolved.local_dir), tunix_cfg, mesh=mesh, dtype=jdtype)
    return model, tunix_cfg


def hf_revision(model_dir: Path) -> str | None:
    """The hub commit of a snapshot directory (…/snapshots/<sha>), when there is one."""
    parts = Path(model_dir).resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots":
        return parts[-1]
    return os.environ.get("GEMMA_TPU_BASE_REVISION")
