"""Gemma 3 text (270M, 1B, FunctionGemma; the text tower of 4B/12B/27B) as registry data.

The Tunix config is built from the checkpoint's own `config.json`; anything Tunix's Gemma 3 cannot
express (soft-capping, another attention pattern, another norm epsilon) is refused by name rather
than silently mis-modelled.
"""

from __future__ import annotations

import math
import re
from typing import Any

from gemma_tpu.core.errors import UserError
from gemma_tpu.formats import gemma_chat
from gemma_tpu.formats.function_calling import FUNCTION_MARKERS, START_RESPONSE, plain_gemma_token_map
from gemma_tpu.models.registry import (
    Family,
    GGUFFacts,
    GGUFTensor,
    Projection,
    Tensor,
    check_types,
    positive_sizes,
    register,
    require_positive,
    require_tied_embeddings,
    text_config,
    text_config_with_defaults,
    top_level_rotary_share,
    tunix_remat,
    tower_tensor_shapes,
    tunix_safetensors_loader,
)
from gemma_tpu.models.sharded_weights import load_sharded
from gemma_tpu.models.sliding_window import configured_size, masks_by_position

# Tunix's Gemma 3: five sliding-window layers, then one global layer (HF `layer_types`, llama.cpp's default).
SLIDING_WINDOW_PATTERN = 6

# HF key prefixes of the decoder: text-only, multimodal as released, multimodal as
# transformers >= 5 saves it.
TEXT_PREFIXES = ("model.", "language_model.model.", "model.language_model.")

# transformers' Gemma3TextConfig defaults of keys that change the shapes or the numbers: a config.json that
# omits one means these values to transformers, so it must mean them here too. The released multimodal
# configs omit most (google/gemma-3-4b-it's text_config names only hidden_size, intermediate_size,
# num_hidden_layers, rope_scaling and sliding_window); hand-written or trimmed ones do too.
HF_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "sliding_window_pattern": SLIDING_WINDOW_PATTERN, "hidden_activation": "gelu_pytorch_tanh"}

# The types transformers' Gemma3TextConfig declares for the keys read here (`check_types`; a test holds
# this table to transformers' own field annotations).
HF_TYPES = {"vocab_size": "int", "hidden_size": "int", "intermediate_size": "int", "num_hidden_layers": "int",
            "num_attention_heads": "int", "num_key_value_heads": "int", "head_dim": "int",
            "max_position_embeddings": "int", "query_pre_attn_scalar": "int", "sliding_window": "int|None",
            "rms_norm_eps": "float", "hidden_activation": "str", "attention_bias": "bool",
            "layer_types": "list[str]|None", "final_logit_softcapping": "float|None",
            "attn_logit_softcapping": "float|None", "use_bidirectional_attention": "bool|None"}


def hf_text_config(hf_config: dict) -> dict:
    """The text config as transformers reads it: omitted keys at transformers' defaults, and
    `layer_types`, when absent, derived from `sliding_window_pattern` (the key of configs written by
    transformers 4.x, the hub's Gemma 3 configs among them) the way transformers derives it;
    `tie_word_embeddings` from the top level of a multimodal config, where transformers reads it."""
    t = text_config_with_defaults(hf_config, HF_DEFAULTS, HF_TYPES)
    # null or absent only: transformers derives no pattern for [] (a list of 0 entries, refused below)
    if t.get("layer_types") is None and t.get("num_hidden_layers") is not None:
        period = t["sliding_window_pattern"]
        if isinstance(period, float) and period.is_integer():  # 6.0, as a config a script wrote may hold:
            period = int(period)  # transformers derives the same layers from it (it was refused)
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise UserError(f"config.json: sliding_window_pattern={period!r} is not a positive integer")
        t["layer_types"] = GEMMA3.layer_types(int(t["num_hidden_layers"]), period)
        t["_layer_types_key"] = "sliding_window_pattern"
    elif t.get("layer_types") is not None and len(t["layer_types"]) != t.get("num_hidden_layers"):
        # transformers refuses it; training called it an unsupported pattern, the GGUF export wrote it
        raise UserError(f"config.json: layer_types has {len(t['layer_types'])} entries for "
                        f"num_hidden_layers={t.get('num_hidden_layers')} (transformers cannot build a model from it)")
    return t


def multimodal(hf_config: dict) -> bool:
    """A Gemma3ForConditionalGeneration config: the decoder's under `text_config`."""
    return text_config(hf_config) is not hf_config


def applied_softcap(hf_config: dict) -> tuple[str, float] | None:
    """The soft-capping transformers' Gemma 3 applies for this config.json, as (key, value), or None: what
    every reader (Tunix, llama.cpp) must apply too or refuse. transformers caps the final logits in
    Gemma3ForCausalLM only: Gemma3ForConditionalGeneration, the class a multimodal config.json (model_type
    gemma3, text under text_config) loads as, even through AutoModelForCausalLM, never reads
    final_logit_softcapping. attn_logit_softcapping is read by no Gemma 3 class (transformers' attention is
    never handed it; vLLM's Gemma 3 passes None). Either key may be present and is then ignored, as there.
    A text model's cap of 0 is applied too: transformers divides by it, and every logit comes out 0."""
    cap = text_config(hf_config).get("final_logit_softcapping")
    if multimodal(hf_config) or cap is None:
        return None
    return "final_logit_softcapping", cap


