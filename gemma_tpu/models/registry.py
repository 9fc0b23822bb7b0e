"""The model-family registry: per-family mapping data used by the loader, the LoRA wiring,
the merger and the PEFT exporter alike, so that no second copy of a mapping exists.

A family says how to build the Tunix config from a Hugging Face `config.json`, how to create the
Tunix model from safetensors, and, for every LoRA-able projection, where it lives in both worlds:

* `Projection.hf_module`  - the HF module under a decoder layer (`self_attn.q_proj`),
* `Projection.tunix_module`/`tunix_param` - the Tunix module and weight (`attn.q_einsum`, `w`),
* `Projection.axes` / `in_axes` - the Tunix weight's axis names and which of them are contracted
  with the input; the rest are outputs. Qwix gives a LoRA on such a weight the factors
  A = (in axes..., r) and B = (r, out axes...), and an HF `nn.Linear` weight is (out, in) with
  both sides flattened in axis order. That one rule gives every transpose and reshape.
* `Projection.split` - for fused Tunix weights (`kv_einsum` holds K and V), the fused axis and the
  index of this HF module along it.
* `Projection.requires` / `Tensor.requires` - a layer feature (`Family.layer_features`) without
  which the weight does not exist in that layer, for families whose layers differ (Gemma 4: K and
  V fused in sliding layers, K only where keys equal values, neither where a layer reuses another
  layer's keys and values).

Non-projection weights (embeddings, norms, per-layer inputs, experts) are `Tensor`s: a rename,
optionally with a regrouping of axes given the same way (`hf_axes`), used to convert full
fine-tunes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Sequence

import numpy as np

from gemma_tpu.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class Projection:
    """One HF linear layer and the Tunix weight that holds it."""

    hf_name: str  # user-facing LoRA target name: q_proj
    hf_module: str  # path under a decoder layer: self_attn.q_proj
    tunix_module: str  # path under a Tunix layer: attn.q_einsum
    tunix_param: str  # weight attribute: w | kernel
    axes: tuple[str, ...]  # Tunix weight axes, e.g. ("N", "D", "H")
    in_axes: tuple[str, ...]  # axes contracted with the input, e.g. ("D",)
    split: tuple[str, int] | None = None  # (fused axis, index) for fused weights
    requires: str | None = None  # layer feature without which this weight is absent

    @property
    def out_axes(self) -> tuple[str, ...]:
        skip = {self.split[0]} if self.split else set()
        return tuple(a for a in self.axes if a not in self.in_axes and a not in skip)

    def tunix_lora_names(self) -> tuple[str, str]:
        return f"{self.tunix_param}_lora_a", f"{self.tunix_param}_lora_b"

    # -- layout algebra ------------------------------------------------------------------
    def _sizes(self, shape: tuple[int, ...]) -> dict[str, int]:
        if len(shape) != len(self.axes):
            raise ValueError(f"{self.tunix_module}.{self.tunix_param}: rank {len(shape)} != {len(self.axes)}")
        return dict(zip(self.axes, shape))

    def lora_to_peft(self, a: np.ndarray, b: np.ndarray, weight_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Tunix factors (A: in axes + r, B: r + non-in axes) -> PEFT (A [r, in], B [out, r])."""
        sizes = self._sizes(weight_shape)
        r = a.shape[-1]
        n_in = math.prod(sizes[x] for x in self.in_axes)
        a_hf = np.asarray(a).reshape(n_in, r).T
        b_axes = [x for x in self.axes if x not in self.in_axes]
        b_full = np.asarray(b).reshape((r, *[sizes[x] for x in b_axes]))
        if self.split:
            axis_name, index = self.split
            b_full = np.take(b_full, index, axis=1 + b_axes.index(axis_name))
            b_axes = [x for x in b_axes if x != axis_name]
        n_out = math.prod(sizes[x] for x in b_axes)
        b_hf = b_full.reshape(r, n_out).T
        return np.ascontiguousarray(a_hf), np.ascontiguousarray(b_hf)

    def hf_to_tunix(self, w_hf: np.ndarray, weight_shape: tuple[int, ...]) -> np.ndarray:
        """An HF (out, in) weight -> this projection's slice of the Tunix weight (axes w/o split)."""
        sizes = self._sizes(weight_shape)
        out_axes, in_axes = self.out_axes, self.in_axes
        full = w_hf.reshape(*[sizes[x] for x in out_axes], *[sizes[x] for x in in_axes])
        order = out_axes + in_axes
        target = [x for x in self.axes if not (self.split and x == self.split[0])]
        return np.transpose(full, [order.index(x) for x in target])

    def tunix_to_hf(self, w: np.ndarray) -> np.ndarray:
        """The Tunix weight (full, fused) -> this projection's HF (out, in) weight."""
        sizes = self._sizes(w.shape)
        axes = list(self.axes)
        if self.split:
            axis_name, index = self.split
            w = np.take(w, index, axis=axes.index(axis_name))
            axes.remove(axis_name)
        order = list(self.out_axes + self.in_axes)
        w = np.transpose(w, [axes.index(x) for x in order])
        n_out = math.prod(sizes[x] for x in self.out_axes)
        return w.reshape(n_out, -1)

    def hf_shape_of(self, tunix_shape: tuple[int, ...]) -> tuple[int, int]:
        """The HF (out, in) shape of this projection's slice of a Tunix weight of this shape."""
        sizes = self._sizes(tuple(tunix_shape))
        return math.prod(sizes[x] for x in self.out_axes), math.prod(sizes[x] for x in self.in_axes)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A non-projection weight: a Tunix param and the HF tensor holding the same numbers.

    `tunix` and `hf` may contain `{i}` (the layer index); `hf` is relative to the decoder prefix.
    With `axes`/`hf_axes` the HF tensor's dims are groups of the Tunix axes, in order
    (e.g. Tunix (D, L, P) stored by HF as (L*P, D): axes ("D", "L", "P"),
    hf_axes (("L", "P"), ("D",))); without them it is the same array.
    """

    tunix: str
    hf: str
    axes: tuple[str, ...] = ()
    hf_axes: tuple[tuple[str, ...], ...] = ()
    requires: str | None = None  # a feature of the layer ({i}) or the model; absent without it

    def tunix_to_hf(self, w: np.ndarray) -> np.ndarray:
        if not self.axes:
            return w
        order = [a for group in self.hf_axes for a in group]
        shape = self.hf_shape_of(tuple(w.shape))
        return np.transpose(w, [self.axes.index(a) for a in order]).reshape(shape)

    def hf_shape_of(self, tunix_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not self.axes:
            return tuple(tunix_shape)
        if len(tunix_shape) != len(self.axes):
            raise ValueError(f"{self.tunix}: rank {len(tunix_shape)} != {len(self.axes)}")
        sizes = dict(zip(self.axes, tunix_shape))
        return tuple(math.prod(sizes[a] for a in group) for group in self.hf_axes)


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One GGUF tensor: its name in llama.cpp's naming (`blk.{i}.attn_q.weight`), the HF key under
    the decoder prefix it holds (`layers.{i}.self_attn.q_proj.weight`; `lm_head.weight` is
    absolute), and whether the file stores `1 + w` (Gemma's RMSNorm scales: llama.cpp multiplies
    by the stored weight, transformers' Gemma by `1 + w`)."""

    gguf: str
    hf: str
    plus_one: bool = False


