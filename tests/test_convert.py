"""Converters: merge (LoRA and full), PEFT export, verify, inspect, errors and atomicity.

Reference logits come from the Tunix model that was saved (in memory, before the checkpoint is
written), so every comparison goes checkpoint -> converter -> transformers against the JAX model
the trainer would have used. Fixtures are module-scoped: the tiny models and checkpoints are made
once.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu.hf import safetensors_io as sio

REPO = Path(__file__).resolve().parents[1]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Several prompts, one longer than the tiny models' sliding window (16).
PROMPTS = [[2, 107, 150, 151, 170, 200], [2, *range(120, 140)], [2, 300, 301, 5, 9, 400, 106, 105, 511, 250, 251]]
TOL = 1e-4


# ------------------------------------------------------------------------------ helpers


def tunix_logits(model, prompts=PROMPTS) -> list[np.ndarray]:
    from convert.verify import model_logits

    return model_logits(model, prompts)


def hf_logits(model_dir, prompts=PROMPTS, adapter=None) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def make_checkpoint(base_dir: Path, ckpt_dir: Path, *, rank=4, alpha=8.0, targets=ALL_TARGETS, full=False,
                    seed=0, std=None) -> list[np.ndarray]:
    """Save a checkpoint exactly as the trainer does (random non-zero factors of this std, or full
    params perturbed by it) and return the Tunix model's logits on PROMPTS."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft.checkpoint_manager import CheckpointManager

    from gemma_tpu.checkpoint.metadata import build_metadata, write_metadata
    from gemma_tpu.core.config import LoraConfig, RunConfig
    from gemma_tpu.lora import apply_lora
    from gemma_tpu.models import load_model, resolve_model

    resolved = resolve_model(str(base_dir))
    model, cfg = load_model(resolved, "float32")
    rng = np.random.default_rng(seed)
    if full:
        kind = nnx.Param
    else:
        model = apply_lora(model, resolved.family, cfg, LoraConfig(rank=rank, alpha=alpha, targets=list(targets)))
        kind = nnx.LoRAParam
    for _, var in nnx.iter_graph(model):
        if isinstance(var, kind):
            value = var.get_value()
            noise = rng.normal(0.0, std or (0.02 if full else 0.1), value.shape).astype(np.float32)
            var.set_value(value + jnp.asarray(noise) if full else jnp.asarray(noise))
    cm = CheckpointManager(str(ckpt_dir))
    cm.save(1, model, None, save_only_lora_params=not full, force=True)
    cm.close()
    run = RunConfig()
    run.model.path = str(base_dir)
    run.lora.enabled = not full
    run.lora.rank, run.lora.alpha, run.lora.targets = rank, alpha, list(targets)
    write_metadata(ckpt_dir, build_metadata(run, resolved))
    return tunix_logits(model)


def merge(*args: str) -> int:
    from convert.merge_orbax import main
    from gemma_tpu.core.cli import cli_main

    return cli_main(main, [str(a) for a in args])


def ordered_keys(model_dir: Path) -> list[str]:
    return sio.WeightsDir(model_dir).names()


def leftovers(out: Path) -> list[str]:
    """Anything at or beside `out` carrying its name (the target, temp or old dirs)."""
    if not out.parent.exists():
        return []
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def base(tiny_dir) -> Path:
    """conftest's session-wide tiny Gemma 3 (GQA); never modified here (copies are)."""
    return tiny_dir


@pytest.fixture(scope="module")
def lora_ckpt(work, base):
    ckpt = work / "ckpt"
    ref = make_checkpoint(base, ckpt, rank=4, alpha=8.0)
    return ckpt, ref


@pytest.fixture(scope="module")
def merged(work, lora_ckpt) -> Path:
    out = work / "merged"
    assert merge("--checkpoint", lora_ckpt[0], "--out", out) == 0
    return out


# ------------------------------------------------------------------------------ merge


def test_merged_matches_jax_lora_model(base, lora_ckpt, merged):
    _, ref = lora_ckpt
    got = hf_logits(merged)
    assert max_diff(ref, got) <= TOL
    # and the LoRA update matters: the base is far off
    assert max_diff(ref, hf_logits(base)) > 100 * TOL