ROPE_TYPES = {"rope_theta": "int|float|None", "factor": "int|float", "rope_type": "str"}


def _rope_parameters(t: dict, kind: str) -> dict:
    """The rotary parameters of 'sliding_attention' or 'full_attention' layers as transformers 5 resolves
    them (`Gemma3TextConfig.convert_rope_params_to_dict`): `rope_parameters[kind]`, with a legacy
    `rope_scaling` laid over the global layers' entry, and a rope_theta the entry lacks taken from
    `rope_theta` (global) or `rope_local_base_freq` (sliding), as transformers 4.x configs name them."""
    params = t.get("rope_parameters")
    entry = params.get(kind) if isinstance(params, dict) else None
    for key, value in (("rope_parameters", params), ("rope_scaling", t.get("rope_scaling")),
                       (f"rope_parameters.{kind}", entry)):  # transformers fails on anything else (ValueError)
        if value is not None and not isinstance(value, dict):
            raise UserError(f"config.json: {key}={value!r} is not an object (transformers cannot build a model "
                            f"from it)")
    # one set of parameters for every layer, as other models write it: transformers' Gemma 3 ignores it (it writes
    # rope_type "default" and rope_theta null there itself), so anything else there is refused, not run unscaled
    flat = sorted(k for k, v in params.items() if k not in ("full_attention", "sliding_attention")
                  and (k, v) not in (("rope_type", "default"), ("type", "default"), ("rope_theta", None))
                  ) if isinstance(params, dict) else []
    if flat:
        raise UserError(f"config.json: rope_parameters.{flat[0]}={params[flat[0]]!r} is not read by transformers' "
                        f"Gemma 3 (it runs without it), which reads rope_parameters.full_attention and "
                        f".sliding_attention")
    p = dict(entry or {"rope_type": "default"})
    # numbers, not strings: float("1e6") here, a TypeError in transformers' rotary embedding
    check_types(p, ROPE_TYPES, f"rope_parameters.{kind}.")
    check_types(t, {"rope_theta": "int|float|None", "rope_local_base_freq": "int|float|None"})
    if kind == "full_attention":
        if isinstance(t.get("rope_scaling"), dict):
            scaling = t["rope_scaling"]
            check_types(scaling, ROPE_TYPES, "rope_scaling.")
            legacy = scaling.get("type")
            if "rope_type" not in scaling and legacy is not None and legacy != p.get("rope_type", "default"):
                # transformers 4 read `type` as the rope type; transformers 5 lays it over an entry whose
                # rope_type is already set and runs unscaled: the two disagree, so neither is guessed
                raise UserError(f"config.json: rope_scaling.type={legacy!r} is the old name of rope_type, which "
                                f"transformers 5 ignores here (it runs the model unscaled); rename it to "
                                f"rope_scaling.rope_type if the scaling is meant")
            p.update(scaling)
        p.setdefault("rope_theta", t.get("rope_theta", 1_000_000.0))
    else:
        p.setdefault("rope_theta", t.get("rope_local_base_freq", 10_000.0))
    return p


def _rope_key(t: dict, kind: str, name: str) -> str:
    """The config.json key `name` of `kind`'s rotary parameters comes from (or, missing, belongs in): the legacy
    rope_scaling, which `_rope_parameters` lays over the global layers' entry, where it holds the name (or, for a
    missing factor, the rope type that needs it), else rope_parameters.<kind>."""
    scaling = t.get("rope_scaling")
    if kind == "full_attention" and isinstance(scaling, dict) and (
            name in scaling or (name == "factor" and ("rope_type" in scaling or "type" in scaling))):
        return f"rope_scaling.{name}"
    return f"rope_parameters.{kind}.{name}"


def top_level_share(t: dict) -> bool:
    """`top_level_rotary_share` for Gemma 3, whose config fills in both layer types' rope_parameters entries."""
    params = t.get("rope_parameters")
    keys = {"full_attention", "sliding_attention", *(params if isinstance(params, dict) else ())}
    return top_level_rotary_share(t, keys, t["layer_types"])


