"""Gemma 4: forward parity with transformers, LoRA -> merge / PEFT export, full fine-tune
conversion, the same loss on every mesh, and config.json presets for offline planning.

Tiny random Gemma 4s written by transformers (`gemma_tpu.assets.tiny.write_tiny_gemma4`):

* dense  - like 31B: K=V global layers (K only), global head size and KV heads of their own;
* ple    - like E2B/E4B: per-layer embeddings, one KV head, the last two layers reusing earlier
           layers' keys and values, double-wide MLPs there;
* moe    - like 26B-A4B: a dense MLP plus eight routed experts per layer;
* *_mm   - the same decoder inside a Gemma4ForConditionalGeneration (keys under
           `model.language_model.`, a vision tower beside it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu.core.errors import UserError
from gemma_tpu.hf import safetensors_io as sio
from tests.conftest import run_cli, xla_env
from tests.test_convert import ALL_TARGETS, TOL, hf_logits, make_checkpoint, max_diff, merge
from tests.test_sharding import EIGHT, MESHES
from tests.test_models import jax_logits, jax_logits_batch

VARIANTS = {"dense": ("dense", False), "dense_mm": ("dense", True), "ple": ("ple", False),
            "ple_mm": ("ple", True), "moe": ("moe", False)}
TEXT_PROMPTS = ["Hello world, this is a tiny test of the model!",
                "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
                "A longer prompt that runs past the sliding window of sixteen tokens, so local layers matter."]


@pytest.fixture(scope="module")
def g4(tmp_path_factory):
    """name -> a tiny Gemma 4 directory, written once per module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            variant, mm = VARIANTS[name]
            made[name] = write(tmp_path_factory.mktemp(name) / "gemma4", variant, mm, seed=list(VARIANTS).index(name))
        return made[name]

    return get


def write(path, variant, mm, seed=0):
    from gemma_tpu.assets.tiny import write_tiny_gemma4

    return write_tiny_gemma4(path, seed=seed, variant=variant, multimodal=mm)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_matches_transformers(g4, name):
    from transformers import AutoTokenizer

    from gemma_tpu.models import load_model, resolve_model

    d = g4(name)
    resolved = resolve_model(str(d))
    assert resolved.family.name == "gemma4"
    model, _ = load_model(resolved, "float32")
    tok = AutoTokenizer.from_pretrained(str(d))
    seqs = [tok(p).input_ids for p in TEXT_PROMPTS] + [[2, *range(120, 160)]]
    assert max(len(s) for s in seqs) > 2 * 16  # well past the sliding window
    ref = hf_logits(d, seqs)
    diff = max_diff(jax_logits_batch(model, seqs), ref)
    print(f"{name}: max |JAX - transformers| = {diff:.2e}")
    assert diff < 1e-4


def test_experts_grouped_mm_cannot_run_are_compared_eagerly(tmp_path):
    """transformers runs Gemma 4's experts with torch's grouped_mm by default, which needs each expert matrix's rows
    16-byte aligned: an moe_intermediate_size of 22 (88 bytes in float32) trained and merged, then merge --verify and
    convert.verify died in a "strides should be multiple of 16 bytes" traceback. Their reference runs the experts
    eagerly, as it runs attention, and gives our forward's logits."""
    from convert.verify import hf_logits as reference_logits
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.models import load_model, resolve_model

    d = write_tiny_gemma4(tmp_path / "g4", seed=3, variant="moe", moe_intermediate_size=22)
    model, _ = load_model(resolve_model(str(d)), "float32")
    ids = [2, *range(120, 160)]
    assert max_diff([jax_logits(model, ids)], reference_logits(d, [ids])) < 1e-4


def test_omitted_keys_mean_transformers_defaults(tmp_path):
    """A config.json without `hidden_size_per_layer_input` / `global_head_dim` (hand-written or trimmed)
    means transformers' defaults, 256 and 512, as in E2B: the per-layer embeddings were dropped without a
    word (logits off by 2.3) and the global layers built with head_dim (a shape error naming k_norm)."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.models import load_model, resolve_model

    d = write_tiny_gemma4(tmp_path / "g4", seed=3, variant="ple", hidden_size_per_layer_input=256,
                          global_head_dim=512)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size_per_layer_input"], cfg["global_head_dim"]
    (d / "config.json").write_text(json.dumps(cfg))
    model, tc = load_model(resolve_model(str(d)), "float32")
    assert (tc.per_layer_input_dim, tc.global_key_size) == (256, 512)
    ids = [2, *range(120, 160)]
    assert max_diff([jax_logits(model, ids)], hf_logits(d, [ids])) < 1e-4
    # and so do the shape keys (a config without them was "missing key 'num_hidden_layers'")
    from transformers import Gemma4TextConfig

    from gemma_tpu.models.registry import detect_family

    bare = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}
    tc, hf = detect_family(bare).tunix_config(bare), Gemma4TextConfig()
    assert (tc.num_embed, tc.embed_dim, tc.num_layers, tc.num_heads, tc.num_kv_heads, tc.head_dim) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)


def test_hidden_only_and_sparse_loss_apply_the_softcap(g4):
    """The trainer's loss projects final hidden states itself: it must soft-cap like the model."""
    import jax
    import jax.numpy as jnp

    from gemma_tpu.models import load_model, resolve_model
    from gemma_tpu.train.loss import attention_mask, full_loss, sparse_loss

    model, cfg = load_model(resolve_model(str(g4("ple"))), "float32")
    assert cfg.final_logit_softcap == 30.0
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 500, size=(2, 24)), jnp.int32)
    seg = jnp.ones_like(tokens)
    pos = jnp.broadcast_to(jnp.arange(24)[None], tokens.shape)
    hidden, _ = model(tokens, pos, None, attention_mask(seg), hidden_only=True)
    logits, _ = model(tokens, pos, None, attention_mask(seg))
    emb = model.embedder.input_embedding.get_value()
    np.testing.assert_allclose(np.asarray(jnp.tanh(hidden @ emb.T / 30.0) * 30.0), np.asarray(logits), atol=2e-5)
    batch = dict(tokens=tokens, positions=pos, segment_ids=seg, loss_idx=jnp.asarray([[3, 9, 20], [0, 5, 23]]),
                 loss_targets=jnp.asarray([[7, 8, 9], [10, 11, 12]]), loss_weights=jnp.ones((2, 3)))
    with jax.default_matmul_precision("highest"):
        assert abs(float(full_loss(model, **batch)) - float(sparse_loss(model, **batch, chunk=2))) < 1e-5


# ------------------------------------------------------------------------------ config


def test_config_built_from_config_json(g4):
    from gemma_tpu.models.gemma4 import kv_source, layer_features
    from gemma_tpu.models.registry import detect_family

    cfg = json.loads((g4("dense") / "config.json").read_text())
    fam = detect_family(cfg)
    tc = fam.tunix_config(cfg)
    assert (tc.num_layers, tc.embed_dim, tc.num_heads, tc.num_kv_heads, tc.head_dim) == (4, 64, 4, 2, 16)
    assert (tc.global_key_size, tc.num_global_kv_heads, tc.k_eq_v_global) == (32, 2, True)
    assert tc.sliding_window_size == 16 and tc.num_embed == 512 and tc.final_logit_softcap == 30.0
    assert (tc.global_rope_proportion, tc.local_rope_proportion) == (0.25, 1.0)
    assert [a.name for a in tc.attention_pattern] == ["LOCAL_SLIDING", "GLOBAL"] * 2
    assert layer_features(tc, 0) == {"own_kv", "kv"} and layer_features(tc, 1) == {"own_kv", "k_eq_v"}

    mm = json.loads((g4("ple_mm") / "config.json").read_text())
    assert mm["architectures"] == ["Gemma4ForConditionalGeneration"] and "text_config" in mm
    tc = fam.tunix_config(mm)
    assert tc.per_layer_input_dim == 8 and tc.override_kv_shared_ffw_hidden == 256 and tc.num_global_kv_heads is None
    # transformers' rule: a shared layer reads the last earlier layer of its own type
    assert kv_source(tc) == [0, 1, 2, 3, 3, 1]
    assert layer_features(tc, 4) == {"ple"} and layer_features(tc, None) == {"ple"}
    # the converters' Layout (no Tunix import) agrees with the Tunix config
    from gemma_tpu.models.registry import read_layout

    layout = read_layout(mm, fam)
    assert [layer_features(layout, i) for i in range(6)] == [layer_features(tc, i) for i in range(6)]


