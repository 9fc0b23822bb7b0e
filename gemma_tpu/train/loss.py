"""The training loss, computed only where it counts.

With loss on assistant tokens only, most positions of a chat never need logits. We run the decoder
to its final hidden states, gather the loss positions named by the batch (a fixed-size buffer, so
shapes stay static), and project only those onto the vocabulary - in row chunks, rematerialised in
the backward pass, with a stable log-sum-exp and no one-hot. Same loss and gradients as the full
projection, a fraction of the FLOPs and memory of a 262k-wide vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(segment_ids: jax.Array, prefix_segment_ids: jax.Array | None = None) -> jax.Array:
    """[B, T] segment ids (0 = padding) -> [B, T, T] causal mask that never crosses examples.

    With `prefix_segment_ids` (a shared-prefix row `[P | S1 | S2 ...]`, `data.batching.Tree`), a
    token also sees the segment its own segment continues: each suffix attends to P and itself.
    """
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_segment_ids is not None:
        same = same | (prefix_segment_ids[:, :, None] == segment_ids[:, None, :])
    real = segment_ids[:, None, :] > 0
    return causal[None] & same & real


def hidden_states(model, tokens: jax.Array, positions: jax.Array, attn_mask: jax.Array) -> jax.Array:
    """The decoder up to the final norm (the family's model class supports `hidden_only`)."""
    hidden, _ = model(tokens, positions, None, attn_mask, hidden_only=True)
    return hidden


def output_embedding(model) -> jax.Array:
    """[V, D] tied output embedding."""
    emb = model.embedder.input_embedding
    return emb.get_value() if hasattr(emb, "get_value") else emb.value


def logit_softcap(model) -> float | None:
    """The final logit soft-cap the model applies (Gemma 4: 30), or None."""
    return getattr(getattr(model, "config", None), "final_logit_softcap", None) or None


def _nll_chunk(h: jax.Array, emb: jax.Array, targets: jax.Array, softcap: float | None = None) -> jax.Array:
    logits = jnp.dot(h, emb.T, preferred_element_type=jnp.float32)  # [C, V]
    if softcap:
        logits = jnp.tanh(logits / softcap) * softcap
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return lse - tgt


def gathered_nll(hidden: jax.Array, emb: jax.Array, loss_idx: jax.Array, loss_targets: jax.Array,
                 chunk: int = 1024, softcap: float | None = None) -> jax.Array:
    """Per-target negative log-likelihood [B, M] at the gathered positions."""
    b, m = loss_idx.shape
    h = jnp.take_along_axis(hidden, loss_idx[..., None], axis=1)  # [B, M, D]
    h = h.reshape(b * m, -1)
    tg = loss_targets.reshape(b * m)
    n = b * m
    if n <= chunk:
        return _nll_chunk(h, emb, tg, softcap).reshape(b, m)
    pad = (-n) % chunk
    h = jnp.pad(h, ((0, pad), (0, 0)))
    tg = jnp.pad(tg, (0, pad))
    fn = jax.checkpoint(lambda args: _nll_chunk(args[0], emb, args[1], softcap))
    out = jax.lax.map(fn, (h.reshape(-1, chunk, h.shape[-1]), tg.reshape(-1, chunk)))
    return out.reshape(-1)[:n].reshape(b, m)


def sparse_loss(model, tokens, positions, segment_ids, loss_idx, loss_targets, loss_weights,
                chunk: int = 1024, prefix_segment_ids=None):
    """Mean NLL over loss-bearing tokens (the PeftTrainer loss function)."""
    hidden = hidden_states(model, tokens, positions, attention_mask(segment_ids, prefix_segment_ids))
    nll = gathered_nll(hidden, output_embedding(model), loss_idx, loss_targets, chunk, logit_softcap(model))
    w = loss_weights.astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def full_loss(model, tokens, positions, segment_ids, loss_idx, loss_targets, loss_weights,
              prefix_segment_ids=None):
    """Reference: logits at every position, then the same targets (for tests and benchmarks)."""
    logits, _ = model(tokens, positions, None, attention_mask(segment_ids, prefix_segment_ids))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logp, loss_idx[..., None], axis=1)  # [B, M, V]
    nll = -jnp.take_along_axis(lp, loss_targets[..., None], axis=-1)[..., 0]
    w = loss_weights.astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def make_loss_fn(chunk: int = 1024, dropout_seed: int = 0):
    """A loss function with explicit batch-field parameters (nnx.grad binds keywords to positions).

    A batch with a `dropout_step` field ([B, 2] int32, every row the same (optimizer step, micro-batch): training
    batches when lora.dropout > 0, see `gemma_tpu.train.trainer.BatchFeed`) is computed with LoRA dropout, masks
    from `dropout_seed` folded with the step, then the micro-batch: fresh masks for every micro-batch, the same
    ones after a resume, whatever train.grad_accum_steps the resume has.
    Batches without it (evaluation) never drop. A `loss_scale` field ([B], every row the same: the trainer's
    eval batches, `gemma_tpu.data.pipeline.eval_batches(token_weighted=True)`, and its micro-batches under gradient
    accumulation, `gemma_tpu.train.trainer.BatchFeed`) scales the batch's mean loss.
    """

    def loss_fn(model, tokens, positions, segment_ids, loss_idx, loss_targets, loss_weights,
                prefix_segment_ids=None, dropout_step=None, loss_scale=None):
        args = (model, tokens, positions, segment_ids, loss_idx, loss_targets, loss_weights, chunk, prefix_segment_ids)
        if dropout_step is None:
            loss = sparse_loss(*args)
        else:
            from gemma_tpu.lora import dropout_active

            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(dropout_seed), dropout_step[0, 0]),
                                     dropout_step[0, 1])
            with dropout_active(model, key):
                loss = sparse_loss(*args)
        return loss if loss_scale is None else loss * loss_scale[0]

    return loss_fn