def _rope(t: dict, kind: str, used: bool = True) -> tuple[float, float]:
    """(base frequency, linear scale factor) for 'sliding_attention' or 'full_attention'.

    What transformers cannot build a model from is refused, not read as a default: linear scaling without a
    factor (a KeyError when it validates the config) and a null rope_theta for layers the model has (a
    TypeError in its rotary embedding). `used`: a layer is of this kind."""
    p = _rope_parameters(t, kind)
    rtype = p.get("rope_type", p.get("type", "default"))
    if rtype not in ("default", "linear"):
        key = _rope_key(t, kind, "rope_type" if "rope_type" in p else "type")
        raise UserError(f"config.json: {key}={rtype!r} is not supported (Tunix's Gemma 3 rotates its {kind} layers "
                        f"with default or linear rope)")
    if rtype == "linear" and "factor" not in p:
        raise UserError(f"config.json: linear rope scaling for {kind} has no factor ({_rope_key(t, kind, 'factor')} "
                        f"missing; transformers cannot build a model from it)")
    if rtype == "linear" and used:
        # transformers' linear RoPE spans int(head_dim * partial_rotary_factor) dimensions (its Gemma 3 default RoPE
        # ignores the key): any other span than the whole head gives cos/sin of another width than the heads, which
        # its first forward fails on (Tunix rotates whole heads, so training went on)
        share = p.get("partial_rotary_factor", 1.0)
        key = _rope_key(t, kind, "partial_rotary_factor")
        if top_level_share(t):
            share, key = t["partial_rotary_factor"], "partial_rotary_factor"
        if isinstance(share, bool) or not isinstance(share, (int, float)):
            raise UserError(f"config.json: {key}={share!r} is not of type int or float")
        head_dim = int(t["head_dim"])
        span = int(head_dim * share) if math.isfinite(share) else share
        if span != head_dim:
            raise UserError(f"config.json: {key}={share!r} is not supported: linear RoPE then spans "
                            f"int(head_dim * partial_rotary_factor)={span} of head_dim={head_dim} "
                            f"dimensions, which transformers cannot run (Tunix's Gemma 3 rotates whole heads); "
                            f"remove it or set it to 1")
    factor = float(p["factor"]) if rtype == "linear" else 1.0
    if factor < 1.0 and used:  # transformers only warns; Tunix's rotary embedding raises a ValueError in a forward
        raise UserError(f"config.json: {_rope_key(t, kind, 'factor')}={p['factor']!r} must be at least 1 (Tunix's "
                        f"Gemma 3 scales rotary positions down only)")
    theta = p["rope_theta"]
    if theta is None:
        if used:
            entry = (t.get("rope_parameters") or {}).get(kind) if isinstance(t.get("rope_parameters"), dict) else None
            key = (f"rope_parameters.{kind}.rope_theta" if isinstance(entry, dict) and "rope_theta" in entry
                   else "rope_theta" if kind == "full_attention" else "rope_local_base_freq")
            raise UserError(f"config.json: {key}=null for the model's {kind} layers (transformers cannot build a "
                            f"model from it)")
        theta = 10_000.0 if kind == "sliding_attention" else 1_000_000.0
    return float(theta), factor


def vllm_softcap_problem(hf_config: dict) -> str | None:
    """A multimodal config's text_config.final_logit_softcapping: vLLM builds a Gemma3ForConditionalGeneration's
    decoder as its Gemma3ForCausalLM on the text config, which caps the final logits by it; transformers'
    Gemma3ForConditionalGeneration never reads it (`applied_softcap`), nor does training."""
    cap = text_config(hf_config).get("final_logit_softcapping")
    if cap is None or not multimodal(hf_config):
        return None
    return (f"text_config.final_logit_softcapping={cap!r}, by which vLLM caps the final logits (its "
            f"Gemma3ForConditionalGeneration runs the decoder as its Gemma3ForCausalLM), where transformers' "
            f"Gemma3ForConditionalGeneration and training apply no cap; remove it")


def vllm_rope_problem(t: dict, jax_model: bool) -> str | None:
    """A partial_rotary_factor other than 1 for default RoPE (an entry's, or one at the top of config.json where vLLM
    lays it over the entries, `top_level_share`): transformers' Gemma 3 (and training) rotate whole heads whatever it
    says, vLLM's get_rope int(head_dim * partial_rotary_factor) of each head's dimensions. `t`: the text config as
    transformers reads it; `jax_model`: unused (tpu-inference has no JAX Gemma 3)."""
    check_types(t, {"partial_rotary_factor": "int|float|None"})  # a number, as vLLM compares it with 0 and 1
    top = t.get("partial_rotary_factor") if top_level_share(t) else None
    for kind in sorted(set(t["layer_types"])):
        p = _rope_parameters(t, kind)
        where = _rope_key(t, kind, "partial_rotary_factor").removesuffix("partial_rotary_factor")
        check_types(p, {"partial_rotary_factor": "int|float"}, where)
        share, key = ((top, "partial_rotary_factor") if top is not None
                      else (p.get("partial_rotary_factor"), _rope_key(t, kind, "partial_rotary_factor")))
        if p.get("rope_type", p.get("type", "default")) == "default" and share is not None and share != 1:
            return (f"{key}={share!r}, by which vLLM's get_rope rotates part of each head of the {kind} layers "
                    f"(default RoPE), where transformers and training rotate the whole head; remove it")
    return None


