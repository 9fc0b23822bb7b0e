"""One reader of Hugging Face model directories: where the directory is (local, hub, embedded), its
config.json, its weight index and its hub revision."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from gemma_tpu.core.errors import UserError, read_json_object

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_path(spec: str, revision: str | None = None) -> Path:
    """Turn a local dir / hub id / embedded:NAME into a local directory."""
    if spec.startswith("embedded:"):
        from gemma_tpu.assets import embedded as assets  # deferred: builds from GGUF with torch

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


def hf_revision(model_dir: Path) -> str | None:
    """The hub commit of a snapshot directory (…/snapshots/<sha>), when there is one."""
    parts = Path(model_dir).resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots":
        return parts[-1]
    return os.environ.get("GEMMA_TPU_BASE_REVISION")
