"""Static-shape rows: padding or first-fit packing, and the fixed-size loss-position buffer.

Every row is `seq_len` tokens; every batch has the same shapes and dtypes, so the train step
compiles once. Besides tokens, positions and segment ids, a row carries the positions where a
loss is taken (`loss_idx`), their next-token targets and weights, padded to a fixed `max_loss`,
so the trainer projects only those hidden states onto the vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from gemma_tpu.errors import UserError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Example:
    ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]


@dataclasses.dataclass
class FitReport:
    read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    no_loss: int = 0


def fit_length(examples: list[Example], seq_len: int, policy: str, source: str) -> tuple[list[Example], FitReport]:
    """Apply the over-length policy (truncate | drop | error); drop examples left with no target."""
    rep = FitReport(read=len(examples))
    out = []
    for i, ex in enumerate(examples):
        if len(ex.ids) > seq_len:
            if policy == "error":
                raise UserError(f"{source}: example {i + 1} has {len(ex.ids)} tokens, more than data.seq_len="
                                f"{seq_len} (data.overlength=error)")
            if policy == "drop":
                rep.dropped += 1
                continue
            ex = Example(ex.ids[:seq_len], ex.loss_mask[:seq_len])
            rep.truncated += 1
        if not ex.loss_mask[1:].any():
            rep.no_loss += 1
            rep.dropped += 1
            continue
        out.append(ex)
    rep.kept = len(out)
    return out, rep


def pack_first_fit(examples: list[Example], seq_len: int) -> list[list[Example]]:
    """First-fit: each example goes into the first row with room, else opens a new row."""
    rows: list[list[Example]] = []
    room: list[int] = []
    for ex in examples:
        n = len(ex.ids)
        for r, free in enumerate(room):
            if free >= n:
                rows[r].append(ex)
                room[r] -= n
                break
        else:
            rows.append([ex])
            room.append(seq_len - n)
    return rows


def row_loss_count(row: list[Example]) -> int:
    return int(sum(ex.loss_mask[1:].sum() for ex in row))


def build_row(row: list[Example], seq_len: int, max_loss: int) -> dict[str, np.ndarray]:
    """Arrays of one packed/padded row; segment 0 is padding."""
    tokens = np.zeros(seq_len, np.int32)
    positions = np.zeros(seq_len, np.int32)
    segments = np.zeros(seq_len, np.int32)
    loss_idx = np.zeros(max_loss, np.int32)
    loss_targets = np.zeros(max_loss, np.int32)
    loss_weights = np.zeros(max_loss, np.float32)
    off, k = 0, 0
    for s, ex in enumerate(row, start=1):
        n = len(ex.ids)
        tokens[off:off + n] = ex.ids
        positions[off:off + n] = np.arange(n)
        segments[off:off + n] = s
        # predicting token t+1 from position t, where t+1 is a target of this example
        t = np.nonzero(ex.loss_mask[1:])[0]
        take = min(len(t), max_loss - k)
        loss_idx[k:k + take] = off + t[:take]
        loss_targets[k:k + take] = ex.ids[t[:take] + 1]
        loss_weights[k:k + take] = 1.0
        k += take
        off += n
    return {"tokens": tokens, "positions": positions, "segment_ids": segments, "loss_idx": loss_idx,
            "loss_targets": loss_targets, "loss_weights": loss_weights}


def make_rows(examples: list[Example], seq_len: int, strategy: str) -> list[list[Example]]:
    if strategy == "pack":
        return pack_first_fit(examples, seq_len)
    return [[ex] for ex in examples]


def loss_buffer_size(rows: list[list[Example]], seq_len: int, requested: int | None) -> int:
    """Static loss-buffer length: the largest row's target count, rounded up to a multiple of 8."""
    if requested:
        return min(requested, seq_len)
    biggest = max((row_loss_count(r) for r in rows), default=1)
    return min(seq_len, max(8, int(math.ceil(biggest / 8) * 8)))