@pytest.mark.parametrize("key,value,needle", [
    ("attention_bias", True, "attention_bias"),
    ("tie_word_embeddings", False, "tie_word_embeddings=false"),  # its lm_head was ignored
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps"),
    ("vocab_size_per_layer_input", 256, "vocab_size_per_layer_input"),
    ("hidden_activation", "silu", "hidden_activation"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_parameters.full_attention.rope_type"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "global_head_dim"),
    ("num_kv_shared_layers", 6, "num_kv_shared_layers"),
    ("sliding_window", None, "sliding_window=None is not of type int"),  # was read as 512
    ("head_dim", 15, "head_dim=15 .*must be even"),  # was a JAX traceback ("array split") at load
    ("global_head_dim", 33, "global_head_dim=33 .*must be even"),
    ("num_key_value_heads", 0, "num_key_value_heads=0 .*must be at least 1"),  # was a ZeroDivisionError traceback
    # experts without enable_moe_block: loaded as dense, the checkpoint's experts dropped with a warning
    ("num_experts", 8, "num_experts=8 with enable_moe_block=false: .*dense model"),
])
def test_unsupported_config_values_are_refused_by_name(g4, key, value, needle):
    from gemma_tpu.models import get_family

    cfg = json.loads((g4("ple") / "config.json").read_text())
    cfg[key] = value
    with pytest.raises(UserError, match=needle) as e:
        get_family("gemma4").tunix_config(cfg)
    assert "\n" not in str(e.value)


_SLIDING, _FULL = {"rope_type": "default", "rope_theta": 1e4}, {"rope_type": "proportional", "rope_theta": 1e6,
                                                                "partial_rotary_factor": 0.25}


@pytest.mark.parametrize("name,rope,layer_types,refused", [
    ("no full_attention entry", {"sliding_attention": _SLIDING}, None, "has no 'full_attention' entry"),
    ("no sliding_attention entry", {"full_attention": _FULL}, None, "has no 'sliding_attention' entry"),
    ("full without rope_theta", {"sliding_attention": _SLIDING, "full_attention": {"rope_type": "proportional"}},
     None, "full_attention has no rope_theta"),
    ("sliding without rope_theta", {"sliding_attention": {"rope_type": "default"}, "full_attention": _FULL}, None,
     "sliding_attention has no rope_theta"),
    ("flat, not per layer type", {"rope_type": "default", "rope_theta": 1e4}, None, "has no 'sliding_attention'"),
    ("no sliding layers, no sliding entry", {"full_attention": _FULL}, ["full_attention"] * 6, None),
    ("absent: transformers' defaults", "absent", None, None),
])
def test_rope_parameters_transformers_cannot_build_are_refused(g4, name, rope, layer_types, refused):
    """transformers' Gemma 4 reads rope_parameters[type]["rope_theta"] for each attention type its layers use and
    fills in nothing when rope_parameters is given: a missing entry or rope_theta was read here as the defaults
    and trained a model no merge of it could be loaded as. Refused exactly where transformers cannot build it."""
    import transformers

    from gemma_tpu.models import get_family

    cfg = json.loads((g4("ple") / "config.json").read_text())
    if rope == "absent":
        del cfg["rope_parameters"]
    else:
        cfg["rope_parameters"] = json.loads(json.dumps(rope))
    if layer_types:
        cfg["layer_types"] = layer_types
    try:
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**json.loads(json.dumps(cfg))))
        builds = True
    except (KeyError, TypeError):  # a missing rope_theta is one or the other, depending on what ran before
        builds = False
    assert builds == (refused is None), name
    if refused is None:
        get_family("gemma4").tunix_config(cfg)
    else:
        with pytest.raises(UserError, match=refused) as e:
            get_family("gemma4").tunix_config(cfg)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