@dataclasses.dataclass(frozen=True)
class GGUFFacts:
    """What llama.cpp's GGUF needs to know about a family (`convert.export_gguf` reads it).

    `hparams`: (key under `{arch}.`, config.json key of the text config, value type, default
    when the config lacks it). `check`: values llama.cpp does not read but hard-wires (Gemma 3's
    query scale, its sliding layers' rotary base, no soft-capping): (config.json, its text config as
    transformers reads it) -> one line per disagreement. `require_unset`:
    config keys llama.cpp's architecture cannot express when set. `swa_period`: llama.cpp's default
    sliding/global layer pattern (every Nth layer global), which the config must follow."""

    arch: str
    tensors: tuple[GGUFTensor, ...]
    hparams: tuple[tuple[str, str, str, Any], ...]
    check: Callable[[dict, dict], list[str]] | None = None
    require_unset: tuple[str, ...] = ()
    swa_period: int | None = None
    # text config -> rotary keys under `{arch}.` (freq_base, freq_base_swa, scaling.*); raises
    # UserError for schemes llama.cpp's architecture cannot express
    rope: Callable[[dict], dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The part of Tunix's `ModelConfig` that the registry's `projections` and the layer loops read,
    under Tunix's attribute names, built from config.json without importing Tunix's model code
    (whose import time and memory would dominate a small merge or a serving check). Converters do not
    build a model, so they need no more; `--verify` builds the real config through the loader."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    head_dim: int
    hidden_dim: int
    # families whose layers differ (Gemma 4), from `Family.layout_fields`
    attention_pattern: tuple[str, ...] | None = None
    frac_shared_layers: float = 0.0
    k_eq_v_global: bool = False
    per_layer_input_dim: int = 0
    enable_moe: bool = False


def read_layout(hf_config: dict, family: "Family | None" = None) -> Layout:
    t = family.read_text_config(hf_config) if family is not None else text_config(hf_config)
    keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
            "intermediate_size")
    missing = [k for k in keys if t.get(k) is None]
    if missing:
        raise UserError(f"config.json: missing key '{missing[0]}'")
    extra = family.layout_fields(hf_config) if family is not None and family.layout_fields else {}
    return Layout(*(int(t[k]) for k in keys), **extra)


