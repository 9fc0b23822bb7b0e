"""Model registry and loading: Tunix's Gemma 3 built from config.json matches transformers."""

import json
import re
import shutil

import numpy as np
import pytest

from gemma_tpu.core.errors import UserError
from gemma_tpu.models import load_model, resolve_model
from gemma_tpu.models.registry import choose_family, detect_family, supported_architectures
from tests.conftest import REPO, assert_one_line_error, run_cli

PROMPTS = ["Hello world, this is a tiny test of the model!",
           "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
           "A longer prompt that runs past the sliding window of sixteen tokens, so local layers matter."]


def jax_logits(model, ids):
    return jax_logits_batch(model, [ids])[0]


def jax_logits_batch(model, seqs):
    """Logits of each sequence, from one eager forward over the right-padded batch: the model runs op by op,
    and each new shape costs every op a compilation (five prompt lengths took 94 s, one padded batch 24 s).
    Causal attention keeps a row's real positions blind to its padding."""
    import jax
    import jax.numpy as jnp

    from gemma_tpu.train.loss import attention_mask

    width = max(len(s) for s in seqs)
    tokens, segments = np.zeros((len(seqs), width), np.int32), np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)], segments[i, :len(s)] = s, 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    with jax.default_matmul_precision("highest"):
        logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), None, attention_mask(jnp.asarray(segments)))
    return [np.asarray(logits[i, :len(s)]) for i, s in enumerate(seqs)]


def hf_logits(model_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("which", ["tiny_dir", "tiny_mha_dir", "tiny_odd_dir"])
def test_tiny_matches_transformers(which, request):
    from transformers import AutoTokenizer

    d = request.getfixturevalue(which)
    resolved = resolve_model(str(d))
    assert resolved.family.name == "gemma3"
    model, cfg = load_model(resolved, "float32")
    tok = AutoTokenizer.from_pretrained(str(d))
    seqs = [tok(p).input_ids for p in PROMPTS]
    assert all(ids[0] == 2 for ids in seqs)
    for p, ids, ours in zip(PROMPTS, seqs, jax_logits_batch(model, seqs)):
        diff = np.abs(ours - hf_logits(d, ids)).max()
        assert diff < 1e-4, (p, diff)


def _legacy_rope_scaling(cfg):
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}


def _top_level_rope_thetas(cfg):
    for kind in ("full_attention", "sliding_attention"):
        del cfg["rope_parameters"][kind]["rope_theta"]
    cfg.update(rope_theta=5000.0, rope_local_base_freq=700.0)


