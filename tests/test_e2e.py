"""Backbone end to end: train (CLI) -> Orbax checkpoint -> merge (CLI) -> transformers reloads it.

The merged directory must give the JAX LoRA model's logits (fp32, within 1e-4) and differ clearly
from the base model's.
"""

import json

import numpy as np
import pytest

from tests.conftest import assert_one_line_error, run_cli, xla_env

# one xdist worker for this module: its module-scoped fixtures are then built once, not once per worker
pytestmark = pytest.mark.xdist_group("e2e")


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory):
    ck = tmp_path_factory.mktemp("e2e") / "ckpt"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={ck}", "train.max_steps=6", "train.learning_rate=0.05",
                   "checkpoint.every_steps=3", "data.eval_path=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ck


def hf_logits(model_dir, prompts):
    import torch
    from transformers import AutoModelForCausalLM
    from gemma_tpu.hf.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for p in prompts:
            out.append(model(torch.tensor([tok(p).input_ids])).logits[0].numpy())
    return out


def jax_lora_logits(ckpt, step, prompts):
    """The JAX LoRA model (base + factors from the checkpoint), built as training built it."""
    from flax import nnx
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.checkpoint.metadata import read_metadata, read_params
    from gemma_tpu.core.config import LoraConfig
    from gemma_tpu.lora import apply_lora
    from gemma_tpu.models import load_model, resolve_model
    from tests.test_models import jax_logits_batch

    meta = read_metadata(ckpt)
    r = resolve_model(meta["base_model"]["local_dir"])
    model, cfg = load_model(r, "float32")
    lc = LoraConfig(rank=meta["lora"]["rank"], alpha=meta["lora"]["alpha"], targets=meta["lora"]["targets"])
    model = apply_lora(model, r.family, cfg, lc)
    params = read_params(ckpt, step)
    state = nnx.state(model, nnx.LoRAParam)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        var.set_value(params[".".join(str(p) for p in path)])
    nnx.update(model, nnx.from_flat_state(flat))
    tok = load_tokenizer(r.local_dir)
    return jax_logits_batch(model, [tok(p).input_ids for p in prompts])


PROMPTS = ["Hi, I am Ada. What is 3 plus 4?", "<start_of_turn>user\nAnd doubled?<end_of_turn>\n<start_of_turn>model\n",
           "A longer prompt that runs past the sliding window of sixteen tokens."]


