"""`model.path` → a family-checked Tunix model: resolve the directory (gemma_tpu.hf), detect the family,
check every tensor is present, then load it (sharded, through the family's loader)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from gemma_tpu.core.errors import UserError
from gemma_tpu.hf.directory import (
    MERGE_RECORD,
    check_revision_applies,
    check_same_directory,
    dir_identity,
    naming_config_file,
    read_hf_config,
    recorded_family,
    resolve_path,
    safetensors_keys,
)
from gemma_tpu.models.registry import Family, choose_family, described_family
from gemma_tpu.models.sharded_weights import check_weight_headers

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ResolvedModel:
    """A base checkpoint on local disk, with what we know about it."""

    spec: str  # what the user wrote
    local_dir: Path
    hf_config: dict
    family: Family
    revision: str | None = None
    ident: tuple[int, int] | None = None  # `dir_identity` of local_dir before its config.json was read

    def check_unchanged(self) -> None:
        """Refuse when another directory was published at local_dir since its config.json was read (see
        `check_same_directory`): call it once the tokenizer and the weights' headers (or the weights) are read."""
        check_same_directory(self.local_dir, self.ident)

    @property
    def text_config(self) -> dict:
        """The decoder's config as transformers reads it (keys config.json omits at its defaults)."""
        with naming_config_file(self.local_dir / "config.json"):
            return self.family.read_text_config(self.hf_config)

    def tunix_config(self, dtype: Any = None) -> Any:
        """The family's Tunix ModelConfig of this config.json; its refusals name the file."""
        with naming_config_file(self.local_dir / "config.json"):
            return self.family.tunix_config(self.hf_config, dtype)

    @property
    def max_positions(self) -> int | None:
        """The context length the model was built for (`max_position_embeddings` of its text config)."""
        v = self.text_config.get("max_position_embeddings")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def resolve_model(spec: str, revision: str | None = None, family: str | None = None,
                  family_key: str = "model.family", what: str = "model.path") -> ResolvedModel:
    """`family_key` names where `family` came from, for the error when it is unknown, and `what` where `spec` did
    (`resolve_path`). Without `family`, a merged directory's is the one its merge recorded (`recorded_family`), else
    the one config.json describes."""
    local = resolve_path(spec, revision, what)
    check_revision_applies(spec, local, revision)
    ident = dir_identity(local)
    hf_config = read_hf_config(local)
    if not family:
        family, family_key = recorded_family(local), f"{local / MERGE_RECORD}: base.family"
    fam = choose_family(hf_config, family, family_key, str(local / "config.json"))
    resolved = ResolvedModel(spec=spec, local_dir=local, hf_config=hf_config, family=fam, revision=revision,
                             ident=ident)
    resolved.text_config  # a value transformers cannot build a model from is refused here, naming the file
    return resolved


def directory_family(model_dir: Path, hf_config: dict) -> Family | None:
    """The family of a Hugging Face directory as `resolve_model` finds it: the one its merge recorded (refused where
    config.json contradicts it), else the one config.json describes; None where neither says (a model no family
    claims, which tools reading it with transformers alone still take)."""
    family = recorded_family(model_dir)
    if family:
        return choose_family(hf_config, family, f"{model_dir / MERGE_RECORD}: base.family",
                             str(model_dir / "config.json"))
    return described_family(hf_config, str(model_dir / "config.json"))


def check_weight_files(resolved: ResolvedModel, tunix_cfg: Any) -> None:
    """What the weights' safetensors headers and index tell, no weight read: the files readable, every
    tensor the model reads present with the shape config.json implies, no decoder layer past
    num_hidden_layers. Training runs it before preparing the data, so these errors come first."""
    keys = safetensors_keys(resolved.local_dir)
    prefix = resolved.family.text_prefix(keys)
    extra = [k for k in keys if re.match(re.escape(prefix) + r"layers\.(\d+)\.", k)
             and int(k[len(prefix) + 7:].split(".")[0]) >= tunix_cfg.num_layers]
    if extra:
        raise UserError(f"{resolved.local_dir}: weight '{extra[0]}' beyond num_hidden_layers={tunix_cfg.num_layers}")
    check_weight_headers(resolved.family, resolved.local_dir, tunix_cfg)


def check_weights(resolved: ResolvedModel, tunix_cfg: Any) -> None:
    """Fail early, naming the first missing, misshapen or contradicting tensor, before the loader runs."""
    check_weight_files(resolved, tunix_cfg)
    keys = safetensors_keys(resolved.local_dir)
    check_output_projection(resolved.local_dir, [k for k in keys if k.endswith("lm_head.weight")],
                            f"{resolved.family.text_prefix(keys)}embed_tokens.weight")


def check_output_projection(model_dir: Path, heads: list[str], embedding: str) -> None:
    """A tied checkpoint (untied ones are refused by the family) that also stores an `lm_head.weight` is
    tied by transformers only when the two are equal; otherwise transformers warns and projects with the
    stored lm_head, an untied model. Tunix's Gemma projects with the embedding, so such a checkpoint would
    train and merge another model than the one transformers runs: refused, naming both tensors."""
    if not heads:
        return
    from gemma_tpu.hf import safetensors_io as sio

    weights = sio.WeightsDir(model_dir)
    emb = weights[embedding]
    for head in heads:
        t = weights[head]
        same = t.shape == emb.shape and all(
            np.array_equal(weights.read_rows(head, a, b).astype(np.float32),
                           weights.read_rows(embedding, a, b).astype(np.float32))
            for a, b in sio.row_chunks(tuple(emb.shape), max(t.np_dtype.itemsize, emb.np_dtype.itemsize)))
        if not same:
            raise UserError(f"{model_dir}: weight '{head}' differs from '{embedding}' although config.json ties "
                            f"them (tie_word_embeddings); transformers then keeps it as a separate output "
                            f"projection, which Tunix's Gemma does not have")


def load_model(resolved: ResolvedModel, dtype: str = "float32", remat: str = "none", mesh=None):
    """Build the Tunix config from config.json and load the weights into a Tunix model."""
    import jax.numpy as jnp

    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    tunix_cfg = resolved.tunix_config(jdtype)
    tunix_cfg = resolved.family.with_remat(tunix_cfg, remat)
    check_weights(resolved, tunix_cfg)
    log.info("loading %s (%s, %d layers) from %s", resolved.spec, resolved.family.name, tunix_cfg.num_layers,
             resolved.local_dir)
    model = resolved.family.create_model(str(resolved.local_dir), tunix_cfg, mesh=mesh, dtype=jdtype)
    resolved.check_unchanged()  # config.json (and the tokenizer, read before) are of the directory the weights are
    return model, tunix_cfg
