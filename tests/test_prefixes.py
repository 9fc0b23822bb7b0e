"""Shared prompt prefixes found at data preparation (issue 15, point 1): grouping and report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemma_tpu.core.config import DataConfig, load_config
from gemma_tpu.core.errors import UserError
from gemma_tpu.data.batching import Example
from gemma_tpu.data.prefixes import find_shared_prefixes


def _ex(ids, n_loss=2):
    ids = np.asarray(ids, np.int32)
    mask = np.zeros(len(ids), bool)
    mask[-n_loss:] = True
    return Example(ids, mask)


def test_groups_by_exact_loss_free_prefix():
    a, b = list(range(100, 150)), list(range(200, 240))
    exs = [_ex([2] + a + [1, 2, 3]), _ex([2] + a + [4, 5, 6, 7]), _ex([2] + b + [9, 9, 9]),
           _ex([2] + a + [1, 2, 8, 8]), _ex([2] + b + [5, 5]), _ex([2, 7, 7, 7, 7]),
           _ex([2] + a[:10] + [3] * 50)]  # shares 11 ids with the a-group: below min_tokens
    rep = find_shared_prefixes(exs, min_tokens=8)
    groups = sorted((g.prefix_len, sorted(g.members)) for g in rep.groups)
    # a-group: 0 and 3 share 53 ids but 0's first target is at 52, so the prefix ends at 51
    assert groups == [(40, [2, 4]), (51, [0, 1, 3])]
    for g in rep.groups:
        ref = exs[g.members[0]].ids[:g.prefix_len]
        for m in g.members:
            assert np.array_equal(exs[m].ids[:g.prefix_len], ref)
            assert not exs[m].loss_mask[:g.prefix_len + 1].any()  # no target in or right after the prefix
    tokens = sum(len(e.ids) for e in exs)
    assert rep.tokens == tokens and rep.shared_tokens == tokens - 2 * 51 - 1 * 40
    s = rep.stats()
    assert s["groups"] == 2 and s["examples_in_groups"] == 5 and s["prefix_len_max"] == 51
    assert s["computed_tokens_per_example_shared"] == round((tokens - 142) / 7, 1)
    assert s["loss_fraction_shared"] > s["loss_fraction"]
    # one big group with a short prefix beats several small ones only when it saves more tokens
    assert find_shared_prefixes(exs, min_tokens=52).groups == []


def test_split_prefers_fewer_computed_tokens():
    common = list(range(100, 140))  # 40 ids shared by all 6
    exs = [_ex([2] + common + [300 + k] * 30 + [k, k]) for k in range(3) for _ in range(2)]
    rep = find_shared_prefixes(exs, min_tokens=8)
    # three pairs sharing 70 loss-free ids save 3 * 70 = 210 > one group of six sharing 41: 5 * 41 = 205
    assert sorted(g.prefix_len for g in rep.groups) == [70, 70, 70]
    exs += [_ex([2] + common + [400 + k] * 5 + [1, 1]) for k in range(6)]
    rep = find_shared_prefixes(exs, min_tokens=8)
    assert [g.prefix_len for g in rep.groups] == [41]  # now 11 * 41 = 451 > 210


def test_config_keys_and_preparation(tmp_path):
    from transformers import AutoTokenizer

    from gemma_tpu.assets.tiny import _write_small_tokenizer
    from gemma_tpu.data import Renderer, prepare_examples, render_examples

    with pytest.raises(UserError, match="data.share_prefix_min_tokens must be at least 1"):
        load_config(None, ["data.share_prefix_min_tokens=0"])
    with pytest.raises(UserError, match="data.share_prefix"):
        load_config(None, ["data.share_prefix=always"])
    assert load_config(None, ["data.share_prefix=on"]).data.share_prefix == "auto"  # off's opposite
    assert load_config(None, ["data.share_prefix=off"]).data.share_prefix == "off"  # YAML reads a bare off as False
    (tmp_path / "c.yaml").write_text("data:\n  share_prefix: off\n")
    assert load_config(str(tmp_path / "c.yaml"), []).data.share_prefix == "off"
    _write_small_tokenizer(tmp_path / "tok", 512)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    sys_a, sys_b = "You are a terse assistant. " * 4, "You answer in French only, please. " * 4
    rows = ([{"messages": [{"role": "system", "content": sys_a}, {"role": "user", "content": f"q{i}"},
                           {"role": "assistant", "content": f"a{i}"}]} for i in range(5)]
            + [{"messages": [{"role": "system", "content": sys_b}, {"role": "user", "content": f"w{i}"},
                             {"role": "assistant", "content": f"r{i}"}]} for i in range(3)]
            + [{"messages": [{"role": "user", "content": "alone"}, {"role": "assistant", "content": "yes"}]}])
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(seq_len=512)
    examples = render_examples(str(path), Renderer(tok), cfg)
    prep = prepare_examples(examples, str(path), cfg, seed=0)
    groups = sorted(prep.prefixes.groups, key=lambda g: len(g.members))
    assert [sorted(g.members) for g in groups] == [[5, 6, 7], [0, 1, 2, 3, 4]]
    for g in groups:  # the prefix is the whole shared system+user opening, up to the first differing id
        ids = [examples[m].ids for m in g.members]
        assert all(np.array_equal(x[:g.prefix_len], ids[0][:g.prefix_len]) for x in ids)
        assert len({int(x[g.prefix_len]) for x in ids}) > 1 or any(
            examples[m].loss_mask[g.prefix_len + 1] for m in g.members)
        assert g.prefix_len > len(sys_b) // 2  # character-level tokenizer: roughly one id per character
    st = prep.stats()["shared_prefixes"]
    assert st["groups"] == 2 and st["examples_in_groups"] == 8 and st["computed_ratio"] < 0.6
    off = prepare_examples(examples, str(path), DataConfig(seq_len=512, share_prefix="off"), seed=0)
    assert off.prefixes is None and off.stats()["shared_prefixes"] is None


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_tokens_one_by_one_are_those_of_the_examples_as_trained(policy):
    """The training log and --dry-run said "N computed tokens per example, M one by one" with M over every read
    example, untruncated (dropped ones too), where data.inspect's "one by one" is over the kept examples as trained:
    with data.share_prefix=off the two differed though nothing is shared (75.4 vs 94.5 at seq_len 80)."""
    from gemma_tpu.data import prepare_examples

    examples = [_ex(range(3, 3 + n), n_loss=n - 5) for n in (10, 20, 30, 60, 90)]  # targets from id 5 on
    for share in ("off", "auto"):
        st = prepare_examples(examples, "t", DataConfig(seq_len=40, overlength=policy, share_prefix=share,
                                                        share_prefix_min_tokens=4), seed=0).stats()
        kept = [10, 20, 30] + ([40, 40] if policy == "truncate" else [])
        assert st["computed_tokens_per_example_unshared"] == round(sum(kept) / len(kept), 1)
        if share == "off":
            assert st["computed_tokens_per_example"] == st["computed_tokens_per_example_unshared"]
        else:  # the same number data.inspect prints as "one by one"
            assert st["computed_tokens_per_example_unshared"] == st["shared_prefixes"]["computed_tokens_per_example"]


def _grouped_by_splitting(examples, min_tokens, seq_len=None):
    """The grouping as `find_shared_prefixes` first chose it, splitting each run of sorted neighbours at its smallest
    shared prefix recursively (quadratic on a chain of examples each a prefix of the next): the reference."""
    from gemma_tpu.data.prefixes import _lcp, _shareable

    order = sorted(range(len(examples)), key=lambda i: np.asarray(examples[i].ids, ">u4").tobytes())
    caps = [_shareable(examples[i]) for i in order]
    adj = [min(_lcp(examples[order[j]].ids, examples[order[j + 1]].ids), caps[j], caps[j + 1])
           for j in range(len(order) - 1)]
    cum = np.concatenate([[0], np.cumsum([len(examples[i].ids) for i in order])])

    def saving(lo, hi, p):
        n = hi - lo
        if seq_len is None:
            return (n - 1) * p
        return max(n - -(-(int(cum[hi] - cum[lo]) - n * p) // max(seq_len - p, 1)), 0) * p

    def best(lo, hi):
        if hi - lo < 2:
            return 0, []
        m = min(adj[lo:hi - 1])
        gain = saving(lo, hi, m) if m >= min_tokens else 0
        whole = (gain, [(lo, hi, m)]) if gain > 0 else (0, [])
        saved, parts, start = 0, [], lo
        for j in range(lo, hi - 1):
            if adj[j] == m:
                s, p = best(start, j + 1)
                saved, parts, start = saved + s, parts + p, j + 1
        s, p = best(start, hi)
        return whole if whole[0] >= saved + s else (saved + s, parts + p)

    return [(p, [order[k] for k in range(lo, hi)]) for lo, hi, p in best(0, len(order))[1]]


def test_grouping_equals_the_recursive_split_on_random_data():
    """The runs of sorted examples are decided bottom-up in one pass (a chain of 8,000 examples each a prefix of the
    next took 1.1 s splitting run after run): the same groups, in the same order, as the recursive split chose."""
    rng = np.random.default_rng(0)
    grouped = 0
    for trial in range(300):
        n, alphabet = int(rng.integers(0, 40)), int(rng.integers(2, 5))
        stems = [list(rng.integers(3, 3 + alphabet, int(rng.integers(0, 12)))) for _ in range(3)]
        exs = []
        for _ in range(n):
            ids = [2] + stems[int(rng.integers(0, 3))] + list(rng.integers(3, 3 + alphabet, int(rng.integers(1, 12))))
            exs.append(_ex(ids, n_loss=int(rng.integers(1, len(ids) + 1))))
        min_tokens, seq_len = int(rng.integers(1, 6)), [None, 16, 40][trial % 3]
        got = [(g.prefix_len, g.members) for g in find_shared_prefixes(exs, min_tokens, seq_len).groups]
        assert got == _grouped_by_splitting(exs, min_tokens, seq_len), (trial, min_tokens, seq_len)
        grouped += bool(got)
    assert grouped > 100  # most trials group something
    chain = [_ex(range(3, 3 + k), n_loss=1) for k in range(2, 400)]  # each a prefix of the next
    for seq_len in (None, 64, 512):
        got = [(g.prefix_len, g.members) for g in find_shared_prefixes(chain, 4, seq_len).groups]
        assert got == _grouped_by_splitting(chain, 4, seq_len) and (got or seq_len == 64), seq_len
