"""Static-shape rows: padding or first-fit packing, and the fixed-size loss-position buffer.

Every row is `seq_len` tokens; every batch has the same shapes and dtypes, so the train step
compiles once. Besides tokens, positions and segment ids, a row carries the positions where a
loss is taken (`loss_idx`), their next-token targets and weights, padded to a fixed `max_loss`,
so the trainer projects only those hidden states onto the vocabulary.

A row item is an `Example` or a `Tree`: a prompt prefix shared by several examples, laid out
once as `[P | S1 | S2 | ...]`. Each suffix is its own segment whose `prefix_segment_ids` names
P's segment, so it attends to P and to itself (`train.loss.attention_mask`); its positions
continue after P, so every token sees the keys, positions and window it would see alone.
Trees, not a prefix run once per batch with its keys and values broadcast to suffix rows
(Hydragen's layout): on the 270M fitness run the two train within 5% of each other per example
and the broadcast one needs more memory, pads every suffix to a fixed length and needs a model
that continues a KV cache (`benchmarks/prefix_layouts.py`, RESULTS.md 2026-11-24 evening).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import numpy as np

from gemma_tpu.core.errors import UserError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Example:
    ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]
    where: str = ""  # FILE:LINE of the example, for messages
    partial: bool = False  # only its start was tokenized (`Renderer.render`'s max_tokens): longer than its ids


@dataclasses.dataclass
class Tree:
    """Examples sharing their first `prefix_len` ids, computed once per row (see module docstring)."""

    prefix_len: int
    members: list[Example]

    @property
    def size(self) -> int:
        """Tokens the tree takes in a row: the prefix once, then every suffix."""
        return self.prefix_len + sum(len(m.ids) - self.prefix_len for m in self.members)


Item = Example | Tree


def members(item: Item) -> list[Example]:
    return item.members if isinstance(item, Tree) else [item]


def item_size(item: Item) -> int:
    return item.size if isinstance(item, Tree) else len(item.ids)


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
    first_overlength: str = ""  # where the first of them is (FILE:LINE), for the warning
    duplicates: int = 0  # examples whose ids and loss mask equal an earlier example's (kept and trained, not deduped)
    first_duplicate: str = ""  # "FILE:LINE repeats FILE:LINE", for the warning
    lengths: list[int] = dataclasses.field(default_factory=list, repr=False)  # rendered length of each read example


def fit_length(examples: list[Example], seq_len: int, policy: str, source: str) -> tuple[list[Example], FitReport]:
    """Apply the over-length policy (truncate | drop | error); drop examples left with no target."""
    if policy not in ("truncate", "drop", "error"):
        raise UserError(f"data.overlength {policy!r} is not one of truncate, drop, error")
    rep = FitReport(read=len(examples), lengths=[len(ex.ids) for ex in examples])
    _count_duplicates(examples, rep, source)
    out = []
    for i, ex in enumerate(examples):
        cut = False
        if len(ex.ids) > seq_len:
            rep.overlength += 1
            rep.first_overlength = rep.first_overlength or ex.where or f"{source}: example {i + 1}"
            if policy == "error":
                where = ex.where or f"{source}: example {i + 1}"
                raise UserError(f"{where}: the example has {'at least ' if ex.partial else ''}{len(ex.ids)} tokens, "
                                f"more than data.seq_len={seq_len} "
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


def example_key(ex: Example) -> bytes:
    """What an example trains, as bytes: equal keys, equal ids and loss mask."""
    return np.ascontiguousarray(ex.ids, np.int32).tobytes() + np.packbits(np.asarray(ex.loss_mask, bool)).tobytes()


def _count_duplicates(examples: list[Example], rep: FitReport, source: str) -> None:
    """Count examples that train exactly what an earlier one trains (a common export bug: rows written twice);
    they are reported, not removed - repeating an example may be meant."""
    seen: dict[bytes, int] = {}
    for i, ex in enumerate(examples):
        j = seen.setdefault(example_key(ex), i)
        if j != i:
            rep.duplicates += 1
            if not rep.first_duplicate:
                rep.first_duplicate = (f"{ex.where or f'{source}: example {i + 1}'} repeats "
                                       f"{examples[j].where or f'example {j + 1}'}")


def first_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """First fit: each size (by index, in order) goes into the first bin with room, else opens a new bin.

    The leftmost bin with enough room is found in a max-tree over the bins' free space, so packing
    is O(n log n) rather than a scan of every open bin per item (make_trees scanned so: 20,000 examples
    sharing one prefix took 0.8 s, 4x as many 16x that).
    """
    n = len(sizes)
    if n == 0:
        return []
    size = 1
    while size < n:
        size *= 2
    tree = [-1] * (2 * size)  # free room per bin at the leaves; -1: no bin yet
    bins: list[list[int]] = []
    for i, need in enumerate(sizes):
        if need > capacity:
            raise ValueError(f"item of {need} tokens does not fit a row of {capacity}")
        if tree[1] >= need:
            node = 1
            while node < size:  # descend to the leftmost leaf with room >= need
                node = 2 * node if tree[2 * node] >= need else 2 * node + 1
            bins[node - size].append(i)
            tree[node] -= need
        else:
            node = size + len(bins)
            bins.append([i])
            tree[node] = capacity - need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def pack_first_fit(examples: list[Item], seq_len: int) -> list[list[Item]]:
    """First-fit: each item (example or tree) goes into the first row with room, else opens a new row."""
    return [[examples[i] for i in row] for row in first_fit([item_size(ex) for ex in examples], seq_len)]


def row_loss_count(row: list[Item]) -> int:
    return int(sum(ex.loss_mask[1:].sum() for item in row for ex in members(item)))


def row_examples(row: list[Item]) -> list[Example]:
    return [ex for item in row for ex in members(item)]


def build_row(row: list[Item], seq_len: int, max_loss: int) -> dict[str, np.ndarray]:
    """Arrays of one packed/padded row; segment 0 is padding, prefix segment 0 means none."""
    tokens = np.zeros(seq_len, np.int32)
    positions = np.zeros(seq_len, np.int32)
    segments = np.zeros(seq_len, np.int32)
    prefix_segments = np.zeros(seq_len, np.int32)
    loss_idx = np.zeros(max_loss, np.int32)
    loss_targets = np.zeros(max_loss, np.int32)
    loss_weights = np.zeros(max_loss, np.float32)
    off, k, s = 0, 0, 0

    def place(ids: np.ndarray, start: int, parent: int) -> None:
        """Ids `start:` of one example (or a prefix) as the next segment, positions from `start`."""
        nonlocal off, s
        n = len(ids) - start
        s += 1
        tokens[off:off + n] = ids[start:]
        positions[off:off + n] = np.arange(start, len(ids))
        segments[off:off + n] = s
        prefix_segments[off:off + n] = parent
        off += n

    for item in row:
        p, parent = 0, 0
        if isinstance(item, Tree):
            p = item.prefix_len
            place(item.members[0].ids[:p], 0, 0)
            parent = s
        for ex in members(item):
            base = off - p  # row index of this example's position 0
            place(ex.ids, p, parent)
            # predicting token t+1 from position t, where t+1 is a target of this example; a
            # tree's prefix ends before the position predicting its members' first target
            t = np.nonzero(ex.loss_mask[1:])[0]
            take = min(len(t), max_loss - k)
            loss_idx[k:k + take] = base + t[:take]
            loss_targets[k:k + take] = ex.ids[t[:take] + 1]
            loss_weights[k:k + take] = 1.0
            k += take
    return {"tokens": tokens, "positions": positions, "segment_ids": segments,
            "prefix_segment_ids": prefix_segments, "loss_idx": loss_idx,
            "loss_targets": loss_targets, "loss_weights": loss_weights}


def make_trees(examples: list[Example], groups: list[tuple[int, list[int]]], seq_len: int) -> list[Item]:
    """Items for a split: each group of examples sharing a prefix (prefix length, member indices, in
    the order to fill trees) cut into trees that fit a row (first fit), the other examples as they
    are. A tree left with one member is a plain example. Items keep their first member's place."""
    first: dict[int, Item] = {}  # index of an item's first member -> the item
    taken: set[int] = set()
    for p, idx in groups:
        trees = [[idx[k] for k in tree] for tree in first_fit([len(examples[i].ids) - p for i in idx], seq_len - p)]
        for mem in trees:
            first[mem[0]] = Tree(p, [examples[i] for i in mem]) if len(mem) > 1 else examples[mem[0]]
            taken.update(mem)
    return [first[i] if i in first else ex for i, ex in enumerate(examples) if i in first or i not in taken]


def make_rows(items: list[Item], seq_len: int, strategy: str) -> list[list[Item]]:
    if strategy == "pack":
        return pack_first_fit(items, seq_len)
    return [[item] for item in items]


def loss_buffer_size(rows: list[list[Item]], seq_len: int, requested: int | None) -> int:
    """Static loss-buffer length: the largest row's target count, rounded up to a multiple of 8."""
    if requested:
        return min(requested, seq_len)
    biggest = max((row_loss_count(r) for r in rows), default=1)
    return min(seq_len, max(8, int(math.ceil(biggest / 8) * 8)))
