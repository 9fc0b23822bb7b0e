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
    def loss(m, step=None):
        extra = {} if step is None else {"dropout_step": jax.numpy.full((2,), step, jax.numpy.int32)}
        return nnx.value_and_grad(lambda m: loss_fn(m, **batch, **extra),
                                  argnums=nnx.DiffState(0, nnx.LoRAParam))(m)

    reference, _ = loss(plain)
    evaluated, _ = loss(model)
    assert float(evaluated) == pytest.approx(float(reference), abs=1e-6)
    (a, ga), (b, gb), (c, _) = loss(model, 3), loss(model, 3), loss(model, 4)
    assert float(a) == float(b) and abs(float(a) - float(reference)) > 1e-4 and abs(float(a) - float(c)) > 1e-4
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    again, _ = loss(model)  # leaving the dropout block left nothing behind
    assert float(again) == float(evaluated)
