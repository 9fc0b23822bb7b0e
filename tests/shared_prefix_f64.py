"""Child of tests/test_shared_prefix_f64.py (float64 must be enabled before JAX starts): loss and LoRA
gradients of shared-prefix rows vs one example a row, with the model built and run in float64.

Tunix's modules cast to float32 in places (RMSNorm, rotary embeddings, attention softmax) and so does our
sparse loss; for this run their `jnp.float32` reads float64, so nothing rounds to float32 anywhere and a
layout error of any size would show above the float64 noise (~1e-14). Prints one JSON line per model."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)


class _Float64Numpy(types.ModuleType):
    def __getattr__(self, name):
        return jnp.float64 if name == "float32" else getattr(jnp, name)


def main(variants: list[str]) -> None:
    import tunix.models.gemma3.model as tunix_gemma3
    import tunix.models.gemma4.model as tunix_gemma4
    from flax import nnx

    import gemma_tpu.train.loss as loss_module
    from gemma_tpu.assets.tiny import write_tiny_gemma3, write_tiny_gemma4
    from gemma_tpu.core.config import DataConfig, LoraConfig
    from gemma_tpu.data import prepare_examples
    from gemma_tpu.lora import apply_lora
    from gemma_tpu.models import resolve_model
    from tests.test_shared_prefix import SEQ, batch_of, loss_and_grads, shared_examples

    for module in (tunix_gemma3, tunix_gemma4, loss_module):
        module.jnp = _Float64Numpy("jax.numpy (float32 read as float64)")

    tmp = Path(tempfile.mkdtemp())
    for variant in variants:
        if variant == "gemma3":
            d = write_tiny_gemma3(tmp / variant, seed=2, num_hidden_layers=6, num_key_value_heads=2)
            examples = shared_examples(2)
        else:
            d = write_tiny_gemma4(tmp / variant, seed=5, variant=variant)
            examples = shared_examples(11)
        r = resolve_model(str(d))
        cfg = r.family.tunix_config(r.hf_config, jnp.float64)
        cfg = dataclasses.replace(cfg, **{f.name: jnp.float64 for f in dataclasses.fields(cfg)
                                          if f.name in ("dtype", "param_dtype")})
        model = r.family.create_model(str(r.local_dir), cfg, mesh=None, dtype=jnp.float64)
        model = apply_lora(model, r.family, cfg, LoraConfig(rank=4, alpha=8.0))
        state = nnx.state(model, nnx.LoRAParam)
        keys = iter(jax.random.split(jax.random.key(0), 1000))
        nnx.update(model, jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape, jnp.float64), state))
        out = {}
        for share in ("off", "auto"):
            prepared = prepare_examples(examples, "t", DataConfig(seq_len=SEQ, share_prefix=share), seed=0)
            out[share] = (loss_and_grads(model, batch_of(prepared)), prepared.trees())
        (l1, g1), _ = out["off"]
        (l2, g2), trees = out["auto"]
        print(json.dumps({"variant": variant, "dtypes": sorted({str(g.dtype) for g in g1 + g2}), "trees": trees,
                          "loss": l1, "loss_diff": abs(l1 - l2),
                          "grad_diff": max(float(np.abs(a - b).max()) for a, b in zip(g1, g2)),
                          "grad_max": max(float(np.abs(g).max()) for g in g1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
