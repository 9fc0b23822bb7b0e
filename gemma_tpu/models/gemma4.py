"""Gemma 4 text as registry data: dense (31B), per-layer embeddings with shared KV (E2B, E4B) and
mixture-of-experts (26B-A4B), text-only (`Gemma4ForCausalLM`, keys `model.`) or the text tower of
the multimodal checkpoints (`Gemma4ForConditionalGeneration`, keys `model.language_model.`).

The Tunix config is built from the checkpoint's own `config.json` (its `text_config` when nested).
Layers differ in Gemma 4, so the registry data is per layer (`layer_features`):

* sliding layers have K and V (Tunix fuses them into `kv_einsum`), global layers of the K=V
  checkpoints (31B, 26B) have K only (`k_einsum`, its output doubles as V), and the last
  `num_kv_shared_layers` layers (E2B, E4B) have neither: they reuse the keys and values of the
  last earlier layer of the same attention type;
* global layers have their own head size (`global_head_dim`) and KV head count
  (`num_global_key_value_heads`, K=V checkpoints only) - shapes the Projection algebra reads off
  the LoRA factors, so no table of sizes is needed.

Where Tunix 0.1.7's Gemma 4 differs from transformers, our subclass (`model_class`) follows
transformers, with the reason at each place:

* KV sharing: Tunix takes a shared layer's keys and values from fixed layers (the last and
  second-to-last non-shared ones), transformers from the last earlier layer of the same type;
  they agree for E2B/E4B but not for every `layer_types`. We set transformers' map.
* Shared layers: Tunix builds K/V weights for them that no checkpoint holds (the loader would fail
  on the missing tensors) and no forward uses; we drop them.
* MoE routing: Tunix routes on the MoE branch's normalised input, transformers (and Google's
  reference implementation, which passes `unnormalized_x`) on the raw residual stream.

Anything else Tunix cannot express is refused by config key, in one line.
"""

from __future__ import annotations

import re
from typing import Any

from gemma_tpu.core.errors import UserError
from gemma_tpu.formats.function_calling import END_CALL, END_RESPONSE, ESCAPE, START_CALL, START_RESPONSE
from gemma_tpu.models.gemma3 import (
    ATTENTION_MLP_PARTITION_DIMS,
    ATTENTION_MLP_PARTITION_RULES,
    NORMS,
    ROPE_TYPES,
    attention_mlp_shapes,
)
from gemma_tpu.models.registry import (
    Family,
    Projection,
    Tensor,
    check_types,
    positive_sizes,
    register,
    require_positive,
    require_tied_embeddings,
    text_config_with_defaults,
    top_level_rotary_share,
    tunix_remat,
    tower_tensor_shapes,
    tunix_safetensors_loader,
)
from gemma_tpu.models.sharded_weights import load_sharded
from gemma_tpu.models.sliding_window import configured_size, masks_by_position

# HF key prefixes of the decoder: text-only, multimodal as transformers >= 5 saves it (the
# released layout), and the older multimodal layout, accepted for symmetry with Gemma 3.
TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")

GLOBAL, LOCAL = "GLOBAL", "LOCAL_SLIDING"  # Tunix's AttentionType names
_HF_TYPES = {"full_attention": GLOBAL, "sliding_attention": LOCAL}


# transformers' Gemma4TextConfig defaults of keys that change the weights' shapes or the numbers: a
# config.json that omits one (hand-written, or trimmed) means these values to transformers, so it must mean
# them here too (an omitted hidden_size_per_layer_input read as 0 dropped the per-layer embeddings).
HF_DEFAULTS = {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
               "global_head_dim": 512, "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
               "sliding_window": 512, "hidden_activation": "gelu_pytorch_tanh"}

# The types transformers' Gemma4TextConfig declares for the keys read here (`check_types`; a test holds
# this table to transformers' own field annotations).
HF_TYPES = {"vocab_size": "int", "hidden_size": "int", "intermediate_size": "int", "num_hidden_layers": "int",
            "num_attention_heads": "int", "num_key_value_heads": "int", "head_dim": "int",
            "max_position_embeddings": "int", "sliding_window": "int", "rms_norm_eps": "float",
            "hidden_activation": "str", "attention_bias": "bool", "layer_types": "list[str]|None",
            "final_logit_softcapping": "float|None", "vocab_size_per_layer_input": "int",
            "hidden_size_per_layer_input": "int", "num_global_key_value_heads": "int|None", "global_head_dim": "int",
            "attention_k_eq_v": "bool", "num_kv_shared_layers": "int", "enable_moe_block": "bool",
            "use_double_wide_mlp": "bool", "num_experts": "int|None", "top_k_experts": "int|None",
            "moe_intermediate_size": "int|None"}


def hf_text_config(hf_config: dict) -> dict:
    """The text config as transformers reads it: omitted keys at transformers' defaults (`HF_DEFAULTS`),
    `tie_word_embeddings` from the top level of a multimodal config, where transformers reads it."""
    return text_config_with_defaults(hf_config, HF_DEFAULTS, HF_TYPES)


def _cfg_error(key: str, value: Any, why: str) -> UserError:
    return UserError(f"config.json: {key}={value!r} is not supported by Tunix's Gemma 4 ({why})")