def test_merged_layout(base, merged):
    from safetensors import safe_open

    base_keys = [k for k in ordered_keys(base) if k != "lm_head.weight"]
    assert ordered_keys(merged) == base_keys
    bw, mw = sio.WeightsDir(base), sio.WeightsDir(merged)
    for k in base_keys:
        assert mw[k].shape == bw[k].shape and mw[k].dtype == bw[k].dtype
    files = list(merged.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"]
    assert not (merged / "model.safetensors.index.json").exists()
    with safe_open(str(files[0]), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in f.keys()
    gen = json.loads((merged / "generation_config.json").read_text())
    assert {1, 106} <= set(gen["eos_token_id"])
    cfg = json.loads((merged / "config.json").read_text())
    assert cfg["dtype"] == "float32" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (merged / name).read_bytes() == (base / name).read_bytes()
    prov = json.loads((merged / "gemma_tpu_merge.json").read_text())
    assert prov["step"] == 1 and prov["lora"]["rank"] == 4 and prov["lora"]["targets"] == ALL_TARGETS
    # untouched tensors are copied byte for byte
    assert mw.read("model.norm.weight").tobytes() == bw.read("model.norm.weight").tobytes()


def test_lm_head_dropped_when_tied(work, base, lora_ckpt):
    """A base that stores a tied lm_head.weight loses it in the merge."""
    from safetensors.numpy import load_file, save_file

    with_head = work / "base_with_head"
    shutil.copytree(base, with_head)
    t = load_file(str(base / "model.safetensors"))
    t["lm_head.weight"] = t["model.embed_tokens.weight"]
    save_file(t, str(with_head / "model.safetensors"), metadata={"format": "pt"})
    out = work / "merged_head"
    # a changed base on purpose: the fingerprint check is told so
    assert merge("--checkpoint", lora_ckpt[0], "--base", with_head, "--out", out, "--allow-base-mismatch") == 0
    assert "lm_head.weight" not in ordered_keys(out)
    assert json.loads((out / "gemma_tpu_merge.json").read_text())["dropped"] == ["lm_head.weight"]


def test_fused_qkv(work, tiny_mha_dir):
    """num_attention_heads == num_key_value_heads: Tunix fuses q, k and v into qkv_einsum."""
    base = tiny_mha_dir
    ckpt = work / "ckpt_mha"
    ref = make_checkpoint(base, ckpt, rank=3, alpha=6.0, seed=1)
    out = work / "merged_mha"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert max_diff(ref, hf_logits(out)) <= TOL
    assert max_diff(ref, hf_logits(base)) > 100 * TOL


def test_subset_of_targets(work, base):
    ckpt = work / "ckpt_subset"
    ref = make_checkpoint(base, ckpt, rank=2, alpha=4.0, targets=["k_proj", "v_proj", "down_proj"], seed=2)
    out = work / "merged_subset"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert max_diff(ref, hf_logits(out)) <= TOL
    bw, mw = sio.WeightsDir(base), sio.WeightsDir(out)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert np.array_equal(bw.read(q), mw.read(q))  # not targeted: copied
    assert not np.array_equal(bw.read(k), mw.read(k))


def test_base_of_an_architecture_no_family_claims_merges_as_the_family_trained(work, base, monkeypatch):
    """A base whose config.json names an architecture of its own trains with model.family (and exports to PEFT);
    its merge was refused as 'unsupported architecture', the recorded family unread. The merged directory keeps that
    config.json: loading it (chat, evaluate --model, serving) and its GGUF export take the family its merge
    recorded; they refused it as 'unsupported architecture'."""
    import functools

    import gemma_tpu.models

    renamed = work / "base_renamed"
    shutil.copytree(base, renamed)
    cfg = json.loads((renamed / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**cfg, "architectures": ["MyGemmaForCausalLM"]}))
    # as a run with model.family=gemma3 resolves it
    monkeypatch.setattr(gemma_tpu.models, "resolve_model",
                        functools.partial(gemma_tpu.models.resolve_model, family="gemma3"))
    ckpt = work / "ckpt_renamed"
    ref = make_checkpoint(renamed, ckpt, rank=2, alpha=4.0, targets=["q_proj", "o_proj"], seed=4)
    out = work / "merged_renamed"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    monkeypatch.undo()
    assert gemma_tpu.models.resolve_model(str(out)).family.name == "gemma3"
    from convert.export_gguf import main as export_gguf

    assert export_gguf(["--merged", str(out), "--out", str(work / "renamed.gguf")]) == 0
    (out / "config.json").write_text(json.dumps(cfg))  # for transformers to load the numbers
    assert max_diff(ref, hf_logits(out)) <= TOL


def _text_run_on_multimodal_layout(work, base, lora_ckpt, name: str, extra: dict | None = None) -> tuple[Path, Path]:
    """The tiny base rewritten in the published multimodal layout (decoder under `language_model.model.`, a vision
    tower, `extra` tensors), and the LoRA checkpoint recorded as if it had been trained on it: (base, checkpoint)."""
    from safetensors.numpy import load_file, save_file

    from gemma_tpu.checkpoint.metadata import read_metadata, write_metadata
    from gemma_tpu.hf.fingerprint import fingerprint

    text_ckpt, _ = lora_ckpt
    mm = work / f"base_{name}"
    mm.mkdir()
    text = load_file(str(base / "model.safetensors"))
    vision = np.random.default_rng(3).normal(size=(8, 3, 4, 4)).astype(np.float32)
    tensors = {"vision_tower.vision_model.embeddings.patch_embedding.weight": vision}
    tensors.update({"language_model." + k: v for k, v in text.items()})
    tensors.update(extra or {})
    save_file(tensors, str(mm / "model.safetensors"), metadata={"format": "pt"})
    text_cfg = json.loads((base / "config.json").read_text())
    mm_cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text_cfg,
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8, "patch_size": 4,
                                "torch_dtype": "bfloat16"},
              "tie_word_embeddings": True, "dtype": "float32"}
    (mm / "config.json").write_text(json.dumps(mm_cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(base / f, mm / f)
    # the same training run, recorded as if it had been made on the multimodal checkpoint
    ckpt = work / f"ckpt_{name}"
    shutil.copytree(text_ckpt, ckpt)
    meta = read_metadata(ckpt)
    meta["hf_config"] = mm_cfg
    meta["base_model"] = {**meta["base_model"], "path": str(mm), "local_dir": str(mm), "fingerprint": fingerprint(mm)}
    write_metadata(ckpt, {k: v for k, v in meta.items() if k not in ("format", "version")})
    return mm, ckpt


def test_multimodal_layout(work, base, lora_ckpt):
    """Decoder under `language_model.model.`, a vision tower copied untouched, LoRA where expected."""
    from gemma_tpu.checkpoint.metadata import read_params
    from gemma_tpu.models import get_family

    mm, ckpt = _text_run_on_multimodal_layout(work, base, lora_ckpt, "mm")
    text_cfg = json.loads((base / "config.json").read_text())
    out = work / "merged_mm"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert ordered_keys(out) == ordered_keys(mm)
    bw, mw = sio.WeightsDir(mm), sio.WeightsDir(out)
    key = "vision_tower.vision_model.embeddings.patch_embedding.weight"
    assert mw.read(key).tobytes() == bw.read(key).tobytes()
    # expected merged arrays, from the checkpoint's raw factors in numpy
    params = read_params(ckpt, 1)
    family = get_family("gemma3")
    cfg = family.tunix_config(text_cfg)
    changed = 0
    for proj in family.projections(cfg):
        for layer in range(cfg.num_layers):
            a = params[f"layers.{layer}.{proj.tunix_module}.{proj.tunix_param}_lora_a"]
            b = params[f"layers.{layer}.{proj.tunix_module}.{proj.tunix_param}_lora_b"]
            hf_key = family.hf_key("language_model.model.", layer, proj)
            w = bw.read(hf_key)
            shape = {"q_einsum": (cfg.num_heads, cfg.embed_dim, cfg.head_dim),
                     "kv_einsum": (2, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim),
                     "attn_vec_einsum": (cfg.num_heads, cfg.head_dim, cfg.embed_dim),
                     "gate_proj": (cfg.embed_dim, cfg.hidden_dim), "up_proj": (cfg.embed_dim, cfg.hidden_dim),
                     "down_proj": (cfg.hidden_dim, cfg.embed_dim)}[proj.tunix_module.split(".")[-1]]
            a_hf, b_hf = proj.lora_to_peft(a, b, shape)
            expected = w + (8.0 / 4) * (b_hf @ a_hf)
            np.testing.assert_allclose(mw.read(hf_key), expected, rtol=0, atol=1e-6)
            changed += 1
    assert changed == 7 * cfg.num_layers
    for k in ("language_model.model.norm.weight", "language_model.model.embed_tokens.weight"):
        assert mw.read(k).tobytes() == bw.read(k).tobytes()
    written = json.loads((out / "config.json").read_text())
    assert written["text_config"]["dtype"] == "float32"
    # the tower's weights are written float32 too: its config said bfloat16 still
    assert written["vision_config"]["dtype"] == written["vision_config"]["torch_dtype"] == "float32"



def _write_multimodal_gemma3(mm, text_config, seed: int, base):
    """A random Gemma3ForConditionalGeneration (a one-layer SigLIP tower) with the tiny base's tokenizer files."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    cfg = Gemma3Config(text_config=text_config, vision_config=vision, mm_tokens_per_image=4, image_token_index=509,
                       boi_token_index=508, eoi_token_index=507)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(str(mm))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(base / f, mm / f)
    return mm

def test_real_multimodal_model_and_peft(work, base):
    """A Gemma3ForConditionalGeneration written by transformers (vision tower included): the merge
    matches the JAX LoRA model, and the PEFT export, whose modules live under
    model.language_model., loads onto it and keeps away from the vision tower's own q/k/v_proj."""
    from transformers import Gemma3TextConfig

    from convert.export_peft import main as export_main
    from gemma_tpu.assets.tiny import TINY_GEMMA3
    from gemma_tpu.core.cli import cli_main

    mm = _write_multimodal_gemma3(work / "base_mm_real", Gemma3TextConfig(**TINY_GEMMA3), 6, base)
    ckpt = work / "ckpt_mm_real"
    ref = make_checkpoint(mm, ckpt, seed=6)
    out = work / "merged_mm_real"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert ordered_keys(out) == ordered_keys(mm)
    got = hf_logits(out)
    assert max_diff(ref, got) <= TOL
    assert max_diff(ref, hf_logits(mm)) > 100 * TOL
    adapter = work / "adapter_mm_real"
    assert cli_main(export_main, ["--checkpoint", str(ckpt), "--out", str(adapter)]) == 0
    names = sio.WeightsDir(adapter).names()
    assert names[0].startswith("base_model.model.model.language_model.layers.0.")
    assert max_diff(hf_logits(mm, adapter=adapter), got) <= TOL
    from serving.config import adapter_rank, check_adapter_fits, check_weights

    check_adapter_fits(adapter, "a", adapter_rank(adapter, "a"), check_weights(mm))  # what serving.launch checks


def test_a_full_finetune_drops_the_stale_output_projection_of_a_multimodal_base(work, base):
    """A tied multimodal base in the published layout may keep a copy of its embedding as
    `language_model.lm_head.weight`. A full fine-tune's merge wrote the trained embedding beside that copy of the old
    one; transformers, finding the two different, untied them and projected with the stale copy (logits of another
    model). The copy is dropped, as a text model's lm_head.weight is."""
    from safetensors.numpy import load_file, save_file
    from transformers import Gemma3TextConfig

    from gemma_tpu.assets.tiny import TINY_GEMMA3

    mm = _write_multimodal_gemma3(work / "base_mm_head", Gemma3TextConfig(**TINY_GEMMA3), 7, base)
    weights = load_file(str(mm / "model.safetensors"))
    assert "language_model.lm_head.weight" not in weights
    weights["language_model.lm_head.weight"] = weights["language_model.model.embed_tokens.weight"].copy()
    save_file(weights, str(mm / "model.safetensors"), metadata={"format": "pt"})
    ckpt = work / "ckpt_mm_head"
    ref = make_checkpoint(mm, ckpt, full=True, seed=7)
    out = work / "merged_mm_head"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert "language_model.lm_head.weight" not in ordered_keys(out)
    assert json.loads((out / "gemma_tpu_merge.json").read_text())["dropped"] == ["language_model.lm_head.weight"]
    assert max_diff(ref, hf_logits(out)) <= TOL


def test_multimodal_final_logit_softcapping_is_not_applied_as_transformers(work, base):
    """transformers caps the final logits in Gemma3ForCausalLM only; Gemma3ForConditionalGeneration (what a
    multimodal config.json loads as, AutoModelForCausalLM included) never reads final_logit_softcapping. Such
    a checkpoint was refused; now it loads, trains, merges and exports with transformers' numbers, and the
    text-only model (which does cap) is still refused."""
    from transformers import Gemma3TextConfig

    from convert.export_peft import main as export_main
    from gemma_tpu.assets.tiny import TINY_GEMMA3
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.models import detect_family, load_model, resolve_model

    mm = _write_multimodal_gemma3(work / "base_mm_softcap",
                                  Gemma3TextConfig(**TINY_GEMMA3, final_logit_softcapping=0.5), 8, base)
    base_logits = hf_logits(mm)
    assert max(float(np.abs(x).max()) for x in base_logits) > 0.5  # a 0.5 cap would have changed them
    assert max_diff(tunix_logits(load_model(resolve_model(str(mm)), "float32")[0]), base_logits) <= TOL
    ckpt = work / "ckpt_mm_softcap"
    ref = make_checkpoint(mm, ckpt, seed=8)
    out = work / "merged_mm_softcap"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    got = hf_logits(out)
    assert max_diff(ref, got) <= TOL
    adapter = work / "adapter_mm_softcap"
    assert cli_main(export_main, ["--checkpoint", str(ckpt), "--out", str(adapter)]) == 0
    assert max_diff(hf_logits(mm, adapter=adapter), got) <= TOL
    text = json.loads((mm / "config.json").read_text())["text_config"]
    with pytest.raises(UserError, match="final_logit_softcapping=0.5"):
        detect_family(text).tunix_config(text)

def test_sparse_multimodal_config_means_transformers_defaults(work, base):
    """google/gemma-3-4b-it's config.json names few text keys (hidden_size, intermediate_size,
    num_hidden_layers, rope_scaling, sliding_window): the rest are transformers' defaults (8 heads, 4 KV
    heads, head_dim 256, ...). Such a config was refused ("missing key 'num_attention_heads'") by the
    loader, the trainer's checks and the merge; now each reads it as transformers does."""
    from transformers import Gemma3TextConfig

    from gemma_tpu.models import load_model, resolve_model

    text = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            sliding_window=16, rope_scaling={"rope_type": "linear", "factor": 8.0})
    mm = _write_multimodal_gemma3(work / "base_mm_sparse", text, 7, base)
    written = json.loads((mm / "config.json").read_text())
    keep = {"hidden_size", "intermediate_size", "num_hidden_layers", "rope_parameters", "sliding_window",
            "vocab_size", "model_type"}
    written["text_config"] = {k: v for k, v in written["text_config"].items() if k in keep}
    (mm / "config.json").write_text(json.dumps(written))
    resolved = resolve_model(str(mm))
    assert max_diff(tunix_logits(load_model(resolved, "float32")[0]), hf_logits(mm)) <= TOL
    ckpt = work / "ckpt_mm_sparse"
    ref = make_checkpoint(mm, ckpt, seed=7)
    out = work / "merged_mm_sparse"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert max_diff(ref, hf_logits(out)) <= TOL
    assert resolved.text_config["num_attention_heads"] == 8 and resolved.max_positions == 131072


def publish_anew(dst, src) -> None:
    """Another process's merge --overwrite, in this one: `src`'s files published over `dst` (a new directory)."""
    from gemma_tpu.core.atomic import AtomicDir

    ad = AtomicDir(dst, overwrite=True)
    with ad as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        ad.publish()


def replaced_while_read(path) -> str:
    """The error of a reader whose model directory `path` was published anew between its config and its weights."""
    return (f"error: {path}: replaced while it was being read (another process published it anew meanwhile, "
            f"e.g. a merge's --overwrite); its config.json, tokenizer and weights as read could mix two "
            f"models, so it was not used: run again")


def test_bf16_output_with_verify(work, lora_ckpt, merged):
    out = work / "merged_bf16"
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--dtype", "bfloat16", "--verify") == 0
    mw = sio.WeightsDir(out)
    assert {t.dtype for t in mw.tensors.values()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # the bf16 weights are the fp32 merge rounded once
    key = "model.layers.1.mlp.up_proj.weight"
    rounded = sio.WeightsDir(merged).read(key).astype(sio.DTYPES["BF16"])
    assert mw.read(key).tobytes() == rounded.tobytes()


def test_a_base_published_anew_during_the_merge_is_refused(work, base, lora_ckpt, monkeypatch, capsys):
    """The merge read the base's config.json first, its weights during the merge and its tokenizer files after: a
    base that is itself a merged output, published anew meanwhile (another merge's --overwrite), gave a merge of one
    model's weights with the other's config.json and tokenizer. Now refused in one line, nothing published."""
    import convert.merge_orbax as mo

    src = work / "base_republished"
    shutil.copytree(base, src)
    real = mo.write_sidecar_files

    def write_sidecar_files(*a):  # after the weights: a merge publishes over the base
        publish_anew(src, base)
        return real(*a)

    monkeypatch.setattr(mo, "write_sidecar_files", write_sidecar_files)
    out = work / "merged_republished"
    capsys.readouterr()
    assert merge("--checkpoint", lora_ckpt[0], "--base", src, "--out", out) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [replaced_while_read(src)]
    assert not out.exists() and not [p for p in work.iterdir() if p.name.startswith(".merged_republished")]


def test_verify_failure_keeps_output_aside(work, lora_ckpt, capsys, monkeypatch):
    import convert.verify as verify

    monkeypatch.setattr(verify, "FP32_ABS_TOL", 0.0)
    monkeypatch.setattr(verify, "FP32_REL_TOL", 0.0)
    monkeypatch.setattr(verify, "FP32_KL", 0.0)
    out = work / "merged_fail"
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--verify") == 3
    err = capsys.readouterr().err
    assert "verification failed" in err and err.strip().splitlines()[-1].startswith("error: ")
    assert not out.exists()
    assert (work / "merged_fail.unverified" / "model.safetensors").is_file()
    # a second failure replaces that earlier unverified output; a file or a foreign directory of that name is
    # kept (it was deleted with shutil.rmtree, or made the move fail and the merged files were lost)
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--verify") == 3
    assert (work / "merged_fail.unverified" / "model.safetensors").is_file()
    for i, make in enumerate((lambda p: p.write_text("mine"), lambda p: (p.mkdir(), (p / "notes").write_text("x")))):
        out = work / f"merged_fail{i}"
        make(work / f"merged_fail{i}.unverified")
        assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--verify") == 3
        kept = [p for p in work.iterdir() if p.name.startswith(f"merged_fail{i}.unverified-")]
        assert len(kept) == 1 and (kept[0] / "model.safetensors").is_file(), capsys.readouterr().err
        assert str(kept[0]) in capsys.readouterr().err.strip().splitlines()[-1]
    assert (work / "merged_fail0.unverified").read_text() == "mine"
    assert (work / "merged_fail1.unverified" / "notes").read_text() == "x"


def test_verification_that_cannot_run_keeps_the_merge_aside(work, lora_ckpt, capsys, monkeypatch):
    """transformers unable to load the merged model (a Gemma 4 on a transformers that predates it), or memory
    running out in the comparison: the merged files, perhaps an hour's work, were deleted with the temp dir.
    They are kept at <out>.unverified, as for a failed comparison, and nothing is published."""
    import convert.verify as verify
    from gemma_tpu.core.errors import UserError

    def cannot_load(model_dir, ids):
        raise UserError(f"{model_dir}: transformers cannot load it (model type gemma3_text is not known)")

    monkeypatch.setattr(verify, "hf_logits", cannot_load)
    out = work / "merged_noverify"
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--verify") == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: verification did not run (") and "transformers cannot load it" in last, last
    kept = work / "merged_noverify.unverified"
    assert last.endswith(f"nothing published at {out}; the merged files are kept at {kept}") and not out.exists()
    assert _complete(kept)

    def out_of_memory(model_dir, ids):
        raise MemoryError()

    monkeypatch.setattr(verify, "hf_logits", out_of_memory)
    with pytest.raises(MemoryError):
        merge("--checkpoint", lora_ckpt[0], "--out", out, "--verify")
    assert f"the merged files are kept at {kept}" in capsys.readouterr().err
    assert _complete(kept) and not out.exists() and leftovers(out) == []


def test_verify_catches_and_names_one_corrupted_lora_site(work, base, lora_ckpt, merged, monkeypatch, capsys):
    """One LoRA site whose update is 1% off passed --verify (the logits' KL moved by 2e-7, under the fp32 drift
    bound) and a failure could not name the tensor. Each site is now checked against the checkpoint's factors,
    so the merge fails naming it; bf16 rounding of every site stays within the bound."""
    import convert.merge_math as merge_math
    from convert.source import open_checkpoint
    from convert.verify import check_lora_sites, verify_merge

    key = "model.layers.1.self_attn.k_proj.weight"
    bad = work / "merged_one_bad_site"
    shutil.copytree(merged, bad)
    tensors = {n: sio.WeightsDir(merged).read(n) for n in ordered_keys(merged)}
    w0 = sio.WeightsDir(base).read(key).astype(np.float32)
    tensors[key] = (w0 + 1.01 * (tensors[key] - w0)).astype(tensors[key].dtype)
    from safetensors.numpy import save_file

    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    source = open_checkpoint(lora_ckpt[0])
    report = verify_merge(source, base, bad, "float32")
    assert not report.passed and report.reason.startswith(f"tensor {key}: ") and "by 1% of it" in report.reason
    assert all(r.passed for r in check_lora_sites(source, base, merged, "float32"))
    for dtype in ("bfloat16", "float16"):
        out = work / f"merged_sites_{dtype}"
        assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--dtype", dtype) == 0
        results = check_lora_sites(source, base, out, dtype)
        assert len(results) == 14 and all(r.passed for r in results), [r.describe() for r in results]

    # the same fault inside a merge: exit 3, the tensor named, nothing published
    real = merge_math.merged_rows

    def off_by_one_percent(weights, name, a_hf, b_hf, scale, *rest):
        return real(weights, name, a_hf, b_hf, scale * (1.01 if name == key else 1.0), *rest)

    monkeypatch.setattr(merge_math, "merged_rows", off_by_one_percent)
    out = work / "merged_bad_site"
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--verify") == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: verification failed (tensor {key}: ") and "by 1% of it" in last, last
    assert not out.exists() and (work / "merged_bad_site.unverified" / "model.safetensors").is_file()


