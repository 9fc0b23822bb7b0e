"""Sliding-window attention by token positions rather than row indices.

Tunix's Gemma 3 and Gemma 4 build the multi-token (prefill/training) sliding-window band from row
indices: row t sees key row s when |t - s| < window. That is the right band only when a row's
positions are its indices, as in one example per row or plain packing. A shared-prefix row
`[P | S1 | S2]` places S2 after S1, so S2's rows are further from P than its positions are, and a
prefix-cached prefill starts at a cache slot other than 0. For both, the band is taken from what
the tokens' positions say (`pos[q] - pos[k] < window`, the band transformers and vLLM use), put
into the mask each sliding layer receives, and the layer's own row band is widened to the whole
row for the duration of the forward so that it cuts nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

from gemma_tpu.core.errors import UserError


def configured_size(text_config: dict, default: int) -> int:
    """`sliding_window` of an HF text config: absent means the family's transformers default; null is
    refused, as transformers' sliding-window mask refuses it (reading it as the default would train and
    serve a model whose sliding layers see other tokens than the reference's)."""
    layer_types = text_config.get("layer_types")
    if "sliding_window" not in text_config or (layer_types and "sliding_attention" not in layer_types):
        return default  # absent, or no layer reads it
    size = text_config["sliding_window"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise UserError(f"config.json: sliding_window={size!r} must be a positive integer (the model has "
                        f"sliding-window layers)")
    return size


def window(attn: Any) -> int | None:
    """The sliding window of a Tunix attention module, or None for a global layer."""
    if getattr(attn.attn_type, "name", str(attn.attn_type)) != "LOCAL_SLIDING":
        return None
    if hasattr(attn, "sliding_window_size"):  # Gemma 3 keeps it on the module
        return attn.sliding_window_size
    return attn.config.sliding_window_size  # Gemma 4 reads it from its config


def set_window(attn: Any, size: int) -> None:
    """Set the row band a Tunix attention module applies (static Python state, not a parameter)."""
    if hasattr(attn, "sliding_window_size"):
        object.__setattr__(attn, "sliding_window_size", size)
    else:
        object.__setattr__(attn, "config", dataclasses.replace(attn.config, sliding_window_size=size))


def position_band(q_positions, k_positions, size: int):
    """[B, T, S] bool: key k is inside the window of query q (`q - k < size`, by position)."""
    return (q_positions[:, :, None] - k_positions[:, None, :]) < size


@contextlib.contextmanager
def masks_by_position(layers: Sequence[Any], positions, attn_mask) -> Iterator[list]:
    """One attention mask per layer, sliding layers banded by `positions` ([B, T]); while inside,
    their row band is widened to the row (restored on exit)."""
    if attn_mask is None:
        yield [None] * len(layers)
        return
    saved = []  # (module, the attribute that held the window, its value)
    masks = []
    try:
        for layer in layers:
            attn = layer.attn
            w = window(attn)
            if w is None:
                masks.append(attn_mask)
                continue
            masks.append(attn_mask & position_band(positions, positions, w))
            name = "sliding_window_size" if hasattr(attn, "sliding_window_size") else "config"
            saved.append((attn, name, getattr(attn, name)))
            set_window(attn, max(attn_mask.shape[-1], w))
        yield masks
    finally:
        for attn, name, value in saved:
            object.__setattr__(attn, name, value)