def _layer_types(t: dict) -> list[str]:
    """Tunix attention type per layer, from `layer_types` (transformers' default when absent:
    five sliding layers then one global; the last layer is always global, as transformers forces)."""
    n = int(t["num_hidden_layers"])
    types = t.get("layer_types")
    if types is None:  # null or absent only: [] is a list of 0 entries to transformers, refused below
        types = GEMMA4.layer_types(n)
    types = list(types)
    if len(types) != n:
        raise UserError(f"config.json: layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = [x for x in types if x not in _HF_TYPES]
    if unknown:
        raise _cfg_error("layer_types", unknown[0], "sliding_attention or full_attention")
    types[-1] = "full_attention"  # transformers overrides the last layer the same way
    return [_HF_TYPES[x] for x in types]


def _num_unshared(num_layers: int, frac: float) -> int:
    """Tunix's own formula for the first KV-sharing layer (`create_kv_cache_sharing_patterns`)."""
    return int(num_layers - frac * num_layers)


def _frac_shared(num_layers: int, num_shared: int) -> float:
    """A `frac_shared_layers` that Tunix's float formula turns back into exactly `num_shared`
    (num_shared/num_layers itself can round to one layer off)."""
    if num_shared == 0:
        return 0.0
    frac = (num_shared - 0.5) / num_layers
    assert _num_unshared(num_layers, frac) == num_layers - num_shared
    return frac


def layout_fields(hf_config: dict) -> dict:
    """What `projections` and `layer_features` read, under Tunix's attribute names, in plain
    Python (the converters use it without importing Tunix)."""
    t = hf_text_config(hf_config)
    n = int(t["num_hidden_layers"])
    types = _layer_types(t)
    shared = int(t.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise _cfg_error("num_kv_shared_layers", shared, f"must be in [0, {n})")
    if not t.get("enable_moe_block"):
        # transformers builds a dense model from such a config and drops the checkpoint's experts and router:
        # an MoE config.json that lost its flag trained and merged a different (dense) model without a word
        given = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if t.get(k) is not None]
        if given:
            flag = "false" if "enable_moe_block" in t else "unset"
            raise UserError(f"config.json: {given[0]}={t[given[0]]!r} with enable_moe_block={flag}: transformers "
                            f"builds a dense model and ignores the experts; set enable_moe_block to true for a "
                            f"mixture-of-experts model, or remove {', '.join(given)}")
    first = n - shared
    for i in range(first, n):
        if types[i] not in types[:first]:
            raise _cfg_error("num_kv_shared_layers", shared,
                             f"shared layer {i} has no earlier {types[i].lower()} layer to share with")
    return dict(
        attention_pattern=tuple(types),
        frac_shared_layers=_frac_shared(n, shared),
        k_eq_v_global=bool(t.get("attention_k_eq_v")),
        per_layer_input_dim=int(t.get("hidden_size_per_layer_input") or 0),
        enable_moe=bool(t.get("enable_moe_block")),
    )


def _type_name(x: Any) -> str:
    return getattr(x, "name", x)


def kv_source(cfg: Any) -> list[int]:
    """Per layer, the layer whose keys and values it attends over (itself unless shared):
    transformers' rule, the last non-shared layer of the same attention type."""
    n = cfg.num_layers
    types = [_type_name(cfg.attention_pattern[i % len(cfg.attention_pattern)]) for i in range(n)]
    first = _num_unshared(n, cfg.frac_shared_layers)
    return [i if i < first else max(j for j in range(first) if types[j] == types[i]) for i in range(n)]


def layer_features(cfg: Any, layer: int | None) -> frozenset[str]:
    """Features of decoder layer `layer` (or of the model, for None) that weights require:
    ple / moe (model-wide), own_kv (not a KV-sharing layer), kv (fused K and V) or k_eq_v
    (K only, a global layer of a K=V checkpoint)."""
    feats = set()
    if getattr(cfg, "per_layer_input_dim", 0):
        feats.add("ple")
    if getattr(cfg, "enable_moe", False):
        feats.add("moe")
    if layer is None:
        return frozenset(feats)
    if kv_source(cfg)[layer] == layer:
        feats.add("own_kv")
        is_global = _type_name(cfg.attention_pattern[layer % len(cfg.attention_pattern)]) == GLOBAL
        feats.add("k_eq_v" if is_global and cfg.k_eq_v_global else "kv")
    return frozenset(feats)


# transformers' Gemma4TextConfig's rotary parameters when config.json has none
ROPE_DEFAULTS = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}


def _top_level_share(t: dict) -> bool:
    """`top_level_rotary_share` for Gemma 4: transformers' two default entries when config.json has none (the last
    layer is global always)."""
    params = t.get("rope_parameters")
    keys = set(ROPE_DEFAULTS) if params is None else set(params) if isinstance(params, dict) else set()
    return top_level_rotary_share(t, keys, {hf for hf, tunix in _HF_TYPES.items() if tunix in _layer_types(t)})


def vllm_rope_problem(t: dict, jax_model: bool) -> str | None:
    """RoPE parameters the servers apply otherwise than transformers' Gemma 4 and training (`t`: the text config as
    transformers reads it; `jax_model`: served by tpu-inference's JAX Gemma 4, else by vLLM's own model):

    * a partial_rotary_factor other than 1 for default RoPE (an entry's, or one at the top of config.json where vLLM
      lays it over the entries, `_top_level_share`): transformers rotates whole heads, vLLM's get_rope
      int(head_size * factor) dimensions of each, tpu-inference that share of each head's angles;
    * proportional RoPE's `factor`, which transformers divides the frequencies by and both servers ignore
      (vLLM's Gemma4RotaryEmbedding, tpu-inference's apply_rope);
    * linear RoPE's `factor` on tpu-inference, which scales it as llama3 RoPE (high frequencies unscaled), and a
      default RoPE entry's, which transformers ignores and tpu-inference applies so;
    * a proportional share of 0 on vLLM's own model, whose get_rope refuses it when the engine starts."""
    params = t.get("rope_parameters")
    params = ROPE_DEFAULTS if params is None else params
    check_types(t, {"partial_rotary_factor": "int|float|None"})  # a number, as vLLM compares it with 0 and 1
    top = t.get("partial_rotary_factor") if _top_level_share(t) else None
    kinds = sorted({hf for hf, tunix in _HF_TYPES.items() if tunix in _layer_types(t)})
    for kind in kinds:
        p = params.get(kind) if isinstance(params, dict) else None
        if not isinstance(p, dict):  # refused where a model is built from it (tunix_config)
            continue
        check_types(p, {**ROPE_TYPES, "partial_rotary_factor": "int|float"}, f"rope_parameters.{kind}.")
        rtype, factor = p.get("rope_type", "default"), p.get("factor", 1)
        share, key = ((top, "partial_rotary_factor") if top is not None
                      else (p.get("partial_rotary_factor"), f"rope_parameters.{kind}.partial_rotary_factor"))
        if rtype == "default" and share is not None and share != 1:
            # at the top it is also the share transformers' proportional RoPE rotates: moved, not dropped
            read = key == "partial_rotary_factor" and any(
                isinstance(params.get(k), dict) and params[k].get("rope_type") == "proportional" for k in kinds)
            return (f"{key}={share!r}, by which vLLM and tpu-inference rotate part of each head of the {kind} layers "
                    f"(default RoPE), where transformers and training rotate the whole head; "
                    + ("set it in the entries of rope_parameters with proportional RoPE instead" if read
                       else "remove it"))
        if rtype == "proportional" and factor != 1:
            return (f"rope_parameters.{kind}.factor={factor!r}, which transformers and training divide the {kind} "
                    f"layers' proportional RoPE frequencies by and vLLM and tpu-inference ignore")
        if rtype in ("linear", "default") and factor != 1 and jax_model:
            done = "as linear scaling of every frequency" if rtype == "linear" else "not at all (default RoPE)"
            return (f"rope_parameters.{kind}.factor={factor!r}, which tpu-inference's JAX Gemma 4 applies to the "
                    f"{kind} layers as llama3 RoPE scaling (high frequencies unscaled), transformers and training "
                    f"{done}; " + ("serve vLLM's own model (container.env.MODEL_IMPL_TYPE=vllm)" if rtype == "linear"
                                   else "remove it"))
        if rtype == "proportional" and share is not None and share <= 0 and not jax_model:
            return (f"{key}={share!r}, which vLLM's get_rope refuses when the engine starts (it takes a share of each "
                    f"head above 0); serve tpu-inference's JAX Gemma 4 (container.env.MODEL_IMPL_TYPE=auto), which "
                    f"rotates nothing there as transformers does")
    return None