def test_qlora_checkpoint_restores_quantized_and_verifies_dense(work, lora_ckpt):
    """One restore for generate and verify: generate gets the model as trained (int8 base), verify the
    dense base with the same factors, which is what a merge of a QLoRA run is made from."""
    from gemma_tpu.checkpoint.metadata import read_metadata, write_metadata
    from gemma_tpu.checkpoint.restore import restore_model

    ckpt = work / "ckpt_qlora"
    shutil.copytree(lora_ckpt[0], ckpt)
    meta = read_metadata(ckpt)
    meta["lora"]["base_quantization"] = "int8"
    write_metadata(ckpt, {k: v for k, v in meta.items() if k not in ("format", "version")})
    dense = restore_model(ckpt, apply_base_quantization=False)
    assert max_diff(tunix_logits(dense.model), lora_ckpt[1]) <= TOL
    quantized = restore_model(ckpt)
    assert "qvalue" in str(nnx_state_paths(quantized.model))
    assert max_diff(tunix_logits(quantized.model), lora_ckpt[1]) > 10 * TOL  # the int8 base is another model
    assert merge("--checkpoint", ckpt, "--out", work / "merged_qlora", "--verify") == 0


def test_base_is_found_at_the_recorded_revision(monkeypatch, tmp_path):
    """generate, evaluate, verify and the converters find the base one way: the recorded local dir while it
    exists, else the recorded hub spec at the recorded revision (generate used to drop the revision)."""
    from convert.source import CheckpointSource, resolve_base
    from gemma_tpu.checkpoint import restore

    calls = []
    monkeypatch.setattr(restore, "resolve_path",
                        lambda spec, revision=None, what="model.path", weights=False: calls.append((spec, revision))
                        or tmp_path)
    meta = {"base_model": {"path": "google/gemma-3-270m", "local_dir": str(tmp_path / "gone"), "revision": "abc123"}}
    assert restore.base_dir(tmp_path, meta) == tmp_path and calls == [("google/gemma-3-270m", "abc123")]
    calls.clear()
    meta["base_model"]["local_dir"] = str(tmp_path)
    assert restore.base_dir(tmp_path, meta) == tmp_path and calls == []
    assert restore.base_dir(tmp_path, meta, override="other") == tmp_path and calls == [("other", None)]
    with pytest.raises(restore.NoBaseModel, match="records no base model$"):
        restore.base_dir(tmp_path, {})
    source = CheckpointSource(tmp_path, 1, {}, None, {}, None, None)
    with pytest.raises(Exception, match="records no base model; pass --base$"):
        resolve_base(source)


def nnx_state_paths(model) -> list[str]:
    from flax import nnx

    return [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))]


@pytest.fixture(scope="module")
def full_ckpt(work, base) -> tuple[Path, list[np.ndarray]]:
    """A full fine-tune's checkpoint (no LoRA) and its logits; a fixture, so that any test that needs it has
    it whichever pytest-xdist worker runs that test."""
    ckpt = work / "ckpt_full"
    return ckpt, make_checkpoint(base, ckpt, full=True, seed=4)


def test_full_finetune(work, base, full_ckpt):
    ckpt, ref = full_ckpt
    out = work / "merged_full"
    assert merge("--checkpoint", ckpt, "--out", out, "--verify") == 0
    assert max_diff(ref, hf_logits(out)) <= TOL
    assert max_diff(ref, hf_logits(base)) > 100 * TOL
    assert json.loads((out / "gemma_tpu_merge.json").read_text())["kind"] == "full"


def test_a_checkpoint_recording_no_lora_settings_is_taken_for_what_its_step_holds(work, lora_ckpt, full_ckpt, capsys):
    """`"lora": null` in gemma_tpu_run.json: a full fine-tune's checkpoint was refused as 'metadata lora.rank is
    missing'. Its step's full parameters say what it is (merged, restored as trained); LoRA factors, whose scale
    is not recorded, are refused saying so."""
    from gemma_tpu.checkpoint.metadata import METADATA_FILE
    from gemma_tpu.checkpoint.restore import restore_model

    copies = {}
    for name, ckpt, recorded in (("full", full_ckpt[0], None), ("lora", lora_ckpt[0], None),
                                 ("full_empty", full_ckpt[0], {})):
        copy = copies[name] = work / f"ckpt_{name}_lora_null"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        meta = json.loads((copy / METADATA_FILE).read_text())
        meta["lora"] = recorded
        (copy / METADATA_FILE).write_text(json.dumps(meta))
    out = work / "merged_full_lora_null"
    assert merge("--checkpoint", copies["full"], "--out", out) == 0
    assert "(full fine-tune)" in capsys.readouterr().err
    assert max_diff(full_ckpt[1], hf_logits(out)) <= TOL
    assert json.loads((out / "gemma_tpu_merge.json").read_text())["kind"] == "full"
    assert max_diff(full_ckpt[1], tunix_logits(restore_model(copies["full"]).model)) <= TOL
    assert merge("--checkpoint", copies["full_empty"], "--out", work / "merged_full_lora_empty") == 0
    _expect_error(capsys, work / "merged_lora_lora_null", "--checkpoint", copies["lora"],
                  contains=f"{copies['lora'] / METADATA_FILE}: lora is null (no LoRA settings recorded) but step 1 "
                           "holds LoRA factors")


def test_sharded_output(work, lora_ckpt, merged):
    out = work / "merged_sharded"
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--max-shard-size", "100KB") == 0
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    w = sio.WeightsDir(out)
    assert index["metadata"]["total_size"] == w.total_bytes == sio.WeightsDir(merged).total_bytes
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    for s in shards:  # each shard within the limit unless it holds a single larger tensor
        infos, meta = sio.file_tensors(s)
        assert meta == {"format": "pt"}
        assert sum(t.nbytes for t in infos) <= 100_000 or len(infos) == 1
    assert w.names() == ordered_keys(merged)
    assert max_diff(hf_logits(out), hf_logits(merged)) == 0.0


def test_overwrite_replaces(work, lora_ckpt, merged):
    out = work / "merged_again"
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--dtype", "bfloat16") == 0
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--overwrite") == 0
    assert {t.dtype for t in sio.WeightsDir(out).tensors.values()} == {"F32"}
    assert leftovers(out) == [out.name]


