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

from gemma_tpu.core.errors import UserError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Example:
    ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]
    where: str = ""  # FILE:LINE of the example, for messages


@dataclasses.dataclass
class FitReport:
    """What the over-length policy and the target check did to a split.

    `read = kept + dropped`; `truncated` counts kept examples that were cut to seq_len;
    `dropped` counts both over-length examples under `drop` and examples left with no target
    (`no_loss`, e.g. an assistant turn that starts past seq_len after truncation).
    """

    read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    no_loss: int = 0
    overlength: int = 0  # examples longer than seq_len, whatever the policy did with them
    lengths: list[int] = dataclasses.field(default_factory=list, repr=False)  # rendered length of each read example


def fit_length(examples: list[Example], seq_len: int, policy: str, source: str) -> tuple[list[Example], FitReport]:
    """Apply the over-length policy (truncate | drop | error); drop examples left with no target."""
    if policy not in ("truncate", "drop", "error"):
        raise UserError(f"data.overlength {policy!r} is not one of truncate, drop, error")
    rep = FitReport(read=len(examples), lengths=[len(ex.ids) for ex in examples])
    out = []
    for i, ex in enumerate(examples):
        cut = False
        if len(ex.ids) > seq_len:
            rep.overlength += 1
            if policy == "error":
                where = ex.where or f"{source}: example {i + 1}"
                raise UserError(f"{where}: the example has {len(ex.ids)} tokens, more than data.seq_len={seq_len} "
                                f"(data.overlength=error; use truncate or drop, or raise data.seq_len)")
            if policy == "drop":
                rep.dropped += 1
                continue
            ex = Example(ex.ids[:seq_len], ex.loss_mask[:seq_len], ex.where)
            cut = True
        if not ex.loss_mask[1:].any():
            rep.no_loss += 1
            rep.dropped += 1
            continue
        rep.truncated += cut
        out.append(ex)
    rep.kept = len(out)
    return out, rep


def pack_first_fit(examples: list[Example], seq_len: int) -> list[list[Example]]:
    """First-fit: each example goes into the first row with room, else opens a new row.

    The leftmost row with enough room is found in a max-tree over the rows' free space, so packing
    is O(n log n) rather than a scan of every open row per example.
    """
    n = len(examples)
    if n == 0:
        return []
    size = 1
    while size < n:
        size *= 2
    tree = [-1] * (2 * size)  # free room per row at the leaves; -1: no row yet
    rows: list[list[Example]] = []
    for ex in examples:
        need = len(ex.ids)
        if need > seq_len:
            raise ValueError(f"example of {need} tokens does not fit a row of {seq_len}")
        if tree[1] >= need:
            node = 1
            while node < size:  # descend to the leftmost leaf with room >= need
                node = 2 * node if tree[2 * node] >= need else 2 * node + 1
            r = node - size
            rows[r].append(ex)
            tree[node] -= need
        else:
            r = len(rows)
            rows.append([ex])
            node = size + r
            tree[node] = seq_len - need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
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