def vllm_lora_problem(t: dict, modules) -> str | None:
    """An adapter changing k_proj of a Gemma 4 with attention_k_eq_v: its global layers take their keys as values,
    k_proj's output with the LoRA update in transformers (PEFT) and training; vLLM's own Gemma 4 loads the base
    k_proj weight into its packed qkv_proj's value slot as well and applies the adapter's k_proj update to the key
    slot alone (the adapter has no v_proj there), so those values lack the update. `modules`: the adapter's module
    paths (`...layers.5.self_attn.k_proj`, what its tensors change, as vLLM loads them), or bare names where the
    layers cannot be told (each then taken as on every layer): an update of k_proj on the sliding layers alone, or
    on a KV-sharing layer (which attends over another layer's keys and values), is served as trained."""
    if not t.get("attention_k_eq_v"):
        return None
    types = _layer_types(t)
    own = len(types) - int(t.get("num_kv_shared_layers") or 0)
    k_eq_v = {i for i, kind in enumerate(types[:own]) if kind == GLOBAL}
    for module in modules:
        if module.rsplit(".", 1)[-1] != "k_proj":
            continue
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", module)
        if layer is None or int(layer[1]) in k_eq_v:
            return (f"changes {module if layer else 'k_proj'}, whose output the global layers of this "
                    "attention_k_eq_v model also take as their values in transformers and training, while vLLM "
                    "applies the update to their keys alone (it copies the base k_proj into their value slot): it "
                    "would serve another model than the one trained; serve the merged model (convert.merge_orbax) "
                    "instead")
    return None


def _rope(t: dict, kind: str, head_dim: int, global_head_dim: int, used: bool = True) -> tuple[float, float, float]:
    """(base frequency, scale factor, rotated proportion) for 'sliding_attention' / 'full_attention'.

    Without `rope_parameters` transformers uses its defaults; with it, transformers' Gemma 4 reads
    `rope_parameters[kind]["rope_theta"]` for every attention type the layers use and fills in nothing
    else, so a missing entry or rope_theta is refused (transformers cannot build the model; read here as
    the defaults, the run trained a model no merge of it could be loaded as). `used`: a layer has `kind`."""
    params = t.get("rope_parameters")
    if params is None or not used:
        params = ROPE_DEFAULTS
    p = params.get(kind) if isinstance(params, dict) else None
    if not isinstance(p, dict) or p.get("rope_theta") is None:
        what = f"has no {kind!r} entry" if not isinstance(p, dict) else f"{kind} has no rope_theta"
        raise UserError(f"config.json: rope_parameters {what}, which the model's {kind} layers read "
                        f"(transformers cannot build a model from it)")
    # numbers, not strings: float("1e6") here, a TypeError in transformers' rotary embedding
    check_types(p, {**ROPE_TYPES, "partial_rotary_factor": "int|float"}, f"rope_parameters.{kind}.")
    rtype = p.get("rope_type", "default")
    share_key = f"rope_parameters.{kind}.partial_rotary_factor"
    check_types(t, {"partial_rotary_factor": "int|float|None"})
    if rtype in ("proportional", "linear") and _top_level_share(t):
        # a top-level partial_rotary_factor (as other models write it) is laid over the entries when transformers
        # builds proportional or linear RoPE, whatever they say
        p, share_key = {**p, "partial_rotary_factor": t["partial_rotary_factor"]}, "partial_rotary_factor"
    theta = float(p["rope_theta"])
    key = f"rope_parameters.{kind}.rope_type"
    if rtype == "default":
        # transformers' default RoPE spans `head_dim` whatever the layer's head size; Tunix spans
        # the layer's own head size. They agree unless a global layer has another head size.
        if kind == "full_attention" and global_head_dim != head_dim:
            raise _cfg_error(key, rtype, f"default RoPE with global_head_dim={global_head_dim} != "
                                         f"head_dim={head_dim}; use proportional")
        return theta, 1.0, 1.0
    if rtype == "proportional":
        factor = float(p.get("factor", 1.0))
        if factor < 1.0:
            raise _cfg_error(f"rope_parameters.{kind}.factor", factor, "must be >= 1")
        prop = float(p.get("partial_rotary_factor", 1.0))
        if not 0.0 <= prop <= 1.0:  # more angles than a head has halves, or fewer than none: both fail in a forward
            raise UserError(f"config.json: {share_key}={p['partial_rotary_factor']!r} must be between 0 and 1 (the "
                            f"share of each head rotated; transformers cannot run a model with it)")
        return theta, factor, prop
    if rtype == "linear":
        # transformers' linear RoPE spans int(head_dim * partial_rotary_factor) of `head_dim` (whatever the
        # layer's head size) and divides the frequencies by `factor`: where that span is the layer's whole head
        # it is proportional RoPE over the whole head with that factor (default RoPE at factor 1); any other span
        # gives cos/sin of another width than the heads, which transformers' first forward fails on
        if "factor" not in p:
            raise UserError(f"config.json: rope_parameters.{kind}.factor is missing for linear RoPE (transformers "
                            f"cannot build a model without it)")
        factor = float(p["factor"])
        if factor < 1.0:
            raise _cfg_error(f"rope_parameters.{kind}.factor", p["factor"], "must be >= 1")
        size = global_head_dim if kind == "full_attention" else head_dim
        span = int(head_dim * float(p.get("partial_rotary_factor", 1.0)))
        if span != size:
            raise _cfg_error(key, rtype, f"linear RoPE spans int(head_dim * {share_key})={span} "
                                         f"dimensions, the {kind} layers' heads have {size}; use proportional")
        return theta, factor, 1.0
    raise _cfg_error(key, rtype, "default, linear or proportional")


