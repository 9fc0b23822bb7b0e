"""Shared-prefix rows (issue 15, points 2-3): a batch laid out as trees `[P | S1 | S2 ...]` gives the
loss and the LoRA gradients of the same examples computed one per row, within 1e-5 in fp32.

Models: tiny Gemma 3 with grouped and with full (fused q/k/v) KV heads, six layers so that both the
sliding-window and the global layer are there; tiny Gemma 4 dense and per-layer-embedding (KV-sharing)
variants. Every tiny model has a 16-token window and the rows are far longer, so later suffixes sit
many rows past the window from their prefix while their positions keep them inside it.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemma_tpu.core.config import DataConfig, LoraConfig
from gemma_tpu.data import prepare_examples
from gemma_tpu.data.batching import Example, Tree, build_row, item_size, row_examples

SEQ = 256


def shared_examples(seed: int = 0, groups=((40, 5), (24, 3)), singles: int = 2) -> list[Example]:
    """Examples in groups sharing a loss-free prefix (prefix length, members), plus loners; targets
    at the end of each suffix, suffixes of different lengths (some longer than the window alone)."""
    rng = np.random.default_rng(seed)
    out = []
    for p, n in groups:
        prefix = rng.integers(3, 500, p)
        for _ in range(n):
            suffix = rng.integers(3, 500, int(rng.integers(6, 30)))
            ids = np.concatenate([prefix, suffix]).astype(np.int32)
            mask = np.zeros(len(ids), bool)
            mask[p + int(rng.integers(2, len(suffix) - 2)):] = True
            out.append(Example(ids, mask, f"group{p}"))
    for _ in range(singles):
        ids = rng.integers(3, 500, int(rng.integers(20, 50))).astype(np.int32)
        mask = np.zeros(len(ids), bool)
        mask[len(ids) // 2:] = True
        out.append(Example(ids, mask, "single"))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def batch_of(prepared, rows=None):
    import jax.numpy as jnp

    idx = range(len(prepared.rows)) if rows is None else rows
    arrays = [prepared.row_arrays(i) for i in idx]
    return {k: jnp.asarray(np.stack([a[k] for a in arrays])) for k in arrays[0]}


def loss_and_grads(model, batch):
    """Jitted (as the trainer's step is): eagerly, every op compiled for each batch shape, and the file's exactness
    tests took 214 s instead of 156 s (the real 270M's 144 s instead of 129 s, same peak RSS) on the AVX2 EPYC."""
    import jax
    from flax import nnx

    from gemma_tpu.train.loss import sparse_loss

    step = nnx.jit(nnx.value_and_grad(lambda m, b: sparse_loss(m, **b, chunk=64),
                                      argnums=nnx.DiffState(0, nnx.LoRAParam)))
    loss, grads = step(model, batch)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


def lora_model(path, seed=0, scale=0.1):
    import jax
    from flax import nnx

    from gemma_tpu.lora import apply_lora
    from gemma_tpu.models import load_model, resolve_model

    r = resolve_model(str(path))
    model, cfg = load_model(r, "float32")
    model = apply_lora(model, r.family, cfg, LoraConfig(rank=4, alpha=8.0))
    state = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    nnx.update(model, jax.tree.map(lambda x: scale * jax.random.normal(next(keys), x.shape, x.dtype), state))
    return model


def assert_exact(model, examples, seq_len=SEQ, strategy="pad", one_seq_len=None, grad_atol=1e-5):
    """Shared layout vs one example a row (rows of `one_seq_len`, default `seq_len`): same targets,
    loss within 1e-5, gradients within `grad_atol` (1e-5)."""
    one = prepare_examples(examples, "t", DataConfig(seq_len=one_seq_len or seq_len, share_prefix="off"), seed=0)
    shared = prepare_examples(examples, "t", DataConfig(seq_len=seq_len, strategy=strategy), seed=0)
    assert shared.trees() >= 1 and len(shared.rows) < len(one.rows)
    assert shared.real_tokens() < one.real_tokens()
    b1, b2 = batch_of(one), batch_of(shared)
    assert float(b1["loss_weights"].sum()) == float(b2["loss_weights"].sum())
    assert sorted(np.asarray(b1["loss_targets"])[np.asarray(b1["loss_weights"]) > 0].tolist()) == \
        sorted(np.asarray(b2["loss_targets"])[np.asarray(b2["loss_weights"]) > 0].tolist())
    l1, g1 = loss_and_grads(model, b1)
    l2, g2 = loss_and_grads(model, b2)
    assert abs(l1 - l2) < 1e-5, (l1, l2)
    assert max(float(np.abs(g).max()) for g in g1) > 1e-3  # gradients that could differ
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=grad_atol, rtol=1e-4)
    return shared


@pytest.fixture(scope="module")
def gemma3_models(tmp_path_factory):
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    made = {}

    def get(kv_heads):
        if kv_heads not in made:
            d = write_tiny_gemma3(tmp_path_factory.mktemp(f"g3kv{kv_heads}") / "m", seed=kv_heads,
                                  num_hidden_layers=6, num_key_value_heads=kv_heads)
            made[kv_heads] = lora_model(d)
        return made[kv_heads]

    return get


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_gemma3_shared_prefix_rows_are_exact(gemma3_models, kv_heads):
    shared = assert_exact(gemma3_models(kv_heads), shared_examples(kv_heads))
    # the 40-token prefix of five members is laid out once: a row holds P and several suffixes
    trees = [it for r in shared.rows for it in r if isinstance(it, Tree)]
    assert max(len(t.members) for t in trees) >= 3


def test_gemma3_suffixes_far_past_the_window_from_their_prefix(gemma3_models):
    """Six members whose suffixes are each longer than the window: the last suffix starts more than
    120 rows after its prefix, positions keep it within reach of the prefix's last tokens."""
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 500, 36)
    exs = []
    for _ in range(6):
        suffix = rng.integers(3, 500, 24)
        ids = np.concatenate([prefix, suffix]).astype(np.int32)
        mask = np.zeros(len(ids), bool)
        mask[37:] = True  # the first target right after the position that predicts it from the prefix
        exs.append(Example(ids, mask))
    shared = assert_exact(gemma3_models(2), exs)
    row = shared.row_arrays(0)
    assert row["segment_ids"].max() == 7 and (row["prefix_segment_ids"] == 1).sum() == 6 * 24
    assert row["positions"][36 + 5 * 24] == 36  # the sixth suffix: row 156, position 36


