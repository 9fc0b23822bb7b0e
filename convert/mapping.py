"""Where each checkpoint tensor lands in a Hugging Face checkpoint, derived from the registry.

Two cases:

* LoRA: for every (layer, projection) a `LoraSite` names the HF weight and the Tunix factor pair.
  The Tunix weight's axis sizes are read off the factors themselves (A = in axes + r,
  B = r + the other axes, Qwix's layout), so no per-family shape table is needed and a checkpoint
  that does not fit the base is caught by comparing shapes before anything is written.
* Full fine-tune: every Tunix param maps to one HF key (a fused weight such as `kv_einsum` to
  several). Projections come from `Projection.tunix_to_hf`; embeddings, norms and the other
  weights from the family's `Tensor` table (a rename, or a regrouping of axes), all registry data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from gemma_tpu.core.errors import UserError
from gemma_tpu.models.registry import Family, Projection, Tensor


def tunix_layer_name(family: Family, layer: int, proj: Projection, param: str) -> str:
    return f"{family.layer_path.format(layer=layer)}.{proj.tunix_module}.{param}"


@dataclasses.dataclass(frozen=True)
class LoraSite:
    """One HF weight that receives a LoRA update, and the Tunix factors that make it."""

    layer: int
    proj: Projection
    hf_key: str
    a_name: str
    b_name: str


def lora_sites(family: Family, tunix_cfg: Any, prefix: str, targets: list[str]) -> list[LoraSite]:
    """Every (layer, targeted projection) that exists, projection-major as the targets are listed."""
    chosen = family.targets_to_modules(tunix_cfg, list(targets))
    by_proj = sorted(family.layer_sites(tunix_cfg, chosen), key=lambda s: chosen.index(s[1]))
    sites = []
    for layer, proj in by_proj:
        a, b = proj.tunix_lora_names()
        sites.append(LoraSite(layer, proj, family.hf_key(prefix, layer, proj),
                              tunix_layer_name(family, layer, proj, a), tunix_layer_name(family, layer, proj, b)))
    return sites


def axis_sizes_from_factors(proj: Projection, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> dict[str, int]:
    """Qwix LoRA factors: A = (*in_axes, r), B = (r, *other axes in weight order)."""
    others = [x for x in proj.axes if x not in proj.in_axes]
    if len(a_shape) != len(proj.in_axes) + 1 or len(b_shape) != len(others) + 1:
        raise UserError(f"{proj.tunix_module}: LoRA factors of shapes {a_shape} / {b_shape} do not fit the "
                        f"Tunix weight axes {proj.axes}")
    return {**dict(zip(proj.in_axes, a_shape[:-1])), **dict(zip(others, b_shape[1:]))}


def weight_shape(proj: Projection, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[x] for x in proj.axes)


def hf_shape(proj: Projection, sizes: dict[str, int]) -> tuple[int, int]:
    """The HF (out, in) shape of this projection's slice of a Tunix weight with these axis sizes."""
    return math.prod(sizes[x] for x in proj.out_axes), math.prod(sizes[x] for x in proj.in_axes)


@dataclasses.dataclass(frozen=True)
class FullSite:
    """One HF tensor produced from a full fine-tune's Tunix param."""

    hf_key: str
    tunix_name: str
    proj: Projection | Tensor  # how the Tunix array becomes the HF one

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        return self.proj.tunix_to_hf(value)

    def hf_shape(self, tunix_shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.proj.hf_shape_of(tuple(tunix_shape))


def full_sites(family: Family, tunix_cfg: Any, prefix: str) -> dict[str, FullSite]:
    """HF key -> where it comes from in a full fine-tune checkpoint (every decoder tensor)."""
    if not family.tensors:
        raise UserError(f"full fine-tune merge has no parameter table for family {family.name}")
    return {hf_key: FullSite(hf_key, tunix_name, how)
            for hf_key, tunix_name, how in family.weight_sources(tunix_cfg, prefix)}