def tunix_config(hf_config: dict, param_dtype: Any = None):
    """Translate an HF Gemma 4 config (text or multimodal) into Tunix's Gemma 4 `ModelConfig`."""
    import jax.numpy as jnp  # deferred, like Tunix: registering the families must not import jax
    from tunix.models.gemma4 import model as g4

    param_dtype = jnp.float32 if param_dtype is None else param_dtype

    t = hf_text_config(hf_config)
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size")
    missing = [k for k in need if t.get(k) is None]  # omitted keys have transformers' defaults: null here
    if missing:
        raise UserError(f"config.json: {missing[0]}=null for a Gemma 4 text model")
    # num_key_value_heads: below, with the query heads it must divide
    require_positive(t, (*(k for k in need if k != "num_key_value_heads"), "max_position_embeddings",
                         "global_head_dim", "num_experts", "top_k_experts", "moe_intermediate_size"))
    if (t.get("hidden_size_per_layer_input") or 0) < 0:
        raise UserError(f"config.json: hidden_size_per_layer_input={t['hidden_size_per_layer_input']} must be 0 "
                        f"(no per-layer inputs) or positive")
    if t.get("attention_bias"):
        raise _cfg_error("attention_bias", t["attention_bias"], "Gemma 4 projections have no bias")
    require_tied_embeddings(hf_config, "Tunix's Gemma 4")
    if t.get("use_bidirectional_attention") == "all":
        raise _cfg_error("use_bidirectional_attention", "all", "an encoder, not a causal LM")
    # attn_logit_softcapping (a Gemma 2/3 key a converted config may carry) is not a Gemma4TextConfig field and no
    # Gemma 4 class of transformers reads it: ignored here as transformers ignores it (vLLM's own Gemma 4 applies it:
    # serving.config refuses it there, `Family.vllm_torch_reads_unused_keys`)
    eps = float(t.get("rms_norm_eps", 1e-6))
    if abs(eps - 1e-6) > 1e-12:
        raise _cfg_error("rms_norm_eps", eps, "Tunix uses 1e-6")
    act = t["hidden_activation"]  # `hidden_act` is the audio tower's key: transformers' text model reads no such key
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise _cfg_error("hidden_activation", act, "tanh-approximated GELU only")
    fields = layout_fields(hf_config)
    n = int(t["num_hidden_layers"])
    vocab, hidden = int(t["vocab_size"]), int(t["hidden_size"])
    heads, kv_heads, head_dim = int(t["num_attention_heads"]), int(t["num_key_value_heads"]), int(t["head_dim"])
    global_head_dim = int(t.get("global_head_dim") or head_dim)
    for key, size in (("head_dim", head_dim), ("global_head_dim", global_head_dim)):
        if size % 2:  # Tunix splits every head in halves for its rotary embeddings (a JAX error at load)
            raise _cfg_error(key, size, "must be even: rotary embeddings split each head in halves")
    ple = fields["per_layer_input_dim"]
    if ple and int(t.get("vocab_size_per_layer_input") or vocab) != vocab:
        raise _cfg_error("vocab_size_per_layer_input", t["vocab_size_per_layer_input"],
                         f"Tunix indexes per-layer embeddings with the main vocabulary ({vocab})")
    k_eq_v = fields["k_eq_v_global"]
    global_kv = t.get("num_global_key_value_heads")
    if k_eq_v and global_kv is None:
        raise _cfg_error("num_global_key_value_heads", None, "attention_k_eq_v needs it")
    for key, kv in (("num_key_value_heads", kv_heads),
                    ("num_global_key_value_heads", int(global_kv) if k_eq_v else kv_heads)):
        if kv < 1:  # 0: a ZeroDivisionError traceback here, as in transformers; "must divide" read as a riddle
            raise UserError(f"config.json: {key}={kv} must be at least 1")
        if heads % kv:
            raise _cfg_error(key, kv, f"must divide num_attention_heads={heads}")
    moe = {}
    if fields["enable_moe"]:
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if t.get(key) is None:
                raise UserError(f"config.json: missing key '{key}' for a Gemma 4 mixture-of-experts model")
        if t["top_k_experts"] > t["num_experts"]:  # transformers' router: torch.topk fails in the first forward
            raise UserError(f"config.json: top_k_experts={t['top_k_experts']} must be at most "
                            f"num_experts={t['num_experts']}")
        moe = dict(enable_moe=True, num_experts=int(t["num_experts"]), num_experts_per_tok=int(t["top_k_experts"]),
                   expert_dim=int(t["moe_intermediate_size"]), moe_dense_hidden_dim=int(t["intermediate_size"]))
    shared = int(t.get("num_kv_shared_layers") or 0)
    double_wide = bool(t.get("use_double_wide_mlp")) and shared > 0
    kinds = set(fields["attention_pattern"])
    local_theta, local_scale, local_prop = _rope(t, "sliding_attention", head_dim, global_head_dim, LOCAL in kinds)
    global_theta, global_scale, global_prop = _rope(t, "full_attention", head_dim, global_head_dim, GLOBAL in kinds)
    softcap = t.get("final_logit_softcapping")
    if softcap is not None and not softcap > 0:  # null is "no cap"; transformers divides by any other value
        raise UserError(f"config.json: final_logit_softcapping={softcap!r} must be positive or null: transformers "
                        f"divides the logits by it (0 makes every logit 0 or NaN)")
    dtype = param_dtype if param_dtype is not None else jnp.float32
    return g4.ModelConfig(
        num_layers=n,
        num_embed=vocab,
        embed_dim=hidden,
        hidden_dim=int(t["intermediate_size"]),
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv_heads,
        final_logit_softcap=float(softcap) if softcap is not None else None,
        sliding_window_size=configured_size(t, 512),
        per_layer_input_dim=ple,
        # transformers uses the global KV head count only in K=V layers; Tunix in every global layer
        num_global_kv_heads=int(global_kv) if k_eq_v else None,
        global_key_size=global_head_dim,
        attention_pattern=tuple(getattr(g4.AttentionType, x) for x in fields["attention_pattern"]),
        frac_shared_layers=fields["frac_shared_layers"],
        global_rope_proportion=global_prop,
        local_rope_proportion=local_prop,
        k_eq_v_global=k_eq_v,
        override_kv_shared_ffw_hidden=2 * int(t["intermediate_size"]) if double_wide else None,
        local_base_frequency=local_theta,
        global_base_frequency=global_theta,
        local_scale_factor=local_scale,
        global_scale_factor=global_scale,
        param_dtype=dtype,
        dtype=dtype,
        # a full-length cache for every layer, as the generator lays it out
        use_sliding_window_kv_cache=False,
        **moe,
    )