# config.json fields whose dimension is replicated, not refused, where the mesh axes on it do not divide it: the KV
# heads (a Gemma 4 E4B's 2, or 26B-A4B's, at tp=4). Queries stay split over tp and each tp shard holds every K and V
# head, as vLLM and MaxText copy KV heads over a tensor-parallel size above their count; the cost is the K/V
# projections (and their LoRA factors and optimizer state) whole on each tp shard, which the planner counts
# (`gemma_tpu.train.partition.resolve`, `sharded_weights.replicate_indivisible`). The vocabulary too: a model with
# tokens added to its 262,144 (262,145 rows) could use no tensor parallelism at all; its embedding is then whole on
# each tp shard (still split over fsdp along the hidden size).
REPLICATED_WHEN_INDIVISIBLE = frozenset({"num_key_value_heads", "num_global_key_value_heads", "vocab_size"})


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything that differs between model families, as data plus a few small functions."""

    name: str
    architectures: tuple[str, ...]  # HF `architectures` served by this family
    model_types: tuple[str, ...]  # HF `model_type` values (text config)
    tunix_config: Callable[[dict, Any], Any]  # (hf text config, param dtype) -> Tunix ModelConfig
    loader: Callable[..., Any]  # (family, dir, tunix cfg, mesh, dtype) -> nnx model
    projections: Callable[[Any], tuple[Projection, ...]]  # tunix cfg -> projections
    text_prefixes: tuple[str, ...]  # where decoder layers live in HF key names
    with_remat: Callable[[Any, str], Any]  # (tunix cfg, none|block|decoder) -> tunix cfg
    chat_format: str = "gemma"
    layer_path: str = "layers.{layer}"  # Tunix path of decoder layer N
    # Non-projection weights, for converting full fine-tunes (see `Tensor`).
    tensors: tuple[Tensor, ...] = ()
    # (tunix cfg or `Layout`, layer index or None for the model) -> feature names
    # that `Projection.requires` / `Tensor.requires` refer to. None: every layer alike.
    layer_features: Callable[[Any, int | None], frozenset[str]] | None = None
    # config.json (text part) -> extra `Layout` fields that `projections` and
    # `layer_features` read, under Tunix's attribute names, computed without importing Tunix.
    layout_fields: Callable[[dict], dict] | None = None
    # generation_config.json eos ids a merged model must stop on
    stop_token_ids: tuple[int, ...] = (1, 106)
    # The vocabulary's end-of-turn marker and its id: generation looks the id up in the tokenizer;
    # checks of a directory without loading its tokenizer (serving) use the recorded one.
    end_of_turn_token: str | None = None
    end_of_turn_id: int | None = None
    # The token the model hands over to a tool with (its generation stops there, a call written or not), as a server
    # names it in a completion's stop_reason: Gemma 3's FunctionGemma format `<start_function_response>` (which
    # convert.tool_tokens adds to a merge's stop ids), Gemma 4's `<|tool_response>` (in its stop_token_ids)
    call_stop_token: str | None = None
    # (FunctionGemma marker, the family's own token) pairs of a family whose chat template writes tool calls in a markup
    # of its own that mirrors FunctionGemma's (Gemma 4's `<|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>`): a reply
    # generated here is read with them as the FunctionGemma markup (`gemma_tpu.infer.generate`)
    call_markers: tuple[tuple[str, str], ...] = ()
    # (start, end, label) of a thinking model's thought in its reply (Gemma 4's `<|channel>thought\n...<channel|>`,
    # which its 26B and 31B write empty with thinking off where the prompt lacks their template's empty one): a reply
    # generated here is read as vLLM's reasoning parser for the family reads it, the thought apart from the answer
    # (`gemma_tpu.formats.gemma_chat.split_thought`), locally and in an endpoint's text
    thought_markers: tuple[str, str, str] | None = None
    # The control tokens the family's chat markup is written with (turns, tool declarations, calls and results, string
    # quotes, media): what message text must not hold where the served model's tokenizer is not at hand (a client of
    # an OpenAI-compatible server refuses every family's, `records.served_markup`); with the tokenizer, its special
    # tokens are read instead (`Renderer.control_tokens`)
    markup_tokens: tuple[str, ...] = ()
    # The `model_type` of the family's multimodal config (one of `model_types`), whose decoder transformers reads from
    # `text_config` alone: without one it builds its default text model, whatever the top level says
    multimodal_model_type: str | None = None
    # HF `layer_types` pattern: `sliding_window_pattern - 1` sliding-window layers, then one global layer.
    sliding_window_pattern: int | None = None
    # Serving on vLLM-TPU: the HF architectures it serves for this family and its tool-call parser.
    vllm_architectures: tuple[str, ...] = ()
    vllm_tool_parser: str | None = None
    vllm_tied_embeddings_only: bool = False  # vLLM's model has no separate lm_head for this family
    # config.json sizes vLLM splits evenly over --tensor-parallel-size (the MLP width: MergedColumnParallelLinear and
    # RowParallelLinear assert it divides when the engine builds the model; tpu-inference shards the same dimension)
    vllm_tp_split_sizes: tuple[str, ...] = ()
    # config.json sizes vLLM splits over --tensor-parallel-size unless --enable-expert-parallel spreads whole experts
    # over the chips instead: each expert's width (FusedMoE divides it by the TP size and asserts it divides)
    vllm_tp_expert_split_sizes: tuple[str, ...] = ()
    # products of config.json sizes that vLLM's own (PyTorch, MODEL_IMPL_TYPE=vllm) model splits evenly over
    # --tensor-parallel-size and tpu-inference's JAX model keeps whole: Gemma 4's per-layer input projection, a
    # ColumnParallelLinear of num_hidden_layers x hidden_size_per_layer_input outputs (it asserts that they divide)
    vllm_torch_tp_split_products: tuple[tuple[str, ...], ...] = ()
    # config.json keys that vLLM's own (PyTorch) model applies and transformers' class ignores (no field of its config;
    # a converted config.json may carry them): served there, the model would not be the one trained and merged.
    # Gemma 4: attn_logit_softcapping, which vLLM's Gemma4Attention takes as its logit cap
    vllm_torch_reads_unused_keys: tuple[str, ...] = ()
    # (text config as transformers reads it, whether tpu-inference's JAX model serves it) -> "<config.json key>=<value>,
    # why": RoPE parameters vLLM (or tpu-inference) applies otherwise than transformers and training do, or None
    vllm_rope_problem: Callable[[dict, bool], str | None] | None = None
    # (config.json) -> "<key>=<value>, why": another value vLLM's model applies otherwise than transformers' class of
    # that config.json (and training), or None
    vllm_config_problem: Callable[[dict], str | None] | None = None
    # (text config as transformers reads it, the modules a LoRA adapter changes: their paths, `...layers.N.k_proj`, or
    # bare names where its layers cannot be told) -> why vLLM would apply the adapter otherwise than transformers
    # (PEFT) and training do, or None
    vllm_lora_problem: Callable[[dict, Sequence[str]], str | None] | None = None
    # tpu-inference resolves MODEL_IMPL_TYPE=auto to its own JAX model for these architectures (flax_nnx), which takes
    # no LoRA adapter: `--enable-lora` works on the vllm (torchax) path only
    vllm_jax_native: bool = False
    # tpu-inference's JAX model reads the decoder's config from config.json's `text_config` and its weights under
    # `model.language_model.` (the multimodal layout): a text-only config.json fails at the engine's start
    vllm_jax_needs_text_config: bool = False
    # why a float16 copy of this family's weights is not served as float16 (None: it is)
    float16_problem: str | None = None
    model_class: Callable[[], type] | None = None  # the nnx class create_model builds (for abstract planning)
    # Tunix's own safetensors loader for this family: whole tensors on every host; kept as the
    # reference that tests check `create_model` (gemma_tpu.models.sharded_weights) against.
    reference_loader: Callable[..., Any] | None = None
    # Partition rules: (regex over the Tunix param path, per-dimension mesh axes), first full match wins;
    # LoRA factors, quantized weights and optimizer state derive theirs (gemma_tpu.train.partition).
    partition_rules: tuple[tuple[str, tuple], ...] = ()
    # (regex over the Tunix param path, the config.json field giving each dimension's size, None where none or
    # unsure): what a refusal of a mesh axis that does not divide a dimension names (gemma_tpu.train.partition)
    partition_dims: tuple[tuple[str, tuple[str | None, ...]], ...] = ()
    # text config (as transformers reads it) -> for each HF projection name, the HF (out, in) shapes it has across
    # the decoder's layers (Gemma 4's global layers have their own head size and KV heads): what is checked
    # before any weight is read (the LoRA rank). {} where a size it needs is not a positive integer.
    projection_shapes: Callable[[dict], dict[str, tuple[tuple[int, int], ...]]] | None = None
    # text config (as transformers reads it) -> the shape of each non-projection weight (embeddings, norms, layer
    # scalars, ...) by its HF key under the decoder prefix: what a merge checks the base tensors it copies against
    # (a wrong-length norm was published, a model transformers refuses to load). {} where a size it needs is not a
    # positive integer; keys it omits are not checked.
    tensor_shapes: Callable[[dict], dict[str, tuple[int, ...]]] | None = None
    # (config.json, the base's tensor names) -> the shape its vision_config (audio_config) gives each of those names
    # that is a weight of a vision (audio) tower or its projection the family knows: what a merge checks the towers
    # it copies against (one of another shape was published, a model transformers refuses to load). Names it does
    # not know, and sizes that are not positive integers, are left out (not checked).
    tower_shapes: Callable[[dict, list[str]], dict[str, tuple[int, ...]]] | None = None
    # config.json -> its text config as transformers reads it: keys it omits at transformers' defaults,
    # keys transformers derives (Gemma 3's `layer_types` from `sliding_window_pattern`) filled in.
    # None: the text config as written.
    hf_text_config: Callable[[dict], dict] | None = None

    def dim_fields(self, path: str) -> tuple[str | None, ...]:
        """The config.json field behind each dimension of the (base, unquantized) weight `path` ('layers.3.attn.
        kv_einsum.w'), from `partition_dims`; () where the registry does not say."""
        for pattern, fields in self.partition_dims:
            if re.fullmatch(pattern, path):
                return fields
        return ()

    def create_model(self, file_dir: str, cfg: Any, mesh=None, dtype=None):
        """The Tunix model of `cfg` with the weights of `file_dir`, each read straight into its shard."""
        return self.loader(self, file_dir, cfg, mesh=mesh, dtype=dtype)

    def text_prefix(self, keys) -> str:
        """Which of the family's decoder prefixes a checkpoint with these weight names uses."""
        for prefix in sorted(self.text_prefixes, key=len, reverse=True):
            if any(k.startswith(prefix + "layers.") for k in keys):
                return prefix
        raise UserError(f"no decoder layers found under any of {', '.join(self.text_prefixes)}")
    # llama.cpp's view of the family (GGUF export); None: `convert.export_gguf` refuses it.
    gguf: GGUFFacts | None = None

    def layer_types(self, n_layers: int, period: int | None = None) -> list[str]:
        """HF `layer_types` of the family's attention pattern (or of `period`: every period-th layer
        global, transformers' `sliding_window_pattern`) for `n_layers` decoder layers."""
        period = period or self.sliding_window_pattern
        if not period:
            raise ValueError(f"model family {self.name} has no fixed attention pattern")
        return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]

    def pattern_departure(self, t: dict, period: int | None = None) -> str | None:
        """Where a text config's `layer_types` (as `read_text_config` gives it) departs from the family's attention
        pattern (or `period`'s), naming the key config.json has and what it needs: 'sliding_window_pattern=3 (6
        expected)' when the types were derived from that key, else the first entry that differs,
        "layer_types[0]='full_attention' ('sliding_attention' expected)"; None where it follows the pattern."""
        types = list(t.get("layer_types") or [])
        want = self.layer_types(len(types), period)
        if types == want:
            return None
        key = t.get("_layer_types_key", "layer_types")  # set by `hf_text_config` when derived from another key
        if key != "layer_types":
            return f"{key}={t.get(key)!r} ({period or self.sliding_window_pattern} expected)"
        i = next(i for i, (got, need) in enumerate(zip(types, want)) if got != need)
        return f"layer_types[{i}]={types[i]!r} ({want[i]!r} expected)"

    def read_text_config(self, hf_config: dict) -> dict:
        """The decoder's config with the values transformers would use for it (see `hf_text_config`)."""
        return self.hf_text_config(hf_config) if self.hf_text_config else text_config(hf_config)

    def features(self, cfg: Any, layer: int | None) -> frozenset[str]:
        return self.layer_features(cfg, layer) if self.layer_features else frozenset()

    def layer_projections(self, cfg: Any, layer: int) -> list[Projection]:
        """The projections decoder layer `layer` really has (all of them unless layers differ)."""
        feats = self.features(cfg, layer)
        return [p for p in self.projections(cfg) if p.requires is None or p.requires in feats]

    def targets_to_modules(self, tunix_cfg: Any, targets: list[str]) -> list[Projection]:
        """Map HF target names to projections; fused Tunix weights need all their HF names.

        One HF name may live in several Tunix weights (Gemma 4's k_proj: `kv_einsum` in some
        layers, `k_einsum` in others); all of them that some layer has are chosen (a Gemma 4 whose
        layers are all K=V global has no `kv_einsum`, so k_proj alone is a complete target there)."""
        projs = self.projections(tunix_cfg)
        names = list(dict.fromkeys(p.hf_name for p in projs))
        unknown = [t for t in targets if t not in names]
        if unknown:
            raise UserError(
                f"lora.targets: {unknown[0]!r} is not a projection of family {self.name} "
                f"(known: {', '.join(names)})"
            )
        present = {p for layer in range(tunix_cfg.num_layers) for p in self.layer_projections(tunix_cfg, layer)}
        projs = [p for p in projs if p in present]
        chosen = [p for t in dict.fromkeys(targets) for p in projs if p.hf_name == t]
        if targets and not chosen:
            want, have = " or ".join(dict.fromkeys(targets)), ", ".join(dict.fromkeys(p.hf_name for p in projs))
            raise UserError(f"lora.targets: no layer of this {self.name} model has {want} (its layers have {have})")
        for p in chosen:
            siblings = [q.hf_name for q in projs if q.tunix_module == p.tunix_module]
            missing = [s for s in siblings if s not in targets]
            if missing:
                raise UserError(
                    f"lora.targets: {p.hf_name} shares one Tunix weight ({p.tunix_module}) with "
                    f"{', '.join(missing)}; target {' and '.join(siblings)} together or not at all"
                )
        return chosen

    def layer_sites(self, cfg: Any, chosen: list[Projection]) -> list[tuple[int, Projection]]:
        """(layer, projection) for every chosen projection that exists in that layer."""
        return [(layer, p) for layer in range(cfg.num_layers)
                for p in self.layer_projections(cfg, layer) if p in chosen]

    def expanded_tensors(self, cfg: Any) -> list[tuple[str, str, Tensor]]:
        """(Tunix name, HF key under the decoder prefix, Tensor) for every non-projection weight."""
        out = []
        for t in self.tensors:
            layers = range(cfg.num_layers) if "{i}" in t.tunix else [None]
            for i in layers:
                if t.requires is None or t.requires in self.features(cfg, i):
                    out.append((t.tunix.format(i=i), t.hf.format(i=i), t))
        return out

    def weight_sources(self, cfg: Any, prefix: str) -> list[tuple[str, str, "Projection | Tensor"]]:
        """(HF key, Tunix param name, the Projection/Tensor relating them) for every decoder weight
        of a checkpoint whose decoder keys start with `prefix`: the one table both directions use
        (loading HF -> Tunix, converting full fine-tunes Tunix -> HF)."""
        out = [(prefix + hf_rel, tunix_name, tensor) for tunix_name, hf_rel, tensor in self.expanded_tensors(cfg)]
        for layer in range(cfg.num_layers):
            for proj in self.layer_projections(cfg, layer):
                tunix = f"{self.layer_path.format(layer=layer)}.{proj.tunix_module}.{proj.tunix_param}"
                out.append((self.hf_key(prefix, layer, proj), tunix, proj))
        return out

    def tunix_module_regex(self, projections: list[Projection]) -> str:
        """A Qwix `module_path` regex matching exactly the chosen Tunix modules."""
        # Qwix full-matches '/'-joined module paths, e.g. 'layers/3/attn/q_einsum'.
        mods = sorted({re.escape(p.tunix_module.replace(".", "/")) for p in projections})
        return r"layers/\d+/(?:" + "|".join(mods) + r")"

    def hf_key(self, prefix: str, layer: int, proj: Projection) -> str:
        return f"{prefix}layers.{layer}.{proj.hf_module}.weight"

    def required_weights(self, hf_config: dict, prefix: str) -> list[str]:
        """Every HF tensor name a checkpoint of this config.json must hold, its decoder under `prefix`: the
        decoder weights `weight_sources` lists for the config's layout (layer count, fused or K=V attention,
        per-layer embeddings, experts, q/k norms: the table the loader and the full fine-tune merge use), and
        `lm_head.weight` when the embeddings are untied. Reads config.json only (no Tunix)."""
        names = [key for key, _, _ in self.weight_sources(read_layout(hf_config, self), prefix)]
        return names + ([] if tied_embeddings(hf_config) else ["lm_head.weight"])