def test_packing_trees_and_loners_together_is_exact(gemma3_models):
    assert_exact(gemma3_models(2), shared_examples(3, groups=((40, 4), (34, 2)), singles=4), strategy="pack")


def test_gemma4_shared_prefix_rows_are_exact(tmp_path):
    """Gemma 4 dense in fp32. The per-layer-embedding (KV-sharing) variant is held in float64 instead
    (tests/test_shared_prefix_f64.py: 1.9e-14): in fp32 on an AVX2-only EPYC (2026-11-25) one of its gradient
    elements differs by 2.2e-5, where two exact layouts (one example a row at 256 vs 512) already differ by 6e-6."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4

    d = write_tiny_gemma4(tmp_path / "dense", seed=5, variant="dense")
    assert_exact(lora_model(d), shared_examples(11))


def test_row_layout_of_a_tree():
    """P once (positions from 0), each suffix its own segment continuing P's positions, targets
    predicted from the suffix's own rows."""
    p = np.arange(10, 20, dtype=np.int32)
    a = Example(np.concatenate([p, [30, 31, 32]]).astype(np.int32), np.array([0] * 11 + [1, 1], bool))
    b = Example(np.concatenate([p, [40, 41]]).astype(np.int32), np.array([0] * 11 + [1], bool))
    row = build_row([Tree(10, [a, b])], 24, 8)
    assert row["tokens"][:15].tolist() == list(range(10, 20)) + [30, 31, 32, 40, 41]
    assert row["positions"][:15].tolist() == list(range(10)) + [10, 11, 12, 10, 11]
    assert row["segment_ids"][:15].tolist() == [1] * 10 + [2] * 3 + [3] * 2
    assert row["prefix_segment_ids"][:15].tolist() == [0] * 10 + [1] * 5
    # a: targets 31 (from row 10), 32 (from row 11); b: target 41 from row 13
    assert row["loss_idx"][:3].tolist() == [10, 11, 13]
    assert row["loss_targets"][:3].tolist() == [31, 32, 41]
    assert row["loss_weights"].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("strategy", ["pad", "pack"])
