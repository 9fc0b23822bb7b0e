"""The real pretrained Gemma 3 270M (embedded default) through the registry matches transformers."""

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_dir():
    from gemma_tpu.assets.embedded import resolve_embedded

    return resolve_embedded("embedded:gemma3-270m")


def test_registry_load_matches_transformers(real_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gemma_tpu.models import load_model, resolve_model
    from tests.test_models import jax_logits

    tok = AutoTokenizer.from_pretrained(str(real_dir))
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is").input_ids
    ids = (ids * 3)[:32]
    model, cfg = load_model(resolve_model(str(real_dir)), "float32")
    assert (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    ours = jax_logits(model, ids)
    hf = AutoModelForCausalLM.from_pretrained(str(real_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    diff = np.abs(ours - ref).max()
    assert diff < 2e-4, diff
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