_FAMILIES: dict[str, Family] = {}


def tunix_safetensors_loader(tunix_family: str, model_class: Callable[[], type], key_mapping: Callable) -> Callable:
    """`create_model(file_dir, cfg, mesh, dtype)` through Tunix's safetensors loader (single or sharded),
    with our model subclass and widened key mapping, and Tunix's own per-family preprocessing."""

    def create_model(file_dir: str, cfg, mesh=None, dtype=None):
        import importlib

        from tunix.models import safetensors_loader

        ps = importlib.import_module(f"tunix.models.{tunix_family}.params_safetensors")
        return safetensors_loader.load_and_create_model(
            file_dir=file_dir, model_class=model_class(), config=cfg, key_mapping=key_mapping, mesh=mesh,
            preprocess_fn=ps._make_preprocess_fn(cfg), dtype=dtype)

    return create_model


def tunix_remat(tunix_family: str) -> Callable:
    """`with_remat(cfg, none|block|decoder)` onto the family's Tunix RematConfig."""

    def with_remat(cfg, remat: str):
        import importlib

        rc = importlib.import_module(f"tunix.models.{tunix_family}.model").RematConfig
        return dataclasses.replace(cfg, remat_config={"none": rc.NONE, "block": rc.BLOCK, "decoder": rc.DECODER}[remat])

    return with_remat