def tunix_config(hf_config: dict, param_dtype: Any = None):
    """Translate an HF Gemma 3 config (text or multimodal) into Tunix's `ModelConfig`."""
    import jax.numpy as jnp  # deferred, like Tunix: registering the families must not import jax
    from tunix.models.gemma3 import model as g3

    param_dtype = jnp.float32 if param_dtype is None else param_dtype

    t = hf_text_config(hf_config)
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size")
    missing = [k for k in need if t.get(k) is None]  # omitted keys have transformers' defaults: null here
    if missing:
        raise UserError(f"config.json: {missing[0]}=null for a Gemma 3 text model")
    # num_key_value_heads: below, with the query heads it must divide
    require_positive(t, (*(k for k in need if k != "num_key_value_heads"), "max_position_embeddings"))
    require_tied_embeddings(hf_config, "Tunix's Gemma 3")
    if t.get("attention_bias"):
        raise UserError(f"config.json: attention_bias={t['attention_bias']} is not supported (Tunix's Gemma 3 "
                        f"projections have no bias)")
    capped = applied_softcap(hf_config)  # Tunix caps nothing
    if capped:
        raise UserError(f"config.json: {capped[0]}={capped[1]} is not supported by Tunix's Gemma 3")
    if t.get("use_bidirectional_attention"):
        raise UserError("config.json: use_bidirectional_attention (an embedding model) is not a causal LM")
    eps = float(t.get("rms_norm_eps", 1e-6))
    if abs(eps - 1e-6) > 1e-12:
        raise UserError(f"config.json: rms_norm_eps={eps} is not supported (Tunix's Gemma 3 uses 1e-6)")
    act = t["hidden_activation"]  # transformers' Gemma 3 reads no `hidden_act` (a Gemma 1 key): nor does this
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise UserError(f"config.json: hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
    n_layers = int(t["num_hidden_layers"])
    departure = GEMMA3.pattern_departure(t)  # the key config.json has: layer_types or sliding_window_pattern
    if departure:
        raise UserError(f"config.json: {departure} is not supported: Tunix's Gemma 3 has five sliding-window layers "
                        f"then one global layer, repeated")
    heads, kv_heads, head_dim = int(t["num_attention_heads"]), int(t["num_key_value_heads"]), int(t["head_dim"])
    hidden = int(t["hidden_size"])
    if kv_heads < 1:  # 0 "must divide" read as a riddle
        raise UserError(f"config.json: num_key_value_heads={kv_heads} must be at least 1")
    if heads % kv_heads:  # each KV head serves a whole group of query heads
        raise UserError(f"config.json: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    if hidden % heads:  # transformers' Gemma3TextConfig refuses it (validate_architecture), head_dim given or not
        raise UserError(f"config.json: hidden_size={hidden} must be a multiple of num_attention_heads={heads} "
                        f"(transformers cannot build a model from it)")
    if head_dim % 2:  # rotary embeddings rotate the two halves of every head
        raise UserError(f"config.json: head_dim={head_dim} must be even (rotary embeddings split it in halves)")
    qpas = t["query_pre_attn_scalar"]
    if qpas == head_dim:
        qnorm = g3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
    elif qpas == hidden // heads:
        qnorm = g3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
    else:
        raise UserError(
            f"config.json: query_pre_attn_scalar={qpas} must equal head_dim ({head_dim}) "
            f"or hidden_size/num_attention_heads ({hidden // heads})"
        )
    local_theta, local_scale = _rope(t, "sliding_attention", "sliding_attention" in t["layer_types"])
    global_theta, global_scale = _rope(t, "full_attention", "full_attention" in t["layer_types"])
    return g3.ModelConfig(
        num_layers=n_layers,
        num_embed=int(t["vocab_size"]),
        embed_dim=hidden,
        hidden_dim=int(t["intermediate_size"]),
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv_heads,
        sliding_window_size=configured_size(t, 4096),
        local_base_frequency=local_theta,
        global_base_frequency=global_theta,
        local_scale_factor=local_scale,
        global_scale_factor=global_scale,
        query_pre_attn_norm=qnorm,
        vision_config=None,
        param_dtype=param_dtype,
    )


def projections(cfg) -> tuple[Projection, ...]:
    """Where each HF projection lives in Tunix's Gemma 3 (fused q/k/v when heads == kv heads)."""
    if cfg.num_heads == cfg.num_kv_heads:
        attn = (
            Projection("q_proj", "self_attn.q_proj", "attn.qkv_einsum", "w", ("S", "N", "D", "H"), ("D",), ("S", 0)),
            Projection("k_proj", "self_attn.k_proj", "attn.qkv_einsum", "w", ("S", "N", "D", "H"), ("D",), ("S", 1)),
            Projection("v_proj", "self_attn.v_proj", "attn.qkv_einsum", "w", ("S", "N", "D", "H"), ("D",), ("S", 2)),
        )
    else:
        attn = (
            Projection("q_proj", "self_attn.q_proj", "attn.q_einsum", "w", ("N", "D", "H"), ("D",)),
            Projection("k_proj", "self_attn.k_proj", "attn.kv_einsum", "w", ("C", "K", "D", "H"), ("D",), ("C", 0)),
            Projection("v_proj", "self_attn.v_proj", "attn.kv_einsum", "w", ("C", "K", "D", "H"), ("D",), ("C", 1)),
        )
    return attn + (
        Projection("o_proj", "self_attn.o_proj", "attn.attn_vec_einsum", "w", ("N", "H", "D"), ("N", "H")),
        Projection("gate_proj", "mlp.gate_proj", "mlp.gate_proj", "kernel", ("D", "F"), ("D",)),
        Projection("up_proj", "mlp.up_proj", "mlp.up_proj", "kernel", ("D", "F"), ("D",)),
        Projection("down_proj", "mlp.down_proj", "mlp.down_proj", "kernel", ("F", "D"), ("F",)),
    )


def attention_mlp_shapes(d: int, f: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """The HF (out, in) shape of each projection of a layer of these sizes."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}


def projection_shapes(t: dict) -> dict[str, tuple[tuple[int, int], ...]]:
    """Every layer alike (see `Family.projection_shapes`)."""
    s = positive_sizes(t, ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                           "head_dim"))
    if s is None:
        return {}
    shapes = attention_mlp_shapes(s["hidden_size"], s["intermediate_size"], s["num_attention_heads"],
                                  s["num_key_value_heads"], s["head_dim"])
    return {name: (shape,) for name, shape in shapes.items()}


NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def tensor_shapes(t: dict) -> dict[str, tuple[int, ...]]:
    """The embedding, the norms (see `Family.tensor_shapes`)."""
    s = positive_sizes(t, ("num_hidden_layers", "hidden_size", "head_dim", "vocab_size"))
    if s is None:
        return {}
    d, hd = s["hidden_size"], s["head_dim"]
    out = {"embed_tokens.weight": (s["vocab_size"], d), "norm.weight": (d,)}
    for i in range(s["num_hidden_layers"]):
        out.update({f"layers.{i}.{norm}.weight": (d,) for norm in NORMS})
        out.update({f"layers.{i}.self_attn.{norm}.weight": (hd,) for norm in ("q_norm", "k_norm")})
    return out


# transformers' SiglipVisionConfig defaults of the keys the vision tower's shapes depend on (a multimodal
# config.json's vision_config omitting one means these values; a test holds this table to transformers').
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_channels": 3, "image_size": 224,
                   "patch_size": 16}
# The SigLIP tower's keys as released (`vision_tower.vision_model.`) and as transformers >= 5 saves them.
_VISION_KEY = re.compile(r"(?:model\.)?vision_tower\.(?:vision_model\.)?(.+)")
_PROJECTOR_KEY = re.compile(r"(?:model\.)?multi_modal_projector\.(.+)")
_ENCODER_LAYER = re.compile(r"encoder\.layers\.\d+\.(.+)")


def tower_shapes(hf_config: dict, names: list[str]) -> dict[str, tuple[int, ...]]:
    """The SigLIP tower's and the projector's weights among `names` (see `Family.tower_shapes`; Gemma 3 has no
    audio tower)."""
    v = hf_config.get("vision_config")
    if not isinstance(v, dict) and v is not None:
        return {}
    v = {**VISION_DEFAULTS, **(v or {})}
    s = positive_sizes(v, ("hidden_size", "intermediate_size", "num_channels", "patch_size"))
    if s is None:
        return {}
    h, f, p = s["hidden_size"], s["intermediate_size"], s["patch_size"]
    tower = {"embeddings.patch_embedding.weight": (h, s["num_channels"], p, p), "embeddings.patch_embedding.bias": (h,),
             "post_layernorm.weight": (h,), "post_layernorm.bias": (h,), "head.probe": (1, 1, h),
             "head.attention.in_proj_weight": (3 * h, h), "head.attention.in_proj_bias": (3 * h,),
             "head.attention.out_proj.weight": (h, h), "head.attention.out_proj.bias": (h,),
             "head.layernorm.weight": (h,), "head.layernorm.bias": (h,)}
    mlp = {"mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,), "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
    tower.update({f"head.{k}": v for k, v in mlp.items()})
    layer = {**mlp, **{f"{norm}.{w}": (h,) for norm in ("layer_norm1", "layer_norm2") for w in ("weight", "bias")}}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        layer.update({f"self_attn.{proj}.weight": (h, h), f"self_attn.{proj}.bias": (h,)})
    image = positive_sizes(v, ("image_size",))
    if image is not None:
        tower["embeddings.position_embedding.weight"] = ((image["image_size"] // p) ** 2, h)
    projector = {"mm_soft_emb_norm.weight": (h,)}
    text = positive_sizes(hf_text_config(hf_config), ("hidden_size",))
    if text is not None:
        projector["mm_input_projection_weight"] = (h, text["hidden_size"])
    return tower_tensor_shapes(names, [(_VISION_KEY, _ENCODER_LAYER, _PROJECTOR_KEY, tower, layer, projector)])


def _key_mapping(cfg):
    """Tunix's HF->Tunix key rules, widened to every decoder prefix in TEXT_PREFIXES."""
    from tunix.models.gemma3 import params_safetensors as ps

    widened = {}
    for pattern, rule in ps._get_key_and_transform_mapping(cfg).items():
        pattern = pattern.replace(
            r"(?:language_model\.)?model\.",
            r"(?:language_model\.model\.|model\.language_model\.|model\.)",
        )
        widened[pattern] = rule
    return widened


_MODEL_CLASS = None


def model_class():
    """Tunix's Gemma3 whose `__call__` can stop at the final norm (`hidden_only=True`), and whose
    cache-free forward bands sliding layers by token positions (`sliding_window`: shared-prefix rows).

    The loss projects only loss-bearing positions onto the vocabulary, so it needs hidden states.
    It must go through `__call__`: Qwix applies LoRA only inside the one model method it
    intercepts. With a cache (generation) or images, Tunix's own forward runs.
    """
    global _MODEL_CLASS
    if _MODEL_CLASS is None:
        from tunix.models.gemma3 import model as g3

        class Gemma3(g3.Gemma3):
            def __call__(self, last_tokens, positions=None, cache=None, attention_mask=None,
                         output_hidden_states=False, *, images=None, hidden_only=False):
                if cache is not None or images is not None or output_hidden_states or positions is None:
                    if hidden_only:
                        raise ValueError("hidden_only needs cache=None, positions and no images")
                    return super().__call__(last_tokens, positions, cache, attention_mask,
                                            output_hidden_states, images=images)
                x = self.embedder.encode(last_tokens)
                with masks_by_position(self.layers, positions, attention_mask) as masks:
                    for layer, mask in zip(self.layers, masks):
                        _, x = layer(x, positions, None, mask)
                x = self.final_norm(x)
                if hidden_only:
                    return x, None
                return self.embedder.decode(x), None

        _MODEL_CLASS = Gemma3
    return _MODEL_CLASS


# Partition rules of Tunix's Gemma weights: the specs Tunix's own ShardingConfig annotates them with, so
# weights load straight into their shards. Gemma 4 shares the attention/MLP part.
_L = r"layers\.\d+\."
ATTENTION_MLP_PARTITION_RULES: tuple[tuple[str, tuple], ...] = (
    (r"embedder\.input_embedding", ("tp", "fsdp")),
    (_L + r"attn\.(q|k)_einsum\.w", ("tp", "fsdp", None)),
    (_L + r"attn\.(kv|qkv)_einsum\.w", (None, "tp", "fsdp", None)),
    (_L + r"attn\.attn_vec_einsum\.w", ("tp", None, "fsdp")),
    (_L + r"mlp\.(gate|up)_proj\.kernel", ("fsdp", "tp")),
    (_L + r"mlp\.down_proj\.kernel", ("tp", "fsdp")),
)
# The config.json field behind each dimension of those weights (Tunix's shapes), for the refusal of a mesh that
# does not divide one. Gemma 4's global layers take their KV heads from num_global_key_value_heads.
ATTENTION_MLP_PARTITION_DIMS: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embedder\.input_embedding", ("vocab_size", "hidden_size")),
    (_L + r"attn\.q_einsum\.w", ("num_attention_heads", "hidden_size", "head_dim")),
    (_L + r"attn\.k_einsum\.w", ("num_key_value_heads", "hidden_size", None)),
    (_L + r"attn\.kv_einsum\.w", (None, "num_key_value_heads", "hidden_size", None)),
    (_L + r"attn\.qkv_einsum\.w", (None, "num_attention_heads", "hidden_size", "head_dim")),
    (_L + r"attn\.attn_vec_einsum\.w", ("num_attention_heads", None, "hidden_size")),
    (_L + r"mlp\.(gate|up)_proj\.kernel", ("hidden_size", "intermediate_size")),
    (_L + r"mlp\.down_proj\.kernel", ("intermediate_size", "hidden_size")),
)
PARTITION_RULES = ATTENTION_MLP_PARTITION_RULES + (
    (_L + r"attn\._(query|key)_norm\.scale", ()),  # Tunix: no sharding on head_dim
    # replicated, where Tunix says 'tp' (gemma_tpu.train.partition.TUNIX_WEIGHTS): a few KB a layer, of a size
    # tp need not divide
    (r"(layers\.\d+\.)?\w*norm\.scale", ()),
)


# llama.cpp's "gemma3" architecture (its converter's tensor names, checked against the `gguf`
# package's own map in the tests). No q/k permutation: llama.cpp runs Gemma with NeoX-style
# rotary embeddings, the same half-split layout as transformers. The tied embedding is also the
# output projection, so a tied model has no `output.weight`.
def gguf_rope(t: dict) -> dict[str, Any]:
    """llama.cpp's rotary keys: the global layers' base and linear scaling, the sliding layers'
    base (written for readers of the file; llama.cpp's gemma3 fixes it at 10000 and applies no scaling
    there, which `gguf_check` holds the config to)."""
    global_theta, global_scale = _rope(t, "full_attention")
    local_theta, local_scale = _rope(t, "sliding_attention")
    if local_scale != 1.0:
        raise UserError(f"config.json: linear rope scaling ({local_scale}) on sliding-window layers cannot be "
                        f"expressed in llama.cpp's gemma3")
    out = {"rope.freq_base": global_theta, "rope.freq_base_swa": local_theta}
    if global_scale != 1.0:
        out.update({"rope.scaling.type": "linear", "rope.scaling.factor": global_scale})
    return out


# What llama.cpp's gemma3 hard-wires instead of reading it from the file (llama-model.cpp, hparams of
# LLM_ARCH_GEMMA3): queries scaled by 1/sqrt(hidden_size / num_attention_heads) when the model has 62
# layers (it takes that for the 27B), else by 1/sqrt(head_dim); sliding layers' rotary base 10000, unscaled.
LLAMA_CPP_27B_LAYERS = 62
LLAMA_CPP_SWA_ROPE_BASE = 10_000.0


def gguf_check(hf_config: dict, t: dict) -> list[str]:
    """Where a config disagrees with what llama.cpp's gemma3 assumes (one line each). Its graph with
    sliding-window layers (what the exported file always has) applies no soft-capping at all, which is
    what transformers does except for a text model's final_logit_softcapping (`applied_softcap`); no
    softcapping key is written, so the file carries no cap a reader could apply where transformers does not."""
    problems = []
    try:  # null, 0 or negative: refused as training refuses it (llama.cpp takes 0 for "no sliding layers")
        configured_size(t, HF_DEFAULTS["sliding_window"])
    except UserError as e:
        problems.append(str(e).removeprefix("config.json: "))
    capped = applied_softcap(hf_config)
    if capped:
        problems.append(f"{capped[0]}={capped[1]} cannot be expressed in llama.cpp's gemma3 (transformers' "
                        f"Gemma3ForCausalLM caps the final logits, llama.cpp's sliding-window gemma3 never does)")
    heads, hidden, head_dim = int(t["num_attention_heads"]), int(t["hidden_size"]), int(t["head_dim"])
    qpas = t.get("query_pre_attn_scalar")
    if int(t["num_hidden_layers"]) == LLAMA_CPP_27B_LAYERS:
        want, what = hidden // heads, (f"hidden_size/num_attention_heads={hidden // heads} (it takes a "
                                       f"{LLAMA_CPP_27B_LAYERS}-layer gemma3 for the 27B)")
    else:
        want, what = head_dim, f"head_dim={head_dim}"
    if qpas != want:
        problems.append(f"query_pre_attn_scalar={qpas} differs from {what}; llama.cpp's gemma3 scales "
                        f"queries by 1/sqrt of that")
    local_theta, _ = _rope(t, "sliding_attention")
    if local_theta != LLAMA_CPP_SWA_ROPE_BASE:
        params = t.get("rope_parameters")
        key = ("rope_parameters.sliding_attention.rope_theta"
               if isinstance(params, dict) and "sliding_attention" in params else "rope_local_base_freq")
        problems.append(f"{key}={local_theta:g} cannot be expressed in llama.cpp's gemma3 (its sliding-window "
                        f"layers use a rotary base of {LLAMA_CPP_SWA_ROPE_BASE:g})")
    return problems


GGUF = GGUFFacts(
    arch="gemma3",
    tensors=(
        GGUFTensor("token_embd.weight", "embed_tokens.weight"),
        GGUFTensor("output_norm.weight", "norm.weight", plus_one=True),
        GGUFTensor("blk.{i}.attn_norm.weight", "layers.{i}.input_layernorm.weight", plus_one=True),
        GGUFTensor("blk.{i}.attn_q.weight", "layers.{i}.self_attn.q_proj.weight"),
        GGUFTensor("blk.{i}.attn_k.weight", "layers.{i}.self_attn.k_proj.weight"),
        GGUFTensor("blk.{i}.attn_v.weight", "layers.{i}.self_attn.v_proj.weight"),
        GGUFTensor("blk.{i}.attn_q_norm.weight", "layers.{i}.self_attn.q_norm.weight", plus_one=True),
        GGUFTensor("blk.{i}.attn_k_norm.weight", "layers.{i}.self_attn.k_norm.weight", plus_one=True),
        GGUFTensor("blk.{i}.attn_output.weight", "layers.{i}.self_attn.o_proj.weight"),
        GGUFTensor("blk.{i}.post_attention_norm.weight", "layers.{i}.post_attention_layernorm.weight", plus_one=True),
        GGUFTensor("blk.{i}.ffn_norm.weight", "layers.{i}.pre_feedforward_layernorm.weight", plus_one=True),
        GGUFTensor("blk.{i}.ffn_gate.weight", "layers.{i}.mlp.gate_proj.weight"),
        GGUFTensor("blk.{i}.ffn_up.weight", "layers.{i}.mlp.up_proj.weight"),
        GGUFTensor("blk.{i}.ffn_down.weight", "layers.{i}.mlp.down_proj.weight"),
        GGUFTensor("blk.{i}.post_ffw_norm.weight", "layers.{i}.post_feedforward_layernorm.weight", plus_one=True),
        GGUFTensor("output.weight", "lm_head.weight"),  # untied models only
    ),
    hparams=(
        ("context_length", "max_position_embeddings", "u32", 131072),
        ("embedding_length", "hidden_size", "u32", None),
        ("block_count", "num_hidden_layers", "u32", None),
        ("feed_forward_length", "intermediate_size", "u32", None),
        ("attention.head_count", "num_attention_heads", "u32", None),
        ("attention.head_count_kv", "num_key_value_heads", "u32", None),
        ("attention.key_length", "head_dim", "u32", None),
        ("attention.value_length", "head_dim", "u32", None),
        ("attention.layer_norm_rms_epsilon", "rms_norm_eps", "f32", 1e-6),
        ("attention.sliding_window", "sliding_window", "u32", 4096),
    ),
    check=gguf_check,
    require_unset=("use_bidirectional_attention",),  # soft-capping: gguf_check, as transformers applies it
    swa_period=SLIDING_WINDOW_PATTERN,
    rope=gguf_rope,
)

GEMMA3 = register(
    Family(
        name="gemma3",
        architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        model_types=("gemma3_text", "gemma3"),
        multimodal_model_type="gemma3",
        tunix_config=tunix_config,
        loader=load_sharded,
        partition_rules=PARTITION_RULES,
        partition_dims=ATTENTION_MLP_PARTITION_DIMS,
        hf_text_config=hf_text_config,
        reference_loader=tunix_safetensors_loader("gemma3", model_class, _key_mapping),
        model_class=model_class,
        projections=projections,
        projection_shapes=projection_shapes,
        tensor_shapes=tensor_shapes,
        tower_shapes=tower_shapes,
        text_prefixes=TEXT_PREFIXES,
        with_remat=tunix_remat("gemma3"),
        chat_format="gemma",
        # Tunix's HF->Tunix key table (tunix/models/gemma3/params_safetensors.py), inverted.
        tensors=(
            Tensor("embedder.input_embedding", "embed_tokens.weight"),
            Tensor("final_norm.scale", "norm.weight"),
            Tensor("layers.{i}.pre_attention_norm.scale", "layers.{i}.input_layernorm.weight"),
            Tensor("layers.{i}.post_attention_norm.scale", "layers.{i}.post_attention_layernorm.weight"),
            Tensor("layers.{i}.pre_ffw_norm.scale", "layers.{i}.pre_feedforward_layernorm.weight"),
            Tensor("layers.{i}.post_ffw_norm.scale", "layers.{i}.post_feedforward_layernorm.weight"),
            Tensor("layers.{i}.attn._query_norm.scale", "layers.{i}.self_attn.q_norm.weight"),
            Tensor("layers.{i}.attn._key_norm.scale", "layers.{i}.self_attn.k_norm.weight"),
        ),
        stop_token_ids=(1, 106),  # <eos>, <end_of_turn>
        gguf=GGUF,
        end_of_turn_token=gemma_chat.END_OF_TURN,
        end_of_turn_id=106,
        call_stop_token=START_RESPONSE,
        # the turns, FunctionGemma's tool markers (our Gemma format writes them) and the reserved tokens a plain
        # Gemma 3 vocabulary writes them as (`<unused2>`, ...), the media markers
        markup_tokens=("<bos>", "<eos>", "<pad>", gemma_chat.START_OF_TURN, gemma_chat.END_OF_TURN, *FUNCTION_MARKERS,
                       *plain_gemma_token_map().values(), *gemma_chat.MEDIA_MARKERS),
        sliding_window_pattern=SLIDING_WINDOW_PATTERN,
        # vLLM-TPU serves Gemma 3 with vLLM's PyTorch model through torchax (text only); tool calls
        # are FunctionGemma text.
        vllm_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        vllm_tool_parser="functiongemma",
        vllm_tied_embeddings_only=True,
        vllm_tp_split_sizes=("intermediate_size",),
        vllm_rope_problem=vllm_rope_problem,
        vllm_config_problem=vllm_softcap_problem,
        # vllm/config/model.py _FLOAT16_NOT_SUPPORTED_MODELS (gemma3, gemma3_text); Gemma 3's activations outgrow
        # float16's range in transformers
        float16_problem="vLLM refuses float16 for Gemma 3 (numerical instability) and transformers' Gemma 3 "
                        "overflows in it",
    )
)