def projections(cfg) -> tuple[Projection, ...]:
    """Every kind of HF projection in Tunix's Gemma 4; `requires` says in which layers it exists."""
    attn = (
        Projection("q_proj", "self_attn.q_proj", "attn.q_einsum", "w", ("N", "D", "H"), ("D",)),
        Projection("k_proj", "self_attn.k_proj", "attn.kv_einsum", "w", ("C", "K", "D", "H"), ("D",), ("C", 0), "kv"),
        Projection("v_proj", "self_attn.v_proj", "attn.kv_einsum", "w", ("C", "K", "D", "H"), ("D",), ("C", 1), "kv"),
    )
    if cfg.k_eq_v_global:
        attn += (Projection("k_proj", "self_attn.k_proj", "attn.k_einsum", "w", ("K", "D", "H"), ("D",),
                            None, "k_eq_v"),)
    return attn + (
        Projection("o_proj", "self_attn.o_proj", "attn.attn_vec_einsum", "w", ("N", "H", "D"), ("N", "H")),
        Projection("gate_proj", "mlp.gate_proj", "mlp.gate_proj", "kernel", ("D", "F"), ("D",)),
        Projection("up_proj", "mlp.up_proj", "mlp.up_proj", "kernel", ("D", "F"), ("D",)),
        Projection("down_proj", "mlp.down_proj", "mlp.down_proj", "kernel", ("F", "D"), ("F",)),
    )