def register(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    return dict(_FAMILIES)


def get_family(name: str, key: str | None = None) -> Family:
    """The family called `name`; `key` is the setting it came from (model.family), named when it is unknown."""
    if name not in _FAMILIES:
        raise UserError(f"{key + ': ' if key else ''}unknown model family {name!r} "
                        f"(known: {', '.join(sorted(_FAMILIES))}; leave it unset to detect it from config.json)")
    return _FAMILIES[name]


def supported_architectures() -> list[str]:
    return sorted({a for f in _FAMILIES.values() for a in f.architectures})


def text_config(hf_config: dict) -> dict:
    """The decoder's config: multimodal checkpoints nest it under `text_config`."""
    nested = hf_config.get("text_config")
    return nested if isinstance(nested, dict) and nested else hf_config


def tied_embeddings(hf_config: dict) -> bool:
    """Whether the output projection is the input embedding: the flag transformers reads (the top
    level of a multimodal config, the text config's own of a text model); Gemma ties unless it says otherwise.
    A multimodal config without the flag at its top is tied whatever its text_config says (Gemma3Config's and
    Gemma4Config's default: transformers builds and loads it tied, with no lm_head.weight)."""
    t = text_config(hf_config)
    nested = t is not hf_config
    # bool("false") is True: a string must not tie an untied model (transformers refuses it)
    check_types(hf_config, {"tie_word_embeddings": "bool|None" if nested else "bool"})
    if nested:
        check_types(t, {"tie_word_embeddings": "bool"}, "text_config.")  # transformers builds the text config too
    return bool(hf_config.get("tie_word_embeddings", True))

def top_level_rotary_share(t: dict, rope_keys, layer_types) -> bool:
    """Whether a `partial_rotary_factor` at the top of config.json (`t`) is laid over the rope_parameters entries
    (`rope_keys`: their keys as transformers fills them in) when transformers builds proportional or linear RoPE (and
    vLLM its config): standardize_rope_params does so only where every such key is one of the model's `layer_types`."""
    return t.get("partial_rotary_factor") is not None and set(rope_keys) <= set(layer_types)


def output_projection_prefixes(text_prefix: str) -> tuple[str, ...]:
    """Where a checkpoint whose decoder layers are under `text_prefix` keeps an output projection (`lm_head.weight`:
    an untied model's, or a tied one's copy of the embedding): at the top (`model.`, and transformers' own multimodal
    layout, `model.language_model.`), or beside the decoder in the layout published multimodal checkpoints use
    (`language_model.model.` and `language_model.lm_head.`)."""
    parent, _, last = text_prefix.rstrip(".").rpartition(".")
    return ("lm_head.",) + ((f"{parent}.lm_head.",) if last == "model" and parent else ())


_JSON_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None)}