@pytest.mark.parametrize("factor,runs", [(1.5, False), (-0.25, False), (0.0, True), (1.0, True)])
def test_partial_rotary_factor_outside_0_to_1_is_refused_naming_the_key(kind, factor, runs):
    """Proportional RoPE rotates int(factor * head_dim // 2) angles: above 1 that is more than a head has halves,
    below 0 fewer than none, and transformers' first forward fails on either (a shape error, an empty range); Tunix's
    rotary embedding fails alike, so the config was taken here and the run died in a JAX traceback."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from gemma_tpu.assets.tiny import TINY_GEMMA4
    from gemma_tpu.models import get_family

    rope = {"full_attention": dict(_FULL), "sliding_attention": dict(_SLIDING)}
    rope[kind].update(rope_type="proportional", partial_rotary_factor=factor)
    cfg = {**TINY_GEMMA4["dense"], "rope_parameters": rope}
    try:
        with torch.no_grad():
            Gemma4ForCausalLM(Gemma4TextConfig(**json.loads(json.dumps(cfg))))(torch.tensor([[2, 5, 6, 7]]))
        ran = True
    except RuntimeError:
        ran = False
    assert ran == runs
    cfg["model_type"] = "gemma4_text"
    if runs:
        assert get_family("gemma4").tunix_config(cfg) is not None
        return
    with pytest.raises(UserError, match=rf"config.json: rope_parameters.{kind}.partial_rotary_factor={factor} "
                                        r"must be between 0 and 1") as e:
        get_family("gemma4").tunix_config(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("top,types", [(0.5, None), (1.0, None), (0.5, ["full_attention"] * 4)])
def test_a_top_level_partial_rotary_factor_is_the_one_transformers_rotates_by(tmp_path, top, types):
    """A `partial_rotary_factor` at the top of config.json (as other models write it) is laid over every
    rope_parameters entry when transformers builds its proportional RoPE (standardize_rope_params): the global
    layers rotate that share of each head, not the entry's 0.25. Read from the entry alone, training rotated 0.25
    of each global head where the merged model, loaded by transformers, rotates `top` of it. transformers lays it
    over the entries only where each of them is of a layer type the model has: a model of global layers alone,
    whose config.json keeps a sliding entry, rotates by the entry's share."""
    from convert.verify import hf_logits as reference_logits
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.models import load_model, resolve_model

    d = write_tiny_gemma4(tmp_path / "g4", seed=6, variant="dense", **({"layer_types": types} if types else {}))
    config = json.loads((d / "config.json").read_text())
    assert config["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    assert {"full_attention", "sliding_attention"} <= set(config["rope_parameters"])
    (d / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": top}))
    ids = [2, *range(120, 160)]
    model, _ = load_model(resolve_model(str(d)), "float32")
    ref = reference_logits(d, [ids])
    assert max_diff([jax_logits(model, ids)], ref) < 1e-4
    (d / "config.json").write_text(json.dumps(config))  # the entry's 0.25: another model where the top one is read
    assert (max_diff(reference_logits(d, [ids]), ref) > 1e-3) == (types is None)


_LINEAR_CASES = {  # name: (kind, its linear entry, global_head_dim, refusal or None)
    "sliding, factor 1": ("sliding_attention", {"factor": 1.0}, 32, None),
    "sliding, factor 2": ("sliding_attention", {"factor": 2.0}, 32, None),
    "full, factor 3, one head size": ("full_attention", {"factor": 3}, 16, None),
    "full, own head size": ("full_attention", {"factor": 1.0}, 32, r"spans int\(head_dim \* .*\)=16 dimensions"),
    "sliding, partial": ("sliding_attention", {"factor": 1.0, "partial_rotary_factor": 0.5}, 32, "=8 dimensions"),
    "no factor": ("sliding_attention", {}, 32, r"rope_parameters.sliding_attention.factor is missing"),
    "factor below 1": ("full_attention", {"factor": 0.5}, 16, r"rope_parameters.full_attention.factor=0.5 .*>= 1"),
}


@pytest.mark.parametrize("name", list(_LINEAR_CASES))
def test_linear_rope_runs_as_transformers_runs_it(tmp_path, name):
    """transformers' linear RoPE divides default frequencies over int(head_dim * partial_rotary_factor) by `factor`:
    where that span is the layer's head it is proportional RoPE over the whole head (default RoPE at factor 1), and
    it was refused ('default or proportional'). Accepted, the logits are transformers'; refused, by the key, exactly
    where transformers cannot build or run the model (no factor: a KeyError; another span: a shape error)."""
    from convert.verify import hf_logits as reference_logits
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.models import get_family, load_model, resolve_model

    kind, entry, global_head_dim, refused = _LINEAR_CASES[name]
    rope = {"full_attention": dict(_FULL), "sliding_attention": dict(_SLIDING)}
    rope[kind] = {"rope_type": "linear", "rope_theta": rope[kind]["rope_theta"], **entry}
    ids = [2, *range(120, 160)]
    if refused is None:
        d = write_tiny_gemma4(tmp_path / "g4", seed=5, variant="dense", global_head_dim=global_head_dim,
                              rope_parameters=rope)
        model, _ = load_model(resolve_model(str(d)), "float32")
        ours, ref = jax_logits(model, ids), reference_logits(d, [ids])
        assert max_diff([ours], ref) < 1e-4
        if entry["factor"] != 1:  # the factor is applied, not ignored
            d1 = write_tiny_gemma4(tmp_path / "g4_1", seed=5, variant="dense", global_head_dim=global_head_dim,
                                   rope_parameters={**rope, kind: {**rope[kind], "factor": 1.0}})
            assert max_diff(reference_logits(d1, [ids]), ref) > 1e-3
        return
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from gemma_tpu.assets.tiny import TINY_GEMMA4

    cfg = {**TINY_GEMMA4["dense"], "global_head_dim": global_head_dim, "rope_parameters": rope}
    if "factor below" not in name:  # transformers only warns on a factor below 1; Tunix refuses it
        with pytest.raises((KeyError, RuntimeError)), torch.no_grad():
            Gemma4ForCausalLM(Gemma4TextConfig(**json.loads(json.dumps(cfg))))(torch.tensor([ids]))
    with pytest.raises(UserError, match=refused) as e:
        get_family("gemma4").tunix_config({**cfg, "model_type": "gemma4_text"})
    assert "\n" not in str(e.value)


def test_multimodal_tie_flag_is_read_where_transformers_reads_it(g4, tmp_path):
    """transformers ties a multimodal model's output projection by the flag at the top of config.json (Gemma4Config's,
    true when absent), not by text_config's: a config.json whose text_config alone says tie_word_embeddings=false
    loads tied (no lm_head.weight needed) there, and was refused here as untied."""
    import shutil

    from convert.verify import hf_logits as reference_logits
    from gemma_tpu.models import load_model, resolve_model

    d = tmp_path / "mm"
    shutil.copytree(g4("dense_mm"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("tie_word_embeddings", None)
    cfg["text_config"]["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    ids = [2, *range(120, 150)]
    ref = reference_logits(d, [ids])  # refuses a missing lm_head.weight (transformers would fill it at random)
    assert max_diff(ref, reference_logits(g4("dense_mm"), [ids])) == 0
    resolved = resolve_model(str(d))
    assert "lm_head.weight" not in resolved.family.required_weights(cfg, "model.language_model.")
    model, _ = load_model(resolved, "float32")
    assert max_diff([jax_logits(model, ids)], ref) < 1e-4


def test_attn_logit_softcapping_is_ignored_as_transformers_ignores_it(g4):
    """Gemma4TextConfig declares no attn_logit_softcapping and no Gemma 4 class reads it: a config.json that sets
    it (a Gemma 2/3 habit) was refused; it now builds the model transformers builds, the key ignored."""
    from gemma_tpu.models import get_family

    cfg = json.loads((g4("ple") / "config.json").read_text())
    plain = get_family("gemma4").tunix_config(cfg)
    assert get_family("gemma4").tunix_config({**cfg, "attn_logit_softcapping": 50.0}) == plain


def test_final_softcap_of_zero_is_refused(g4):
    """transformers' Gemma 4 divides the logits by final_logit_softcapping whenever it is not null: a 0 made every
    logit 0 (or NaN) there, where we read it as "no cap" and trained on."""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.models import get_family

    cfg = json.loads((g4("ple") / "config.json").read_text())
    for bad in (0.0, -30.0):  # an int is refused by the type table first
        with pytest.raises(UserError, match="final_logit_softcapping=.* must be positive or null"):
            get_family("gemma4").tunix_config({**cfg, "final_logit_softcapping": bad})
    assert get_family("gemma4").tunix_config({**cfg, "final_logit_softcapping": None}).final_logit_softcap is None


def test_lora_lands_where_each_layer_has_the_projection(g4):
    """K and V are fused in sliding layers, K alone in the K=V global layers, and KV-sharing
    layers have neither; LoRA factors exist exactly there."""
    from gemma_tpu.core.config import LoraConfig
    from gemma_tpu.lora import apply_lora, lora_state_paths
    from gemma_tpu.models import load_model, resolve_model

    def lora_modules(name):
        r = resolve_model(str(g4(name)))
        model, cfg = load_model(r, "float32")
        model = apply_lora(model, r.family, cfg, LoraConfig(rank=2, alpha=4.0, targets=ALL_TARGETS))
        return {p.rsplit(".", 1)[0] for p in lora_state_paths(model)}

    dense = lora_modules("dense")
    assert "layers.0.attn.kv_einsum" in dense and "layers.1.attn.k_einsum" in dense
    assert "layers.1.attn.kv_einsum" not in dense and "layers.0.attn.k_einsum" not in dense
    ple = lora_modules("ple")
    assert {f"layers.{i}.attn.kv_einsum" for i in range(4)} <= ple
    assert not {m for m in ple if m.startswith(("layers.4.attn.k", "layers.5.attn.k"))}
    assert {"layers.5.attn.q_einsum", "layers.5.mlp.down_proj"} <= ple
    r = resolve_model(str(g4("dense")))
    with pytest.raises(UserError, match="k_proj shares one Tunix weight"):
        r.family.targets_to_modules(r.family.tunix_config(r.hf_config), ["k_proj"])


def test_k_proj_alone_targets_a_gemma4_whose_layers_are_all_k_eq_v_global(tmp_path):
    """Every layer global with K=V: no layer has the fused K/V weight, yet `lora.targets: [k_proj]` was refused
    for not naming v_proj with it. It trains K in every layer and merges; v_proj alone names no layer."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.core.config import LoraConfig
    from gemma_tpu.lora import apply_lora, lora_state_paths
    from gemma_tpu.models import load_model, resolve_model

    base = write_tiny_gemma4(tmp_path / "all_global", seed=9, layer_types=["full_attention"] * 4)
    r = resolve_model(str(base))
    model, cfg = load_model(r, "float32")
    model = apply_lora(model, r.family, cfg, LoraConfig(rank=2, alpha=4.0, targets=["k_proj"]))
    assert {p.rsplit(".", 1)[0] for p in lora_state_paths(model)} == {f"layers.{i}.attn.k_einsum" for i in range(4)}
    with pytest.raises(UserError, match="no layer of this gemma4 model has v_proj"):
        r.family.targets_to_modules(cfg, ["v_proj"])
    ckpt = tmp_path / "ckpt"
    ref = make_checkpoint(base, ckpt, rank=2, alpha=4.0, targets=["k_proj"], seed=3)
    assert merge("--checkpoint", ckpt, "--out", tmp_path / "merged") == 0
    assert max_diff(ref, hf_logits(tmp_path / "merged")) <= TOL
    assert max_diff(ref, hf_logits(base)) > 10 * TOL


def test_qlora_forward_is_the_quantized_base(g4):
    """QLoRA on Gemma 4 (Tunix's attention projections cast their weight, which Qwix hands over
    quantized: a TypeError at the first step before). With B = 0 the logits are those of the base
    with each projection's dequantized int8 weight in place, and not the float base's."""
    from qwix._src.core import qarray
    from transformers import AutoTokenizer

    from gemma_tpu.core.config import LoraConfig
    from gemma_tpu.lora import apply_lora
    from gemma_tpu.models import load_model, resolve_model

    r = resolve_model(str(g4("ple")))
    model, cfg = load_model(r, "float32")
    ids = AutoTokenizer.from_pretrained(str(g4("ple")))(TEXT_PROMPTS[0]).input_ids
    lora = LoraConfig(rank=2, alpha=4.0, targets=["q_proj", "k_proj", "v_proj", "o_proj"], base_quantization="int8")
    q = apply_lora(model, r.family, cfg, lora)
    got = jax_logits(q, ids)
    for qa, a in zip(q.layers, model.layers):  # the float model, its weights replaced by their int8 values
        for name in ("q_einsum", "kv_einsum", "k_einsum", "attn_vec_einsum"):
            if hasattr(a.attn, name):
                w = getattr(a.attn, name).w
                deq = qarray.dequantize(getattr(qa.attn, name).w.value.array)
                assert 0 < np.abs(np.asarray(deq) - np.asarray(w.value)).max() < 0.01 * np.abs(w.value).max()
                w.value = deq
    assert np.abs(got - jax_logits(model, ids)).max() < 1e-4


# ------------------------------------------------------------------------------ trained LoRA, meshes


# Plain SGD: AdamW's first updates are ~lr * sign(gradient), so a gradient element within ~1e-8 of
# zero (AdamW's eps) turns fp32 reduction-order noise into an lr-sized step. Measured on ple_mm
# with AdamW (lr 0.01): one element of layers.0.mlp.up_proj's A differed by 4e-3 after step 2
# between 1 and 8 devices, every other parameter by < 1.2e-4, and the step-3 loss by 2.2e-5 -
# an optimizer property, not a sharding one. With SGD the same runs agree to 5e-7.
TRAIN_ARGS = ("train.max_steps=3", "train.batch_size=8", "data.eval_path=null", "checkpoint.every_steps=3",
              "train.optimizer=sgd", "train.learning_rate=0.1")


def train_losses(model_dir: Path, ckpt: Path, mesh_args: list[str], env: dict, *extra: str) -> list[float]:
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={model_dir}",
                   f"checkpoint.dir={ckpt}", *TRAIN_ARGS, *mesh_args, *extra, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (Path(ckpt) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["mode"] == "train"]


MESH_VARIANTS = ["ple_mm"]  # per-layer embeddings + multimodal layout; dense shares the code path (CI time)


@pytest.fixture(scope="module")
def trained(g4, tmp_path_factory):
    """name -> (checkpoint dir, losses) of 3 LoRA steps through the CLI on one device."""
    done: dict[str, tuple[Path, list[float]]] = {}

    def get(name: str):
        if name not in done:
            ckpt = tmp_path_factory.mktemp(f"trained_{name}") / "ckpt"
            done[name] = ckpt, train_losses(g4(name), ckpt, MESHES["1x1x1"], xla_env())
        return done[name]

    return get


@pytest.mark.xdist_group("gemma4_trained")  # the `trained` fixture: one 1x1x1 training for both
@pytest.mark.parametrize("name", MESH_VARIANTS)
def test_trained_lora_merges_and_exports(g4, trained, tmp_path, name):
    """3 training steps -> merge: transformers on the merged dir equals the JAX LoRA model; the
    PEFT adapter on the base equals the merged model."""
    from tests.test_e2e import jax_lora_logits

    base = g4(name)
    ckpt, losses = trained(name)
    assert len(losses) == 3 and losses[-1] < losses[0]
    out = tmp_path / "merged"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    ours = jax_lora_logits(ckpt, 3, TEXT_PROMPTS)
    merged = hf_logits_text(out, TEXT_PROMPTS)
    diff = max_diff(ours, merged)
    print(f"{name}: max |merged - JAX LoRA| = {diff:.2e}")
    assert diff < TOL
    assert max_diff(merged, hf_logits_text(base, TEXT_PROMPTS)) > 100 * TOL
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert {1, 106, 50} <= set(eos)
    assert sio.WeightsDir(out).names() == [k for k in sio.WeightsDir(base).names() if k != "lm_head.weight"]

    from convert.export_peft import main as export_main  # in-process: the CLI itself is tests/test_e2e.py's
    from gemma_tpu.core.cli import cli_main

    adapter = tmp_path / "adapter"
    assert cli_main(export_main, ["--checkpoint", str(ckpt), "--out", str(adapter)]) == 0
    check_adapter_keys(base, adapter)
    diff = max_diff(hf_logits_text(base, TEXT_PROMPTS, adapter), merged)
    print(f"{name}: max |PEFT on base - merged| = {diff:.2e}")
    assert diff < TOL


@pytest.mark.xdist_group("gemma4_trained")  # the `trained` fixture: one 1x1x1 training for both
@pytest.mark.parametrize("name", MESH_VARIANTS)
def test_same_loss_on_every_mesh(g4, trained, tmp_path, name):
    _, single = trained(name)
    # one mesh with both FSDP and TP covers Gemma 4's partition rules (the data axis is family-independent and
    # covered for Gemma 3 by tests/test_sharding.py; every rule spec on every mesh: test_every_parameter_has_...)
    for mesh in ("fsdp4_tp2",):
        args = MESHES[mesh]
        got = train_losses(g4(name), tmp_path / mesh, args, EIGHT)
        assert len(got) == 3
        worst = max(abs(a - b) for a, b in zip(got, single))
        print(f"{name} {mesh}: losses {got}, max |diff| vs 1x1x1 {worst:.1e}")
        assert worst < 1e-5, (mesh, got, single)


def hf_logits_text(model_dir, prompts, adapter=None):
    from gemma_tpu.hf.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    return hf_logits(model_dir, [tok(p).input_ids for p in prompts], adapter)


def check_adapter_keys(base: Path, adapter: Path) -> None:
    """Fused Tunix weights land on the right HF modules: one A shared by k_proj and v_proj where
    kv_einsum fuses them, k_proj alone in K=V layers, nothing where a layer shares KV."""
    from gemma_tpu.models import get_family
    from gemma_tpu.models.gemma4 import layer_features

    cfg = json.loads((base / "config.json").read_text())
    tc = get_family("gemma4").tunix_config(cfg)
    names = set(sio.WeightsDir(adapter).names())
    w = sio.WeightsDir(adapter)
    prefix = "base_model.model." + ("model.language_model." if "text_config" in cfg else "model.")
    for i in range(tc.num_layers):
        feats = layer_features(tc, i)
        stem = f"{prefix}layers.{i}.self_attn."
        has = {m for m in ("k_proj", "v_proj") if f"{stem}{m}.lora_A.weight" in names}
        assert has == ({"k_proj", "v_proj"} if "kv" in feats else {"k_proj"} if "k_eq_v" in feats else set()), i
        if "kv" in feats:
            assert np.array_equal(w.read(f"{stem}k_proj.lora_A.weight"), w.read(f"{stem}v_proj.lora_A.weight"))
        assert f"{stem}q_proj.lora_B.weight" in names and f"{prefix}layers.{i}.mlp.down_proj.lora_A.weight" in names
    assert not [n for n in names if "vision" in n]
    # layer-major, modules in PEFT's order (K=V layers wrote v_proj... before k_proj: k_proj's later index won)
    modules = [n.split(".")[-3] for n in w.names() if n.endswith(".lora_A.weight")]
    peft_order = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    layers = [int(n.split("layers.")[1].split(".")[0]) for n in w.names() if n.endswith(".lora_A.weight")]
    assert [(layer, peft_order.index(m)) for layer, m in zip(layers, modules)] == sorted(
        (layer, peft_order.index(m)) for layer, m in zip(layers, modules))


# ------------------------------------------------------------------------------ random factors, full fine-tunes


@pytest.mark.parametrize("name", ["dense_mm", "moe"])
def test_lora_merge_and_peft(g4, tmp_path, name):
    base = g4(name)
    ckpt = tmp_path / "ckpt"
    ref = make_checkpoint(base, ckpt, rank=3, alpha=6.0, seed=7)
    out = tmp_path / "merged"
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    got = hf_logits(out)
    assert max_diff(ref, got) <= TOL
    assert max_diff(ref, hf_logits(base)) > 100 * TOL
    bw, mw = sio.WeightsDir(base), sio.WeightsDir(out)
    untouched = [k for k in bw.names() if "vision" in k or "experts" in k or "router" in k]
    assert untouched and all(mw.read(k).tobytes() == bw.read(k).tobytes() for k in untouched)
    from convert.export_peft import main as export_main
    from gemma_tpu.core.cli import cli_main

    adapter = tmp_path / "adapter"
    assert cli_main(export_main, ["--checkpoint", str(ckpt), "--out", str(adapter)]) == 0
    check_adapter_keys(base, adapter)
    assert max_diff(hf_logits(base, adapter=adapter), got) <= TOL
    from serving.config import adapter_rank, check_adapter_fits, check_weights

    check_adapter_fits(adapter, "a", adapter_rank(adapter, "a"), check_weights(base))  # what serving.launch checks


def merge_refuses_edited_base(base, tensors, ckpt, bad, key, edit, says, capsys, config_update=None):
    """A copy of `base` at `bad` with tensor `key` edited (and config.json's sections updated by `config_update`):
    merging `ckpt` onto it (--allow-base-mismatch) is one error line ending in `says`, and nothing is written."""
    import shutil

    from safetensors.numpy import save_file

    from tests.test_convert import leftovers

    shutil.copytree(base, bad)
    save_file({k: edit(v) if k == key else v for k, v in tensors.items()}, str(bad / "model.safetensors"),
              metadata={"format": "pt"})
    if config_update:
        cfg = json.loads((bad / "config.json").read_text())
        for section, values in config_update.items():
            cfg[section].update(values)
        (bad / "config.json").write_text(json.dumps(cfg))
    out = bad.parent / f"out-{bad.name}"
    capsys.readouterr()
    assert merge("--checkpoint", ckpt, "--base", bad, "--allow-base-mismatch", "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and f"{bad}: {says}" in err[-1], err
    assert leftovers(out) == []


def test_a_multimodal_base_vision_tensor_must_have_its_config_shape(g4, tmp_path, capsys):
    """Gemma 4's vision tower and its projection into the text model are copied by the merge as they are: one of
    another shape than config.json's vision_config gives it (let through by --allow-base-mismatch) was published,
    a model transformers refuses to load. Refused by name, nothing written."""
    from safetensors.numpy import load_file

    base = g4("dense_mm")
    ckpt = tmp_path / "ckpt"
    make_checkpoint(base, ckpt, rank=2, alpha=4.0, targets=["q_proj"], seed=9)
    q = "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"
    cases = [(q, lambda v: v[:-8], None, f"tensor {q} is [24, 32], but its config.json makes it [32, 32]"),
             ("model.embed_vision.embedding_projection.weight", lambda v: v[:, :-2], None,
              "tensor model.embed_vision.embedding_projection.weight is [64, 30], but its config.json makes it "
              "[64, 32]"),
             (None, None, {"patch_size": 2}, "tensor model.vision_tower.patch_embedder.input_proj.weight is "
                                             "[32, 48], but its config.json makes it [32, 12]")]
    t = load_file(str(base / "model.safetensors"))
    for i, (key, edit, vision, says) in enumerate(cases):
        merge_refuses_edited_base(base, t, ckpt, tmp_path / f"bad{i}", key, edit, says, capsys,
                                  {"vision_config": vision} if vision else None)
    assert merge("--checkpoint", ckpt, "--out", tmp_path / "merged") == 0  # the base as written
    # every tensor beside the decoder is checked, and the table's defaults are transformers'
    from transformers import Gemma4VisionConfig

    from gemma_tpu.models.gemma4 import VISION_DEFAULTS, tower_shapes

    for name in ("dense_mm", "ple_mm"):
        tensors = sio.WeightsDir(g4(name)).tensors
        want = tower_shapes(json.loads((g4(name) / "config.json").read_text()), list(tensors))
        assert set(want) == {n for n in tensors if not n.startswith("model.language_model.")}
        assert all(tuple(tensors[n].shape) == shape for n, shape in want.items())
    defaults = Gemma4VisionConfig().to_dict()
    assert {k: defaults[k] for k in VISION_DEFAULTS} == VISION_DEFAULTS
    # and a tower of other sizes (one KV head, a head size of its own, standardized) as transformers builds it
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    text = {k: v for k, v in json.loads((base / "config.json").read_text())["text_config"].items()
            if k not in ("model_type", "transformers_version")}
    vision = Gemma4VisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
                                num_key_value_heads=1, head_dim=8, patch_size=3, position_embedding_size=7,
                                standardize=True)
    cfg = Gemma4Config(text_config=Gemma4TextConfig(**text), vision_config=vision, audio_config=None)
    with torch.device("meta"):
        built = {n: tuple(p.shape) for n, p in Gemma4ForConditionalGeneration(cfg).state_dict().items()}
    want = tower_shapes(cfg.to_dict(), list(built))
    assert set(want) == {n for n in built if not n.startswith("model.language_model.") and n != "lm_head.weight"}
    assert all(built[n] == shape for n, shape in want.items())


def test_a_multimodal_base_audio_tensor_must_have_its_config_shape(g4, tmp_path, capsys):
    """The same for the audio tower of an E2B/E4B-like Gemma 4 and its projection into the text model (copied by
    the merge as they are): one of another shape than audio_config gives it is refused by name, nothing written."""
    import shutil

    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration

    from gemma_tpu.models.gemma4 import AUDIO_DEFAULTS, tower_shapes

    # ple_mm with an audio tower as transformers builds it (its weights random)
    audio = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, output_proj_dims=48,
                              subsampling_conv_channels=[8, 4], conv_kernel_size=3)
    base = tmp_path / "base"
    shutil.copytree(g4("ple_mm"), base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["audio_config"] = audio.to_dict()
    with torch.device("meta"):
        built = {n: tuple(p.shape) for n, p in Gemma4ForConditionalGeneration(Gemma4Config(**cfg)).state_dict().items()}
    rng = np.random.default_rng(0)
    tensors = load_file(str(base / "model.safetensors"))
    tensors.update({n: rng.normal(0, 0.05, shape).astype(np.float32) for n, shape in built.items()
                    if n.startswith(("model.audio_tower.", "model.embed_audio."))})
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    (base / "config.json").write_text(json.dumps(cfg))
    want = tower_shapes(cfg, list(built))
    assert {n for n in want if "audio" in n} == {n for n in built if n.startswith(("model.audio_tower.",
                                                                                  "model.embed_audio."))
                                                 and not n.endswith(("_min", "_max"))}  # clipping bounds: scalars
    assert all(built[n] == shape for n, shape in want.items())
    defaults = Gemma4AudioConfig().to_dict()
    assert {k: defaults[k] for k in AUDIO_DEFAULTS} == {k: list(v) if isinstance(v, (list, tuple)) else v
                                                         for k, v in AUDIO_DEFAULTS.items()}

    ckpt = tmp_path / "ckpt"
    make_checkpoint(base, ckpt, rank=2, alpha=4.0, targets=["q_proj"], seed=9)
    conv = "model.audio_tower.layers.1.lconv1d.depthwise_conv1d.weight"
    cases = [(conv, lambda v: v[..., :-1], f"tensor {conv} is [32, 1, 2], but its config.json makes it [32, 1, 3]"),
             ("model.embed_audio.embedding_projection.weight", lambda v: v[:, :-8],
              "tensor model.embed_audio.embedding_projection.weight is [64, 40], but its config.json makes it "
              "[64, 48]")]
    for i, (key, edit, says) in enumerate(cases):
        merge_refuses_edited_base(base, tensors, ckpt, tmp_path / f"bad{i}", key, edit, says, capsys)
    out = tmp_path / "merged"  # the base as written: merged, its audio tower copied
    assert merge("--checkpoint", ckpt, "--out", out) == 0
    assert sio.WeightsDir(out).read(conv).tobytes() == sio.WeightsDir(base).read(conv).tobytes()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_serving_finds_every_tensor_of_each_variant(g4, name):
    """serving.launch's tensor-name check (the registry's required_weights) holds every Gemma 4 transformers
    writes: per-layer embeddings, experts, K=V and shared layers; a vision tower is outside the decoder."""
    from gemma_tpu.models import get_family
    from serving.config import check_weight_names, check_weights

    d = g4(name)
    hf = json.loads((d / "config.json").read_text())
    weights = check_weights(d)
    assert check_weight_names(d, get_family("gemma4"), hf, list(weights)) == []
    with pytest.raises(UserError, match=r"1 tensor of the model .* missing from the weights "
                       r"\(model\.(language_model\.)?layers\.0\.input_layernorm\.weight\)"):
        names = [n for n in weights if not n.endswith("layers.0.input_layernorm.weight")]
        check_weight_names(d, get_family("gemma4"), hf, names)


@pytest.mark.parametrize("name", ["ple_mm", "moe"])
def test_full_finetune_converts(g4, tmp_path, name):
    """Every Tunix param back to its HF tensor: per-layer embeddings (regrouped axes), layer
    scalars, experts (3-D, transposed), and no K/V for KV-sharing layers."""
    base = g4(name)
    ckpt = tmp_path / "ckpt"
    ref = make_checkpoint(base, ckpt, full=True, seed=8)
    out = tmp_path / "merged"
    assert merge("--checkpoint", ckpt, "--out", out, "--verify") == 0
    assert max_diff(ref, hf_logits(out)) <= TOL
    assert max_diff(ref, hf_logits(base)) > 100 * TOL
    bw, mw = sio.WeightsDir(base), sio.WeightsDir(out)
    changed = [k for k in bw.names() if "vision" not in k and mw.read(k).tobytes() != bw.read(k).tobytes()]
    assert len(changed) == len([k for k in bw.names() if "vision" not in k])


# ------------------------------------------------------------------------------ presets


PRESETS = {
    "google/gemma-4-31b-it": ("gemma4", 60, 5376),
    "google/gemma-4-e2b-it": ("gemma4", 35, 1536),
    "google/gemma-4-e4b-it": ("gemma4", 42, 2560),
    "google/gemma-4-26B-A4B-it": ("gemma4", 30, 2816),  # the hub's spelling: ids are case-insensitive
    "google/gemma-3-27b-it": ("gemma3", 62, 5376),
    "google/gemma-3-27b-pt": ("gemma3", 62, 5376),
    "google/gemma-3-12b-it": ("gemma3", 48, 3840),
    "google/gemma-3-12b-pt": ("gemma3", 48, 3840),
    "google/gemma-3-4b-it": ("gemma3", 34, 2560),
    "google/gemma-3-4b-pt": ("gemma3", 34, 2560),
    "google/gemma-3-1b-it": ("gemma3", 26, 1152),
    "google/gemma-3-1b-pt": ("gemma3", 26, 1152),
    "google/functiongemma-270m-it": ("gemma3", 18, 640),
    "google/gemma-3-270m": ("gemma3", 18, 640),
    "google/gemma-3-270m-it": ("gemma3", 18, 640),
}


@pytest.mark.parametrize("hub_id", list(PRESETS))
def test_config_json_for_presets(hub_id, monkeypatch, tmp_path):
    import huggingface_hub.constants

    from gemma_tpu.hf.directory import config_json_for
    from gemma_tpu.models.registry import detect_family, text_config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = config_json_for(hub_id)
    family, layers, hidden = PRESETS[hub_id]
    fam = detect_family(cfg)
    assert fam.name == family
    tc = fam.tunix_config(cfg)
    assert (tc.num_layers, tc.embed_dim) == (layers, hidden)
    assert int(text_config(cfg)["num_hidden_layers"]) == layers


def test_preset_values_match_tunix():
    """Presets cross-checked with Tunix's own configs of the same models."""
    from tunix.models.gemma3 import model as g3
    from tunix.models.gemma4 import model as g4m

    from gemma_tpu.hf.directory import config_json_for
    from gemma_tpu.models.registry import detect_family

    fields = ("num_layers", "embed_dim", "hidden_dim", "num_heads", "head_dim", "num_kv_heads",
              "sliding_window_size", "per_layer_input_dim", "num_global_kv_heads", "k_eq_v_global",
              "global_key_size", "override_kv_shared_ffw_hidden", "enable_moe", "num_experts", "num_experts_per_tok",
              "expert_dim", "moe_dense_hidden_dim", "global_rope_proportion")
    for hub_id, tunix in [("google/gemma-4-31b-it", g4m.ModelConfig.gemma4_31b()),
                          ("google/gemma-4-26b-a4b-it", g4m.ModelConfig.gemma4_26b_a4b()),
                          ("google/gemma-4-e2b-it", g4m.ModelConfig.gemma4_e2b()),
                          ("google/gemma-4-e4b-it", g4m.ModelConfig.gemma4_e4b())]:
        cfg = config_json_for(hub_id)
        ours = detect_family(cfg).tunix_config(cfg)
        assert {f: getattr(ours, f) for f in fields} == {f: getattr(tunix, f) for f in fields}, hub_id
        from gemma_tpu.models.gemma4 import _num_unshared

        assert _num_unshared(ours.num_layers, ours.frac_shared_layers) == _num_unshared(tunix.num_layers,
                                                                                        tunix.frac_shared_layers)
    for hub_id, tunix in [("google/gemma-3-27b-it", g3.ModelConfig.gemma3_27b_it()),
                          ("google/gemma-3-27b-pt", g3.ModelConfig.gemma3_27b_pt()),
                          ("google/gemma-3-12b-it", g3.ModelConfig.gemma3_12b_it()),
                          ("google/gemma-3-12b-pt", g3.ModelConfig.gemma3_12b_pt()),
                          ("google/gemma-3-4b-it", g3.ModelConfig.gemma3_4b_it()),
                          ("google/gemma-3-4b-pt", g3.ModelConfig.gemma3_4b_pt()),
                          ("google/gemma-3-270m", g3.ModelConfig.gemma3_270m()),
                          ("google/gemma-3-270m-it", g3.ModelConfig.gemma3_270m_it()),
                          ("google/gemma-3-1b-it", g3.ModelConfig.gemma3_1b_it()),
                          ("google/gemma-3-1b-pt", g3.ModelConfig.gemma3_1b_pt()),
                          ("google/functiongemma-270m-it", g3.ModelConfig.gemma3_270m_it())]:
        cfg = config_json_for(hub_id)
        ours = detect_family(cfg).tunix_config(cfg)
        for f in ("num_layers", "embed_dim", "hidden_dim", "num_heads", "head_dim", "num_kv_heads",
                  "sliding_window_size", "global_scale_factor", "query_pre_attn_norm"):
            assert getattr(ours, f) == getattr(tunix, f), (hub_id, f)


# Published decoder sizes (text only: model cards count vision/audio towers too): KerasHub's exact counts of the text
# models (with the 262,144-token vocabulary of the text-only releases, 64 rows fewer than the multimodal 262,208),
# Google's 25.2B total of the 26B-A4B.
PUBLISHED_PARAMS = {
    "google/gemma-3-270m": 268_098_176,
    "google/gemma-3-12b-it": 11_765_788_416 + 64 * 3840,
    "google/gemma-4-26B-A4B-it": 25.2e9,
}


@pytest.mark.parametrize("hub_id", list(PUBLISHED_PARAMS))
def test_presets_plan_the_published_parameter_count(hub_id, monkeypatch, tmp_path):
    """A hub id the registry's families cover plans offline (the 26B-A4B, 12B and 270M had no preset: their dry
    run stopped at 'no preset'), with the published number of parameters (within 0.5%)."""
    import huggingface_hub.constants

    from gemma_tpu.hf.directory import config_json_for
    from gemma_tpu.models.registry import detect_family
    from gemma_tpu.train.plan import _flat_shapes, abstract_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    cfg = config_json_for(hub_id)
    model, _ = abstract_model(detect_family(cfg), cfg, "bfloat16")
    total = sum(math.prod(shape) for shape, _ in _flat_shapes(model).values())
    assert total == pytest.approx(PUBLISHED_PARAMS[hub_id], rel=5e-3), (hub_id, total)


def test_config_json_for_prefers_local_dir_then_cache(g4, monkeypatch, tmp_path):
    import huggingface_hub.constants

    from gemma_tpu.hf.directory import config_json_for

    d = g4("dense")
    assert config_json_for(str(d)) == json.loads((d / "config.json").read_text())
    # a hub cache entry wins over the preset
    cache = tmp_path / "hub"
    snap = cache / "models--google--gemma-4-31b-it" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"architectures": ["Gemma4ForCausalLM"], "cached": True}))
    (cache / "models--google--gemma-4-31b-it" / "refs").mkdir()
    (cache / "models--google--gemma-4-31b-it" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert config_json_for("google/gemma-4-31b-it")["cached"] is True
    with pytest.raises(UserError, match="no preset") as e:
        config_json_for("google/gemma-9-nope")
    assert "google/gemma-4-31b-it" in str(e.value) and "\n" not in str(e.value)
    # a hub id of another family: what to do, without claiming the id is supported (it said only 'no preset')
    with pytest.raises(UserError, match=r"^meta-llama/Llama-3\.1-8B: no local directory, no cached config\.json and "
                                        r"no preset, so its architecture is unknown offline: fetch its config\.json "
                                        r"\(`hf download meta-llama/Llama-3\.1-8B config\.json` puts it in the Hugging "
                                        r"Face cache read here\) or give the path of a local directory holding it"):
        config_json_for("meta-llama/Llama-3.1-8B")
    with pytest.raises(UserError, match="no such directory"):
        config_json_for(str(tmp_path / "missing" / "dir"))


# ------------------------------------------------------------------------------ generation


@pytest.mark.parametrize("name", ["ple", "moe"])
def test_greedy_generation_matches_transformers(g4, name):
    """The KV-cached decoder (per-layer cache shapes, KV-sharing layers reading their source's
    cache, sliding windows) continues left-padded prompts as transformers does."""
    import torch
    from transformers import AutoModelForCausalLM

    from gemma_tpu.infer.generate import Generator, load_hf_dir

    d = g4(name)
    prompts = [[2, 120, 121, 122, 300, 301], [2, *range(130, 160)]]  # the second one past the window
    ours = Generator(load_hf_dir(str(d)), max_new_tokens=20, batch_size=2).generate(prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    for p, g in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=[1, 106],
                          pad_token_id=0)[0, len(p):].tolist()
        assert len(g.ids) >= 5 and g.ids == ref[:len(g.ids)]


def test_local_generation_stops_where_vllm_does_at_the_familys_call_stop_token(g4):
    """A merged Gemma 4 lists <|tool_response> among generation_config's stop ids, so vLLM ends a reply there and
    the client scores a hand-over without a call as a format error; the local generator knew only our format's
    marker and decoded on past it to the token limit."""
    from gemma_tpu.infer.generate import Generator, load_hf_dir

    loaded = load_hf_dir(str(g4("dense")))
    loaded.tokenizer.add_tokens(["<|tool_response>"], special_tokens=True)  # the tiny vocabulary has Gemma 3's ids
    gen = Generator(loaded, max_new_tokens=4, batch_size=1)
    stop = loaded.tokenizer.convert_tokens_to_ids("<|tool_response>")
    assert stop in gen.stop_ids.tolist()
    assert gen._stop_reason([300, stop]) == "call" and gen._stop_reason([300, 106]) == "end_of_turn"


def test_a_call_in_gemma4s_own_markup_is_read_as_that_call(g4):
    """A Gemma 4 whose chat template writes tool calls in its own markup (`<|tool_call>call:NAME{k:<|"|>v<|"|>}
    <tool_call|>`, a string between `<|"|>` quotes) answers in it. Generation here (evaluate, the chat) read that as a
    bare call whose strings kept their quotes ('<|"|>today<|"|>'): a right call scored wrong locally, where vLLM's
    gemma4 parser reads 'today'. Its markup is read as the FunctionGemma markup it mirrors."""
    from gemma_tpu.formats.function_calling import ToolCall
    from gemma_tpu.infer.generate import Generator, load_hf_dir

    loaded = load_hf_dir(str(g4("dense")))
    tok = loaded.tokenizer  # the tiny vocabulary has Gemma 3's ids: Gemma 4's markup added as its special tokens
    tok.add_tokens(["<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>"], special_tokens=True)
    gen = Generator(loaded, max_new_tokens=4, batch_size=1)
    stop = tok.convert_tokens_to_ids("<|tool_response>")
    text = '<|tool_call>call:get_steps{date:<|"|>today<|"|>,days:[<|"|>mon<|"|>,2]}<tool_call|>'
    out = gen.generation(tok.encode(text, add_special_tokens=False) + [stop, 0, 0])
    assert out.stop == "call" and out.ids[-1] == stop
    reply = out.reply()
    assert (reply.kind, reply.calls, reply.text, reply.error) == (
        "call", [ToolCall("get_steps", {"date": "today", "days": ["mon", 2]})], "", None)
    said = gen.generation(tok.encode("It is <|\"|>fine<|\"|>.", add_special_tokens=False) + [106])
    assert said.stop == "end_of_turn" and said.reply().kind == "text"


def test_a_thought_is_read_apart_from_the_answer_as_vllms_gemma4_reasoning_parser_reads_it(g4):
    """A Gemma 4 26B or 31B writes an empty thought block with thinking off (`<|channel>thought\\n<channel|>` before
    its answer), a thinking one a whole thought: local evaluate scored it as part of the answer ("channel thought"
    two words more: no exact match) and read a call after a thought as it read the text, where vLLM's gemma4 reasoning
    parser returns the thought apart (`reasoning`) and the answer alone. The chat traces the thought apart."""
    import dataclasses
    import io

    from gemma_tpu.evaluate.answers import exact_match
    from gemma_tpu.examples.fitness.chat import Coach
    from gemma_tpu.examples.fitness.providers import make_provider
    from gemma_tpu.formats.function_calling import ToolCall
    from gemma_tpu.infer.generate import Generator, load_hf_dir

    loaded = load_hf_dir(str(g4("dense")))
    tok = loaded.tokenizer  # the tiny vocabulary has Gemma 3's ids: Gemma 4's markup added as its special tokens
    tok.add_tokens(["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>"],
                   special_tokens=True)
    gen = Generator(loaded, max_new_tokens=4, batch_size=1)

    def generated(text, stop=(106,)):
        return gen.generation(tok.encode(text, add_special_tokens=False) + list(stop))

    empty = generated("<|channel>thought\n<channel|>It is fine.")
    assert empty.reply().text == "It is fine." and exact_match(empty.reply().text, "It is fine.") == 1.0
    assert (empty.text, empty.thought, empty.stop) == ("It is fine.", "", "end_of_turn")
    assert empty.raw == "<|channel>thought\n<channel|>It is fine."  # evaluate's record keeps what was generated
    call = generated('<|channel>thought\nThe steps of today.<channel|><|tool_call>call:get_steps{date:<|"|>today<|"|>}'
                     '<tool_call|>', [tok.convert_tokens_to_ids("<|tool_response>")])
    assert call.thought == "The steps of today." and (call.reply().kind, call.reply().calls) == (
        "call", [ToolCall("get_steps", {"date": "today"})])
    cut = generated("<|channel>thought\nLet me think", [])  # cut at the token limit within its thought: no answer
    assert (cut.text, cut.thought, cut.stop, cut.reply().kind) == ("", "Let me think", "length", "text")
    plain = generated("No thought here.")
    assert (plain.text, plain.thought, plain.raw) == ("No thought here.", None, "No thought here.")

    class Forced:  # the generator's own decoding of forced ids
        max_new_tokens = 4

        def generate(self, prompts, **_):
            return [generated("<|channel>thought\nThey asked about sleep.<channel|>Sleep well.")]

    trace = io.StringIO()
    roomy = dataclasses.replace(loaded, max_positions=4096)  # the coach's tool declarations pass the tiny context
    answer = Coach(roomy, make_provider("simulated"), generator=Forced(), trace=trace).ask("how did I sleep?")
    assert answer == "Sleep well." and "(thought) They asked about sleep." in trace.getvalue()


@pytest.mark.parametrize("variant,multimodal", [("dense", False), ("ple", False), ("moe", False), ("ple", True)])
def test_tensor_shapes_are_the_checkpoints(tmp_path, variant, multimodal):
    """`Family.tensor_shapes` (what a merge checks the base tensors it copies against) gives the shapes of the
    weights transformers writes: every non-projection decoder tensor of each layout, q/k norms of a global layer at
    its own head size. A KV-sharing layer has no k_norm: listed, and not checked where a checkpoint has none."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.models import resolve_model

    d = write_tiny_gemma4(tmp_path / "g4", variant=variant, multimodal=multimodal)
    resolved = resolve_model(str(d))
    weights = sio.WeightsDir(d)
    prefix = resolved.family.text_prefix(weights.names())
    want = resolved.family.tensor_shapes(resolved.text_config)
    have = {k[len(prefix):]: tuple(weights[k].shape) for k in weights.names() if k.startswith(prefix)}
    assert {k: v for k, v in want.items() if k in have} == {k: v for k, v in have.items() if k in want}
    unlisted = [k for k in have if k not in want and not k.endswith("_proj.weight")]
    assert unlisted == [], unlisted
    missing = [k for k in want if k not in have]
    assert all(k.endswith("self_attn.k_norm.weight") for k in missing), missing
    if variant == "ple":
        assert missing  # the shared layers'


# ------------------------------------------------------------------------------ LoRA rank


@pytest.mark.parametrize("variant,overrides", [
    ("dense", {}), ("ple", {}), ("moe", {}),
    # global keys narrower than sliding ones: one global KV head of 16 (sliding: two of 16)
    ("dense", {"num_global_key_value_heads": 1, "global_head_dim": 16}),
])
def test_projection_shapes_are_the_checkpoints_and_bound_the_lora_rank(tmp_path, variant, overrides):
    """The rank check read every layer as a sliding one (head_dim, num_key_value_heads): a rank above a global
    layer's k_proj side (K=V checkpoints: num_global_key_value_heads x global_head_dim) was accepted, adding
    parameters, not rank. The family's shapes are those of the weights transformers writes, and bound the rank."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4
    from gemma_tpu.core.config import load_config, validate_for_model
    from gemma_tpu.models import resolve_model
    from tests.conftest import REPO

    d = write_tiny_gemma4(tmp_path / "g4", variant=variant, **overrides)
    resolved = resolve_model(str(d))
    shapes = resolved.family.projection_shapes(resolved.text_config)
    weights = sio.WeightsDir(d)
    found: dict[str, set] = {}
    for key in weights.names():
        name = key.split(".")[-2]
        if key.endswith("_proj.weight") and name in shapes and ".layers." in key and "vision" not in key:
            found.setdefault(name, set()).add(tuple(weights[key].shape))
    assert {k: set(v) for k, v in shapes.items()} == found
    smallest = min(min(s) for s in shapes["k_proj"])
    for rank, refused in ((smallest, False), (smallest + 1, True)):
        cfg = load_config(REPO / "configs/tiny.yaml", [f"model.path={d}", f"lora.rank={rank}",
                                                      "lora.targets=[k_proj]"])
        if refused:
            with pytest.raises(UserError, match=f"lora.rank={rank} exceeds the smallest dimension of k_proj "
                                                f"\\({smallest}\\)"):
                validate_for_model(cfg, resolved.text_config, "m", shapes)
        else:
            validate_for_model(cfg, resolved.text_config, "m", shapes)
    if overrides:
        assert smallest == 16  # the global layers' side, which the check missed