@pytest.mark.parametrize("edit", [_legacy_rope_scaling, _top_level_rope_thetas])
def test_rope_keys_resolved_as_transformers_resolves_them(edit, tiny_odd_dir, tmp_path):
    """transformers 5 lays a 4.x `rope_scaling` over `rope_parameters.full_attention`, and takes a rope_theta
    that entry lacks from `rope_theta` / `rope_local_base_freq`; both were ignored (the global layers ran
    with factor 4 instead of 8, or every layer with the default base: logits off by 0.13 and 1.7)."""
    d = shutil.copytree(tiny_odd_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(resolve_model(str(d)), "float32")
    ids = [2, *range(120, 160)]
    assert np.abs(jax_logits(model, ids) - hf_logits(d, ids)).max() < 1e-4


def test_omitted_query_pre_attn_scalar_means_transformers_default(tiny_dir, tmp_path):
    """A config.json without `query_pre_attn_scalar` (hand-written or trimmed) means transformers'
    default, 256, not head_dim: with head_dim 16 transformers scales queries by 1/16, which Tunix
    cannot express, so it is refused by name (it loaded with 1/4 before, logits off by ~1.4)."""
    cfg = json.loads((tiny_dir / "config.json").read_text())
    del cfg["query_pre_attn_scalar"]
    with pytest.raises(UserError, match=r"query_pre_attn_scalar=256 must equal head_dim \(16\)"):
        detect_family(cfg).tunix_config(cfg)
    cfg["head_dim"] = 256  # and where 256 is head_dim, the config is accepted as transformers reads it
    assert detect_family(cfg).tunix_config(cfg).head_dim == 256


def test_config_built_from_config_json(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    resolved = resolve_model(str(d))
    tc = resolved.family.tunix_config(cfg)
    assert (tc.num_layers, tc.embed_dim, tc.num_heads, tc.num_kv_heads, tc.head_dim) == (2, 64, 4, 2, 16)
    assert tc.sliding_window_size == 16 and tc.num_embed == 512
    cfg["final_logit_softcapping"] = 30.0
    with pytest.raises(UserError, match="final_logit_softcapping"):
        resolved.family.tunix_config(cfg)
    # 0 too: Gemma3ForCausalLM divides by it (every logit 0), where it was read as "no cap" and trained on
    cfg["final_logit_softcapping"] = 0.0
    with pytest.raises(UserError, match="final_logit_softcapping=0.0"):
        resolved.family.tunix_config(cfg)


def test_attn_logit_softcapping_is_ignored_as_transformers_ignores_it(tiny_odd_dir, tmp_path):
    """No Gemma 3 class applies attn_logit_softcapping (transformers never hands it to the attention, vLLM's
    Gemma 3 passes None): a config.json that sets it was refused; it now loads with transformers' numbers."""
    d = shutil.copytree(tiny_odd_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["attn_logit_softcapping"] = 0.5  # would flatten every attention score if applied
    (d / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(resolve_model(str(d)), "float32")
    ids = [2, *range(120, 160)]
    assert np.abs(jax_logits(model, ids) - hf_logits(d, ids)).max() < 1e-4


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_declared_types_are_transformers_own(family):
    """Each family's table of config.json types (what a value must be for transformers to build the
    model) is the type transformers' text config class declares for that key."""
    import dataclasses

    import transformers

    from gemma_tpu.models import gemma3, gemma4

    module, cls = {"gemma3": (gemma3, transformers.Gemma3TextConfig),
                   "gemma4": (gemma4, transformers.Gemma4TextConfig)}[family]
    declared = {f.name: str(f.type).replace("<class '", "").replace("'>", "").replace("NoneType", "None")
                .replace(" ", "") for f in dataclasses.fields(cls)}
    assert {k: declared.get(k) for k in module.HF_TYPES} == module.HF_TYPES


@pytest.mark.parametrize("key,value", [("num_attention_heads", "4"), ("head_dim", 16.0), ("num_hidden_layers", True),
                                       ("rms_norm_eps", 1), ("final_logit_softcapping", "30"),
                                       ("tie_word_embeddings", "false"), ("layer_types", "sliding_attention")])
def test_values_transformers_refuses_are_refused(key, value, tiny_dir):
    """transformers builds no model from a config.json whose values are not of the declared types ("4" for
    num_attention_heads, 1 for rms_norm_eps); int("4") trained it here, into a run that could never be merged
    or served. Both refuse it, naming the key (under text_config. in a multimodal config)."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import Gemma3TextConfig

    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg[key] = value
    with pytest.raises(StrictDataclassFieldValidationError, match=key):
        Gemma3TextConfig.from_dict(cfg)
    with pytest.raises(UserError, match=f"config.json: {key}={value!r} is not of type"):
        detect_family(cfg).tunix_config(cfg)
    if key != "tie_word_embeddings":  # read from the top level of a multimodal config
        mm = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": cfg}
        with pytest.raises(UserError, match=f"config.json: text_config.{key}={value!r} is not of type"):
            detect_family(mm).tunix_config(mm)


@pytest.mark.parametrize("edit,key", [
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": "20000"},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters.sliding_attention.rope_theta='20000'"),
    ({"rope_parameters": None, "rope_theta": 1e6, "rope_local_base_freq": "10000"}, "rope_local_base_freq='10000'"),
])
def test_rotary_numbers_given_as_strings_are_refused(edit, key, tiny_dir):
    """A rotary base written as a string was float()-ed here; transformers' rotary embedding fails on it."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = {**json.loads((tiny_dir / "config.json").read_text()), **edit}
    with pytest.raises(TypeError):
        Gemma3ForCausalLM(Gemma3TextConfig.from_dict(cfg))(torch.tensor([[2, 3]]))
    with pytest.raises(UserError, match=f"config.json: {re.escape(key)} is not of type int or float"):
        detect_family(cfg).tunix_config(cfg)


def _pop_factor(cfg):
    del cfg["rope_parameters"]["full_attention"]["factor"]


def _legacy_scaling_without_factor(cfg):
    del cfg["rope_parameters"]
    cfg["rope_scaling"] = {"rope_type": "linear"}


def _null_theta(kind):
    return lambda cfg: cfg["rope_parameters"][kind].__setitem__("rope_theta", None)


def _null_legacy(key):
    def edit(cfg):
        del cfg["rope_parameters"]
        cfg[key] = None
    return edit


@pytest.mark.parametrize("edit,needle", [
    (_pop_factor, "linear rope scaling for full_attention has no factor"),
    (_legacy_scaling_without_factor, "linear rope scaling for full_attention has no factor"),
    (_null_theta("full_attention"), "rope_parameters.full_attention.rope_theta=null"),
    (_null_theta("sliding_attention"), "rope_parameters.sliding_attention.rope_theta=null"),
    (_null_legacy("rope_theta"), "rope_theta=null for the model's full_attention layers"),
    (_null_legacy("rope_local_base_freq"), "rope_local_base_freq=null for the model's sliding_attention layers"),
])
def test_rotary_settings_transformers_cannot_build_are_refused(edit, needle, tiny_odd_dir):
    """Linear scaling without a factor (transformers: KeyError validating the config) was read as factor 1, a
    null rotary base (transformers: TypeError in its rotary embedding) as the default base: a run trained on
    them could never be loaded by transformers. Both now refuse it, here naming the key."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = json.loads((tiny_odd_dir / "config.json").read_text())  # sliding and global layers
    edit(cfg)
    with pytest.raises((KeyError, TypeError)):
        Gemma3ForCausalLM(Gemma3TextConfig.from_dict(json.loads(json.dumps(cfg))))(torch.tensor([[2, 3]]))
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        detect_family(cfg).tunix_config(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit,key", [
    (lambda cfg: cfg["rope_parameters"]["full_attention"].update(factor=0.5), "rope_parameters.full_attention.factor"),
    (lambda cfg: cfg["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=0),
     "rope_parameters.sliding_attention.factor"),
    (lambda cfg: cfg.update(rope_scaling={"rope_type": "linear", "factor": 0.25}), "rope_scaling.factor"),
])
def test_linear_rope_factor_below_one_is_refused_naming_the_key(edit, key, tiny_odd_dir):
    """Tunix's Gemma 3 rotary embedding refuses a scale factor below 1 (transformers only warns and divides the
    frequencies by it): the config was taken and the first training step died in a JAX ValueError traceback."""
    cfg = json.loads((tiny_odd_dir / "config.json").read_text())
    edit(cfg)
    with pytest.raises(UserError, match=rf"config.json: {re.escape(key)}=0?\.?\d* must be at least 1") as e:
        detect_family(cfg).tunix_config(cfg)
    assert "\n" not in str(e.value)


def _rope_entry(kind, **entry):
    def edit(cfg):
        cfg["rope_parameters"][kind] = {"rope_theta": 1e4 if kind == "sliding_attention" else 1e6, **entry}
    return edit


def _legacy_scaling(**scaling):
    def edit(cfg):
        cfg["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": 1e6}
        cfg["rope_scaling"] = scaling
    return edit


@pytest.mark.parametrize("edit,needle", [
    (_rope_entry("full_attention", rope_type="yarn", factor=4.0),
     "rope_parameters.full_attention.rope_type='yarn' is not supported"),
    (_rope_entry("sliding_attention", rope_type="dynamic", factor=2.0),
     "rope_parameters.sliding_attention.rope_type='dynamic' is not supported"),
    (_rope_entry("full_attention", type="llama3", factor=8.0),
     "rope_parameters.full_attention.type='llama3' is not supported"),
    (_legacy_scaling(rope_type="yarn", factor=4.0), "rope_scaling.rope_type='yarn' is not supported"),
    (_rope_entry("sliding_attention", rope_type="linear"), "(rope_parameters.sliding_attention.factor missing"),
    (_legacy_scaling(rope_type="linear"), "(rope_scaling.factor missing"),
])
def test_rotary_refusals_name_the_key_config_json_has(edit, needle, tiny_odd_dir):
    """A rope type Tunix's Gemma 3 cannot express, or a linear one without its factor, is refused naming the key it
    is (or belongs) under: rope_parameters.<layer type> or the legacy rope_scaling. It said "rope type 'yarn' for
    full_attention", which names no key of config.json."""
    cfg = json.loads((tiny_odd_dir / "config.json").read_text())  # sliding and global layers
    edit(cfg)
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        detect_family(cfg).tunix_config(cfg)
    assert str(e.value).startswith("config.json: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("edit,needle", [
    (lambda cfg: cfg["rope_parameters"]["full_attention"].update(partial_rotary_factor=0.5),
     "rope_parameters.full_attention.partial_rotary_factor=0.5"),
    (_rope_entry("sliding_attention", rope_type="linear", factor=2.0, partial_rotary_factor=0.25),
     "rope_parameters.sliding_attention.partial_rotary_factor=0.25"),
    (_legacy_scaling(rope_type="linear", factor=2.0, partial_rotary_factor=0.5),
     "rope_scaling.partial_rotary_factor=0.5"),
    (lambda cfg: cfg["rope_parameters"]["full_attention"].update(partial_rotary_factor=2),
     "rope_parameters.full_attention.partial_rotary_factor=2"),
    # at the top of config.json (as other models write it): laid over every entry as transformers builds linear RoPE
    (lambda cfg: cfg.update(partial_rotary_factor=0.5), "config.json: partial_rotary_factor=0.5"),
])
def test_linear_rope_over_part_of_the_head_is_refused_naming_the_key(edit, needle, tiny_odd_dir):
    """transformers' linear RoPE spans int(head_dim * partial_rotary_factor) dimensions (Gemma 3's own default RoPE
    ignores the key), so a share other than the whole head gives cos/sin of another width than the heads: its first
    forward fails. The config was taken here and trained whole-head rotations, a run no merge of could be loaded."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = json.loads((tiny_odd_dir / "config.json").read_text())  # sliding and global layers, global ones linear
    edit(cfg)
    with pytest.raises(RuntimeError, match="must match the size"):
        Gemma3ForCausalLM(Gemma3TextConfig.from_dict(json.loads(json.dumps(cfg))))(torch.tensor([[2, 3]]))
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        detect_family(cfg).tunix_config(cfg)
    assert str(e.value).startswith("config.json: ") and "\n" not in str(e.value)
    # the whole head (1, or a share whose span rounds down to it) is linear RoPE as before
    edit(cfg)
    for c in (cfg["rope_parameters"]["full_attention"], cfg["rope_parameters"]["sliding_attention"],
              cfg.get("rope_scaling") or {}, cfg):
        if "partial_rotary_factor" in c:
            c["partial_rotary_factor"] = 1.0
    detect_family(cfg).tunix_config(cfg)


def test_a_top_level_partial_rotary_factor_transformers_does_not_lay_over_the_entries_is_not_refused(tiny_dir,
                                                                                                      tmp_path):
    """transformers lays a top-level partial_rotary_factor over the rope_parameters entries (where linear RoPE would
    span part of the head, which it cannot run) only where each entry is of a layer type the model has: a Gemma 3 of
    sliding layers alone (Gemma 3 always has a full_attention entry) rotates its linear RoPE over whole heads, and
    runs; it was refused as though transformers could not run it."""
    from convert.verify import hf_logits as reference_logits

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    assert set(cfg["layer_types"]) == {"sliding_attention"}
    cfg["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0}
    (d / "config.json").write_text(json.dumps({**cfg, "partial_rotary_factor": 0.5}))
    ids = [2, *range(120, 150)]
    ref = reference_logits(d, [ids])
    model, _ = load_model(resolve_model(str(d)), "float32")
    assert np.abs(jax_logits(model, ids) - ref[0]).max() < 1e-4
    (d / "config.json").write_text(json.dumps(cfg))
    assert np.abs(reference_logits(d, [ids])[0] - ref[0]).max() < 1e-6  # the top-level share is read nowhere


@pytest.mark.parametrize("family,key,value", [
    ("gemma3", "vocab_size", 0), ("gemma3", "hidden_size", 0), ("gemma3", "intermediate_size", -1),
    ("gemma3", "num_attention_heads", 0), ("gemma3", "head_dim", -16), ("gemma3", "max_position_embeddings", 0),
    ("gemma4", "vocab_size", 0), ("gemma4", "global_head_dim", 0), ("gemma4", "num_hidden_layers", 0),
    ("gemma4", "hidden_size_per_layer_input", -8), ("gemma4", "num_experts", 0),
    ("gemma4", "top_k_experts", 9),  # of 8 experts: transformers' router fails in its first forward
])
def test_impossible_sizes_are_refused_naming_the_key(family, key, value):
    """transformers builds these configs, but no checkpoint has weights of such shapes: Tunix's config took them
    silently (a negative intermediate_size died in a JAX broadcast traceback at load, Gemma 4's global_head_dim=0
    was read as head_dim, hidden_size_per_layer_input=-8 blamed vocab_size_per_layer_input)."""
    from gemma_tpu.assets.tiny import TINY_GEMMA3, TINY_GEMMA4
    from gemma_tpu.models.registry import get_family

    base = (TINY_GEMMA3 if family == "gemma3" else TINY_GEMMA4["moe"] if "experts" in key
            else {**TINY_GEMMA4["ple"], "vocab_size_per_layer_input": 512})
    cfg = {**base, "model_type": f"{family}_text", key: value}
    with pytest.raises(UserError, match=f"config.json: {key}={value} must be ") as e:
        get_family(family).tunix_config(cfg)
    assert "\n" not in str(e.value)


def test_hidden_size_not_a_multiple_of_the_heads_is_refused_as_transformers_refuses_it():
    """transformers' Gemma3TextConfig refuses a hidden_size that is not a multiple of num_attention_heads, even with
    head_dim given (66 over 4 heads of 16): the run trained on it here, and its merge could not be loaded."""
    from huggingface_hub.errors import StrictDataclassClassValidationError
    from transformers import Gemma3TextConfig

    from gemma_tpu.assets.tiny import TINY_GEMMA3
    from gemma_tpu.models.registry import get_family

    cfg = {**TINY_GEMMA3, "model_type": "gemma3_text", "hidden_size": 66}
    with pytest.raises(StrictDataclassClassValidationError, match="hidden size"):
        Gemma3TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    with pytest.raises(UserError, match=r"config.json: hidden_size=66 must be a multiple of "
                                        r"num_attention_heads=4 \(transformers cannot") as e:
        get_family("gemma3").tunix_config(cfg)
    assert "\n" not in str(e.value)
    mm = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": cfg}
    with pytest.raises(UserError, match="hidden_size=66 must be a multiple"):
        get_family("gemma3").tunix_config(mm)


def test_layer_types_of_another_length_than_the_layers_is_refused_as_such(tiny_odd_dir):
    """7 layers, 6 layer_types (transformers: a validation error): training called it an unsupported attention
    pattern and the GGUF export wrote it; both now name the count, through the family's text config."""
    from transformers import Gemma3TextConfig

    cfg = json.loads((tiny_odd_dir / "config.json").read_text())
    cfg["layer_types"] = cfg["layer_types"][:6]
    with pytest.raises(Exception, match="must be equal to the number of `layer_types`"):
        Gemma3TextConfig.from_dict(json.loads(json.dumps(cfg)))
    family = detect_family(cfg)
    for call in (family.tunix_config, family.read_text_config):
        with pytest.raises(UserError, match=r"config.json: layer_types has 6 entries for num_hidden_layers=7"):
            call(cfg)


@pytest.mark.parametrize("family_name", ["gemma3", "gemma4"])
def test_empty_layer_types_is_refused_as_transformers_refuses_it(family_name):
    """`"layer_types": []` is not an absent key to transformers (which derives the pattern only for null) but a
    list of 0 entries, refused when it reads config.json; both families read it as absent and trained the default
    pattern on a config no merge of it could be loaded with."""
    import transformers

    from gemma_tpu.assets.tiny import TINY_GEMMA3, TINY_GEMMA4
    from gemma_tpu.models import get_family

    cfg = {**(TINY_GEMMA3 if family_name == "gemma3" else TINY_GEMMA4["dense"]), "layer_types": []}
    config_class = transformers.Gemma3TextConfig if family_name == "gemma3" else transformers.Gemma4TextConfig
    with pytest.raises(Exception, match="must be equal to the number of `layer_types`"):
        config_class(**cfg)
    n = cfg["num_hidden_layers"]
    with pytest.raises(UserError, match=rf"config.json: layer_types has 0 entries for num_hidden_layers={n}") as e:
        get_family(family_name).tunix_config({**cfg, "model_type": f"{family_name}_text"})
    assert "\n" not in str(e.value)


def test_legacy_rope_scaling_type_key_is_refused_naming_it(tiny_odd_dir):
    """`rope_scaling={"type": "linear", "factor": 8}` (the key's name before `rope_type`) meant linear scaling to
    transformers 4, and means nothing to transformers 5 (it runs the global layers unscaled, with a warning);
    training read it as transformers 5 does, silently: now refused, naming the key. `rope_type` still scales."""
    from transformers import Gemma3TextConfig

    cfg = json.loads((tiny_odd_dir / "config.json").read_text())
    del cfg["rope_parameters"]  # as transformers 4 wrote it
    cfg["rope_scaling"] = {"type": "linear", "factor": 8.0}
    assert Gemma3TextConfig.from_dict(json.loads(json.dumps(cfg))).rope_parameters["full_attention"][
        "rope_type"] == "default"  # what transformers 5 makes of it: no scaling
    with pytest.raises(UserError, match=r"rope_scaling\.type='linear' is the old name of rope_type") as e:
        detect_family(cfg).tunix_config(cfg)
    assert "\n" not in str(e.value)
    cfg["rope_scaling"] = {"type": "linear", "rope_type": "linear", "factor": 8.0}  # both agree: read as such
    assert detect_family(cfg).tunix_config(cfg).global_scale_factor == 8.0
    cfg["rope_scaling"] = {"type": "default"}  # no scaling either way
    assert detect_family(cfg).tunix_config(cfg).global_scale_factor == 1.0


@pytest.mark.parametrize("key,value", [("rope_scaling", "linear"), ("rope_scaling", 8.0), ("rope_parameters", [1]),
                                       ("rope_parameters.full_attention", "linear")])
def test_rotary_keys_that_are_not_objects_are_refused(tiny_odd_dir, key, value):
    """transformers cannot build a Gemma 3 from these (ValueError, TypeError, a validation error); they were
    ignored, the model run without its scaling (or, for a layer type's entry, a ValueError traceback)."""
    from transformers import Gemma3TextConfig

    cfg = json.loads((tiny_odd_dir / "config.json").read_text())
    parent, _, name = key.rpartition(".")
    (cfg[parent] if parent else cfg)[name] = value
    with pytest.raises(Exception):
        Gemma3TextConfig.from_dict(json.loads(json.dumps(cfg)))
    with pytest.raises(UserError, match=f"config.json: {key}={re.escape(repr(value))} is not an object"):
        detect_family(cfg).tunix_config(cfg)


def test_flat_rope_parameters_are_refused_naming_the_key(tiny_odd_dir):
    """`rope_parameters` as one set for every layer (how other models write it) is ignored by transformers'
    Gemma 3, which reads it per layer type: it ran unscaled, and so did training, without a word."""
    from transformers import Gemma3TextConfig

    cfg = json.loads((tiny_odd_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    hf = Gemma3TextConfig.from_dict(json.loads(json.dumps(cfg))).rope_parameters
    assert hf["full_attention"]["rope_type"] == "default"  # transformers 5: the flat keys ignored
    with pytest.raises(UserError, match=r"rope_parameters\.factor=8\.0 is not read by transformers' Gemma 3"):
        detect_family(cfg).tunix_config(cfg)
    # what transformers 5 writes there itself, beside the per-layer-type entries: read as it reads it
    cfg = json.loads((tiny_odd_dir / "config.json").read_text())
    cfg["rope_parameters"].update(rope_type="default", rope_theta=None)
    assert detect_family(cfg).tunix_config(cfg).global_scale_factor == 4.0


def test_null_rotary_base_of_a_layer_type_the_model_lacks_is_accepted_as_transformers_does(tiny_dir):
    """A null rope_theta only fails where transformers builds a rotary embedding for it: the 2-layer model has no
    global layer, so a null full_attention base is accepted by both."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["rope_parameters"]["full_attention"]["rope_theta"] = None
    Gemma3ForCausalLM(Gemma3TextConfig.from_dict(json.loads(json.dumps(cfg))))(torch.tensor([[2, 3]]))
    assert detect_family(cfg).tunix_config(cfg).num_layers == 2


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UserError) as e:
        detect_family({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    for arch in supported_architectures():
        assert arch in str(e.value)
    assert "LlamaForCausalLM" in str(e.value)


@pytest.mark.parametrize("arch,model_type", [("Gemma3ForCausalLM", "llama"), ("Gemma4ForCausalLM", "gemma3_text"),
                                              ("Gemma3ForConditionalGeneration", "gemma4")])
def test_an_architecture_contradicting_its_model_type_is_refused(arch, model_type, tiny_dir, tmp_path):
    """Gemma3ForCausalLM with model_type llama trained as a Gemma 3; transformers builds what model_type names (a
    Llama), and the merge refused the base only after training. Refused where the family is read, naming both."""
    with pytest.raises(UserError, match=rf"architectures {arch} but model_type '{model_type}'"):
        detect_family({"architectures": [arch], "model_type": model_type})
    edited = tmp_path / "m"
    shutil.copytree(tiny_dir, edited)
    cfg = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={edited}", "--dry-run")
    assert_one_line_error(proc, "config.json: architectures Gemma3ForCausalLM but model_type 'llama'")


@pytest.mark.parametrize("arch,model_type,text_type", [("Gemma3ForCausalLM", "gemma3", "gemma3_text"),
                                                        ("Gemma3ForConditionalGeneration", "gemma3", "gemma3_text"),
                                                        ("Gemma4ForCausalLM", "gemma4", "gemma4_text")])
def test_a_multimodal_model_type_without_a_text_config_is_refused(arch, model_type, text_type, tiny_dir, tmp_path):
    """model_type gemma3 (gemma4) is the multimodal config, whose decoder transformers reads from text_config: with the
    decoder's keys at the top and no text_config, transformers builds its default text model (hidden_size 2304) and
    leaves every weight of the checkpoint out, where training and generation here read the top-level keys and ran
    the checkpoint's model; a merge of it loaded in transformers as random weights. Refused naming the key."""
    with pytest.raises(UserError, match=rf"^config.json: model_type '{model_type}' is the multimodal config, whose "
                                        rf"decoder transformers reads from text_config, and there is none: .* set "
                                        rf"model_type '{text_type}'"):
        detect_family({"architectures": [arch], "model_type": model_type, "hidden_size": 64})
    with pytest.raises(UserError, match=rf"^config.json: model_type '{model_type}' is the multimodal config"):
        choose_family({"architectures": [arch], "model_type": model_type}, model_type)  # model.family named too
    edited = tmp_path / "m"
    shutil.copytree(tiny_dir, edited)
    cfg = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma3"}))
    proc = run_cli("gemma_tpu.chat", "--model", str(edited), "--once", "hi")
    assert_one_line_error(proc, "config.json: model_type 'gemma3' is the multimodal config")


@pytest.mark.parametrize("arch,model_type", [("Gemma3ForCausalLM", "gemma3_text"),
                                             ("Gemma4ForCausalLM", "gemma4_text")])
def test_a_text_model_type_with_a_text_config_is_refused(arch, model_type, tiny_dir, tmp_path):
    """model_type gemma3_text (gemma4_text) is a text config: transformers reads its decoder at the top and keeps a
    text_config beside it as it is, and building the model on it fails; training and generation here read the nested
    keys as the model (a smaller hidden_size there, or another sliding window, trained a model no other tool loads).
    Refused naming the key, as a multimodal model_type without one is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    edited = tmp_path / "m"
    shutil.copytree(tiny_dir, edited)
    cfg = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**cfg, "text_config": {**cfg, "hidden_size": 32}}))
    with pytest.raises(AttributeError, match="has no attribute 'to_dict'"):  # what transformers makes of it
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(edited)))
    with pytest.raises(UserError, match=r"config.json: model_type 'gemma3_text' is a text config, whose decoder "
                                        r"transformers reads at its top level, yet it holds a text_config.*: remove "
                                        r"text_config .*, or set model_type 'gemma3'"):
        resolve_model(str(edited))
    for nested in ({}, {"hidden_size": 32}):
        with pytest.raises(UserError, match=rf"^config.json: model_type '{model_type}' is a text config"):
            detect_family({"architectures": [arch], "model_type": model_type, "text_config": nested})
    assert detect_family({"architectures": [arch], "model_type": model_type, "text_config": None}).name in model_type


def test_multimodal_text_config_is_detected():
    fam = detect_family({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                         "text_config": {"model_type": "gemma3_text"}})
    assert fam.name == "gemma3"


def test_missing_weight_is_named(tiny_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "broken"
    shutil.copytree(tiny_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model.layers.1.mlp.up_proj.weight' is missing"):
        load_model(resolve_model(str(d)))



def test_a_model_dir_published_anew_after_its_config_was_read_is_refused(tiny_dir, tmp_path):
    """resolve_model reads config.json (and the merge record), load_model the weights later (train, evaluate, chat
    read the tokenizer between): another merge's --overwrite publishing over the directory meanwhile loaded one
    model's weights under the other's config.json and tokenizer. The directory must still be the one whose
    config.json was read; a directory merely read again is accepted."""
    from gemma_tpu.core.atomic import AtomicDir

    d = tmp_path / "merged"
    shutil.copytree(tiny_dir, d)
    load_model(resolve_model(str(d)))
    resolved = resolve_model(str(d))
    ad = AtomicDir(d, overwrite=True)
    with ad as tmp:
        shutil.copytree(tiny_dir, tmp, dirs_exist_ok=True)
        ad.publish()
    with pytest.raises(UserError, match=re.escape(f"{d}: replaced while it was being read (another process "
                                                  f"published it anew meanwhile")):
        load_model(resolved)


def test_stored_lm_head_other_than_the_embedding_is_refused(tiny_dir, tmp_path):
    """A tied config.json whose checkpoint also stores an lm_head.weight: transformers ties the two only
    when they are equal, else it projects with the stored lm_head (an untied model). Tunix's Gemma
    projects with the embedding, so that model was trained silently with other logits; it is refused now,
    and an lm_head equal to the embedding (as torch .bin exports save it) still loads."""
    from safetensors.numpy import load_file, save_file

    d = shutil.copytree(tiny_dir, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    emb = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": emb.copy()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(resolve_model(str(d)), "float32")
    ids = [2, *range(120, 140)]
    assert np.abs(jax_logits(model, ids) - hf_logits(d, ids)).max() < 1e-4
    other = emb.copy()
    other[7, 3] += 0.01
    save_file({**tensors, "lm_head.weight": other}, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert np.abs(jax_logits(model, ids) - hf_logits(d, ids)).max() > 1e-3  # transformers did not tie them
    with pytest.raises(UserError, match="weight 'lm_head.weight' differs from 'model.embed_tokens.weight' although "
                                        "config.json ties them"):
        load_model(resolve_model(str(d)), "float32")

def test_sharded_checkpoint_loads(tiny_dir, tmp_path):
    """A checkpoint split across files with model.safetensors.index.json loads the same."""
    import torch
    from transformers import AutoModelForCausalLM

    d = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    hf.save_pretrained(str(d), max_shard_size="100KB")
    shutil.copy(tiny_dir / "tokenizer.json", d)
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("*.safetensors"))) > 1
    m1, _ = load_model(resolve_model(str(tiny_dir)))
    m2, _ = load_model(resolve_model(str(d)))
    ids = [2, 120, 130, 140, 150]
    np.testing.assert_array_equal(jax_logits(m1, ids), jax_logits(m2, ids))
    # an index that omits a tensor one of its shards holds: transformers loads it from that shard (every
    # tensor of the listed shards); it was refused here as "missing from the checkpoint"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    m3, _ = load_model(resolve_model(str(d)))
    np.testing.assert_array_equal(jax_logits(m1, ids), jax_logits(m3, ids))
    np.testing.assert_allclose(hf_logits(d, ids), jax_logits(m3, ids), atol=1e-4)



def test_model_safetensors_beside_an_index_of_other_shards_is_refused(tiny_dir, tmp_path):
    """A directory holding model.safetensors and an index naming other shards (a re-sharded copy, a stale
    file): transformers loads model.safetensors, vLLM and this loader the shards. Such a base trained
    silently on weights other than transformers runs; it is refused now, by the loader and the merge's
    reader alike, while a sharded directory alone still loads."""
    import torch
    from transformers import AutoModelForCausalLM

    from gemma_tpu.hf import safetensors_io as sio

    d = shutil.copytree(tiny_dir, tmp_path / "both")
    other = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight.mul_(-1.0)
    other.save_pretrained(str(tmp_path / "other"), max_shard_size="100KB")
    for f in (tmp_path / "other").glob("model*.safetensors*"):
        shutil.copy(f, d)
    ids = [2, *range(120, 140)]
    assert np.abs(hf_logits(d, ids) - hf_logits(tmp_path / "other", ids)).max() > 1e-3  # transformers: the file
    needle = "holds both model.safetensors and model.safetensors.index.json naming other files"
    with pytest.raises(UserError, match=needle):
        load_model(resolve_model(str(d)), "float32")
    with pytest.raises(UserError, match=needle):
        sio.WeightsDir(d)
    (d / "model.safetensors").unlink()
    model, _ = load_model(resolve_model(str(d)), "float32")
    assert np.abs(jax_logits(model, ids) - hf_logits(d, ids)).max() < 1e-4


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"google/gemma-3-does-not-exist: not a local directory"):
        resolve_model("google/gemma-3-does-not-exist")


def test_a_base_cached_in_part_offline_is_named_so(tiny_dir, tmp_path, monkeypatch):
    """A hub base whose cache holds config.json alone (what `hf download ID config.json` leaves, as the plan
    suggests), merged offline: the snapshot was taken for the base, and the merge said 'not the base this checkpoint
    was trained on (.../model.safetensors is missing); pass --allow-base-mismatch', a dead end ('no *.safetensors
    weights' with it). It says the cache holds part of it and how to get the rest; a shard the index names missing
    alike. The whole snapshot is used; a tokenizer is read from a part as before."""
    import huggingface_hub.constants

    from gemma_tpu.checkpoint.restore import base_dir
    from gemma_tpu.hf.directory import resolve_path

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    for name, files in (("part", ["config.json", "tokenizer.json"]), ("whole", None), ("shards", None)):
        snap = cache / f"models--org--{name}" / "snapshots" / commit
        shutil.copytree(tiny_dir, snap) if files is None else snap.mkdir(parents=True)
        for f in files or []:
            shutil.copyfile(tiny_dir / f, snap / f)
        (snap.parent.parent / "refs").mkdir()
        (snap.parent.parent / "refs" / "main").write_text(commit)
    shards = cache / "models--org--shards" / "snapshots" / commit
    (shards / "model.safetensors").rename(shards / "model-00001-of-00002.safetensors")
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    part = cache / "models--org--part" / "snapshots" / commit
    with pytest.raises(UserError, match=rf"^--base org/part: its copy in the Hugging Face cache, {part}, has no "
                                        r"\*\.safetensors weights: a partial download .*\(`hf download org/part`\)"):
        base_dir(tmp_path, {}, "org/part")
    with pytest.raises(UserError, match=r"^model\.path org/part: its copy .* has no \*\.safetensors weights"):
        base_dir(tmp_path, {"base_model": {"path": "org/part"}})
    with pytest.raises(UserError, match=r"has no model-00002-of-00002\.safetensors \(a shard its model\.safetensors"):
        base_dir(tmp_path, {}, "org/shards")
    assert base_dir(tmp_path, {}, "org/whole") == cache / "models--org--whole" / "snapshots" / commit
    # the hub's own layout: the snapshot's files are links into blobs/, one of them to a blob that is not there
    whole = cache / "models--org--whole" / "snapshots" / commit
    (whole / "model.safetensors").rename(whole.parent.parent / "blob")
    (whole / "model.safetensors").symlink_to("../../blobs/0a1b")
    with pytest.raises(UserError, match=r"has no model\.safetensors \(a link to nothing: \.\./\.\./blobs/0a1b\)"):
        base_dir(tmp_path, {}, "org/whole")
    assert base_dir(tmp_path, {}, "org/part", weights=False) == part
    assert resolve_path("org/part", what="--tokenizer") == part


def test_missing_model_path_cli(tmp_path):
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tmp_path}/nope",
                   f"checkpoint.dir={tmp_path}/ck")
    assert_one_line_error(proc, f"{tmp_path}/nope")
    assert not (tmp_path / "ck").exists()


def test_non_gemma_config_cli(tiny_dir, tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (d / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={d}",
                   f"checkpoint.dir={tmp_path}/ck")
    assert_one_line_error(proc, "unsupported architecture LlamaForCausalLM", "Gemma3ForCausalLM")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_hidden_act_is_not_read_as_transformers_does_not_read_it(family):
    """transformers' Gemma 3 / 4 text models apply `hidden_activation` (default gelu_pytorch_tanh) and never read
    `hidden_act` (Gemma 1's key; Gemma 4's audio tower's): a config.json carrying only `"hidden_act": "gelu"` was
    refused as 'hidden_activation='gelu' is not supported', a model transformers and vLLM run."""
    import transformers

    from gemma_tpu.models import get_family

    cls, arch = {"gemma3": (transformers.Gemma3TextConfig, "Gemma3ForCausalLM"),
                 "gemma4": (transformers.Gemma4TextConfig, "Gemma4ForCausalLM")}[family]
    cfg = {"architectures": [arch], "hidden_act": "gelu", "num_hidden_layers": 6}
    assert cls(**{k: v for k, v in cfg.items() if k != "architectures"}).hidden_activation == "gelu_pytorch_tanh"
    get_family(family).tunix_config(cfg)  # taken, as transformers takes it
    with pytest.raises(UserError, match="hidden_activation='gelu'"):
        get_family(family).tunix_config({**cfg, "hidden_activation": "gelu"})


def test_a_family_config_json_contradicts_is_refused_naming_both(tiny_dir, tmp_path):
    """model.family=gemma4 on a Gemma 3 checkpoint was read as a Gemma 4 config: refused for
    'vocab_size_per_layer_input=262144', a key the file lacks (a Gemma 4 read as Gemma 3: its softcap). A config
    whose architecture no family claims still takes the family named."""
    from gemma_tpu.core.config import load_config
    from gemma_tpu.train.plan import make_plan

    with pytest.raises(UserError, match=r"^model.family=gemma4 contradicts .*config.json \(architectures "
                                        r"Gemma3ForCausalLM: a gemma3 model\)"):
        resolve_model(str(tiny_dir), family="gemma4")
    cfg = load_config(REPO / "configs/tiny.yaml", [f"model.path={tiny_dir}", "model.family=gemma4"])
    with pytest.raises(UserError, match="model.family=gemma4 contradicts"):
        make_plan(cfg)
    d = tmp_path / "renamed"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["MyGemmaForCausalLM"], model_type="my_gemma")
    (d / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(d), family="gemma3").family.name == "gemma3"


def test_tokenizer_is_built_once_per_content_and_named_after_its_directory(tiny_dir, tmp_path):
    """load_tokenizer builds a tokenizer once per process for the same files (transformers takes seconds): a
    second directory holding the same files gets it named after itself, a changed file is read again, and a
    damaged one is a one-line error naming the directory."""
    from gemma_tpu.hf.tokenizer import load_tokenizer

    # an earlier test in this process may have loaded these files from another directory first (CI's stop 37
    # failed on that order): a directory loaded first elsewhere must still get the same object each time
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tiny_dir, elsewhere, ignore=shutil.ignore_patterns("*.safetensors"))
    from gemma_tpu.hf import tokenizer as tokenizer_module

    for loaded_first in (False, True):
        tokenizer_module._LOADED.clear()
        tokenizer_module._NAMED.clear()
        if loaded_first:
            load_tokenizer(elsewhere)
        first = load_tokenizer(tiny_dir)
        copy_dir = tmp_path / "copy"
        shutil.rmtree(copy_dir, ignore_errors=True)
        shutil.copytree(tiny_dir, copy_dir, ignore=shutil.ignore_patterns("*.safetensors"))
        again = load_tokenizer(copy_dir)
        assert again.name_or_path == str(copy_dir) and first.name_or_path == str(tiny_dir)
        assert again._tokenizer is first._tokenizer  # the same backend, not rebuilt
        assert again("Hello there")["input_ids"] == first("Hello there")["input_ids"]
        assert load_tokenizer(tiny_dir) is first and load_tokenizer(copy_dir) is again

    cfg = json.loads((copy_dir / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = not cfg.get("add_bos_token", True)
    (copy_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    changed = load_tokenizer(copy_dir)
    assert changed._tokenizer is not first._tokenizer

    (copy_dir / "tokenizer.json").write_text("{ damaged")
    with pytest.raises(UserError, match=rf"^{re.escape(str(copy_dir))}: cannot load the tokenizer"):
        load_tokenizer(copy_dir)


@pytest.mark.parametrize("tokenizer_class,model_type,named", [
    (None, "gemma3_text", True),  # as written by the tiny-model helper
    ("GemmaTokenizerFast", "gemma3_text", True),  # a transformers 4 name
    ("PreTrainedTokenizerFast", "gemma3_text", True),
    ("GemmaTokenizer", "gemma3_text", True),
    ("GemmaTokenizer", "llama", False),  # a model type AutoTokenizer may know better: left to it
])
def test_named_tokenizer_class_is_what_auto_tokenizer_picks(tiny_dir, tmp_path, tokenizer_class, model_type, named):
    """load_tokenizer takes the class tokenizer_config.json names without AutoTokenizer (whose import costs
    seconds: it pulls torch._dynamo) only where AutoTokenizer would pick that same class."""
    from transformers import AutoTokenizer

    from gemma_tpu.hf.tokenizer import _named_class, load_tokenizer

    d = tmp_path / "tok"
    shutil.copytree(tiny_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    for name, key, value in (("tokenizer_config.json", "tokenizer_class", tokenizer_class),
                             ("config.json", "model_type", model_type)):
        cfg = json.loads((d / name).read_text())
        if value is not None:
            cfg[key] = value
        (d / name).write_text(json.dumps(cfg))
    assert (_named_class(d) is not None) == named
    ours, auto = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert type(ours) is type(auto)
    text = "Hello, wörld!\n\t<start_of_turn>user 12 34<end_of_turn>"
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.decode(auto(text).input_ids) == auto.decode(auto(text).input_ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                         auto.pad_token_id)


def test_named_tokenizer_class_defers_to_auto_tokenizer_for_remote_code(tiny_dir, tmp_path):
    from gemma_tpu.hf.tokenizer import _named_class

    d = tmp_path / "tok"
    shutil.copytree(tiny_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert _named_class(d) is not None
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_mine.MyTokenizer"]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert _named_class(d) is None


def test_loading_a_tokenizer_leaves_out_torch_dynamo(tiny_dir):
    """What the named class saves: a command that loads a Gemma tokenizer does not import transformers'
    auto-model machinery and torch._dynamo with it (~2.5 s of start-up on the AVX2 EPYC)."""
    import subprocess
    import sys

    code = ("import sys; from gemma_tpu.hf.tokenizer import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
            "print(type(t).__name__, 'torch._dynamo' in sys.modules, 'transformers.models.auto' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_dir)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[1:] == ["False", "False"], proc.stdout


def test_a_command_that_loads_a_tokenizer_and_the_trainer_leaves_out_torch_and_pandas(tiny_dir):
    """`cli_main` runs every entry point within `lean_imports.deferred_imports`: loading a tokenizer
    (transformers' GGUF reader) and importing the trainer (tunix -> tensorboardX, pandas) imported torch and
    pandas (1.4 s + 0.2 s of each start) for nothing. The tokenizer's output stays the same."""
    import subprocess
    import sys

    code = ("import sys; from gemma_tpu.core.cli import cli_main; from gemma_tpu.hf.tokenizer import load_tokenizer\n"
            "def main(argv):\n"
            "    import gemma_tpu.train.trainer\n"
            "    print(load_tokenizer(argv[0])('hi there').input_ids)\n"
            "cli_main(main, sys.argv[1:])\n"
            "print(*(m in sys.modules for m in ('torch', 'pandas', 'tunix')))")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_dir)], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    ids, present = proc.stdout.splitlines()
    assert present.split() == ["False", "False", "True"], proc.stdout
    from gemma_tpu.hf.tokenizer import load_tokenizer
    assert ids == str(load_tokenizer(tiny_dir)("hi there").input_ids)


def test_deferred_imports_hand_a_stand_in_that_imports_at_first_use(tmp_path, monkeypatch):
    """The mechanism on stand-in modules: a LAZY import binds a stand-in, never left in sys.modules, that
    imports the real module at its first attribute read and rebinds the importer's global; an ABSENT one
    fails as if the module were not installed; the importers' later function-level imports and every other
    module's import of the same name are untouched."""
    import sys

    from gemma_tpu.core import lean_imports

    (tmp_path / "heavy_x.py").write_text("LOADS = 1\ndef f():\n    return 42\n")
    (tmp_path / "lazy_user.py").write_text("import heavy_x as hx\ndef g():\n    return hx.f()\n"
                                           "def later():\n    import heavy_x\n    return heavy_x\n")
    (tmp_path / "absent_user.py").write_text("try:\n    import heavy_x\n    HAS = True\nexcept ImportError:\n"
                                             "    HAS = False\ndef later():\n    import heavy_x\n    return heavy_x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lean_imports, "DEFERRED", {"lazy_user": ("heavy_x", lean_imports.LAZY),
                                                   "absent_user": ("heavy_x", lean_imports.ABSENT)})
    for name in ("heavy_x", "lazy_user", "absent_user"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with lean_imports.deferred_imports():
        import absent_user
        import lazy_user
        assert "heavy_x" not in sys.modules and not absent_user.HAS
        assert isinstance(lazy_user.hx, lean_imports._Deferred)
    assert lean_imports._Gate not in {type(f) for f in sys.meta_path}
    assert lazy_user.g() == 42  # first use: the real module, imported once
    real = sys.modules["heavy_x"]
    assert lazy_user.hx is real and real.LOADS == 1 and not isinstance(real, lean_imports._Deferred)
    assert absent_user.later() is real and lazy_user.later() is real

    monkeypatch.delitem(sys.modules, "heavy_x")
    monkeypatch.delitem(sys.modules, "absent_user")
    with lean_imports.deferred_imports():
        import heavy_x  # imported by someone else first: the importers get the real module
        import absent_user
    assert absent_user.HAS and absent_user.later() is heavy_x


def test_a_revision_for_a_local_model_is_refused_unless_it_is_that_snapshot(tiny_dir, tmp_path):
    """`model.revision` only chooses what to download: with a local `model.path` it was ignored without a word and
    recorded in the run's metadata as the base's revision. A hub snapshot directory with its own commit passes."""
    with pytest.raises(UserError, match=rf"^model.revision=v2 chooses what to download from the hub, but model.path "
                                        rf"{re.escape(str(tiny_dir))} is a local directory, used as it is"):
        resolve_model(str(tiny_dir), revision="v2")
    snap = tmp_path / "models--org--tiny" / "snapshots" / "0a1b2c3d4e"
    shutil.copytree(tiny_dir, snap)
    assert resolve_model(str(snap), revision="0a1b2c3").revision == "0a1b2c3"
    with pytest.raises(UserError, match=r"\(a hub snapshot at commit 0a1b2c3d4e\)"):
        resolve_model(str(snap), revision="main")
    assert resolve_model(str(tiny_dir)).revision is None


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_zero_kv_heads_is_refused_as_zero_not_as_a_divisor(family):
    """`num_key_value_heads: 0` was refused as '0 must divide num_attention_heads=4' (a riddle: nothing is wrong with
    the division a user reads there); it is a count that must be at least 1."""
    from gemma_tpu.models import get_family

    arch = {"gemma3": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM"}[family]
    with pytest.raises(UserError, match=r"num_key_value_heads=0 must be at least 1"):
        get_family(family).tunix_config({"architectures": [arch], "num_hidden_layers": 6, "num_key_value_heads": 0})


_SWA, _FULL = "sliding_attention", "full_attention"


# The keys transformers 4.x (sliding_window_pattern), 5.x (layer_types, and `_sliding_window_pattern`, which its
# reader ignores) write for the attention pattern, alone and together, in a text and a multimodal config.json.
@pytest.mark.parametrize("keys", [
    {},
    {"sliding_window_pattern": 2},
    {"_sliding_window_pattern": 2},
    {"layer_types": [_FULL, _SWA, _SWA, _FULL]},
    {"sliding_window_pattern": 2, "_sliding_window_pattern": 2},
    {"layer_types": [_SWA] * 4, "sliding_window_pattern": 2, "_sliding_window_pattern": 2},
    {"layer_types": None, "sliding_window_pattern": 3},
    {"sliding_window_pattern": 3.0},  # a float a script wrote: transformers takes it (it was refused here)
], ids=["none", "pattern", "private-pattern", "layer-types", "both-patterns", "all-three", "null-layer-types",
        "float-pattern"])
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@pytest.mark.parametrize("nested", [False, True], ids=["text", "multimodal"])
def test_attention_pattern_keys_give_transformers_layer_types(keys, family, nested):
    """Whichever of the pattern keys a config.json has (as transformers 4.x or 5.x writes it), the layer types
    read here are the ones transformers builds the model with (Gemma 4 ignores sliding_window_pattern)."""
    import transformers

    text = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, **keys}
    if family == "gemma3":
        text_cls, arch, model_type = transformers.Gemma3TextConfig, "Gemma3ForCausalLM", "gemma3_text"
        top_cls, top_arch, top_type = transformers.Gemma3Config, "Gemma3ForConditionalGeneration", "gemma3"
    else:
        text_cls, arch, model_type = transformers.Gemma4TextConfig, "Gemma4ForCausalLM", "gemma4_text"
        top_cls, top_arch, top_type = transformers.Gemma4Config, "Gemma4ForConditionalGeneration", "gemma4"
    if nested:
        cfg = {"architectures": [top_arch], "model_type": top_type, "text_config": {"model_type": model_type, **text}}
        want = top_cls.from_dict(json.loads(json.dumps(cfg))).text_config.layer_types
    else:
        cfg = {"architectures": [arch], "model_type": model_type, **text}
        want = text_cls.from_dict(json.loads(json.dumps(cfg))).layer_types
    t = detect_family(cfg).read_text_config(cfg)
    if family == "gemma3":
        got = t["layer_types"]
    else:  # Gemma 4 derives them where read (Tunix's names; the last layer global, as transformers forces)
        from gemma_tpu.models.gemma4 import _HF_TYPES, _layer_types
        got, want = _layer_types(t), [_HF_TYPES[x] for x in want]
    assert list(got) == list(want)
