"""The gathered, chunked loss equals the full-vocabulary loss, in value and gradient."""

import numpy as np
import pytest

from gemma_tpu.core.config import DataConfig, LoraConfig
from gemma_tpu.data import Renderer, eval_batches, prepare_split
from gemma_tpu.models import load_model, resolve_model
from tests.conftest import REPO


@pytest.fixture(scope="module")
def lora_model(tiny_dir):
    import jax
    from flax import nnx

    from gemma_tpu.lora import apply_lora

    r = resolve_model(str(tiny_dir))
    model, cfg = load_model(r, "float32")
    model = apply_lora(model, r.family, cfg, LoraConfig(rank=4, alpha=8.0))
    state = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    state = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), state)
    nnx.update(model, state)
    return model, r


@pytest.mark.parametrize("strategy", ["pad", "pack"])
def test_sparse_equals_full(lora_model, strategy):
    import jax
    from flax import nnx
    from transformers import AutoTokenizer

    from gemma_tpu.train.loss import full_loss, sparse_loss

    model, r = lora_model
    tok = AutoTokenizer.from_pretrained(str(r.local_dir))
    dc = DataConfig(seq_len=256, strategy=strategy)
    split = prepare_split(str(REPO / "tests/data/chat_sample.jsonl"), Renderer(tok), dc, seed=0)
    batch = {k: jax.numpy.asarray(v) for k, v in eval_batches(split, 4, 1)[0].items()}

    def grads(fn):
        return nnx.value_and_grad(lambda m: fn(m, **batch), argnums=nnx.DiffState(0, nnx.LoRAParam))(model)

    (l1, g1), (l2, g2) = grads(full_loss), grads(lambda m, **b: sparse_loss(m, **b, chunk=16))
    assert abs(float(l1) - float(l2)) < 1e-5
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_packed_and_padded_give_same_per_example_loss(lora_model):
    """Packing must not let attention cross examples: per-example losses are unchanged."""
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from gemma_tpu.data.batching import Example, build_row
    from gemma_tpu.train.loss import attention_mask, gathered_nll, hidden_states, output_embedding

    model, r = lora_model
    tok = AutoTokenizer.from_pretrained(str(r.local_dir))
    split = prepare_split(str(REPO / "tests/data/chat_sample.jsonl"), Renderer(tok), DataConfig(seq_len=512), 0)
    exs: list[Example] = [row[0] for row in split.rows[:3]]

    def nll(rows, m):
        b = [build_row(row, 512, m) for row in rows]
        arr = {k: jnp.asarray(np.stack([x[k] for x in b])) for k in b[0]}
        h = hidden_states(model, arr["tokens"], arr["positions"], attention_mask(arr["segment_ids"]))
        out = gathered_nll(h, output_embedding(model), arr["loss_idx"], arr["loss_targets"])
        return np.asarray(out), arr["loss_weights"]

    padded = [nll([[e]], 64)[0][0][: int(e.loss_mask[1:].sum())] for e in exs]
    packed, _ = nll([exs], 192)
    np.testing.assert_allclose(np.concatenate(padded), packed[0][: sum(len(p) for p in padded)], atol=1e-5)


