"""The converters on the real Gemma 3 270M (slow): a rank-8 LoRA on all projections, merged in fp32
and bf16 with --verify (the tolerances documented in convert.verify are set from this model), and
the PEFT export loaded onto the HF base."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_convert import hf_logits, make_checkpoint, max_diff, merge

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_dir():
    from gemma_tpu.assets.embedded import resolve_embedded

    return resolve_embedded("embedded:gemma3-270m")


@pytest.fixture(scope="module")
def real_ckpt(real_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("real") / "ckpt"
    make_checkpoint(real_dir, ckpt, rank=8, alpha=16.0, seed=0, std=0.02)  # a LoRA of realistic size
    return ckpt


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_verifies(real_ckpt, tmp_path, dtype):
    out = tmp_path / f"merged_{dtype}"
    assert merge("--checkpoint", real_ckpt, "--out", out, "--dtype", dtype, "--verify") == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.model").is_file()


def test_peft_matches_merge(real_dir, real_ckpt, tmp_path):
    from convert.export_peft import main
    from gemma_tpu.core.cli import cli_main

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert merge("--checkpoint", real_ckpt, "--out", merged, "--dtype", "float32") == 0
    assert cli_main(main, ["--checkpoint", str(real_ckpt), "--out", str(adapter)]) == 0
    prompts = [[2, 818, 5279, 529, 7001, 563], [2, 106, 1645, 107, 9259, 496, 11497, 236761]]
    peft_logits = hf_logits(real_dir, prompts, adapter=adapter)
    merged_logits = hf_logits(merged, prompts)
    scale = max(float(np.abs(x).max()) for x in merged_logits)
    assert max_diff(peft_logits, merged_logits) <= max(1e-4, 1e-5 * scale)