def _has_type(value: Any, spec: str) -> bool:
    for alt in spec.split("|"):
        if alt == "list[str]":
            if isinstance(value, list) and all(isinstance(x, str) for x in value):
                return True
        elif type(value) is _JSON_TYPES[alt]:  # exact: True is no int, 4 no float, as transformers checks
            return True
    return False


def check_types(config: dict, types: dict[str, str], where: str = "") -> None:
    """Refuse, naming the key, a value that is not of the type transformers declares for it (`types`:
    key -> "int", "float|None", "list[str]|None", ...). transformers 5 builds no model from such a config
    (`"num_attention_heads": "4"`, `"rms_norm_eps": 1`, `"final_logit_softcapping": 30` are refused when
    it reads config.json), so a run on it could never be merged, reloaded or served; `int("4")` here would
    have trained it silently."""
    for key, spec in types.items():
        if key in config and not _has_type(config[key], spec):
            raise UserError(f"config.json: {where}{key}={config[key]!r} is not of type {spec.replace('|', ' or ')} "
                            f"(transformers cannot build a model from it)")


def positive_sizes(t: dict, keys: tuple[str, ...]) -> dict[str, int] | None:
    """The values of `keys` when each is a positive integer, else None (refused later, by the family's config)."""
    sizes = {k: t.get(k) for k in keys}
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes.values())
    return sizes if ok else None