def test_lora_dropout_only_in_training_batches(tiny_dir, lora_model):
    """lora.dropout drops only where a batch carries `dropout_step` (training): evaluation and any other
    forward of the same model equal the model without dropout, and the masks are fixed by the step."""
    import jax
    from flax import nnx
    from transformers import AutoTokenizer

    from gemma_tpu.lora import apply_lora
    from gemma_tpu.train.loss import make_loss_fn

    plain, r = lora_model
    model, cfg = load_model(r, "float32")
    model = apply_lora(model, r.family, cfg, LoraConfig(rank=4, alpha=8.0, dropout=0.5))
    nnx.update(model, nnx.state(plain, nnx.LoRAParam))  # the same (non-zero) LoRA factors
    tok = AutoTokenizer.from_pretrained(str(r.local_dir))
    split = prepare_split(str(REPO / "tests/data/chat_sample.jsonl"), Renderer(tok), DataConfig(seq_len=128), 0)
    batch = {k: jax.numpy.asarray(v) for k, v in eval_batches(split, 2, 1)[0].items()}
    loss_fn = make_loss_fn(16, dropout_seed=0)

    @nnx.jit
    def loss(m, step=None, micro=0):
        extra = {} if step is None else {"dropout_step": jax.numpy.tile(jax.numpy.array([step, micro]), (2, 1))}
        return nnx.value_and_grad(lambda m: loss_fn(m, **batch, **extra),
                                  argnums=nnx.DiffState(0, nnx.LoRAParam))(m)

    reference, _ = loss(plain)
    evaluated, _ = loss(model)
    assert float(evaluated) == pytest.approx(float(reference), abs=1e-6)
    (a, ga), (b, gb), (c, _) = loss(model, 3), loss(model, 3), loss(model, 4)
    assert float(a) == float(b) and abs(float(a) - float(reference)) > 1e-4 and abs(float(a) - float(c)) > 1e-4
    assert abs(float(loss(model, 3, 1)[0]) - float(a)) > 1e-4  # each micro-batch of a step has its own masks
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    again, _ = loss(model)  # leaving the dropout block left nothing behind
    assert float(again) == float(evaluated)


def _train_ctx(step: int):
    """What BatchFeed reads of Tunix's PeftTrainer (the `train_ctx` its data hooks get): the step counters and the
    training config (`max_steps`, `get_with_default`)."""
    import types

    config = types.SimpleNamespace(max_steps=100, get_with_default=lambda key, default: default)
    return types.SimpleNamespace(train_steps=step, iter_steps=step, config=config)


def test_dropout_masks_stay_fresh_when_a_resume_changes_grad_accum_steps():
    """Each training micro-batch's dropout key is (optimizer step, micro-batch), not step × accum + micro: a run
    resumed at step 2 with train.grad_accum_steps 4 -> 2 drew keys 4..7 again (step 2's and 3's masks repeated
    those of step 1), and 2 -> 4 skipped some."""
    import numpy as np

    from gemma_tpu.train.trainer import BatchFeed

    def keys(accum: int, steps: range) -> list[tuple[int, int]]:
        row = {"tokens": np.zeros((2, 4), np.int32), "segment_ids": np.ones((2, 4), np.int32),
               "loss_weights": np.ones((2, 3), np.float32)}
        feed = BatchFeed(iter([row] * (accum * len(steps))), None, dropout=True, grad_accum_steps=accum)
        out = []
        for step in steps:
            ctx = _train_ctx(step)
            for _ in range(accum):
                d = feed.load_next_train_batch(ctx)["dropout_step"]
                assert d.shape == (2, 2) and (d == d[0]).all()
                out.append(tuple(int(x) for x in d[0]))
        return out

    for before, after in ((4, 2), (2, 4)):
        drawn = keys(before, range(0, 2)) + keys(after, range(2, 4))
        assert len(set(drawn)) == len(drawn) == 2 * before + 2 * after, (before, after, drawn)
        assert drawn[2 * before:] == [(s, m) for s in (2, 3) for m in range(after)]


def test_accumulated_micro_batches_carry_their_share_of_the_steps_loss_tokens():
    """Under gradient accumulation each micro-batch's mean loss is scaled by its share of the step's loss tokens
    (times their number), so MultiSteps' plain average of the micro-batches is the step's token mean; a step
    cut short by the end of the data is not fed (MultiSteps never applies it; its loss was recorded as a step)."""
    import numpy as np

    from gemma_tpu.train.trainer import BatchFeed

    def rows(tokens: int) -> dict:
        w = np.zeros((2, 4), np.float32)
        w[0, :tokens] = 1
        return {"tokens": np.zeros((2, 8), np.int32), "segment_ids": np.ones((2, 8), np.int32), "loss_weights": w}

    feed = BatchFeed(iter([rows(1), rows(3), rows(4), rows(2), rows(2)]), None, grad_accum_steps=2)
    ctx = _train_ctx(0)
    scales = []
    while (batch := feed.load_next_train_batch(ctx)) is not None:
        assert batch["loss_scale"].shape == (2,) and (batch["loss_scale"] == batch["loss_scale"][0]).all()
        scales.append(float(batch["loss_scale"][0]))
    np.testing.assert_allclose(scales, [0.5, 1.5, 4 / 3, 2 / 3])