def test_a_second_writer_of_one_output_is_refused_until_the_first_is_gone(work, lora_ckpt, merged, capsys, caplog):
    """Two `--overwrite` runs to one --out both succeeded (the last one's output won): the second is now
    refused in one line naming the first's PID, leaving the output as it was; once the first is killed
    (SIGKILL: its lock stays behind), the next run takes the stale lock over and writes."""
    from convert.export_peft import main as export_main
    from gemma_tpu.core.cli import cli_main

    out = work / "contended"
    shutil.copytree(merged, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    hold = ("import sys, time; from gemma_tpu.core.atomic import AtomicDir\n"
            "with AtomicDir(sys.argv[1], overwrite=True) as tmp:\n    print('held', flush=True); time.sleep(300)")
    from tests.conftest import holding

    proc = holding(hold, str(out))
    try:
        for main in (lambda a: merge(*a), lambda a: cli_main(export_main, [str(x) for x in a])):
            assert main(["--checkpoint", lora_ckpt[0], "--out", out, "--overwrite"]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith(f"error: {out} is being written by another process (PID {proc.pid} on "), err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    finally:
        proc.kill()
        proc.wait()
    assert sorted(p.name for p in work.iterdir() if p.name.startswith(".contended.")) == [
        f".contended.tmp-{proc.pid}", ".contended.writer.lock"]
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--overwrite", "--dtype", "bfloat16") == 0
    assert f"taking over a stale lock (PID {proc.pid} on " in caplog.text
    assert {t.dtype for t in sio.WeightsDir(out).tensors.values()} == {"BF16"}
    assert leftovers(out) == [out.name]


# ------------------------------------------------------------------------------ errors


def _expect_error(capsys, out: Path, *args, contains: str) -> str:
    rc = merge(*args, "--out", out)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert err and err[-1].startswith("error: ") and contains in err[-1], err
    assert leftovers(out) == []
    return err[-1]


def test_error_missing_checkpoint_dir_cli(work):
    """Through the real CLI: exit code 2, one line, no traceback."""
    from tests.conftest import assert_one_line_error, run_cli

    out = work / "err_cli"
    proc = run_cli("convert.merge_orbax", "--checkpoint", str(work / "nope"), "--out", str(out), timeout=120)
    assert proc.returncode == 2
    assert_one_line_error(proc, f"checkpoint directory {work / 'nope'} does not exist")
    assert leftovers(out) == []


def test_error_no_metadata(work, capsys):
    empty = work / "not_a_ckpt"
    empty.mkdir(exist_ok=True)
    _expect_error(capsys, work / "err1", "--checkpoint", empty, contains="gemma_tpu_run.json")


def test_error_a_step_given_relative_to_a_directory_inside_it_names_the_run(work, lora_ckpt, capsys, monkeypatch):
    """`--checkpoint .` from inside a step (its model_params, say) said "no gemma_tpu_run.json" of `.`: a step, or a
    directory inside one, is found through the absolute path and the run named, as for `--checkpoint RUN/1`."""
    ckpt = lora_ckpt[0]
    monkeypatch.chdir(ckpt / "1" / "model_params")
    _expect_error(capsys, work / "err_dot", "--checkpoint", ".",
                  contains=f". is inside step 1 of the checkpoint directory {ckpt}: give {ckpt}")
    monkeypatch.chdir(ckpt / "1")
    _expect_error(capsys, work / "err_dot", "--checkpoint", ".",
                  contains=f". is step 1 of the checkpoint directory {ckpt}: give {ckpt} (and --step 1)")


def test_error_missing_step(work, lora_ckpt, capsys):
    msg = _expect_error(capsys, work / "err2", "--checkpoint", lora_ckpt[0], "--step", "99", contains="step 99")
    assert "have: 1" in msg


def test_error_existing_out(work, lora_ckpt, capsys):
    out = work / "err3"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc = merge("--checkpoint", lora_ckpt[0], "--out", out)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and "--overwrite" in err[-1]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert leftovers(out) == [out.name]


def test_error_shape_mismatch(work, lora_ckpt, capsys):
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    other = write_tiny_gemma3(work / "base_h32", seed=5, hidden_size=32)
    msg = _expect_error(capsys, work / "err4", "--checkpoint", lora_ckpt[0], "--base", other,
                        "--allow-base-mismatch", contains="shape mismatch")  # past the fingerprint check
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "(64, 64)" in msg and "(64, 32)" in msg


def test_error_missing_base_names_the_flag(work, lora_ckpt, capsys):
    """It was named model.path, a setting of training configs that no one had given here."""
    msg = _expect_error(capsys, work / "err_nobase", "--checkpoint", lora_ckpt[0], "--base", work / "no_such_base",
                        contains=f"--base {work / 'no_such_base'}: no such directory")
    assert "model.path" not in msg


def test_error_base_without_config(work, base, lora_ckpt, capsys):
    broken = work / "base_noconfig"
    shutil.copytree(base, broken)
    (broken / "config.json").unlink()
    _expect_error(capsys, work / "err5", "--checkpoint", lora_ckpt[0], "--base", broken, contains="config.json")


def test_error_base_without_weights(work, base, lora_ckpt, capsys):
    broken = work / "base_noweights"
    shutil.copytree(base, broken)
    (broken / "model.safetensors").unlink()
    _expect_error(capsys, work / "err6", "--checkpoint", lora_ckpt[0], "--base", broken, contains="safetensors")


def _base_with(work: Path, base: Path, name: str, convert) -> Path:
    """A copy of `base` whose tensors are `convert(key, array)`."""
    from safetensors.numpy import load_file, save_file

    out = work / name
    shutil.copytree(base, out)
    t = load_file(str(base / "model.safetensors"))
    save_file({k: convert(k, v) for k, v in t.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_error_quantized_base_is_refused_by_name(work, base, lora_ckpt, capsys):
    """An int8 base (given with --allow-base-mismatch): a LoRA site of it crashed the writer with a RuntimeError
    traceback, an untargeted int8 tensor was copied into the output as int8; both merged without their scales."""
    i8 = _base_with(work, base, "base_i8", lambda k, v: np.clip(np.round(v * 100), -127, 127).astype(np.int8)
                    if k.endswith(("q_proj.weight", "embed_tokens.weight")) else v)
    _expect_error(capsys, work / "err_i8", "--checkpoint", lora_ckpt[0], "--base", i8, "--allow-base-mismatch",
                  contains="weight 'model.embed_tokens.weight' is I8, not floating point")
    # the merged sites the only int8 tensors
    only_q = _base_with(work, base, "base_i8_q", lambda k, v: v.astype(np.int8) if k.endswith("q_proj.weight") else v)
    _expect_error(capsys, work / "err_i8_q", "--checkpoint", lora_ckpt[0], "--base", only_q, "--allow-base-mismatch",
                  contains="weight 'model.layers.0.self_attn.q_proj.weight' is I8, not floating point")

    from convert.export_gguf import main as gguf_main
    from gemma_tpu.core.cli import cli_main

    pytest.importorskip("gguf")
    assert cli_main(gguf_main, ["--merged", str(only_q), "--out", str(work / "i8.gguf"), "--type", "f16"]) == 2
    assert "q_proj.weight' is I8, not floating point" in capsys.readouterr().err
    assert leftovers(work / "i8.gguf") == []


def test_a_quantized_output_projection_is_refused_in_the_multimodal_layout_too(work, base, lora_ckpt, capsys):
    """An int8 `lm_head.weight` is refused as a quantized base's; the same tensor where published multimodal
    checkpoints keep it, `language_model.lm_head.weight`, was let through unchecked."""
    embed = sio.WeightsDir(base).read("model.embed_tokens.weight")
    head = np.clip(np.round(embed * 100), -127, 127).astype(np.int8)
    mm, ckpt = _text_run_on_multimodal_layout(work, base, lora_ckpt, "mm_i8_head",
                                              {"language_model.lm_head.weight": head})
    _expect_error(capsys, work / "err_mm_i8_head", "--checkpoint", ckpt,
                  contains=f"{mm}: weight 'language_model.lm_head.weight' is I8, not floating point")


def test_a_base_tensor_the_merge_copies_must_have_its_config_shape(work, base, lora_ckpt, capsys):
    """A norm or embedding of another length (let through by --allow-base-mismatch) was copied into the output
    as it was: a merge transformers refuses to load ('size mismatch'). Each is refused by name, nothing written."""
    cases = [("model.norm.weight", lambda v: v[:-1], "is [63], but its config.json makes it [64]"),
             ("model.layers.1.self_attn.k_norm.weight", lambda v: np.concatenate([v, v]), "is [32]"),
             ("model.embed_tokens.weight", lambda v: v[:-3], "is [509, 64], but its config.json makes it [512, 64]")]
    for i, (key, edit, says) in enumerate(cases):
        bad = _base_with(work, base, f"base_badshape{i}", lambda k, v: edit(v) if k == key else v)
        _expect_error(capsys, work / f"err_badshape{i}", "--checkpoint", lora_ckpt[0], "--base", bad,
                      "--allow-base-mismatch", contains=f"{bad}: tensor {key} {says}")


def test_a_base_projection_no_lora_targets_must_have_its_config_shape(work, base, capsys):
    """A run that targets q_proj only copies the other projections: one of another width (let through by
    --allow-base-mismatch) was published as it was, a model transformers refuses to load."""
    ckpt = work / "ckpt_q_only"
    if not ckpt.exists():
        make_checkpoint(base, ckpt, rank=2, alpha=4.0, targets=["q_proj"], seed=3)
    key = "model.layers.1.mlp.down_proj.weight"
    bad = _base_with(work, base, "base_narrow_down", lambda k, v: v[:, :-8] if k == key else v)
    _expect_error(capsys, work / "err_narrow_down", "--checkpoint", ckpt, "--base", bad, "--allow-base-mismatch",
                  contains=f"{bad}: tensor {key} is [64, 120], but its config.json makes it [64, 128]")


def test_a_multimodal_base_vision_tensor_must_have_its_config_shape(work, base, capsys):
    """The merge copies a multimodal base's vision tower and projector as they are: one of another shape than
    config.json's vision_config gives it (a tower copied from another model, a vision_config edited; let through
    the fingerprint by --allow-base-mismatch) was published, a model transformers refuses to load ('size
    mismatch'). Each is refused by name, nothing written; the text tensors were already checked."""
    from transformers import Gemma3TextConfig

    from gemma_tpu.assets.tiny import TINY_GEMMA3

    mm = work / "base_mm_vision"
    if not mm.exists():
        _write_multimodal_gemma3(mm, Gemma3TextConfig(**TINY_GEMMA3), 9, base)
    ckpt = work / "ckpt_mm_vision"
    if not ckpt.exists():
        make_checkpoint(mm, ckpt, rank=2, alpha=4.0, targets=["q_proj"], seed=9)
    fc1, proj = "vision_tower.encoder.layers.0.mlp.fc1.weight", "multi_modal_projector.mm_input_projection_weight"
    cases = [(fc1, lambda v: v[:-16], None, f"tensor {fc1} is [48, 32], but its config.json makes it [64, 32]"),
             (proj, lambda v: v[:, :-4], None, f"tensor {proj} is [32, 60], but its config.json makes it [32, 64]"),
             (None, None, {"patch_size": 4}, "tensor vision_tower.embeddings.patch_embedding.weight is [32, 3, 8, 8], "
                                              "but its config.json makes it [32, 3, 4, 4]")]
    for i, (key, edit, vision, says) in enumerate(cases):
        bad = _base_with(work, mm, f"base_mm_badvision{i}", lambda k, v: edit(v) if k == key else v)
        if vision:
            cfg = json.loads((bad / "config.json").read_text())
            cfg["vision_config"].update(vision)
            (bad / "config.json").write_text(json.dumps(cfg))
        _expect_error(capsys, work / f"err_mm_badvision{i}", "--checkpoint", ckpt, "--base", bad,
                      "--allow-base-mismatch", contains=f"{bad}: {says}")
    out = work / "merged_mm_vision"  # the base as written: merged
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert ordered_keys(out) == ordered_keys(mm)
    # every tensor beside the decoder is checked, and the table's defaults are transformers'
    from transformers import SiglipVisionConfig

    from gemma_tpu.models.gemma3 import VISION_DEFAULTS, tower_shapes

    tensors = sio.WeightsDir(mm).tensors
    want = tower_shapes(json.loads((mm / "config.json").read_text()), list(tensors))
    assert set(want) == {n for n in tensors if not n.startswith("language_model.")}
    assert all(tuple(tensors[n].shape) == shape for n, shape in want.items())
    defaults = SiglipVisionConfig().to_dict()
    assert {k: defaults[k] for k in VISION_DEFAULTS} == VISION_DEFAULTS
    # and a tower of other sizes (no head, an image size patches do not divide) as transformers builds it
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig

    vision = SiglipVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
                                image_size=30, patch_size=8, vision_use_head=False)
    cfg = Gemma3Config(text_config=Gemma3TextConfig(**TINY_GEMMA3), vision_config=vision, mm_tokens_per_image=4)
    with torch.device("meta"):
        built = {n: tuple(p.shape) for n, p in Gemma3ForConditionalGeneration(cfg).state_dict().items()}
    want = tower_shapes(cfg.to_dict(), list(built))
    assert set(want) == {n for n in built if not n.startswith("model.language_model.") and n != "lm_head.weight"}
    assert all(built[n] == shape for n, shape in want.items())


def test_a_base_config_without_model_type_is_refused(work, base, lora_ckpt, capsys):
    """transformers picks the model class by config.json's model_type: a base without it (or with another family's,
    its architecture a Gemma 3) merged, and transformers could not load the output ('Unrecognized model')."""
    for i, (value, says) in enumerate([(None, "is missing"), ("llama", "is 'llama'")]):
        bad = work / f"base_model_type{i}"
        shutil.copytree(base, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg.pop("model_type")
        (bad / "config.json").write_text(json.dumps(cfg if value is None else {**cfg, "model_type": value}))
        _expect_error(capsys, work / f"err_model_type{i}", "--checkpoint", lora_ckpt[0], "--base", bad,
                      "--allow-base-mismatch", contains=f"{bad / 'config.json'}: model_type {says}, so transformers "
                      f"cannot load the merged model (a gemma3 config.json has one of: gemma3_text, gemma3)")


def test_float64_base_merges_to_float32(work, base, lora_ckpt, merged):
    """A float64 base (which the trainer loads) was refused: 'no floating-point tensors'. An integer buffer
    outside the decoder (a vision tower's position ids) is no quantized weight: copied as it is."""
    from safetensors.numpy import load_file, save_file

    f64 = _base_with(work, base, "base_f64", lambda k, v: v.astype(np.float64))
    t = load_file(str(f64 / "model.safetensors"))
    t["vision_tower.position_ids"] = np.arange(16, dtype=np.int64)
    save_file(t, str(f64 / "model.safetensors"), metadata={"format": "pt"})
    out = work / "merged_f64"
    assert merge("--checkpoint", lora_ckpt[0], "--base", f64, "--out", out, "--allow-base-mismatch") == 0
    mw = sio.WeightsDir(out)
    assert {t.dtype for n, t in mw.tensors.items() if n != "vision_tower.position_ids"} == {"F32"}
    assert mw["vision_tower.position_ids"].dtype == "I64"
    assert list(mw.read("vision_tower.position_ids")) == list(range(16))
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert max_diff(hf_logits(merged), hf_logits(out)) <= 1e-6


def test_a_base_with_scalar_and_empty_tensors_merges_them_as_they_are(work, base, lora_ckpt, merged):
    """A 0-dim tensor beside the decoder (a buffer such as a scale) crashed the cast to another --dtype with a
    numpy reshape traceback; it and an empty tensor are cast and kept."""
    from safetensors.numpy import load_file, save_file

    odd = _base_with(work, base, "base_scalars", lambda k, v: v)
    t = load_file(str(odd / "model.safetensors"))
    t["extra.scale"], t["extra.step"], t["extra.none"] = np.array(3.5, np.float32), np.array(7), np.zeros((0, 4))
    save_file(t, str(odd / "model.safetensors"), metadata={"format": "pt"})
    out = work / "merged_scalars"
    assert merge("--checkpoint", lora_ckpt[0], "--base", odd, "--out", out, "--allow-base-mismatch",
                 "--dtype", "bfloat16") == 0
    mw = sio.WeightsDir(out)
    assert (mw["extra.scale"].dtype, mw["extra.scale"].shape, float(mw.read("extra.scale"))) == ("BF16", (), 3.5)
    assert (mw["extra.step"].dtype, int(mw.read("extra.step"))) == ("I64", 7)
    assert (mw["extra.none"].dtype, mw["extra.none"].shape) == ("BF16", (0, 4))
    key = "model.layers.0.mlp.down_proj.weight"
    assert mw.read(key).tobytes() == sio.WeightsDir(merged).read(key).astype(sio.DTYPES["BF16"]).tobytes()


def test_a_peft_adapter_config_beside_the_base_is_not_copied(work, base, lora_ckpt, merged):
    """Files beside the base's weights travel with the merge (licence, README), but a PEFT adapter_config.json
    there made transformers load the merged directory as that adapter on its base, not the merged weights."""
    shutil.copytree(base, work / "base_adapter")
    (work / "base_adapter" / "README.md").write_text("licence and card\n")
    (work / "base_adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": str(base), "r": 2, "lora_alpha": 2,
         "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}))
    out = work / "merged_beside_adapter"
    assert merge("--checkpoint", lora_ckpt[0], "--base", work / "base_adapter", "--out", out) == 0
    assert (out / "README.md").read_text() == "licence and card\n"
    assert not (out / "adapter_config.json").exists()
    assert max_diff(hf_logits(merged), hf_logits(out)) <= 1e-6


# ------------------------------------------------------------------------------ atomicity


def test_out_that_is_a_mount_point_is_refused_before_the_merge(work, lora_ckpt, small_disk, capsys):
    """--out a mounted disk with --overwrite: the whole merge ran (and its space was checked on the disk above),
    then the rename into place failed with 'Device or resource busy'. Refused first; inside it, the merge works."""
    mnt = small_disk("80m")
    assert merge("--checkpoint", lora_ckpt[0], "--out", mnt, "--overwrite") == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"error: --out {mnt} is a mount point, which an output cannot replace (it "
                                            f"is built beside the target and renamed into place); give a path inside "
                                            f"it, e.g. {mnt / 'out'}")
    assert "merge: " not in err and list(mnt.iterdir()) == [] and leftovers(mnt) == [mnt.name]
    assert merge("--checkpoint", lora_ckpt[0], "--out", mnt / "out") == 0 and _complete(mnt / "out")


def test_out_that_is_a_link_to_an_earlier_output_is_named_as_a_link(work, lora_ckpt, capsys):
    """--out latest --overwrite, `latest` a symlink to the last merge: refused as 'exists and is not a directory',
    while `ls` showed a directory. It is named as the link it is, and the path it points to is replaced."""
    real = work / "merged_linked"
    assert merge("--checkpoint", lora_ckpt[0], "--out", real) == 0
    link = work / "latest"
    link.symlink_to(real)
    assert merge("--checkpoint", lora_ckpt[0], "--out", link, "--overwrite") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {link} is a symbolic link (to {real}); refusing to replace the link: give the path it points to, or "
        f"remove the link")
    assert link.is_symlink() and _complete(real)
    assert merge("--checkpoint", lora_ckpt[0], "--out", link.resolve(), "--overwrite") == 0 and _complete(real)


def test_a_target_overwrite_would_refuse_is_refused_so_without_it(work, lora_ckpt, capsys):
    """--out naming a link, or a file where a directory is written (a directory where a .gguf is), was refused as
    'already exists (use --overwrite to replace it)', and --overwrite then refused it for what it is: the first
    refusal says what it is."""
    from convert.export_gguf import main as export_gguf
    from gemma_tpu.core.cli import cli_main

    (work / "a_file").write_text("mine")
    (work / "a_dir.gguf").mkdir()
    (work / "a_link").symlink_to(work / "nowhere")
    for out, error in ((work / "a_file", f"{work / 'a_file'} exists and is not a directory; refusing to replace it"),
                       (work / "a_link", f"{work / 'a_link'} is a symbolic link (to {work / 'nowhere'}); refusing")):
        assert merge("--checkpoint", lora_ckpt[0], "--out", out) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {error}")
    assert cli_main(export_gguf, ["--checkpoint", str(lora_ckpt[0]), "--out", str(work / "a_dir.gguf")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {work / 'a_dir.gguf'} exists and is not a regular file; refusing to replace it")
    assert (work / "a_file").read_text() == "mine" and (work / "a_link").is_symlink()
    assert not any((work / "a_dir.gguf").iterdir())
    # an input (the base, the checkpoint, one of its steps), a directory of other files, a file of other bytes: each
    # was 'already exists (use --overwrite to replace it)', then refused with --overwrite as what it is
    ckpt, base = lora_ckpt[0], json.loads((lora_ckpt[0] / "gemma_tpu_run.json").read_text())["base_model"]["local_dir"]
    (work / "others").mkdir()
    (work / "others" / "notes.txt").write_text("mine")
    (work / "notes.gguf").write_text("mine")
    for out, error in ((Path(base), f"--out {base} would replace an input ({base})"),
                       (ckpt, f"--out {ckpt} would replace an input ({ckpt})"),
                       (ckpt / "1", f"--out {ckpt / '1'} is inside an input ({ckpt}); write it elsewhere"),
                       (work / "others", f"--out {work / 'others'}: --overwrite replaces an earlier output (a "
                                         "directory with gemma_tpu_merge.json), and this one holds other files")):
        assert merge("--checkpoint", ckpt, "--out", out) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {error}")
    assert cli_main(export_gguf, ["--checkpoint", str(ckpt), "--out", str(work / "notes.gguf")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: --out {work / 'notes.gguf'}: --overwrite replaces an earlier output (a file starting with")
    assert (work / "notes.gguf").read_text() == (work / "others" / "notes.txt").read_text() == "mine"


def test_too_little_disk_names_the_margin_it_keeps(work, lora_ckpt, small_disk, capsys):
    """A disk with room for the output but not for the 64 MiB kept free beside it: the refusal read 'need
    428.54 KB, 4.19 MB free', a contradiction to whoever read it."""
    out = small_disk("4m") / "out"
    msg = _expect_error(capsys, out, "--checkpoint", lora_ckpt[0], contains="not enough disk space")
    assert "need 428.54 KB plus 67.11 MB to spare, 4.19 MB free" in msg, msg


def test_space_a_killed_merge_left_behind_counts_as_free(work, lora_ckpt, small_disk, capsys):
    """A merge SIGKILLed near its end leaves its hidden temp dir holding almost a whole output: the rerun was
    refused 'not enough disk space' (it measured the space before removing the leftover), so a disk that held
    one output could not take it again until the user found and removed the hidden directory."""
    disk = small_disk("68m")  # 71.3 MB: the output (428.54 KB) and the 67.11 MB margin fit, not with 4 MB held
    killed = disk / f".out.tmp-{2 ** 22 + 7}"  # above pid_max: a writer that is gone
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"x" * 4_000_000)
    assert merge("--checkpoint", lora_ckpt[0], "--out", disk / "out") == 0, capsys.readouterr().err
    assert _complete(disk / "out") and sorted(p.name for p in disk.iterdir()) == ["out"]
    # not enough even with the leftover: the refusal counts it, names it, and leaves it
    (disk / "filler").write_bytes(b"x" * 3_500_000)
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"x" * 1_000_000)
    msg = _expect_error(capsys, disk / "again", "--checkpoint", lora_ckpt[0], contains="not enough disk space")
    assert msg.endswith("free")
    assert merge("--checkpoint", lora_ckpt[0], "--out", disk / "out", "--overwrite") == 2
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    assert msg.startswith(f"error: not enough disk space for {disk / 'out'}: ")
    assert re.search(r"MB free \(1\.\d+ MB of it held by what killed runs left, e\.g\. \.out\.tmp-4194311, removed "
                     r"before writing\)$", msg), msg
    assert killed.is_dir()


def test_overwrite_replaces_only_what_it_was_allowed_to_even_if_made_while_writing(tmp_path):
    """--overwrite replaces an earlier output, never a directory of other files, a link or a file of other bytes
    (check_target, at the start). One made at --out while the merge ran was replaced all the same: a directory of a
    user's files swapped out and deleted, a file left under the temp's name for the next run to delete. It is
    refused, nothing published; an earlier output made meanwhile is replaced as --overwrite says."""
    from gemma_tpu.core.atomic import AtomicDir, AtomicFile
    from gemma_tpu.core.errors import UserError

    def publish(out, made, kind="dir"):
        ad = (AtomicDir(out, overwrite=True, marker="gemma_tpu_merge.json") if kind == "dir" else
              AtomicFile(out, overwrite=True, magic=b"GGUF"))
        with ad as tmp:
            if kind == "dir":
                (tmp / "gemma_tpu_merge.json").write_text("new")
            else:
                tmp.write_bytes(b"GGUF new")
            made(out)
            ad.publish()

    def user_dir(out):
        out.mkdir()
        (out / "notes.txt").write_text("precious")

    cases = [("dir", user_dir, "a directory of other files (notes.txt)"),
             ("dir", lambda out: out.write_text("precious"), "not a directory"),
             ("dir", lambda out: out.symlink_to(tmp_path), f"a symbolic link (to {tmp_path})"),
             ("file", lambda out: out.write_text("precious"), "a file that does not start with b'GGUF'")]
    for i, (kind, made, why) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(UserError, match=re.escape(f"{out} was made anew while writing and is {why}; not "
                                                      f"replacing it, nothing was published")):
            publish(out, made, kind)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((out.name, f".{out.name}"))) == \
            [out.name], kind
        assert out.is_symlink() or ((out / "notes.txt") if out.is_dir() else out).read_text() == "precious"
    earlier = tmp_path / "earlier"
    publish(earlier, lambda out: (out.mkdir(), (out / "gemma_tpu_merge.json").write_text("old")))
    assert (earlier / "gemma_tpu_merge.json").read_text() == "new"


def _start_merge(ckpt: Path, out: Path, *extra: str, slow: float = 0.15) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GEMMA_TPU_MERGE_SLOW": str(slow)}
    return subprocess.Popen([sys.executable, "-m", "convert.merge_orbax", "--checkpoint", str(ckpt),
                             "--out", str(out), *extra], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for_tmp(proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    tmp = out.parent / f".{out.name}.tmp-{proc.pid}"
    while not tmp.exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _complete(out: Path) -> bool:
    names = {p.name for p in out.iterdir()}
    wanted = {"model.safetensors", "config.json", "gemma_tpu_merge.json"}
    return wanted <= names and len(sio.WeightsDir(out).names()) == 28


def test_sigkill_never_leaves_partial_output(work, lora_ckpt):
    ckpt = lora_ckpt[0]
    out = work / "atomic"
    rnd = random.Random(0)
    # 28 tensors at 0.15 s each: the write phase lasts about 4 s; kill at random points in it,
    # nine times here and once more below during an --overwrite (the issue's ten)
    for _ in range(9):
        proc = _start_merge(ckpt, out)
        _wait_for_tmp(proc, out)
        time.sleep(rnd.uniform(0.0, 3.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not out.exists()
    stale = [p for p in work.iterdir() if p.name.startswith(".atomic.tmp-")]
    assert stale  # what SIGKILL leaves behind: a hidden temp dir, never the target
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert _complete(out)
    assert leftovers(out) == ["atomic"]  # the re-run cleaned the stale temp dirs

    # --overwrite killed half-way: the old output is still there, whole
    before = (out / "gemma_tpu_merge.json").read_text()
    proc = _start_merge(ckpt, out, "--overwrite", "--dtype", "bfloat16")
    _wait_for_tmp(proc, out)
    time.sleep(rnd.uniform(0.5, 3.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _complete(out) and (out / "gemma_tpu_merge.json").read_text() == before


def test_sigterm_cleans_up(work, lora_ckpt):
    out = work / "atomic_term"
    proc = _start_merge(lora_ckpt[0], out)
    _wait_for_tmp(proc, out)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    assert leftovers(out) == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_after_the_output_is_written_exits_0(work, lora_ckpt, sig):
    """A stop that lands after `merge: wrote OUT`, while the interpreter shuts down (JAX's teardown takes a while):
    the process died by SIGTERM (-15) or SIGHUP (-1) although its output was published whole. The work is done:
    it ends at once with the command's exit code, 0."""
    out = work / f"stopped_at_exit_{sig}"
    code = (f"import atexit, signal, sys\natexit.register(signal.raise_signal, signal.{sig})\n"
            "from convert.merge_orbax import main\nfrom gemma_tpu.core.cli import cli_main\nsys.exit(cli_main(main))")
    proc = subprocess.run([sys.executable, "-c", code, "--checkpoint", str(lora_ckpt[0]), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"merge: wrote {out}", proc.stderr[-2000:]
    assert _complete(out) and leftovers(out) == [out.name]


@pytest.mark.parametrize("tool", ["merge_orbax", "export_peft", "export_gguf"])
def test_a_sigterm_once_the_output_is_published_says_both(work, lora_ckpt, tool):
    """A SIGTERM as the writer lock beside --out is removed, the output in place: the process died by the signal
    (-15) with nothing said. 'wrote OUT' is said, then the stop, naming the output as published (exit 143);
    tests/test_interrupts.py has the other moments."""
    out = work / f"stopped_published_{tool}{'.gguf' if tool == 'export_gguf' else ''}"
    lock = str(out.parent / f".{out.name}.writer.lock")
    code = ("import os, signal, sys\n"
            f"def hook(event, args):\n    if event == 'os.remove' and os.fspath(args[0]) == {lock!r}:\n"
            "        signal.raise_signal(signal.SIGTERM)\n"
            f"sys.addaudithook(hook)\nfrom convert.{tool} import main\nfrom gemma_tpu.core.cli import cli_main\n"
            "sys.exit(cli_main(main))")
    proc = subprocess.run([sys.executable, "-c", code, "--checkpoint", str(lora_ckpt[0]), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 143, proc.stderr[-2000:]
    said = proc.stderr.strip().splitlines()[-2:]
    assert said[0].startswith(f"{ {'merge_orbax': 'merge', 'export_gguf': 'gguf'}.get(tool, tool)}: wrote {out}"), \
        proc.stderr[-2000:]
    assert said[1] == f"error: stopped by SIGTERM after {out} was published", proc.stderr[-2000:]
    record = {"merge_orbax": "gemma_tpu_merge.json", "export_peft": "gemma_tpu_adapter.json"}.get(tool)
    assert leftovers(out) == [out.name] and ((out / record).is_file() if record else out.read_bytes()[:4] == b"GGUF")


def test_a_merge_that_fails_mid_write_leaves_no_directory_it_made(work, lora_ckpt):
    """--out new/run/merged, and the write fails (a file-size limit here: a full disk alike): the output was not
    published, but new/ and new/run/, made for it, were left behind. They are removed; a parent that was there
    before is kept."""
    import shlex

    from tests.conftest import assert_one_line_error

    (work / "there").mkdir()
    for out, left in ((work / "new" / "run" / "merged", work / "new"), (work / "there" / "merged", None)):
        # files of at most 1 KiB (Python ignores SIGXFSZ: the write fails with EFBIG)
        merge_cmd = shlex.join([sys.executable, "-m", "convert.merge_orbax", "--checkpoint", str(lora_ckpt[0]),
                                "--out", str(out)])
        proc = subprocess.run(["bash", "-c", f"ulimit -f 2 && exec {merge_cmd}"], cwd=REPO, capture_output=True,
                              text=True, timeout=600)
        assert_one_line_error(proc, f"writing {out} failed", "(File too large); nothing was published")
        assert not left.exists() if left else list((work / "there").iterdir()) == []


def test_a_step_deleted_while_the_merge_reads_it(work, lora_ckpt):
    """A merge run while training goes on: the trainer's max_to_keep deletes the step the merge chose (here
    as soon as the merge's temp dir appears, before it reads the second layer's factors). One line saying
    so (it said `cannot read tensor ...; the step is incomplete or damaged`), nothing at --out."""
    from tests.conftest import assert_one_line_error

    ckpt, out = work / "deleted_ckpt", work / "deleted_merge"
    shutil.copytree(lora_ckpt[0], ckpt)
    (step,) = [p for p in ckpt.iterdir() if p.name.isdigit()]
    proc = _start_merge(ckpt, out, slow=0.2)  # 28 tensors: ~6 s of writing
    _wait_for_tmp(proc, out)
    shutil.rmtree(step)
    assert proc.wait(timeout=120) != 0
    err = proc.stderr.read().decode()
    assert_one_line_error(subprocess.CompletedProcess([], proc.returncode, "", err),
                          f"{step}: the step was deleted while being read", "checkpoint.max_to_keep")
    assert leftovers(out) == []


# ------------------------------------------------------------------------------ PEFT


def test_peft_export_matches_merge(work, base, lora_ckpt, merged):
    from safetensors import safe_open

    from convert.export_peft import main
    from gemma_tpu.core.cli import cli_main

    out = work / "adapter"
    assert cli_main(main, ["--checkpoint", str(lora_ckpt[0]), "--out", str(out)]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["target_modules"] == ALL_TARGETS and cfg["base_model_name_or_path"] == str(base)
    assert cfg["bias"] == "none" and cfg["fan_in_fan_out"] is False
    with safe_open(str(out / "adapter_model.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
        p = "base_model.model.model.layers.1.self_attn."
        assert f.get_tensor(p + "q_proj.lora_A.weight").shape == (4, 64)
        assert f.get_tensor(p + "q_proj.lora_B.weight").shape == (64, 4)
        assert f.get_tensor(p + "k_proj.lora_B.weight").shape == (32, 4)
        # K and V share the fused kv_einsum's A
        assert np.array_equal(f.get_tensor(p + "k_proj.lora_A.weight"), f.get_tensor(p + "v_proj.lora_A.weight"))
        assert not np.array_equal(f.get_tensor(p + "k_proj.lora_B.weight"), f.get_tensor(p + "v_proj.lora_B.weight"))
    assert len(keys) == 2 * 7 * 2
    assert max_diff(hf_logits(base, adapter=out), hf_logits(merged)) <= TOL


def test_peft_adapter_names_the_base_it_was_trained_on_wherever_it_is_loaded(work, base, lora_ckpt, merged):
    """model.path as written in a run's config, relative to where training ran (`tiny/gemma3`), went into
    adapter_config.json as is: AutoPeftModelForCausalLM run anywhere else found no such model. The absolute
    directory trained on is named; a hub id stays the hub id."""
    import torch
    from peft import AutoPeftModelForCausalLM

    from convert.export_peft import main, peft_base_path
    from gemma_tpu.checkpoint.metadata import read_metadata, write_metadata
    from gemma_tpu.core.cli import cli_main

    ckpt = work / "ckpt_relative_base"
    shutil.copytree(lora_ckpt[0], ckpt)
    meta = read_metadata(ckpt)
    meta["base_model"]["path"] = "tiny/gemma3"
    write_metadata(ckpt, {k: v for k, v in meta.items() if k not in ("format", "version")})
    out = work / "adapter_relative_base"
    assert cli_main(main, ["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    model = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        got = [model(input_ids=torch.tensor([p])).logits[0].numpy() for p in PROMPTS]
    assert max_diff(got, hf_logits(merged)) <= TOL
    hub = {"path": "google/gemma-3-270m", "local_dir": "/cache/models--google--gemma-3-270m/snapshots/0123abc"}
    assert peft_base_path(hub) == "google/gemma-3-270m"
    assert peft_base_path({"path": "embedded:tiny", "local_dir": "/assets/tiny"}) == "/assets/tiny"


def test_verify_compares_a_peft_adapter_on_its_base_with_the_merge(work, base, lora_ckpt, merged, capsys):
    """`convert.verify MERGED ADAPTER` said "config.json: missing": an adapter could not be checked against the
    merge of its step before serving it. It is compared as PEFT loads it, on the base its config names."""
    from convert.export_peft import main
    from convert.verify import main as verify
    from gemma_tpu.core.cli import cli_main

    out = work / "adapter_verified"
    assert cli_main(main, ["--checkpoint", str(lora_ckpt[0]), "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(verify, [str(merged), str(out), "--max-abs-diff", str(TOL), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["passed"] and got["max_abs_diff"] <= TOL and got["argmax_agreement"] == 1.0
    assert cli_main(verify, [str(out), str(base), "--max-abs-diff", "0.01"]) == 1  # the adapter changes the model
    assert "max |diff|" in capsys.readouterr().err
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(work / "gone")}))
    assert cli_main(verify, [str(merged), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out}: its base_model_name_or_path {work / 'gone'} is not a directory here" in err
    assert "Traceback" not in err


def test_verify_refuses_an_adapter_of_a_base_of_another_shape(work, base, tiny_mha_dir, lora_ckpt, merged, capsys):
    """An adapter compared on a base of another shape (other K/V widths; more layers than the base has) passed
    with peft's "missing adapter keys" and size warnings while its logits were not the adapter's. Refused in one
    line naming the module and shapes; so is a bias (Gemma has none; vLLM refuses it at load)."""
    from safetensors.numpy import load_file, save_file

    from convert.export_peft import main
    from convert.verify import main as verify
    from gemma_tpu.core.cli import cli_main

    out = work / "adapter_other_shape"
    assert cli_main(main, ["--checkpoint", str(lora_ckpt[0]), "--out", str(out)]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(tiny_mha_dir)}))
    capsys.readouterr()
    assert cli_main(verify, [str(merged), str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{out} on {tiny_mha_dir}: the adapter's update of model.layers.0.self_attn.k_proj is" in err
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "adapter_model.safetensors"))  # as trained on a deeper base: layers past its last
    save_file({k.replace("layers.0.", "layers.40."): v for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    assert cli_main(verify, [str(merged), str(out)]) == 2
    assert re.search(r"the adapter changes model\.layers\.40\.\w+\.\w+_proj, which the base has no weight for",
                     capsys.readouterr().err)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "bias": "all"}))
    assert cli_main(verify, [str(merged), str(out)]) == 2
    assert "adapter_config.json has bias='all'" in capsys.readouterr().err
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    assert cli_main(verify, [str(merged), str(out), "--max-abs-diff", str(TOL)]) == 0
    import torch  # peft's safe_serialization=False: pickled weights, which peft and vLLM read too

    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, out / "adapter_model.bin")
    (out / "adapter_model.safetensors").unlink()
    assert cli_main(verify, [str(merged), str(out), "--max-abs-diff", str(TOL)]) == 0
    (out / "adapter_model.bin").unlink()  # peft's per-module ranks: q_proj at rank 2, what peft loads
    save_file({k: (v[:2] if "q_proj.lora_A" in k else v[:, :2] if "q_proj.lora_B" in k else v)
               for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "rank_pattern": {"q_proj": 2}}))
    capsys.readouterr()
    assert cli_main(verify, [str(merged), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_abs_diff"] > TOL  # a quarter of q_proj's update is gone


def test_peft_export_of_a_tool_calling_run_needs_its_base_tokenizer(work, base, capsys):
    """A tool-calling run (token map in its metadata) whose base was gone only warned "no tokenizer written": the
    adapter shipped without its markers, and serving's launch check could no longer see that it needs them.
    Refused in one line naming --base, nothing written; with --base the tokenizer ships with the markers."""
    from convert.export_peft import main
    from gemma_tpu.checkpoint.metadata import METADATA_FILE
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.formats.function_calling import FUNCTION_MARKERS
    from gemma_tpu.hf.tokenizer import tokens_named

    gone = work / "base_tool_gone"
    shutil.copytree(base, gone)
    ckpt = work / "ckpt_tool"
    make_checkpoint(gone, ckpt, seed=3)
    meta = json.loads((ckpt / METADATA_FILE).read_text())
    meta["token_map"] = {m: f"<unused{5 + i}>" for i, m in enumerate(FUNCTION_MARKERS)}
    (ckpt / METADATA_FILE).write_text(json.dumps(meta))
    shutil.rmtree(gone)
    out = work / "adapter_tool"
    capsys.readouterr()
    assert cli_main(main, ["--checkpoint", str(ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{ckpt}: a tool-calling run's adapter ships its base's tokenizer" in err and err.rstrip().endswith(
        "pass --base DIR"), err
    assert leftovers(out) == []
    assert cli_main(main, ["--checkpoint", str(ckpt), "--out", str(out), "--base", str(base)]) == 0
    assert tokens_named(out, FUNCTION_MARKERS) == set(FUNCTION_MARKERS)


@pytest.mark.parametrize("edit,error", [
    (lambda t: {**t, "added_tokens": None}, "added_tokens is null, not a list of tokens with an id"),
    (lambda t: {**t, "added_tokens": [{"content": "<eos>"}]}, 'added_tokens holds {"content": "<eos>"}, not a list'),
    (lambda t: {**t, "model": {**t["model"], "vocab": [1, 2]}}, "model.vocab is neither an object of token ids"),
])
def test_a_tool_calling_merge_refuses_a_damaged_tokenizer_json_by_name(work, base, lora_ckpt, capsys, edit, error):
    """A tool-calling run publishes its markers in the base's tokenizer.json: one whose added_tokens is null, holds
    an entry without an id, or whose vocabulary is of no known shape (a file the tokenizers library refuses too)
    was a TypeError or KeyError traceback from the merge and the PEFT export. One line naming the file, nothing
    written."""
    from convert.export_peft import main as export_main
    from gemma_tpu.checkpoint.metadata import METADATA_FILE
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.formats.function_calling import FUNCTION_MARKERS

    ckpt = work / "ckpt_tool_tok"
    if not ckpt.exists():
        shutil.copytree(lora_ckpt[0], ckpt)
        meta = json.loads((ckpt / METADATA_FILE).read_text())
        meta["token_map"] = {m: f"<unused{5 + i}>" for i, m in enumerate(FUNCTION_MARKERS)}
        (ckpt / METADATA_FILE).write_text(json.dumps(meta))
    bad = work / "base_bad_tok"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(base, bad)
    (bad / "tokenizer.json").write_text(json.dumps(edit(json.loads((base / "tokenizer.json").read_text()))))
    for run, out in ((merge, work / "merged_bad_tok"), (lambda *a: cli_main(export_main, [str(x) for x in a]),
                                                        work / "adapter_bad_tok")):
        capsys.readouterr()
        assert run("--checkpoint", ckpt, "--base", bad, "--out", out, "--allow-base-mismatch") == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
            f"error: {bad / 'tokenizer.json'}: {error}"), err
        assert leftovers(out) == []


def test_peft_export_refuses_full_finetune(work, full_ckpt, capsys):
    from convert.export_peft import main
    from gemma_tpu.core.cli import cli_main

    ckpt = full_ckpt[0]
    out = work / "adapter_full"
    assert cli_main(main, ["--checkpoint", str(ckpt), "--out", str(out)]) == 2
    assert "full fine-tune" in capsys.readouterr().err
    assert leftovers(out) == []


def test_peft_export_refuses_factors_of_another_model_than_the_recorded_one(work, lora_ckpt, capsys, tmp_path):
    """A step whose LoRA factors do not fit the model its gemma_tpu_run.json records (a checkpoint dir that two runs
    of different models wrote): the adapter was written with A [4, 64] for a base whose hidden_size is 32 by the
    record, which peft refuses on load ('size mismatch'). The merge refused it only against the base's weights."""
    from convert.export_peft import main
    from gemma_tpu.core.cli import cli_main

    ckpt = tmp_path / "ck"
    shutil.copytree(lora_ckpt[0], ckpt)
    meta = json.loads((ckpt / "gemma_tpu_run.json").read_text())
    meta["hf_config"]["hidden_size"] = 32
    (ckpt / "gemma_tpu_run.json").write_text(json.dumps(meta))
    out = tmp_path / "adapter"
    assert cli_main(main, ["--checkpoint", str(ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layers.0.attn.q_einsum.w_lora_a (64, 4)" in err[0], err
    assert f"a (64, 64) weight, where the model recorded in {ckpt / 'gemma_tpu_run.json'}" in err[0], err
    assert "model.layers.0.self_attn.q_proj.weight of shape (64, 32)" in err[0], err
    assert leftovers(out) == []


def test_peft_export_over_the_base_names_it_as_an_input(work, base, lora_ckpt, capsys):
    from convert.export_peft import main
    from gemma_tpu.core.cli import cli_main

    assert cli_main(main, ["--checkpoint", str(lora_ckpt[0]), "--out", str(base), "--overwrite"]) == 2
    assert f"would replace an input ({base.resolve()})" in capsys.readouterr().err
    assert (base / "config.json").is_file()


def test_peft_export_checks_the_base_it_is_given(work, lora_ckpt, capsys):
    """--base names the base the adapter is for; of a run that ships no tokenizer (no tool-call markers) it was
    ignored: another model (here one of the same shapes, other weights) went unchecked and the adapter was written.
    It is refused as the merge refuses it, and taken with --allow-base-mismatch."""
    from convert.export_peft import main
    from gemma_tpu.assets.tiny import write_tiny_gemma3
    from gemma_tpu.core.cli import cli_main

    other = write_tiny_gemma3(work / "base_other_weights", seed=7)
    out = work / "adapter_other_base"
    assert cli_main(main, ["--checkpoint", str(lora_ckpt[0]), "--out", str(out), "--base", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: base {other} is not the base this checkpoint was trained on"), err
    assert "--allow-base-mismatch" in err[-1] and leftovers(out) == []
    assert cli_main(main, ["--checkpoint", str(lora_ckpt[0]), "--out", str(out), "--base", str(other),
                           "--allow-base-mismatch"]) == 0


def test_peft_export_refuses_too_little_disk_before_writing(work, lora_ckpt, capsys, monkeypatch):
    """As the merge and the GGUF export do: a full disk midway named only the temp folder."""
    from convert.export_peft import main
    from gemma_tpu.core import atomic
    from gemma_tpu.core.cli import cli_main

    monkeypatch.setattr(atomic, "free_space", lambda path: 100 << 10)
    out = work / "adapter_no_space"
    assert cli_main(main, ["--checkpoint", str(lora_ckpt[0]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not enough disk space for" in err and str(out) in err and err.count("\n") == 1
    assert leftovers(out) == []


# ------------------------------------------------------------------------------ verify / inspect


def test_verify_cli(base, merged, capsys):
    from convert.verify import main

    assert main([str(merged), str(merged), "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["max_abs_diff"] == 0.0 and same["argmax_agreement"] == 1.0 and same["kl_mean"] <= 1e-12
    assert main([str(base), str(merged), "--max-abs-diff", "1e-6"]) == 1


def test_verify_thresholds_fail_logits_that_are_not_numbers(merged, tmp_path, capsys):
    """A weight holding a NaN makes every logit NaN: `--max-kl`/`--max-abs-diff` compared NaN > bound, which is
    false, and the comparison passed (exit 0, "passed": true)."""
    from safetensors.numpy import load_file, save_file

    from convert.verify import main

    copy = tmp_path / "m"
    shutil.copytree(merged, copy)
    weights = load_file(str(copy / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert main([str(merged), str(copy), "--max-kl", "0.1", "--json"]) == 1
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["passed"] is False and result["kl_mean"] is None, result
    assert "KL mean nan > 0.1" in captured.err, captured.err
    assert main([str(merged), str(copy), "--max-abs-diff", "1"]) == 1
    assert "max |diff| nan > 1" in capsys.readouterr().err


def test_verify_takes_a_merged_directorys_family_from_its_record(merged, tmp_path, capsys):
    """verify read the family off config.json alone (detect_family), where every loader takes a merge's record first
    (resolve_model): a directory whose record contradicts its config.json was compared, and evaluated or served
    it is refused. Both now go through gemma_tpu.models.loading.directory_family."""
    from convert.verify import main as verify
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.hf.directory import MERGE_RECORD

    copy = tmp_path / "m"
    shutil.copytree(merged, copy)
    record = json.loads((copy / MERGE_RECORD).read_text())
    record["base"]["family"] = "gemma4"
    (copy / MERGE_RECORD).write_text(json.dumps(record))
    assert cli_main(verify, [str(merged), str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {copy / MERGE_RECORD}: base.family=gemma4 contradicts "
                                               f"{copy / 'config.json'}"), err


def test_verify_says_when_it_cannot_compare_the_prompts(merged, tmp_path, capsys):
    """Without a usable tokenizer the comparison runs on fixed pseudo-random ids; --prompt was then ignored
    without a word."""
    from convert.verify import main

    copy = tmp_path / "m"
    shutil.copytree(merged, copy)
    (copy / "tokenizer.json").write_text("{broken")
    assert main([str(copy), str(merged), "--prompt", "hello there", "--json"]) == 0
    err = capsys.readouterr().err
    assert f"{copy}: no usable tokenizer" in err and "pseudo-random token ids instead of the prompts" in err


def test_inspect(base, lora_ckpt, merged, capsys):
    from convert.inspect import main

    assert main([str(lora_ckpt[0]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["steps"] == [1] and info["lora"]["rank"] == 4 and info["base_model"]["path"] == str(base)
    names = {t["name"]: t for t in info["tensors"]}
    assert names["layers.0.attn.kv_einsum.w_lora_b"]["shape"] == [4, 2, 2, 16]
    assert info["total_bytes"] == sum(4 * int(np.prod(t["shape"])) for t in info["tensors"])
    assert main([str(merged), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architectures"] == ["Gemma3ForCausalLM"] and info["shards"] == 1
    assert info["total_bytes"] == sio.WeightsDir(merged).total_bytes and len(info["tensors"]) == 28
    assert main([str(merged)]) == 0
    assert "28 tensors" in capsys.readouterr().out


@pytest.mark.parametrize("tool", ["convert.inspect", "convert.verify"])
def test_output_into_a_pipe_whose_reader_is_gone_ends_quietly(merged, tool):
    """`python -m convert.inspect DIR | head -3`: once head had its lines, the listing ended in 'error: Broken pipe',
    exit 2, as if inspect had failed (verify's report alike). The reader is gone here before the first line."""
    read, write = os.pipe()
    os.close(read)
    args = [str(merged)] if tool == "convert.inspect" else [str(merged), str(merged), "--json"]
    try:
        proc = subprocess.run([sys.executable, "-m", tool, *args], cwd=REPO, stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=300)
    finally:
        os.close(write)
    assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr


def test_inspect_single_files(merged, tmp_path, capsys):
    """One .safetensors shard or one .gguf (written here by the gguf package's own writer) is described
    from its header; a cut-short GGUF and any other file are one line naming the file."""
    import gguf

    from convert.inspect import main
    from gemma_tpu.core.errors import UserError

    assert main([str(merged / "model.safetensors"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "safetensors file" and info["num_tensors"] == 28
    assert info["total_bytes"] == sio.WeightsDir(merged).total_bytes

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(2)
    w.add_token_list([f"t{i}" for i in range(40)])
    w.add_tensor("token_embd.weight", np.ones((40, 8), np.float32))  # numpy order: 40 rows of 8
    w.add_tensor("blk.0.attn_q.weight", np.zeros((16, 8), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main([str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "gguf file" and info["architecture"] == "gemma3"
    assert info["metadata"]["gemma3.block_count"] == 2 and info["metadata"]["tokenizer.ggml.tokens"] == "[40 items]"
    assert {t["name"]: (t["shape"], t["dtype"]) for t in info["tensors"]} == {
        "token_embd.weight": ([40, 8], "F32"), "blk.0.attn_q.weight": ([16, 8], "F16")}
    assert info["total_bytes"] == 40 * 8 * 4 + 16 * 8 * 2
    assert main([str(path)]) == 0
    assert "gemma3.block_count = 2" in capsys.readouterr().out

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(UserError, match=f"{cut}: not a readable GGUF file, truncated or damaged"):
        main([str(cut)])
    with pytest.raises(UserError, match="config.json: give the directory it describes"):
        main([str(merged / "config.json")])
    with pytest.raises(UserError, match="--step 3: .* single file"):
        main([str(path), "--step", "3"])



def test_inspect_says_what_it_counts_and_not_what_is_missing(work, base, lora_ckpt, tmp_path, capsys):
    """The summary said '1 tensors', '0 B ()' of a file of no tensors, 'revision None' of a local base, '(name None)'
    of a GGUF without one and printed an adapter's targets as a Python list ['q_proj', ...]."""
    import gguf
    from safetensors.numpy import save_file

    from convert.export_peft import main as export_main
    from convert.inspect import main
    from gemma_tpu.core.cli import cli_main

    def shown(path) -> list[str]:
        assert main([str(path), "--no-tensors"]) == 0
        return capsys.readouterr().out.splitlines()[1:]

    save_file({"a": np.zeros((2, 3), np.float32)}, str(tmp_path / "one.safetensors"))
    assert shown(tmp_path / "one.safetensors") == ["  1 tensor, 24 B (F32 24 B)"]
    save_file({}, str(tmp_path / "none.safetensors"))
    assert shown(tmp_path / "none.safetensors") == ["  0 tensors, 0 B"]
    w = gguf.GGUFWriter(str(tmp_path / "one.gguf"), "gemma3")
    w.add_tensor("token_embd.weight", np.ones((40, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert shown(tmp_path / "one.gguf") == ["  architecture: gemma3", "  1 tensor, 1.28 KB (F32 1.28 KB)"]
    assert shown(lora_ckpt[0])[0] == f"  base: {base} (family gemma3, local {base})"
    adapter = work / "adapter_inspected"
    if not adapter.exists():
        assert cli_main(export_main, ["--checkpoint", str(lora_ckpt[0]), "--out", str(adapter)]) == 0
    assert shown(adapter)[0] == f"  adapter: LORA r=4 alpha=8.0 on {','.join(ALL_TARGETS)} (base {base})"
    # a hand-edited config.json's `architectures` as one string was printed a letter at a time ("G, e, m, ...")
    model = tmp_path / "model"
    model.mkdir()
    save_file({"a": np.zeros((2, 3), np.float32)}, str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps({"architectures": "Gemma3ForCausalLM"}))
    assert shown(model)[0] == "  architecture: Gemma3ForCausalLM"


def test_inspect_step_of_a_checkpoint_with_no_completed_step_is_refused(lora_ckpt, tmp_path, capsys):
    """`convert.inspect CKPT --step 5` on a run with no completed step listed 'none completed' and ignored --step."""
    from convert.inspect import main
    from gemma_tpu.checkpoint.metadata import METADATA_FILE
    from gemma_tpu.core.errors import UserError

    empty = tmp_path / "ckpt"
    empty.mkdir()
    shutil.copy(lora_ckpt[0] / METADATA_FILE, empty / METADATA_FILE)
    assert main([str(empty)]) == 0 and "none completed" in capsys.readouterr().out
    with pytest.raises(UserError, match=f"{empty}: no completed checkpoint step found"):
        main([str(empty), "--step", "5"])

def test_inspect_says_when_a_checkpoint_records_no_lora_settings(lora_ckpt, full_ckpt, tmp_path, capsys):
    """A checkpoint whose metadata has `"lora": null` (or one without rank) was described as 'LoRA: rank None, alpha
    None, targets ' whatever its step held; it says the settings are not recorded and what the step holds."""
    from convert.inspect import main
    from gemma_tpu.checkpoint.metadata import METADATA_FILE

    for name, ckpt, holds in (("lora", lora_ckpt[0], "LoRA factors"), ("full", full_ckpt[0], "full parameters")):
        copy = shutil.copytree(ckpt, tmp_path / name)
        meta = json.loads((copy / METADATA_FILE).read_text())
        meta["lora"] = None
        (copy / METADATA_FILE).write_text(json.dumps(meta))
        assert main([str(copy), "--no-tensors"]) == 0
        out = capsys.readouterr().out
        assert f"LoRA or full fine-tune: not recorded ({METADATA_FILE} has no lora settings); step 1 holds {holds}" \
            in out and "None" not in out.split("\n", 2)[2], out
    meta = json.loads((lora_ckpt[0] / METADATA_FILE).read_text())
    del meta["lora"]["rank"]
    (tmp_path / "lora" / METADATA_FILE).write_text(json.dumps(meta))
    assert main([str(tmp_path / "lora"), "--no-tensors"]) == 0
    assert "LoRA: rank not recorded, alpha 8.0, targets q_proj, k_proj" in capsys.readouterr().out


def test_inspect_a_file_that_describes_a_directory_names_the_directory(tmp_path):
    """`convert.inspect run/config.json` said 'neither .safetensors nor .gguf', leaving the user to guess
    that the directory was meant; any other file keeps that message."""
    from convert.inspect import main
    from gemma_tpu.core.errors import UserError
    from tests.conftest import assert_one_line_error, run_cli
    for name in ("config.json", "adapter_config.json", "gemma_tpu_run.json"):
        (tmp_path / name).write_text("{}")
        proc = run_cli("convert.inspect", str(tmp_path / name))
        assert_one_line_error(proc, f"{tmp_path / name}: give the directory it describes: "
                                    f"python -m convert.inspect {tmp_path}")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="neither .safetensors nor .gguf"):
        main([str(tmp_path / "notes.txt")])



def test_a_path_option_given_with_equals_tilde_is_read_from_home(tmp_path, tiny_dir):
    """`--merged=~/m` (and a `~/m` the shell left quoted): the shell expands no `~` there, and the converters said
    "--merged ~/m: no such directory" of a directory that exists; paths of the config expand it."""
    from tests.conftest import REPO, run_cli

    home = tmp_path / "home"
    home.mkdir()
    (home / "m").symlink_to(tiny_dir)
    proc = run_cli("convert.inspect", "~/m", "--json", "--no-tensors", cwd=tmp_path,
                   env={"HOME": str(home), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["architectures"] == ["Gemma3ForCausalLM"]
    proc = run_cli("convert.export_gguf", "--merged=~/m", "--out=~/m.gguf", "--type", "f16", cwd=tmp_path,
                   env={"HOME": str(home), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    from tests.test_export_gguf import fields

    assert fields(home / "m.gguf")["general.architecture"] == "gemma3"
    assert not (tmp_path / "~").exists()

# ------------------------------------------------------------------------------ safetensors I/O


def test_writer_roundtrip(tmp_path):
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    arrays = {
        "b": rng.normal(size=(3, 5)).astype(sio.DTYPES["BF16"]),
        "a": rng.normal(size=(7,)).astype(np.float16),
        "s": np.array(3.5, dtype=np.float32),
        "i": np.arange(6, dtype=np.int64).reshape(2, 3),
        "e": np.zeros((0, 4), dtype=np.float32),
    }
    specs = [sio.OutSpec(k, sio.st_dtype(v.dtype), v.shape) for k, v in arrays.items()]
    w = sio.ShardedWriter(tmp_path, specs, max_shard_bytes=40)
    for k, v in arrays.items():
        w.write_tensor(k, v)
    w.close()
    got = sio.WeightsDir(tmp_path)
    assert got.names() == list(arrays)
    with safe_open(str(tmp_path / got[list(arrays)[1]].file.name), framework="pt") as f:
        assert f.get_tensor("a").numpy().tobytes() == arrays["a"].tobytes()
    for k, v in arrays.items():
        assert got.read(k).tobytes() == v.tobytes() and got[k].shape == v.shape
    # file-to-file copies, in the kernel and by the read/write fallback, give the same bytes
    for in_kernel in (True, False):
        dst = tmp_path / f"copy_{in_kernel}"
        dst.mkdir()
        w = sio.ShardedWriter(dst, specs, max_shard_bytes=1 << 20)
        w._in_kernel = in_kernel
        for k in arrays:
            w.begin(k)
            w.copy_from(got[k])
        w.close()
        assert (dst / "model.safetensors").is_file()
        assert all(sio.WeightsDir(dst).read(k).tobytes() == v.tobytes() for k, v in arrays.items())
    with pytest.raises(RuntimeError, match="out of order"):
        sio.ShardedWriter(tmp_path / "x", specs, 1 << 20).begin("a")


def test_parse_size():
    from gemma_tpu.core.errors import UserError

    assert sio.parse_size("5GB") == 5 * 10**9
    assert sio.parse_size("200KB") == 200_000
    assert sio.parse_size("1GiB") == 2**30
    assert sio.parse_size("1024") == 1024
    with pytest.raises(UserError):
        sio.parse_size("lots")
    # a fraction without a unit is a fraction of a byte: it said "must be positive", which it is
    with pytest.raises(UserError, match=r"^size '0.5' is 0.5 bytes, less than one; give a unit \(e.g. 0.5GB\)$"):
        sio.parse_size("0.5")
    with pytest.raises(UserError, match=r"^size '0.1B' is 0.1 bytes, less than one$"):
        sio.parse_size("0.1B")
    with pytest.raises(UserError, match=r"^size '0' must be positive$"):
        sio.parse_size("0")
    assert sio.parse_size("0.5GB") == 5 * 10**8


# ------------------------------------------------------------------------------ with the real trainer


def test_trainer_checkpoint_end_to_end(work, base):
    """What `gemma_tpu.train.run` writes merges, verifies and exports (guards the format contract)."""
    from tests.conftest import run_cli

    run = work / "trained"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={base}",
                   f"checkpoint.dir={run}", "train.max_steps=2", "train.eval_every_steps=0", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = work / "trained_merged"
    assert merge("--checkpoint", run, "--out", out, "--verify") == 0
    prov = json.loads((out / "gemma_tpu_merge.json").read_text())
    assert prov["step"] == 2 and prov["lora"]["rank"] == 4
    from convert.export_peft import main
    from gemma_tpu.core.cli import cli_main

    adapter = work / "trained_adapter"
    assert cli_main(main, ["--checkpoint", str(run), "--out", str(adapter)]) == 0
    assert max_diff(hf_logits(base, adapter=adapter), hf_logits(out)) <= TOL


def test_float16_output_beyond_its_range_is_refused(work, lora_ckpt, capsys):
    """A merged weight past float16's +-65504 (here a large lora.alpha) was written as inf with exit 0: a model
    of infs that only --verify would have noticed. Refused naming the tensor, nothing at --out; bfloat16 holds it."""
    ckpt = shutil.copytree(lora_ckpt[0], work / "ckpt_large_alpha")
    meta = json.loads((ckpt / "gemma_tpu_run.json").read_text())
    meta["lora"]["alpha"] = 1e9
    (ckpt / "gemma_tpu_run.json").write_text(json.dumps(meta))
    out = work / "merged_f16_overflow"
    line = _expect_error(capsys, out, "--checkpoint", ckpt, "--dtype", "float16",
                         contains="values beyond float16's range")
    assert "tensor model.layers.0." in line and "--dtype bfloat16" in line
    assert leftovers(out) == []
    assert merge("--checkpoint", ckpt, "--out", out, "--dtype", "bfloat16") == 0
    assert np.isfinite(sio.WeightsDir(out).read("model.layers.0.self_attn.q_proj.weight").astype(np.float32)).all()


def test_a_float16_gemma3_merge_is_warned_of_and_served_wider(work, lora_ckpt, merged, capsys):
    """vLLM refuses float16 for Gemma 3 and transformers' Gemma 3 overflows in it: the merge says so in one line (it
    said nothing), and the local server loads such a directory in float32 (transformers serve took its float16);
    vLLM is given --dtype bfloat16 by serving.launch whatever the weights."""
    from serving.local import local_dtype

    out = work / "merged_f16"
    assert merge("--checkpoint", lora_ckpt[0], "--out", out, "--dtype", "float16") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "float16 for a gemma3 model: vLLM refuses float16 for Gemma 3" in warnings[0]
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float16" and local_dtype(config) == "float32"
    assert local_dtype(json.loads((merged / "config.json").read_text())) == "auto"  # float32 weights: as they are
    assert merge("--checkpoint", lora_ckpt[0], "--out", work / "merged_bf16_quiet", "--dtype", "bfloat16") == 0
    assert "warning" not in capsys.readouterr().err


def test_verify_given_the_config_file_names_its_directory(tmp_path, capsys):
    """`convert.verify runs/x-merged/config.json ...` said "runs/x-merged/config.json/config.json: missing"; the
    file given for its directory is now named as such, with the directory to give."""
    from convert.verify import main as verify
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.hf.directory import read_hf_config

    d = tmp_path / "merged"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    assert read_hf_config(d) == {"model_type": "gemma3_text"}
    assert cli_main(verify, [str(d / "config.json"), str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {d / 'config.json'}: a file, not a Hugging Face model directory: give {d}"], err


def test_a_training_checkpoint_given_for_a_model_says_to_merge_it(tmp_path, capsys):
    """`convert.verify runs/x/checkpoints merged` (or the run directory above it) said only "config.json: missing (not
    a Hugging Face model directory)"; a directory holding a training run's record now says it is a checkpoint and
    how to merge it. A directory that is neither keeps the plain message."""
    from convert.verify import main as verify
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.hf.directory import RUN_RECORD

    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / RUN_RECORD).write_text("{}")
    other = tmp_path / "empty"
    other.mkdir()
    for given in (ckpt, ckpt.parent):
        assert cli_main(verify, [str(given), str(other)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {given / 'config.json'}: missing ({ckpt} is a gemma-tpu training checkpoint, not a "
                       f"Hugging Face model directory: merge it first, python -m convert.merge_orbax --checkpoint "
                       f"{ckpt} --out DIR)"], err
    assert cli_main(verify, [str(other), str(ckpt)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {other / 'config.json'}: missing (not a Hugging Face model "
                                               f"directory)")


def test_a_peft_adapter_given_for_a_model_names_its_base(tmp_path, capsys):
    """`export_gguf --merged adapters/x` (or merge --base, serving's model.dir) given convert.export_peft's output said
    only "config.json: missing (not a Hugging Face model directory)"; it now says it is an adapter and names the
    base its adapter_config.json records. Nothing is written."""
    from convert.export_gguf import main as export_gguf
    from gemma_tpu.core.cli import cli_main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "/m/g3"}))
    out = tmp_path / "x.gguf"
    assert cli_main(export_gguf, ["--merged", str(adapter), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {adapter / 'config.json'}: missing ({adapter} is a PEFT adapter, not a whole model: give "
                   "its base /m/g3, or a merged directory from python -m convert.merge_orbax)"], err
    assert not out.exists()