def tower_tensor_shapes(names: list[str], towers: list[tuple]) -> dict[str, tuple[int, ...]]:
    """The shape config.json gives each of `names` that a tower table knows (for `Family.tower_shapes`). Each tower is
    (tower_key, layer_key, embed_key, tower, layer, embed): `tower_key` matches the tower's tensors (its group, the
    rest of the name), `layer_key` an encoder layer's rest (its group, the name within the layer), `embed_key` the
    projection into the text model's; the three dicts map those rests to shapes."""
    out = {}
    for name in names:
        for tower_key, layer_key, embed_key, tower, layer, embed in towers:
            m = tower_key.fullmatch(name)
            if m:
                lm = layer_key.fullmatch(m.group(1))
                want = layer.get(lm.group(1)) if lm else tower.get(m.group(1))
            else:
                m = embed_key.fullmatch(name)
                want = embed.get(m.group(1)) if m else None
            if want is not None:
                out[name] = want
    return out


def require_positive(t: dict, keys: tuple[str, ...]) -> None:
    """Refuse, naming the key, a size of 0 or less (`"vocab_size": 0`, `"head_dim": -16`): transformers builds
    such a config, but no checkpoint's weights have that shape, and Tunix took it silently (a negative one died
    in a JAX broadcast traceback at load; a 0 `global_head_dim` was read as `head_dim`)."""
    for key in keys:
        v = t.get(key)
        if v is not None and v < 1:
            raise UserError(f"config.json: {key}={v!r} must be a positive integer")


def text_config_with_defaults(hf_config: dict, defaults: dict, types: dict[str, str] | None = None) -> dict:
    """The decoder's config as transformers reads it: values of the types transformers declares (`types`,
    see `check_types`), keys config.json omits at the family's transformers defaults (`defaults`),
    `tie_word_embeddings` where transformers reads it (`tied_embeddings`)."""
    raw = text_config(hf_config)
    check_types(raw, types or {}, "text_config." if raw is not hf_config else "")
    t = dict(raw)
    for key, value in defaults.items():
        t.setdefault(key, value)
    t["tie_word_embeddings"] = tied_embeddings(hf_config)
    return t


def require_tied_embeddings(hf_config: dict, model: str) -> None:
    """Tunix's Gemma models project onto the vocabulary with the input embedding: an untied
    checkpoint's own `lm_head.weight` would be ignored, so it is refused."""
    if not tied_embeddings(hf_config):
        raise UserError(f"config.json: tie_word_embeddings=false is not supported ({model} projects onto the "
                        f"vocabulary with the input embedding; there is no separate lm_head)")


