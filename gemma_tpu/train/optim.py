"""Optimizer and learning-rate schedule from `train.*` (optax)."""

from __future__ import annotations

from typing import Any, Mapping

import optax

from gemma_tpu.core.config import TrainConfig


def make_schedule(t: TrainConfig):
    """constant | warmup_cosine | warmup_linear, in optimizer updates (not micro-batches)."""
    lr, warm = t.learning_rate, min(t.warmup_steps, t.max_steps)
    if t.schedule == "constant":
        if warm:
            return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), optax.constant_schedule(lr)], [warm])
        return optax.constant_schedule(lr)
    if t.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(t.max_steps, warm + 1), lr * t.min_lr_ratio)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warm), optax.linear_schedule(lr, lr * t.min_lr_ratio, t.max_steps - warm)],
        [warm],
    )


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    """Clipping + the base optimizer, with the learning rate injected so it can be logged.

    Wrapped in `optax.apply_if_finite`: an update whose gradients are not finite is dropped, so the
    parameters (and any checkpoint written after that step) stay the last good ones. The trainer then
    stops (`train.on_nonfinite: stop`) or carries on with the next batch (`skip`).
    """

    def build(learning_rate):
        if t.optimizer == "adamw":
            base = optax.adamw(learning_rate, weight_decay=t.weight_decay)
        elif t.optimizer == "adafactor":
            base = optax.adafactor(learning_rate, weight_decay_rate=t.weight_decay or None)
        else:
            base = optax.sgd(learning_rate)
        parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip else []
        return optax.chain(*parts, base)

    inner = optax.inject_hyperparams(build)(learning_rate=make_schedule(t))
    return optax.apply_if_finite(inner, max_consecutive_errors=1 << 30)


def state_layout(train: Mapping[str, Any]) -> dict[str, bool | str | None]:
    """What of `train.*` (a config section as a dict) decides the tree of the optimizer state a checkpoint
    holds: the optimizer, whether gradients are clipped or accumulated (optax.MultiSteps), and for
    adafactor whether weight decay is on (one more transform in its chain). A resume that changes one
    cannot restore the saved state; hyperparameters (learning rate, schedule, clip norm, adamw's decay)
    may change."""
    optimizer = train.get("optimizer")
    return {"train.optimizer": optimizer,
            "train.grad_clip": bool(train.get("grad_clip")),
            "train.grad_accum_steps": (train.get("grad_accum_steps") or 1) > 1,
            "train.weight_decay": bool(train.get("weight_decay")) if optimizer == "adafactor" else None}
