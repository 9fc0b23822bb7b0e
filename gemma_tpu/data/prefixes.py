"""Shared prompt prefixes in a prepared split (issue 15, point 1): analysis only.

Examples are grouped by the longest common prefix of their token ids, exact ids, loss-free tokens
only (a prefix stops at an example's first training target, so every member keeps all of its
targets in its own suffix), at least `data.share_prefix_min_tokens` long. Several distinct
prefixes (different system prompts or tool sets) form several groups; an example with no partner
is in none.

How: sort the examples by their ids; the common prefix of any run of neighbours is the smallest
common prefix of adjacent pairs in it. A run is either one group (prefix = that minimum) or split
where the minimum is reached, whichever computes fewer tokens (`_best_runs`, in linear time). A group of n
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


def _best_runs(adj: Sequence[int], min_tokens: int, saving) -> list[tuple[int, int, int]]:
    """The groups that save most, as (lo, hi, prefix) runs of the sorted examples, left to right, given `adj` (the
    shareable common prefix of each pair of neighbours) and `saving(lo, hi, prefix)`.

    A run lo..hi-1 whose neighbours share at least m ids, exactly m at its split points (its smallest), is one group
    of prefix m or its parts between the split points each grouped their own way, whichever saves more (one group
    on a tie, none where nothing is saved). The runs nest as a tree, built left to right with a stack and each run
    decided as it closes: every neighbour pair is pushed and popped once, where splitting run after run (recursion
    over the shrinking runs of a chain of examples each a prefix of the next) was quadratic: 8,000 examples, 1.1 s
    (now 6 ms).
    """
    saved: list[int] = []  # per closed run: the tokens its best choice saves
    whole: list[tuple[int, int, int] | None] = []  # the run as one group, when that is its best choice
    parts: list[list[int]] = []  # else its closed sub-runs, left to right
    stack: list[tuple[int, int, list[int]]] = []  # open runs: (prefix m, lo, closed sub-runs)
    root = None
    for j in range(len(adj) + 1):
        a = adj[j] if j < len(adj) else -1  # shared by examples j and j+1; -1 closes every run at the end
        lo, child = j, None
        while stack and stack[-1][0] > a:
            m, lo, kids = stack.pop()
            split = sum(saved[k] for k in kids)
            gain = saving(lo, j + 1, m) if m >= min_tokens else 0
            one = gain > 0 and gain >= split
            saved.append(gain if one else split)
            whole.append((lo, j + 1, m) if one else None)
            parts.append([] if one else kids)
            if stack and stack[-1][0] >= a:
                stack[-1][2].append(len(saved) - 1)
            else:
                child = len(saved) - 1
        if a < 0:
            root = child
        elif not stack or stack[-1][0] < a:
            stack.append((a, lo, [] if child is None else [child]))
    found, todo = [], [] if root is None else [root]
    while todo:
        k = todo.pop()
        if whole[k] is not None:
            found.append(whole[k])
        else:
            todo.extend(reversed(parts[k]))
    return found


def find_shared_prefixes(examples: Sequence[Example], min_tokens: int, seq_len: int | None = None) -> PrefixReport:
    """Group `examples` by shared loss-free prefixes of at least `min_tokens` ids, choosing the groups
    that save most when each row of `seq_len` tokens computes its group's prefix once."""
    # big-endian bytes of non-negative ids sort as the id sequences do, at 4 bytes a token
    order = sorted(range(len(examples)), key=lambda i: np.asarray(examples[i].ids, ">u4").tobytes())
    caps = [_shareable(examples[i]) for i in order]
    adj = [min(_lcp(examples[order[j]].ids, examples[order[j + 1]].ids), caps[j], caps[j + 1])
           for j in range(len(order) - 1)]
    cum = np.concatenate([[0], np.cumsum([len(examples[i].ids) for i in order])])

    def saving(lo: int, hi: int, p: int) -> int:
        """Tokens saved by one group of sorted examples lo..hi-1 with prefix p."""
        n = hi - lo
        if seq_len is None:
            return (n - 1) * p
        suffixes = int(cum[hi] - cum[lo]) - n * p
        rows = -(-suffixes // max(seq_len - p, 1))
        return max(n - rows, 0) * p

    found = _best_runs(adj, min_tokens, saving)
    groups: list[PrefixGroup] = []
    for lo, hi, p in found:
        groups.append(PrefixGroup(p, [order[k] for k in range(lo, hi)]))
    return PrefixReport(groups, len(examples), sum(len(e.ids) for e in examples),
                        sum(int(e.loss_mask.sum()) for e in examples), min_tokens)
