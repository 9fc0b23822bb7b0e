"""Shared prompt prefixes in a prepared split (issue 15, point 1): analysis only.

Examples are grouped by the longest common prefix of their token ids, exact ids, loss-free tokens
only (a prefix stops at an example's first training target, so every member keeps all of its
targets in its own suffix), at least `data.share_prefix_min_tokens` long. Several distinct
prefixes (different system prompts or tool sets) form several groups; an example with no partner
is in none.

How: sort the examples by their ids; the common prefix of any run of neighbours is the smallest
common prefix of adjacent pairs in it. A run is either one group (prefix = that minimum) or split
where the minimum is reached, whichever computes fewer tokens (decided recursively). A group of n
examples with prefix p computes p once per row it fills (`seq_len` given: its suffixes fill
ceil(suffix tokens / (seq_len - p)) rows) instead of n times; without `seq_len`, once in all.

The groups become trees `[P | S1 | S2 ...]` in training rows (`batching.make_trees`); the report
says what computing each prefix once in all would cost (the bound), the prepared split's stats what
its rows compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from gemma_tpu.data.batching import Example


@dataclasses.dataclass
class PrefixGroup:
    prefix_len: int
    members: list[int]  # indices into the examples


@dataclasses.dataclass
class PrefixReport:
    groups: list[PrefixGroup]
    examples: int
    tokens: int  # tokens computed one example at a time
    loss_tokens: int
    min_tokens: int

    @property
    def saved_tokens(self) -> int:
        return sum((len(g.members) - 1) * g.prefix_len for g in self.groups)

    @property
    def shared_tokens(self) -> int:
        """Tokens computed when each group's prefix is computed once."""
        return self.tokens - self.saved_tokens

    def stats(self) -> dict[str, Any]:
        lens = sorted(g.prefix_len for g in self.groups)
        sizes = sorted(len(g.members) for g in self.groups)
        n = max(self.examples, 1)
        return {
            "min_tokens": self.min_tokens, "groups": len(self.groups),
            "examples_in_groups": sum(sizes), "examples": self.examples,
            "group_size_max": sizes[-1] if sizes else 0,
            "group_size_mean": round(sum(sizes) / len(sizes), 2) if sizes else 0.0,
            "prefix_len_min": lens[0] if lens else 0, "prefix_len_median": lens[len(lens) // 2] if lens else 0,
            "prefix_len_max": lens[-1] if lens else 0,
            "computed_tokens_per_example": round(self.tokens / n, 1),
            "computed_tokens_per_example_shared": round(self.shared_tokens / n, 1),
            "computed_ratio": round(self.shared_tokens / max(self.tokens, 1), 4),
            "loss_fraction": round(self.loss_tokens / max(self.tokens, 1), 4),
            "loss_fraction_shared": round(self.loss_tokens / max(self.shared_tokens, 1), 4),
        }


def _shareable(ex: Example) -> int:
    """How many leading ids of this example may be shared: up to its first training target (a
    target's prediction is made at the position before it, so that position is not shareable
    either), and never the whole example."""
    hits = np.flatnonzero(ex.loss_mask)
    first = int(hits[0]) if len(hits) else len(ex.ids)
    return max(0, min(first - 1, len(ex.ids) - 1))


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def find_shared_prefixes(examples: Sequence[Example], min_tokens: int, seq_len: int | None = None) -> PrefixReport:
    """Group `examples` by shared loss-free prefixes of at least `min_tokens` ids, choosing the groups
    that save most when each row of `seq_len` tokens computes its group's prefix once."""
    # big-endian bytes of non-negative ids sort as the id sequences do, at 4 bytes a token
    order = sorted(range(len(examples)), key=lambda i: np.asarray(examples[i].ids, ">u4").tobytes())
    caps = [_shareable(examples[i]) for i in order]
    adj = [min(_lcp(examples[order[j]].ids, examples[order[j + 1]].ids), caps[j], caps[j + 1])
           for j in range(len(order) - 1)]
    groups: list[PrefixGroup] = []
    cum = np.concatenate([[0], np.cumsum([len(examples[i].ids) for i in order])])

    def saving(lo: int, hi: int, p: int) -> int:
        """Tokens saved by one group of sorted examples lo..hi-1 with prefix p."""
        n = hi - lo
        if seq_len is None:
            return (n - 1) * p
        suffixes = int(cum[hi] - cum[lo]) - n * p
        rows = -(-suffixes // max(seq_len - p, 1))
        return max(n - rows, 0) * p

    def best(lo: int, hi: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(saved tokens, groups as (lo, hi, prefix)) for sorted examples lo..hi-1."""
        if hi - lo < 2:
            return 0, []
        m = min(adj[lo:hi - 1])
        gain = saving(lo, hi, m) if m >= min_tokens else 0
        whole = (gain, [(lo, hi, m)]) if gain > 0 else (0, [])
        if m == max(adj[lo:hi - 1]):  # all neighbours share exactly m: nothing to split
            return whole
        saved, parts, start = 0, [], lo
        for j in range(lo, hi - 1):
            if adj[j] == m:
                s, p = best(start, j + 1)
                saved, parts, start = saved + s, parts + p, j + 1
        s, p = best(start, hi)
        split = (saved + s, parts + p)
        return whole if whole[0] >= split[0] else split

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * max((len(e.ids) for e in examples), default=0) + 100))
    try:
        _, found = best(0, len(order))
    finally:
        sys.setrecursionlimit(limit)
    for lo, hi, p in found:
        groups.append(PrefixGroup(p, [order[k] for k in range(lo, hi)]))
    return PrefixReport(groups, len(examples), sum(len(e.ids) for e in examples),
                        sum(int(e.loss_mask.sum()) for e in examples), min_tokens)
