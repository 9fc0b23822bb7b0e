"""JAX tracing without the slow part of a tracer's AttributeError.

Flax and Qwix ask traced values for attributes they may lack (`getattr(value, "sharding", None)` when a
variable is set, when Qwix wraps a weight). On a tracer JAX answers with an AttributeError whose message
names where the value came from, found by walking every equation traced so far: per question, so the cost
grows with the square of the model's size. Building a Gemma 3 27B abstractly (the dry run) spent 30 of its
45 s there, and the LoRA rewrite of the 270M ~10 of its ~20 s (2026-11-25/26, AMD EPYC, 2 cores). Only that
message changes, and only inside the block; what is traced is the same.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def cheap_tracer_attribute_errors() -> Iterator[None]:
    """Inside this block a tracer's AttributeError says nothing of the value's origin (see the module)."""
    try:
        from jax._src.interpreters import partial_eval as pe  # deferred: core imports no JAX at import time

        tracer = pe.DynamicJaxprTracer
        original = tracer.__dict__["_origin_msg"]
    except (ImportError, AttributeError, KeyError):  # another JAX: nothing to shortcut
        yield
        return
    tracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        tracer._origin_msg = original