def test_merged_matches_jax_lora_and_differs_from_base(trained, tiny_dir, tmp_path):
    out = tmp_path / "merged"
    proc = run_cli("convert.merge_orbax", "--checkpoint", str(trained), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = hf_logits(out, PROMPTS)
    base = hf_logits(tiny_dir, PROMPTS)
    ours = jax_lora_logits(trained, 6, PROMPTS)
    for m, b, j in zip(merged, base, ours):
        assert np.abs(m - j).max() < 1e-4
        assert np.abs(m - b).max() > 1e-2
    meta = json.loads((out / "generation_config.json").read_text())
    eos = meta["eos_token_id"]
    assert 106 in (eos if isinstance(eos, list) else [eos])
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in f.keys()


def test_merge_of_dir_without_checkpoint_is_refused(tmp_path):
    empty = tmp_path / "nockpt"
    empty.mkdir()
    proc = run_cli("convert.merge_orbax", "--checkpoint", str(empty), "--out", str(tmp_path / "o"))
    assert_one_line_error(proc, str(empty))
    assert not (tmp_path / "o").exists()


def test_merged_tokenizer_publishes_tool_markers(trained, tmp_path):
    """The checkpoint's <unusedN> -> marker map becomes real tokens: same ids, marker names, atomic
    encoding, a tool-calling chat template, and <start_function_response> as a stop id."""
    from transformers import AutoTokenizer

    from gemma_tpu.checkpoint.metadata import read_metadata
    from gemma_tpu.formats.function_calling import function_token_map

    token_map = read_metadata(trained)["token_map"]
    assert token_map, "a plain Gemma 3 vocabulary needs the map"
    base_tok = AutoTokenizer.from_pretrained(read_metadata(trained)["base_model"]["local_dir"])
    out = tmp_path / "merged"
    proc = run_cli("convert.merge_orbax", "--checkpoint", str(trained), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(str(out))
    assert function_token_map(tok) == {}  # nothing left to map: the markers are in the vocabulary
    for marker, unused in token_map.items():
        old_id = base_tok.convert_tokens_to_ids(unused)
        assert tok.convert_tokens_to_ids(marker) == old_id
        assert tok(f"x {marker} y", add_special_tokens=False).input_ids.count(old_id) == 1
        assert tok.decode([old_id]) == marker
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_tokens_to_ids("<start_function_response>") in eos and 106 in eos
    tools = [{"type": "function", "function": {"name": "get_steps", "description": "Steps on a day.",
                                               "parameters": {"type": "object", "properties": {
                                                   "date": {"type": "string", "description": "The day."}},
                                                   "required": ["date"]}}}]
    msgs = [{"role": "user", "content": "steps today?"},
            {"role": "assistant", "tool_calls": [{"type": "function",
                                                  "function": {"name": "get_steps", "arguments": {"date": "today"}}}]}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert "<start_function_declaration>declaration:get_steps" in text
    assert "<start_function_call>call:get_steps{date:<escape>today<escape>}<end_function_call>" in text


def test_peft_adapter_ships_the_published_tokenizer(trained, tmp_path):
    from transformers import AutoTokenizer

    from gemma_tpu.checkpoint.metadata import read_metadata

    out = tmp_path / "adapter"
    proc = run_cli("convert.export_peft", "--checkpoint", str(trained), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tool-call markers" in proc.stderr
    tok = AutoTokenizer.from_pretrained(str(out))
    base_tok = AutoTokenizer.from_pretrained(read_metadata(trained)["base_model"]["local_dir"])
    for marker, unused in read_metadata(trained)["token_map"].items():
        assert tok.convert_tokens_to_ids(marker) == base_tok.convert_tokens_to_ids(unused)
    assert (out / "chat_template.jinja").is_file()


def test_merge_and_export_accept_a_relative_checkpoint_path(trained, tmp_path):
    """Users type relative paths (the README does); Orbax reads no tree metadata from one."""
    import os

    rel = os.path.relpath(trained, tmp_path)
    proc = run_cli("convert.merge_orbax", "--checkpoint", rel, "--out", "merged", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("convert.export_peft", "--checkpoint", rel, "--out", "adapter", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from gemma_tpu.checkpoint.metadata import read_params

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert read_params(rel, 6)
    finally:
        os.chdir(cwd)


def test_odd_shape_with_one_target_at_rank_one_merges_and_loads_in_peft(tiny_odd_dir, tmp_path):
    """The 7-layer, one-KV-head, head_dim != hidden/heads, linear-rope, vocab-509 model trained through the CLI
    with LoRA on q_proj alone at rank 1: the merge verifies, and PEFT's adapter on the base gives the merged
    logits (only q_proj modules in the adapter)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ck, merged, adapter = tmp_path / "ck", tmp_path / "merged", tmp_path / "adapter"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_odd_dir}",
                   f"checkpoint.dir={ck}", "train.max_steps=2", "train.learning_rate=0.05", "data.eval_path=null",
                   "lora.targets=[q_proj]", "lora.rank=1", env=xla_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    from convert.export_peft import main as export_peft  # in-process: their CLIs run in the tests above
    from convert.merge_orbax import main as merge
    from gemma_tpu.core.cli import cli_main

    assert cli_main(merge, ["--checkpoint", str(ck), "--out", str(merged), "--verify"]) == 0  # 1 when it fails
    assert cli_main(export_peft, ["--checkpoint", str(ck), "--out", str(adapter)]) == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] in (["q_proj"], "q_proj")
    ids = torch.tensor([list(range(2, 40))])
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(merged), **kw)(ids).logits.numpy()
        base = AutoModelForCausalLM.from_pretrained(str(tiny_odd_dir), **kw)
        plain = base(ids).logits.numpy()
        got = PeftModel.from_pretrained(base, str(adapter))(ids).logits.numpy()
    assert np.abs(got - want).max() < 1e-4
    assert np.abs(want - plain).max() > 1e-2