def projection_shapes(t: dict) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per projection, its shapes in sliding layers (head_dim, num_key_value_heads) and global ones
    (global_head_dim; num_global_key_value_heads and no v_proj in K=V checkpoints), MLPs double wide in
    KV-sharing layers where use_double_wide_mlp says so (see `Family.projection_shapes`)."""
    s = positive_sizes(t, ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                           "num_key_value_heads", "head_dim", "global_head_dim"))
    if s is None:
        return {}
    d, f, heads, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
    layers = []
    if LOCAL in _layer_types(t):
        layers.append(attention_mlp_shapes(d, f, heads, kv, s["head_dim"]))
    if GLOBAL in _layer_types(t):
        k_eq_v = bool(t.get("attention_k_eq_v"))
        global_kv = positive_sizes(t, ("num_global_key_value_heads",)) if k_eq_v else {"": kv}
        if global_kv is None:
            return {}
        shapes = attention_mlp_shapes(d, f, heads, next(iter(global_kv.values())), s["global_head_dim"])
        if k_eq_v:
            del shapes["v_proj"]  # keys double as values
        layers.append(shapes)
    if t.get("use_double_wide_mlp") and (t.get("num_kv_shared_layers") or 0) > 0:
        layers.append({"gate_proj": (2 * f, d), "up_proj": (2 * f, d), "down_proj": (d, 2 * f)})
    names = dict.fromkeys(name for shapes in layers for name in shapes)
    return {name: tuple(dict.fromkeys(shapes[name] for shapes in layers if name in shapes)) for name in names}



def tensor_shapes(t: dict) -> dict[str, tuple[int, ...]]:
    """The embeddings, the norms (q/k norms of a global layer its own head size), the layer scalars, and where the
    model has them the per-layer embeddings' and the experts' weights (see `Family.tensor_shapes`)."""
    s = positive_sizes(t, ("num_hidden_layers", "hidden_size", "head_dim", "global_head_dim", "vocab_size"))
    if s is None:
        return {}
    n, d = s["num_hidden_layers"], s["hidden_size"]
    types = _layer_types(t)
    out = {"embed_tokens.weight": (s["vocab_size"], d), "norm.weight": (d,)}
    ple = positive_sizes(t, ("hidden_size_per_layer_input", "vocab_size_per_layer_input"))
    if ple is not None:
        p = ple["hidden_size_per_layer_input"]
        out.update({"embed_tokens_per_layer.weight": (ple["vocab_size_per_layer_input"], n * p),
                    "per_layer_model_projection.weight": (n * p, d), "per_layer_projection_norm.weight": (p,)})
    moe = positive_sizes(t, ("num_experts", "moe_intermediate_size")) if t.get("enable_moe_block") else None
    for i in range(n):
        layer = f"layers.{i}."
        hd = s["global_head_dim"] if types[i] == GLOBAL else s["head_dim"]
        out.update({f"{layer}{norm}.weight": (d,) for norm in NORMS})
        out.update({f"{layer}self_attn.{norm}.weight": (hd,) for norm in ("q_norm", "k_norm")})
        out[f"{layer}layer_scalar"] = (1,)
        if ple is not None:
            out.update({f"{layer}per_layer_input_gate.weight": (p, d), f"{layer}per_layer_projection.weight": (d, p),
                        f"{layer}post_per_layer_input_norm.weight": (d,)})
        if moe is not None:
            e, f = moe["num_experts"], moe["moe_intermediate_size"]
            out.update({f"{layer}{norm}.weight": (d,) for norm in ("post_feedforward_layernorm_1",
                                                                     "pre_feedforward_layernorm_2",
                                                                     "post_feedforward_layernorm_2")})
            out.update({f"{layer}router.proj.weight": (e, d), f"{layer}router.scale": (d,),
                        f"{layer}router.per_expert_scale": (e,), f"{layer}experts.gate_up_proj": (e, 2 * f, d),
                        f"{layer}experts.down_proj": (e, d, f)})
    return out


# transformers' Gemma4VisionConfig and Gemma4AudioConfig defaults of the keys the towers' shapes depend on (a
# vision_config or audio_config omitting one means these values; a test holds these tables to transformers').
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_key_value_heads": 12,
                   "head_dim": 64, "patch_size": 16, "position_embedding_size": 10 * 1024}
AUDIO_DEFAULTS = {"hidden_size": 1024, "num_attention_heads": 8, "conv_kernel_size": 5, "output_proj_dims": 1536,
                  "subsampling_conv_channels": [128, 32]}
# (a tower's keys, its projection's keys into the text model, the layers' keys inside the tower)
_TOWER_KEYS = {"vision": (re.compile(r"(?:model\.)?vision_tower\.(.+)"), re.compile(r"(?:model\.)?embed_vision\.(.+)"),
                          re.compile(r"encoder\.layers\.\d+\.(.+)")),
               "audio": (re.compile(r"(?:model\.)?audio_tower\.(.+)"), re.compile(r"(?:model\.)?embed_audio\.(.+)"),
                         re.compile(r"layers\.\d+\.(.+)"))}


def _vision_tables(v: dict) -> tuple[dict, dict, int] | None:
    """(the tower's own weights, each layer's, the width it hands the text model) from a vision_config."""
    s = positive_sizes({**VISION_DEFAULTS, **v}, tuple(VISION_DEFAULTS))
    if s is None:
        return None
    h, f, p, hd = s["hidden_size"], s["intermediate_size"], s["patch_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    tower = {"patch_embedder.input_proj.weight": (h, 3 * p * p),
             "patch_embedder.position_embedding_table": (2, s["position_embedding_size"], h),
             "std_bias": (h,), "std_scale": (h,)}
    layer = {f"{norm}.weight": (h,) for norm in NORMS}
    layer.update({"self_attn.q_proj.linear.weight": (q, h), "self_attn.k_proj.linear.weight": (kv, h),
                  "self_attn.v_proj.linear.weight": (kv, h), "self_attn.o_proj.linear.weight": (h, q),
                  "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                  "mlp.gate_proj.linear.weight": (f, h), "mlp.up_proj.linear.weight": (f, h),
                  "mlp.down_proj.linear.weight": (h, f)})
    return tower, layer, h


def _audio_tables(a: dict) -> tuple[dict, dict, int] | None:
    """(the tower's own weights, each conformer layer's, the width it hands the text model) from an audio_config."""
    a = {**AUDIO_DEFAULTS, **a}
    s = positive_sizes(a, ("hidden_size", "num_attention_heads", "conv_kernel_size", "output_proj_dims"))
    channels = a["subsampling_conv_channels"]
    if s is None or not isinstance(channels, (list, tuple)) or len(channels) != 2 \
            or positive_sizes(dict(enumerate(channels)), (0, 1)) is None:
        return None
    h, out, (c0, c1) = s["hidden_size"], s["output_proj_dims"], channels
    tower = {"subsample_conv_projection.layer0.conv.weight": (c0, 1, 3, 3),
             "subsample_conv_projection.layer0.norm.weight": (c0,),
             "subsample_conv_projection.layer1.conv.weight": (c1, c0, 3, 3),
             "subsample_conv_projection.layer1.norm.weight": (c1,),
             "subsample_conv_projection.input_proj_linear.weight": (h, (c0 // 4) * c1),
             "output_proj.weight": (out, h), "output_proj.bias": (out,)}
    layer = {f"{norm}.weight": (h,) for norm in ("norm_pre_attn", "norm_post_attn", "norm_out",
                                                 "lconv1d.pre_layer_norm", "lconv1d.conv_norm")}
    for ffw in ("feed_forward1", "feed_forward2"):
        layer.update({f"{ffw}.ffw_layer_1.linear.weight": (4 * h, h), f"{ffw}.ffw_layer_2.linear.weight": (h, 4 * h),
                      f"{ffw}.pre_layer_norm.weight": (h,), f"{ffw}.post_layer_norm.weight": (h,)})
    layer.update({f"self_attn.{proj}.linear.weight": (h, h) for proj in ("q_proj", "k_proj", "v_proj", "post")})
    layer.update({"self_attn.relative_k_proj.weight": (h, h),
                  "self_attn.per_dim_scale": (h // s["num_attention_heads"],),
                  "lconv1d.linear_start.linear.weight": (2 * h, h), "lconv1d.linear_end.linear.weight": (h, h),
                  "lconv1d.depthwise_conv1d.weight": (h, 1, s["conv_kernel_size"])})
    return tower, layer, out


def tower_shapes(hf_config: dict, names: list[str]) -> dict[str, tuple[int, ...]]:
    """The vision and audio towers' weights and their projections' among `names` (see `Family.tower_shapes`); none
    for a tower whose config is null (transformers then builds none)."""
    text = positive_sizes(hf_text_config(hf_config), ("hidden_size",))
    tables = {}
    for kind, make in (("vision", _vision_tables), ("audio", _audio_tables)):
        config = hf_config.get(f"{kind}_config")
        made = make(config) if isinstance(config, dict) else None
        if made is not None:
            tower, layer, width = made
            embed = {"embedding_projection.weight": (text["hidden_size"], width)} if text is not None else {}
            tower_key, embed_key, layer_key = _TOWER_KEYS[kind]
            tables[kind] = tower_key, layer_key, embed_key, tower, layer, embed
    return tower_tensor_shapes(names, list(tables.values()))


# Non-projection weights: Tunix's HF->Tunix key table (tunix/models/gemma4/params_safetensors.py),
# inverted; axes regrouped where HF stores them otherwise.
TENSORS = (
    Tensor("embedder.input_embedding", "embed_tokens.weight"),
    Tensor("final_norm.scale", "norm.weight"),
    Tensor("embedder.per_layer_input_embedding", "embed_tokens_per_layer.weight",
           ("V", "L", "P"), (("V",), ("L", "P")), "ple"),
    Tensor("embedder.per_layer_model_projection.w", "per_layer_model_projection.weight",
           ("D", "L", "P"), (("L", "P"), ("D",)), "ple"),
    Tensor("embedder.per_layer_projection_norm.scale", "per_layer_projection_norm.weight", requires="ple"),
    Tensor("layers.{i}.pre_attention_norm.scale", "layers.{i}.input_layernorm.weight"),
    Tensor("layers.{i}.post_attention_norm.scale", "layers.{i}.post_attention_layernorm.weight"),
    Tensor("layers.{i}.pre_ffw_norm.scale", "layers.{i}.pre_feedforward_layernorm.weight"),
    Tensor("layers.{i}.post_ffw_norm.scale", "layers.{i}.post_feedforward_layernorm.weight"),
    Tensor("layers.{i}.attn._query_norm.scale", "layers.{i}.self_attn.q_norm.weight"),
    Tensor("layers.{i}.attn._key_norm.scale", "layers.{i}.self_attn.k_norm.weight", requires="own_kv"),
    Tensor("layers.{i}.skip_scale", "layers.{i}.layer_scalar"),
    Tensor("layers.{i}.per_layer_input_gate.w", "layers.{i}.per_layer_input_gate.weight",
           ("D", "P"), (("P",), ("D",)), "ple"),
    Tensor("layers.{i}.per_layer_projection.w", "layers.{i}.per_layer_projection.weight",
           ("P", "D"), (("D",), ("P",)), "ple"),
    Tensor("layers.{i}.post_per_layer_input_norm.scale", "layers.{i}.post_per_layer_input_norm.weight",
           requires="ple"),
    Tensor("layers.{i}.dense_post_ffw_norm.scale", "layers.{i}.post_feedforward_layernorm_1.weight", requires="moe"),
    Tensor("layers.{i}.moe_pre_ffw_norm.scale", "layers.{i}.pre_feedforward_layernorm_2.weight", requires="moe"),
    Tensor("layers.{i}.moe_post_ffw_norm.scale", "layers.{i}.post_feedforward_layernorm_2.weight", requires="moe"),
    Tensor("layers.{i}.moe.router_logits", "layers.{i}.router.proj.weight", ("D", "E"), (("E",), ("D",)), "moe"),
    Tensor("layers.{i}.moe.router_scale", "layers.{i}.router.scale", requires="moe"),
    Tensor("layers.{i}.moe.per_expert_scale", "layers.{i}.router.per_expert_scale", requires="moe"),
    Tensor("layers.{i}.moe.gating_einsum", "layers.{i}.experts.gate_up_proj",
           ("E", "C", "I", "D"), (("E",), ("C", "I"), ("D",)), "moe"),
    Tensor("layers.{i}.moe.linear", "layers.{i}.experts.down_proj", ("E", "I", "D"), (("E",), ("D",), ("I",)), "moe"),
)


def _key_mapping(cfg):
    """Tunix's HF->Tunix key rules, widened to every decoder prefix in TEXT_PREFIXES (Tunix's
    rules know only `model.language_model.` and bare keys, so a text-only `Gemma4ForCausalLM`
    checkpoint, keyed `model.`, would load nothing)."""
    from tunix.models.gemma4 import params_safetensors as ps

    widened = {}
    for pattern, rule in ps._get_key_and_transform_mapping(cfg).items():
        assert pattern.startswith(r"(?:model\.language_model\.)?"), pattern
        pattern = pattern.replace(r"(?:model\.language_model\.)?",
                                  r"(?:model\.language_model\.|language_model\.model\.|model\.)?", 1)
        widened[pattern] = rule
    return widened


_MODEL_CLASS = None


def model_class():
    """Tunix's Gemma4 with transformers' semantics where they differ (see the module docstring),
    and a `__call__` that can stop at the final norm (`hidden_only=True`): the loss projects only
    loss-bearing positions onto the vocabulary. It must go through `__call__`: Qwix applies LoRA
    only inside the one model method it intercepts."""
    global _MODEL_CLASS
    if _MODEL_CLASS is not None:
        return _MODEL_CLASS

    import jax
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as g4
    from tunix.models.gemma4 import moe as g4_moe

    class MoERoutedOnResidual(g4_moe.MoERagged):
        """Experts run on the normalised MoE input; the router sees the raw residual stream."""

        def __call__(self, x, residual):
            r = residual.astype(jnp.float32)
            r = r * jax.lax.rsqrt(jnp.mean(jnp.square(r), axis=-1, keepdims=True) + 1e-6)
            r = r * (self.features ** -0.5) * self.router_scale.value.astype(jnp.float32)
            logits = jnp.einsum("gsd,de->gse", r.astype(x.dtype), self.router_logits.value.astype(x.dtype))
            weights, choices = self._router(logits)
            return self._run_ffw_and_routing(x, choices, weights)

    class MoEDecoderLayer(g4.DecoderLayer):
        """Tunix's decoder layer, except that the router gets the residual (transformers'
        `Gemma4TextDecoderLayer`: `self.router(residual)`, experts on
        `pre_feedforward_layernorm_2(residual)`)."""

        def block(self, x, segment_pos, cache, attn_mask, per_layer_input=None, kv_shared_cache=None):
            cache, attn, kv = self.attn(self.pre_attention_norm(x), segment_pos, cache, attn_mask,
                                        kv_shared_cache=kv_shared_cache)
            h = x + self.post_attention_norm(attn)
            dense = self.dense_post_ffw_norm(self.mlp(self.pre_ffw_norm(h)))
            experts = self.moe_post_ffw_norm(self.moe(self.moe_pre_ffw_norm(h), h))
            out = h + self.post_ffw_norm(dense + experts)
            if self.config.per_layer_input_dim > 0 and per_layer_input is not None:
                gate = jax.nn.gelu(self.per_layer_input_gate(out)) * per_layer_input
                out = out + self.post_per_layer_input_norm(self.per_layer_projection(gate))
            return cache, out * self.skip_scale.value, kv

    class QuantizableEinsum(g4.Einsum):
        """Tunix's projection, without casting a QLoRA-quantized weight: Qwix hands it over as its own
        wrapper, which `jnp.astype` rejects (a TypeError at the first step), and its einsum dequantizes
        it (Gemma 3's einsum does not cast its weight either)."""

        def __call__(self, x):
            w = self.w.value
            if not isinstance(w, jax.Array):
                y = jnp.einsum(self.einsum_str, jnp.astype(x, self.dtype), w)
                return y if self.w_scale is None else y * self.w_scale
            return super().__call__(x)

    class Gemma4(g4.Gemma4):
        def __init__(self, config, *, rngs):
            super().__init__(config, rngs=rngs)
            for _, module in self.iter_modules():
                if type(module) is g4.Einsum:
                    module.__class__ = QuantizableEinsum
            # transformers' KV-sharing map (Tunix's fixed choice is right only for some layouts)
            source = kv_source(config)
            self.kv_cache_sharing_patterns = source
            self.shared_layer_origins = {j for i, j in enumerate(source) if i != j}
            for i, layer in enumerate(self.layers):
                if source[i] != i:  # no checkpoint has these, no forward reads them
                    for name in ("kv_einsum", "k_einsum", "_key_norm"):
                        if hasattr(layer.attn, name):
                            delattr(layer.attn, name)
                if config.enable_moe:
                    layer.__class__ = MoEDecoderLayer
                    layer.moe.__class__ = MoERoutedOnResidual
            _unsplit_size_one_dims(self)

        def __call__(self, tokens, positions=None, cache=None, attention_mask=None,
                     decode_only_last_token=False, segment_ids=None, *, hidden_only=False):
            if cache is not None:  # decoding: Tunix's cache handling, with the map set above
                if hidden_only:
                    raise ValueError("hidden_only needs cache=None")
                return super().__call__(tokens, positions, cache, attention_mask, decode_only_last_token,
                                        segment_ids)
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
            x = self.embedder.encode(tokens)
            per_layer = (self.embedder.encode_per_layer_input(x, tokens)
                         if self.config.per_layer_input_dim > 0 else None)
            kvs = {}
            # sliding layers banded by token positions (shared-prefix rows): see sliding_window
            with masks_by_position(self.layers, positions, attention_mask) as masks:
                for i, layer in enumerate(self.layers):
                    src = self.kv_cache_sharing_patterns[i]
                    shared = None if src == i else {"k": kvs[src][0], "v": kvs[src][1]}
                    _, x, kv = layer(x, positions, None, masks[i],
                                     per_layer_input=None if per_layer is None else per_layer[:, :, i, :],
                                     kv_shared_cache=shared)
                    if i in self.shared_layer_origins:
                        kvs[i] = kv
            x = self.final_norm(x)
            if hidden_only:
                return x, None
            if decode_only_last_token:
                x = x[:, -1:, :]
            logits = self.embedder.decode(x).astype(jnp.float32)
            cap = self.config.final_logit_softcap
            if cap:
                logits = jnp.tanh(logits / cap) * cap
            return logits, None

    _MODEL_CLASS = Gemma4
    return _MODEL_CLASS


def _unsplit_size_one_dims(model) -> None:
    """Drop the mesh axis from every weight dimension of size 1 (the rule of gemma_tpu.train.partition).

    Tunix replicates a single KV head in `kv_einsum` but annotates `k_einsum` (K=V global layers) with 'tp'
    on its head axis whatever its size: with num_global_key_value_heads=1 any mesh with tp > 1 failed to
    place it (a JAX IndivisibleError traceback at load), and its LoRA factors and optimizer state inherit
    the annotation."""
    from flax import nnx

    for _, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        spec = var.get_metadata().get("out_sharding")
        shape = getattr(var.get_value(), "shape", None)
        if spec and shape is not None and len(spec) == len(shape) and any(
                s == 1 and a is not None for s, a in zip(shape, spec)):
            var.set_metadata(out_sharding=tuple(None if s == 1 else a for s, a in zip(shape, spec)))


_L = r"layers\.\d+\."
PARTITION_RULES = ATTENTION_MLP_PARTITION_RULES + (
    (r"embedder\.per_layer_input_embedding", ("tp", None, "fsdp")),
    (r"embedder\.per_layer_model_projection\.w", ("fsdp", None, "tp")),
    (_L + r"per_layer_input_gate\.w", ("fsdp", "tp")),
    (_L + r"per_layer_projection\.w", ("tp", "fsdp")),
    (_L + r"moe\.gating_einsum", ("fsdp", None, None, "tp")),
    (_L + r"moe\.linear", ("fsdp", "tp", None)),
    (_L + r"moe\.(router_logits|router_scale|per_expert_scale)", ()),
    (_L + r"skip_scale", ()),
    (r"(embedder\.|layers\.\d+\.(attn\.)?)?\w*norm\.scale", ()),  # replicated, as Gemma 3's
)
# the attention and MLP dims as Gemma 3's but for a global layer's own head size, and the KV heads of the weight's
# own kind: K and V fused (kv_einsum: sliding layers, and global ones unless keys equal values) have
# num_key_value_heads, K alone (k_einsum: the global layers of a K=V model) num_global_key_value_heads, as
# transformers' Gemma4TextAttention takes them; the per-layer embeddings' (Tunix: vocabulary × layers × per-layer
# width); the experts'
_GLOBAL_FIELDS = {"head_dim": "head_dim (global_head_dim on global layers)"}
_KV_HEADS = {_L + r"attn\.k_einsum\.w": "num_global_key_value_heads"}
PARTITION_DIMS = tuple((pattern, tuple(_KV_HEADS.get(pattern, f) if f == "num_key_value_heads"
                                       else _GLOBAL_FIELDS.get(f, f) if f else f for f in fields))
                       for pattern, fields in ATTENTION_MLP_PARTITION_DIMS) + (
    (r"embedder\.per_layer_input_embedding", ("vocab_size", "num_hidden_layers", "hidden_size_per_layer_input")),
    (r"embedder\.per_layer_model_projection\.w", ("hidden_size", "num_hidden_layers", "hidden_size_per_layer_input")),
    (_L + r"per_layer_input_gate\.w", ("hidden_size", "hidden_size_per_layer_input")),
    (_L + r"per_layer_projection\.w", ("hidden_size_per_layer_input", "hidden_size")),
    # the experts (Tunix: experts × gate/up × expert width × model width, experts × expert width × model width)
    (_L + r"moe\.gating_einsum", ("num_experts", None, "moe_intermediate_size", "hidden_size")),
    (_L + r"moe\.linear", ("num_experts", "moe_intermediate_size", "hidden_size")),
    (_L + r"moe\.router_logits", ("hidden_size", "num_experts")),
)


GEMMA4 = register(
    Family(
        name="gemma4",
        architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
        model_types=("gemma4_text", "gemma4"),
        multimodal_model_type="gemma4",
        tunix_config=tunix_config,
        loader=load_sharded,
        partition_rules=PARTITION_RULES,
        partition_dims=PARTITION_DIMS,
        hf_text_config=hf_text_config,
        reference_loader=tunix_safetensors_loader("gemma4", model_class, _key_mapping),
        model_class=model_class,
        projections=projections,
        projection_shapes=projection_shapes,
        tensor_shapes=tensor_shapes,
        tower_shapes=tower_shapes,
        text_prefixes=TEXT_PREFIXES,
        with_remat=tunix_remat("gemma4"),
        chat_format="gemma",
        tensors=TENSORS,
        layer_features=layer_features,
        layout_fields=layout_fields,
        stop_token_ids=(1, 106, 50),  # <eos>, <turn|>, <|tool_response>
        end_of_turn_token="<turn|>",
        end_of_turn_id=106,
        call_stop_token="<|tool_response>",  # id 50: vLLM names it by its id (stop_reason), /detokenize by text
        # its template's calls and results: FunctionGemma's syntax in its own tokens, the string quote `<|"|>`
        call_markers=((START_CALL, "<|tool_call>"), (END_CALL, "<tool_call|>"), (ESCAPE, '<|"|>'),
                      (START_RESPONSE, "<|tool_response>"), (END_RESPONSE, "<tool_response|>")),
        thought_markers=("<|channel>", "<channel|>", "thought\n"),  # vLLM's gemma4 reasoning parser's
        # its chat template's markup: turns, tool declarations, calls and results, the string quote, thinking
        # channels, media placeholders (each one special token of the vocabulary)
        markup_tokens=("<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                       "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>",
                       "<|think|>", "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>",
                       "<|video|>"),
        sliding_window_pattern=6,  # transformers' default when config.json has no layer_types
        # vLLM-TPU serves Gemma 4 with tpu-inference's JAX-native models
        # (`tpu_inference/models/common/model_loader.py` registers both); tool calls are `<|tool_call>` blocks.
        vllm_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
        vllm_tool_parser="gemma4",
        vllm_jax_native=True,
        # tpu_inference/models/jax/gemma4.py: `hf_config.text_config`, weights mapped to `language_model.`
        vllm_jax_needs_text_config=True,
        vllm_tp_split_sizes=("intermediate_size",),  # the dense MLP, beside the experts in a MoE's layers too
        vllm_tp_expert_split_sizes=("moe_intermediate_size",),  # None in a dense model: not checked
        # hidden_size_per_layer_input 0 (no per-layer inputs): not checked
        vllm_torch_tp_split_products=(("num_hidden_layers", "hidden_size_per_layer_input"),),
        vllm_torch_reads_unused_keys=("attn_logit_softcapping",),  # ignored here (tunix_config), as transformers
        vllm_rope_problem=vllm_rope_problem,
        vllm_lora_problem=vllm_lora_problem,
    )
)