def test_shared_layout_holds_every_example_once_in_static_rows(strategy):
    exs = shared_examples(21, groups=((40, 9), (50, 4), (36, 2)), singles=5)
    one = prepare_examples(exs, "t", DataConfig(seq_len=128, strategy=strategy, share_prefix="off"), seed=0)
    shared = prepare_examples(exs, "t", DataConfig(seq_len=128, strategy=strategy), seed=0)

    def key(rows):
        return sorted((e.ids.tobytes(), e.loss_mask.tobytes()) for r in rows for e in row_examples(r))

    assert key(shared.rows) == key(one.rows)  # nothing lost, nothing duplicated
    assert shared.loss_tokens() == one.loss_tokens()
    st = shared.stats()
    assert st["trees"] >= 4 and st["computed_tokens_per_example"] < st["computed_tokens_per_example_unshared"]
    assert all(sum(item_size(i) for i in r) <= 128 for r in shared.rows)
    shapes = {(k, v.shape) for i in range(len(shared.rows)) for k, v in shared.row_arrays(i).items()}
    assert len(shapes) == 7
    for i in range(len(shared.rows)):  # every target is predicted from its own segment, never from a prefix
        a = shared.row_arrays(i)
        w = a["loss_weights"] > 0
        idx = a["loss_idx"][w]
        np.testing.assert_array_equal(a["tokens"][idx + 1], a["loss_targets"][w])
        np.testing.assert_array_equal(a["segment_ids"][idx], a["segment_ids"][idx + 1])
        prefixes = set(a["prefix_segment_ids"][a["prefix_segment_ids"] > 0].tolist())
        assert not set(a["segment_ids"][idx].tolist()) & prefixes
    from gemma_tpu.train.trainer import examples_in

    assert examples_in(batch_of(shared)) == len(exs)


@pytest.mark.slow
def test_real_270m_fitness_batch_is_exact():
    """One batch of the fitness data on the real Gemma 3 270M (window 512): six conversations sharing
    the developer turn with the tool declarations, as one tree of 1,024 tokens vs six rows as long as the longest
    conversation (463 tokens: rows of 512 computed ~10% more padding; the reference's activations must fit a
    24 GiB machine next to another test worker). Six, not fewer: with five the tree (839 tokens) keeps every suffix
    within the window of 512 from its prefix of 342."""
    from gemma_tpu.assets.embedded import resolve_embedded
    from gemma_tpu.data import make_renderer, render_examples
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from tests.conftest import REPO

    real = resolve_embedded("embedded:gemma3-270m")
    tok = load_tokenizer(str(real))
    cfg = DataConfig(seq_len=1024, strategy="pack")
    renderer = make_renderer(tok, cfg, "gemma", function_token_map(tok))
    exs = render_examples(str(REPO / "data/fitness/train.jsonl"), renderer, cfg)[:6]
    # LoRA factors at 0.01: a loss near the base's (0.1 makes it ~29, where fp32 rounding alone is 4e-5)
    model = lora_model(real, seed=3, scale=0.01)
    shared = assert_exact(model, exs, seq_len=1024, strategy="pack", one_seq_len=max(len(e.ids) for e in exs))
    trees = [it for r in shared.rows for it in r if isinstance(it, Tree)]
    assert trees and min(t.prefix_len for t in trees) > 300  # the developer turn and the declarations
    assert max(t.size for t in trees) > 512 + min(t.prefix_len for t in trees)  # later suffixes sit past the window


def test_training_on_shared_prefix_rows_compiles_once_and_resumes_exactly(tiny_dir, tmp_path):
    """`python -m gemma_tpu.train` on data whose chats share a long system prompt: the rows are trees,
    the train step compiles once, and a run stopped at step 3 and started again ends bit-identical
    to an uninterrupted one (the data position restored inside the tree-packed stream)."""
    import json

    from tests.conftest import REPO, run_cli
    from tests.test_resume import assert_same_params

    system = ("You are a careful assistant for a bakery. Answer in one short sentence, and name the price. "
              "Prices are in euros; items are numbered; never invent an item that is not on the list.")
    chats = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Price of item {i}?"},
                           {"role": "assistant", "content": f"Item {i} costs {i % 7 + 1} euros."}]}
             for i in range(40)]
    data = tmp_path / "bakery.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))

    def train(ckpt, steps):
        proc = run_cli("gemma_tpu.train", "--config", str(REPO / "configs/tiny.yaml"), f"model.path={tiny_dir}",
                       f"data.train_path={data}", "data.eval_path=null", "data.seq_len=256",
                       f"checkpoint.dir={ckpt}", f"train.max_steps={steps}", "checkpoint.every_steps=3",
                       "train.batch_size=2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    out = train(whole, 6)
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["train_step_compiles"] == 1, summary
    rows = [json.loads(l) for l in (whole / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("train_step_compiles", 1) == 1 for r in rows)
    assert "RECOMPIL" not in out.stderr
    train(parts, 3)
    train(parts, 6)
    a = {r["step"]: r["loss"] for r in rows if r["mode"] == "train"}
    b = {json.loads(l)["step"]: json.loads(l)["loss"] for l in (parts / "metrics.jsonl").read_text().splitlines()
         if json.loads(l)["mode"] == "train"}
    assert a == b
    assert_same_params(whole, parts, 6)