def attention_dropout_warning(hf_config: dict, where: str = "config.json") -> str | None:
    """config.json's attention_dropout > 0, which transformers applies in training (a recipe ported from PEFT trains
    with it) and Tunix's Gemma attention does not have: said once, where it was silently not applied. Inference is
    unaffected (no dropout there on either side)."""
    rate = text_config(hf_config).get("attention_dropout")
    if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
        return (f"{where}: attention_dropout={rate} is not applied in training (the JAX Gemma attention has no "
                f"dropout; transformers applies it); LoRA's own dropout is lora.dropout")
    return None


def detect_family(hf_config: dict, where: str = "config.json") -> Family:
    """Pick the family from `architectures` / `model_type`; unknown ones get a clear error."""
    archs = list(hf_config.get("architectures") or [])
    model_types = {hf_config.get("model_type"), text_config(hf_config).get("model_type")}
    for fam in _FAMILIES.values():
        if any(a in fam.architectures for a in archs):
            other = hf_config.get("model_type")
            if isinstance(other, str) and other and other not in fam.model_types:
                # Gemma3ForCausalLM with model_type llama trained as a Gemma 3, and its merge was refused only after
                # training: transformers builds the model model_type names (a Llama here), not the architecture
                raise UserError(f"{where}: architectures {', '.join(map(str, archs))} but model_type {other!r}, "
                                f"which transformers loads as another model (a {fam.name} config.json has "
                                f"{' or '.join(fam.model_types)}); fix the file")
            return _nested_as_read(fam, hf_config, where)
    if not archs:
        for fam in _FAMILIES.values():
            if model_types & set(fam.model_types):
                return _nested_as_read(fam, hf_config, where)
    got = ", ".join(a for a in archs) or f"model_type {hf_config.get('model_type')!r}"
    raise UserError(
        f"{where}: unsupported architecture {got}; supported: {', '.join(supported_architectures())}"
    )


def _nested_as_read(fam: Family, hf_config: dict, where: str) -> Family:
    """`fam`, unless config.json's model_type is the family's multimodal config and it has no text_config (or an empty
    one): transformers then builds its default text model (a Gemma 3's hidden_size 2304) and leaves the checkpoint's
    weights out, where the decoder's keys at the top were read here (training, generation) as the model. Nor where
    its model_type is the family's text config and it holds a text_config too: transformers reads a text config's
    decoder at its top and keeps the nested one (even {}) as it is, on which building the model fails ('dict' object
    has no attribute 'to_dict'), where the nested keys were read here as the model."""
    model_type = hf_config.get("model_type")
    if isinstance(model_type, str) and model_type in fam.model_types and model_type != fam.multimodal_model_type \
            and hf_config.get("text_config") is not None:  # {} too: transformers fails on any but null
        raise UserError(f"{where}: model_type {model_type!r} is a text config, whose decoder transformers reads at its "
                        f"top level, yet it holds a text_config, with which transformers cannot build the model: "
                        f"remove text_config (its keys are not read)"
                        + (f", or set model_type {fam.multimodal_model_type!r} for a multimodal config"
                           if fam.multimodal_model_type else ""))
    if fam.multimodal_model_type is not None and model_type == fam.multimodal_model_type \
            and text_config(hf_config) is hf_config:
        text_type = next(t for t in fam.model_types if t != model_type)
        raise UserError(f"{where}: model_type {model_type!r} is the multimodal config, whose decoder transformers "
                        f"reads from text_config, and there is none: transformers builds its default text model, not "
                        f"the one this file describes; for a text-only model set model_type {text_type!r}, else nest "
                        f"the decoder's keys under text_config")
    return fam


def described_family(hf_config: dict, where: str = "config.json") -> Family | None:
    """The family config.json describes; None where no family claims its architecture (a setting decides then)."""
    try:
        return detect_family(hf_config, where)
    except UserError:
        return None


def choose_family(hf_config: dict, name: str | None = None, key: str = "model.family",
                  where: str = "config.json") -> Family:
    """The family `name` names (`key`: the setting it came from), else the one config.json (`where`) describes.

    A name is for a config.json whose architecture no family claims; one that contradicts the config's (a Gemma 3
    checkpoint with model.family=gemma4) is refused: read as the other family's config, the model failed on keys
    its file does not have (a Gemma 3 as Gemma 4: 'vocab_size_per_layer_input=262144', transformers' Gemma 4
    default), and the merge refuses such a checkpoint's base anyway."""
    if not name:
        return detect_family(hf_config, where)
    family = get_family(name, key)
    described = described_family(hf_config, where)
    if described is not None and described is not family:  # None: an architecture no family claims, name decides
        archs = hf_config.get("architectures") or []
        what = f"architectures {', '.join(map(str, archs))}" if archs else f"model_type {hf_config.get('model_type')!r}"
        raise UserError(f"{key}={name} contradicts {where} ({what}: a {described.name} model); leave {key} unset "
                        f"to use the family config.json describes")
    return _nested_as_read(family, hf_config, where)
