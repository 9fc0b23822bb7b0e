"""Plan before launch: per-device memory and step time of a run, from config.json alone.

`python -m gemma_tpu.train --config FILE --dry-run [overrides]` (or `python -m gemma_tpu.plan ...`)
reads the model's config.json (`gemma_tpu.hf.directory.config_json_for`: a local dir, the Hugging Face cache or a
shipped preset - no weights, no download), builds the model *abstractly* (`nnx.eval_shape`: every
parameter's shape and dtype, nothing allocated), places every parameter with the partition rules
(`gemma_tpu.train.partition`) on the configured mesh, and adds up what one device holds. It exits 2, with
a one-line reason naming the biggest term, when the total exceeds the accelerator's HBM less a
safety margin of `SAFETY_MARGIN` (15%: XLA's own reservations, fragmentation, and the error of the
activation estimate below).

Per device (a dimension split over mesh axes holds size / product-of-axis-sizes; see `partition`):

* base params - every base weight at `model.dtype`; with QLoRA (`lora.base_quantization`) the
  targeted projection weights at 1 byte (int8) or 0.5 byte (nf4) per element plus one scale per
  output channel (`model.dtype`). The weights are loaded at `model.dtype` and quantized afterwards,
  so the *load peak* (full-precision base + quantized copies) is checked too.
* LoRA params - A (in × r) and B (r × out) per targeted projection and layer, at `model.dtype`
  (Qwix creates them in the base weight's dtype), sharded like the base weight.
* optimizer state - adamw: mu and nu, each the trainable parameters' size and dtype (optax keeps
  them in the parameter dtype: 2 × 4 bytes per trainable parameter in float32, 2 × 2 in
  bfloat16); adafactor: factored second moments (row + column vectors for dims ≥ 128, a full copy
  otherwise; parameter dtype); sgd: none. Gradient accumulation (`train.grad_accum_steps` > 1, optax
  MultiSteps) adds one accumulator of the trainable size.
* gradients - one copy of the trainable parameters (live during the update).
* activations - what the backward pass keeps, per micro-batch. With b = bytes of `model.dtype`,
  t = tokens per device = (batch_size / (data·fsdp)) × seq_len, per layer l with model dim D, query
  heads N × head size Hq, KV heads K × head size Hk, MLP width F (+ top-k × expert width for MoE),
  attention over T = seq_len keys (Tunix materialises the full T×T scores, also in sliding layers),
  and model dims split tp ways:

      full_l  = b·(8·D + 6·N·Hq + 6·K·Hk + 8·F − u)/tp + 3·b·N·T/tp      bytes per token
                (residual and norm outputs; q, k, v before and after norm/RoPE, the scaled queries
                and the attention output; gate, up, the tanh-GELU's intermediates and the product;
                the attention logits, probabilities and their gradient: the coefficients are fitted
                to XLA's compiled memory (CPU) from 2 to 6 layers, 4 to 8 heads, head sizes 16 to
                256, widths 64 to 640 - within 0.95-1.25 of it, where one copy of the
                probabilities per layer gave 0.55 at 270M-like widths; these are for LoRA on all seven
                projections or a full fine-tune. u: what the projections a LoRA run leaves untargeted save,
                `UNTARGETED_SAVES`: 3·N·Hq for q, 1.5·2·K·Hk for k and for v, 2·N·Hq for o, 1.25·F for gate
                and for up, F for down, fitted likewise)
      saved_l = full_l               remat none
              = b·8·D/tp             remat block   (attention and MLP blocks recomputed)
              = b·D/tp               remat decoder (only each layer's input is kept)

      activations = t·Σ_l saved_l + t·max_l full_l·[remat ≠ none]   (one layer recomputed at a time)
                    + t·T (attention mask) + t·2·b·D/tp (final norm) + loss logits

  The loss projects at most 1024 loss positions at a time onto the vocabulary (float32 logits and
  their gradient): 2·4·min(1024, rows)·V bytes, rows = loss positions per device (from
  `data.max_loss_tokens`, else assumed seq_len).
* batch inputs - seven int32/float32 arrays of the micro-batch.

Time: FLOPs per step from `gemma_tpu.train.flops` with the exact projection sizes of the abstract model,
tokens per step = batch_size × seq_len × grad_accum_steps, step time = FLOPs / (devices × peak bf16
FLOP/s × assumed MFU).

When the model is small enough to compile here (`COMPILE_LIMIT` parameters: the tiny test models),
the real train step is also compiled on the local devices (random weights, nothing loaded) and XLA's
`memory_analysis()` is printed beside our estimate for the same local mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import sys
from typing import Any, Sequence

from gemma_tpu import lora as lora_lib
from gemma_tpu.core import cli
from gemma_tpu.core.accelerators import ACCELERATORS
from gemma_tpu.core.config import RunConfig, validate_for_model
from gemma_tpu.core.errors import UserError
from gemma_tpu.core.tracing import cheap_tracer_attribute_errors
from gemma_tpu.hf.directory import config_json_for, naming_config_file
from gemma_tpu.models.registry import choose_family
from gemma_tpu.train import flops as flops_lib
from gemma_tpu.train import mesh as mesh_lib
from gemma_tpu.train import partition
from gemma_tpu.train.mesh import mesh_shape
from gemma_tpu.train.partition import flat_params

SAFETY_MARGIN = 0.15
DEFAULT_MFU = 0.4
COMPILE_LIMIT = 50_000_000  # parameters: compile the real step on CPU only below this
LOSS_CHUNK = 1024  # rows projected onto the vocabulary at a time (gemma_tpu.train.loss)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_QUANT_BYTES = {"int8": 1.0, "nf4": 0.5}


@dataclasses.dataclass
class Term:
    name: str
    bytes: float  # per device
    note: str = ""


@dataclasses.dataclass
class Plan:
    model: str
    family: str
    accelerator: str
    mesh: dict[str, int]
    n_devices: int
    dtype: str
    remat: str
    terms: list[Term]
    load_peak: float
    hbm: float
    total_params: int
    trainable_params: int
    tokens_per_step: int
    flops_per_step: float
    assumed_mfu: float
    step_time_s: float | None
    notes: list[str] = dataclasses.field(default_factory=list)
    compiled: dict | None = None
    data: dict | None = None  # the training split's layout (data_layout), when it could be read here

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def usable(self) -> float:
        return self.hbm * (1 - SAFETY_MARGIN)

    @property
    def fits(self) -> bool:
        return not self.hbm or max(self.total, self.load_peak) <= self.usable

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)

    def refusal(self) -> str | None:
        """One line naming the biggest term, or None when the plan fits."""
        if self.fits:
            return None
        gib = 2 ** 30
        biggest = max(self.terms, key=lambda t: t.bytes)
        if self.load_peak > self.total and self.load_peak > self.usable:
            what = f"loading the base at {self.dtype} before quantizing needs {self.load_peak / gib:.1f} GiB"
        else:
            what = f"needs {self.total / gib:.1f} GiB"
        return (f"plan does not fit {self.accelerator}: {what} per device, more than {self.usable / gib:.1f} GiB "
                f"({self.hbm / gib:.0f} GiB HBM less a {SAFETY_MARGIN:.0%} margin); biggest term: {biggest.name} "
                f"{biggest.bytes / gib:.1f} GiB" + (f" ({biggest.note})" if biggest.note else ""))


# ---------------------------------------------------------------- the abstract model


def model_class(family):
    """The nnx model class a family's loader builds (registry data)."""
    if family.model_class is None:
        raise UserError(f"family {family.name}: the registry gives no model_class to plan with")
    return family.model_class()


def abstract_model(family, hf_config: dict, dtype: str = "float32", remat: str = "none"):
    """(abstract nnx model, Tunix config): shapes, dtypes and sharding annotations, no memory."""
    import jax.numpy as jnp
    from flax import nnx

    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    tcfg = family.with_remat(family.tunix_config(hf_config, jdtype), remat)
    cls = model_class(family)
    with cheap_tracer_attribute_errors():  # 30 of the 27B's 45 s went into tracer error texts
        return nnx.eval_shape(lambda: cls(tcfg, rngs=nnx.Rngs(params=0))), tcfg


def _flat_shapes(model) -> dict[str, tuple[tuple[int, ...], str]]:
    return {p: (tuple(v.shape), str(v.dtype)) for p, v in flat_params(model)}


@dataclasses.dataclass
class LayerDims:
    D: int
    nq: int  # query heads × head size
    heads: int
    nkv: int  # 2 × KV heads × head size (K and V), 0 when the layer reuses another layer's
    F: int  # MLP width (+ routed experts' active width)
    matmul: int  # projection weight elements (active ones for MoE)


def loss_positions(cfg: RunConfig) -> int:
    """Loss positions a row: data.max_loss_tokens capped at seq_len as the data pipeline caps it
    (`data.batching.loss_buffer_size`); seq_len when unset (the data not counted)."""
    T = cfg.data.seq_len
    return min(cfg.data.max_loss_tokens or T, T)


def step_flops(cfg: RunConfig, tcfg, dims: list[LayerDims]) -> flops_lib.StepFlops:
    """A training step's FLOPs from each layer's real sizes (`layer_dims`): Gemma 4's global layers have their
    own head size and KV heads, its MoE layers routed experts, which the uniform formula of
    `flops_lib.training_flops` misses. The planner and the trainer's MFU both count with this."""
    return flops_lib.training_flops(tcfg, cfg.data.seq_len, cfg.lora.rank if cfg.lora.enabled else None,
                                    len(cfg.lora.targets), matmul_params=sum(d.matmul for d in dims),
                                    attn_dims=sum(d.nq for d in dims))


def model_dims(model, tcfg) -> list[LayerDims]:
    """`layer_dims` of an (abstract) model."""
    return layer_dims(_flat_shapes(model), tcfg)


def layer_dims(shapes: dict, tcfg) -> list[LayerDims]:
    """Per decoder layer, the sizes the activation and FLOP formulas need, read off the weights."""
    out = []
    D = tcfg.embed_dim
    topk = getattr(tcfg, "num_experts_per_tok", None) or 0
    for i in range(tcfg.num_layers):
        pre = f"layers.{i}."

        def shape(name):
            return shapes.get(pre + name, (None,))[0]

        nq = heads = nkv = F = matmul = 0
        if shape("attn.qkv_einsum.w"):
            _, n, _, h = shape("attn.qkv_einsum.w")
            nq, heads, nkv = n * h, n, 2 * n * h
        if shape("attn.q_einsum.w"):
            n, _, h = shape("attn.q_einsum.w")
            nq, heads = n * h, n
        if shape("attn.kv_einsum.w"):
            _, k, _, h = shape("attn.kv_einsum.w")
            nkv = 2 * k * h
        if shape("attn.k_einsum.w"):
            k, _, h = shape("attn.k_einsum.w")
            nkv = 2 * k * h  # keys double as values: both are kept
        if shape("mlp.gate_proj.kernel"):
            F = shape("mlp.gate_proj.kernel")[1]
        for name, (shp, _) in shapes.items():
            if not name.startswith(pre):
                continue
            rest = name[len(pre):]
            n = math.prod(shp)
            if re.fullmatch(r"(attn\.\w+_einsum\.w|mlp\.\w+_proj\.kernel|per_layer_\w+\.w)", rest):
                matmul += n
            elif re.fullmatch(r"moe\.(gating_einsum|linear)", rest):
                matmul += n * topk // max(shp[0], 1)
        if shape("moe.gating_einsum"):
            F += topk * shape("moe.gating_einsum")[2]
        out.append(LayerDims(D, nq, heads, nkv, F, matmul))
    return out


# What a projection that carries no LoRA saves of `full_l` (values per token; the formula's coefficients are for all
# seven targeted, or a full fine-tune): a LoRA site keeps its input for A's gradient, and XLA then keeps more around
# it. Fitted to XLA's compiled peak (CPU, 3 and 6 layers, GQA and MHA) with one to four of the seven targeted: within
# 0.96-1.01 of it, where counting all seven gave 1.2-1.34.
UNTARGETED_SAVES = {"q_proj": lambda d: 3 * d.nq, "k_proj": lambda d: 1.5 * d.nkv, "v_proj": lambda d: 1.5 * d.nkv,
                    "o_proj": lambda d: 2 * d.nq, "gate_proj": lambda d: 1.25 * d.F,
                    "up_proj": lambda d: 1.25 * d.F, "down_proj": lambda d: d.F}


def activation_bytes(dims: list[LayerDims], tokens: float, seq_len: int, b: int, tp: int, remat: str,
                     vocab: int, loss_rows: float, untargeted: frozenset[str] = frozenset()) -> tuple[float, str]:
    """The activation formula of the module docstring; returns (bytes, a short breakdown). `untargeted`: the
    projections of `UNTARGETED_SAVES` that a LoRA run leaves without LoRA."""

    def full(d: LayerDims) -> float:
        saved = sum(UNTARGETED_SAVES[name](d) for name in untargeted)
        return b * (8 * d.D + 6 * d.nq + 3 * d.nkv + 8 * d.F - saved) / tp + 3 * b * d.heads * seq_len / tp

    def saved(d: LayerDims) -> float:
        return {"none": full(d), "block": b * 8 * d.D / tp, "decoder": b * d.D / tp}[remat]

    if not dims:
        return 0.0, ""
    layers = tokens * sum(saved(d) for d in dims)
    recompute = tokens * max(full(d) for d in dims) if remat != "none" else 0.0
    mask = tokens * seq_len
    final = tokens * 2 * b * dims[0].D / tp
    loss = 2 * 4 * min(LOSS_CHUNK, loss_rows) * vocab
    note = (f"layers {_gib(layers).strip()} + recompute {_gib(recompute).strip()} + mask "
            f"{_gib(mask).strip()} + loss logits {_gib(loss).strip()}")
    return layers + recompute + mask + final + loss, note


# ---------------------------------------------------------------- the plan


def plan_devices(cfg: RunConfig, devices: int | None) -> int:
    """How many devices the plan is for: the mesh sizes when all are given, else `devices`, else
    (CPU only) the local ones."""
    m = cfg.mesh
    sizes = [m.data, m.fsdp, m.tp]
    if -1 not in sizes:
        n = math.prod(sizes) * max(m.dcn_data, 1)
        if devices and devices != n:  # planned for n, --devices unsaid, where a run on `devices` refuses the mesh
            dcn = f" × mesh.dcn_data={m.dcn_data}" if m.dcn_data > 1 else ""
            raise UserError(f"--devices {devices}: mesh.data={m.data} × mesh.fsdp={m.fsdp} × mesh.tp={m.tp}{dcn} "
                            f"make {n} devices, and a run on {devices} refuses that mesh; give one axis -1 (the rest "
                            f"of the devices) or sizes that make {devices}, or leave --devices out")
        return n
    if devices:
        return devices
    if m.accelerator == "cpu":
        import jax

        return jax.device_count()
    axis = ["data", "fsdp", "tp"][sizes.index(-1)]
    raise UserError(f"mesh.{axis}=-1: give every mesh axis a size for a {m.accelerator} plan "
                    f"(or --devices N)")


def check_plan_args(devices: int | None, assumed_mfu: float | None) -> None:
    """`--devices` a positive count, `--assumed-mfu` a fraction in (0, 1] (0 divided the step time by
    zero, a negative or NaN one printed a negative or NaN step time)."""
    if devices is not None and devices < 1:
        raise UserError(f"--devices must be a positive number of devices, got {devices}")
    if assumed_mfu is not None and not 0 < assumed_mfu <= 1:
        raise UserError(f"--assumed-mfu must be a fraction in (0, 1], e.g. 0.4, got {assumed_mfu}")


def family_of(cfg: RunConfig, hf_config: dict, where: str | None = None):
    """The family `model.family` names (its key named when unknown), else the one config.json describes."""
    return choose_family(hf_config, cfg.model.family, "model.family", where or "config.json")


def make_plan(cfg: RunConfig, devices: int | None = None, assumed_mfu: float | None = None,
              hf_config: dict | None = None) -> Plan:
    check_plan_args(devices, assumed_mfu)
    hf = hf_config if hf_config is not None else config_json_for(cfg.model.path)
    family = family_of(cfg, hf, f"{cfg.model.path} config.json")
    remat = cfg.train.remat or cfg.model.remat
    n = plan_devices(cfg, devices)
    try:
        sizes = dict(zip(("data", "fsdp", "tp"), mesh_shape(cfg.mesh, n)))
    except UserError as e:
        if devices:
            raise
        # the count came from this machine, which is rarely the one the plan is for
        raise UserError(f"{e}; this plan counted the {n} local device(s): give --devices N to plan for N "
                        f"devices") from None
    model, tcfg = abstract_model(family, hf, cfg.model.dtype, remat)
    shapes = _flat_shapes(model)
    b = _DTYPE_BYTES[cfg.model.dtype]
    notes: list[str] = []

    # which projection weights carry LoRA (and are quantized under QLoRA)
    lora_sites: dict[str, Any] = {}
    if cfg.lora.enabled:
        chosen = family.targets_to_modules(tcfg, list(cfg.lora.targets))
        for layer, proj in family.layer_sites(tcfg, chosen):
            path = family.layer_path.format(layer=layer) + f".{proj.tunix_module}.{proj.tunix_param}"
            if path in shapes:
                lora_sites[path] = proj
    qbytes = _QUANT_BYTES.get(cfg.lora.base_quantization or "", 0.0)

    base = full_base = 0.0
    total_params = 0
    base_arrays: list[tuple[tuple[int, ...], float]] = []  # (shape, fraction one device holds)
    replicated: dict[str, int] = {}  # KV-head fields the tp axis does not divide -> their size
    for path, (shape, _) in shapes.items():
        rule, fields = partition.spec_for(family, tcfg, path, len(shape)), partition.config_fields(family, path, tcfg)
        replicated.update({f: size for (size, _), f in partition.replicated_dims(rule, shape, sizes, fields).items()})
        spec = partition.resolve(rule, shape, sizes, path, fields)
        per_dev = math.prod(shape) / partition.shards(spec, sizes)
        base_arrays.append((shape, 1 / partition.shards(spec, sizes)))
        total_params += math.prod(shape)
        full_base += per_dev * b
        if qbytes and path in lora_sites:
            proj = lora_sites[path]
            scale_shape = tuple(1 if a in proj.in_axes else s for a, s in zip(proj.axes, shape))
            scale_spec = partition.resolve(spec, scale_shape, sizes, path)
            base += per_dev * qbytes + math.prod(scale_shape) / partition.shards(scale_spec, sizes) * b
        else:
            base += per_dev * b
    load_peak = full_base + (base if qbytes else 0.0)
    for field, size in sorted(replicated.items()):
        what = ("the token embedding (and its optimizer state, when trained) is" if field == "vocab_size" else
                "those K/V projections (and their LoRA factors and optimizer state) are")
        notes.append(f"mesh.tp={sizes['tp']} does not divide config.json {field}={size}: {what} whole on every tp "
                     f"shard (counted above)")
    base_note = f"{cfg.model.dtype}" + (f", {cfg.lora.base_quantization} projections" if qbytes else "")

    # LoRA factors
    lora_bytes = 0.0
    lora_params = 0
    lora_arrays: list[tuple[tuple[int, ...], float]] = []
    r = cfg.lora.rank
    for path, proj in lora_sites.items():
        shape = shapes[path][0]
        by_axis = dict(zip(proj.axes, shape))
        a_shape = tuple(by_axis[a] for a in proj.axes if a in proj.in_axes) + (r,)
        b_shape = (r,) + tuple(by_axis[a] for a in proj.axes if a not in proj.in_axes)
        for suffix, shp in (("_lora_a", a_shape), ("_lora_b", b_shape)):
            p = path + suffix
            spec = partition.placed_spec(family, tcfg, p, shp, sizes)
            lora_params += math.prod(shp)
            lora_arrays.append((shp, 1 / partition.shards(spec, sizes)))
            lora_bytes += math.prod(shp) / partition.shards(spec, sizes) * b

    trainable_bytes = lora_bytes if cfg.lora.enabled else full_base
    trainable = lora_params if cfg.lora.enabled else total_params
    opt = cfg.train.optimizer
    if opt == "adamw":
        opt_bytes, opt_note = 2 * trainable_bytes, f"adamw mu+nu at {cfg.model.dtype}"
    elif opt == "adafactor":
        opt_bytes = 0.0
        for shp, per_dev_frac in (lora_arrays if cfg.lora.enabled else base_arrays):
            opt_bytes += _adafactor_elems(shp) * b * per_dev_frac
        opt_note = f"adafactor second moments (factored where both dims >= 128) at {cfg.model.dtype}"
    else:
        opt_bytes, opt_note = 0.0, "sgd: no state"
    accum = cfg.train.grad_accum_steps
    terms = [
        Term("base params", base, base_note),
        Term("LoRA params", lora_bytes, f"rank {r}, {len(lora_sites)} weights" if cfg.lora.enabled else "disabled"),
        Term("optimizer state", opt_bytes, opt_note),
        Term("gradients", trainable_bytes, "trainable parameters"),
    ]
    if accum > 1:
        terms.append(Term("gradient accumulator", trainable_bytes, f"{accum} micro-batches (optax MultiSteps)"))

    ways = sizes["data"] * sizes["fsdp"]
    B = cfg.train.batch_size
    b_dev = B / ways if B % ways == 0 else B
    if B % ways:
        notes.append(f"train.batch_size={B} is not divisible by data×fsdp={ways}: every device computes it all")
    T = cfg.data.seq_len
    tokens_dev = b_dev * T
    M = loss_positions(cfg)
    if not cfg.data.max_loss_tokens:
        notes.append(f"loss positions per row assumed {T} (data.max_loss_tokens unset)")
    dims = layer_dims(shapes, tcfg)
    untargeted = frozenset(UNTARGETED_SAVES) - set(cfg.lora.targets) if cfg.lora.enabled else frozenset()
    act, act_note = activation_bytes(dims, tokens_dev, T, b, sizes["tp"], remat, tcfg.num_embed, b_dev * M,
                                     untargeted)
    terms.append(Term("activations", act, f"remat {remat}, {b_dev:g}×{T} tokens/device; {act_note}"))
    terms.append(Term("batch inputs", b_dev * (4 * T + 3 * M) * 4,
                      "tokens, positions, segments, prefix segments, loss buffers"))

    tokens_per_step = B * T * accum
    sf = step_flops(cfg, tcfg, dims)
    flops_step = sf.step(tokens_per_step, B * M * accum)

    acc = ACCELERATORS[cfg.mesh.accelerator]
    mfu = assumed_mfu if assumed_mfu is not None else DEFAULT_MFU
    peak = acc["peak_flops"] * n
    step_time = flops_step / (peak * mfu) if peak else None
    return Plan(model=cfg.model.path, family=family.name, accelerator=cfg.mesh.accelerator, mesh=sizes,
                n_devices=n, dtype=cfg.model.dtype, remat=remat, terms=terms, load_peak=load_peak,
                hbm=acc["hbm_bytes"], total_params=total_params, trainable_params=trainable,
                tokens_per_step=tokens_per_step, flops_per_step=flops_step, assumed_mfu=mfu,
                step_time_s=step_time, notes=notes)


def _adafactor_elems(shape: tuple[int, ...], min_dim: int = 128) -> int:
    """Elements of optax.adafactor's second-moment state for one parameter (factored when the two
    largest dims are both ≥ min_dim: a row and a column vector; else a full copy)."""
    if len(shape) >= 2:
        d = sorted(shape)
        if d[-1] >= min_dim and d[-2] >= min_dim:
            total = math.prod(shape)
            return total // d[-1] + total // d[-2]
    return math.prod(shape)


# ---------------------------------------------------------------- compiled check (tiny models)


def compiled_memory(cfg: RunConfig, hf_config: dict) -> dict:
    """Compile the real train step on the local devices (random weights) and return XLA's memory
    analysis, with our estimate for the same local mesh beside it."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from gemma_tpu.train import optim, partition  # deferred: imports jax/torch
    from gemma_tpu.train.loss import make_loss_fn  # deferred: imports jax/torch

    family = family_of(cfg, hf_config)
    remat = cfg.train.remat or cfg.model.remat
    # the configured mesh when the local devices can form it, else all local devices on fsdp
    local = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, accelerator="cpu", dcn_data=1))
    n = jax.device_count()
    try:
        mesh_lib.mesh_shape(local.mesh, n)
    except UserError:
        local = dataclasses.replace(local, mesh=dataclasses.replace(local.mesh, data=1, fsdp=-1, tp=1))
    ours = make_plan(local, n, hf_config=hf_config)
    mesh = mesh_lib.build_mesh(local.mesh)
    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[cfg.model.dtype]
    tcfg = partition.with_activation_rules(family.with_remat(family.tunix_config(hf_config, jdtype), remat))
    cls = model_class(family)
    with mesh:
        model = _random_sharded(family, cls, tcfg, mesh)
        if cfg.lora.enabled:
            model = lora_lib.apply_lora(model, family, tcfg, cfg.lora, seed=0, mesh=mesh)
        tx = optim.make_optimizer(cfg.train)
        if cfg.train.grad_accum_steps > 1:
            tx = optax.MultiSteps(tx, cfg.train.grad_accum_steps)
        wrt = nnx.LoRAParam if cfg.lora.enabled else nnx.Param
        optimizer = nnx.Optimizer(model, tx, wrt=wrt)
        partition.shard_optimizer_state(optimizer, mesh)
        loss_fn = make_loss_fn(LOSS_CHUNK)

        def train_step(model, optimizer, batch):
            grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))
            loss, grads = grad_fn(model, **batch)
            optimizer.update(model, grads)
            return loss

        B, T = cfg.train.batch_size, cfg.data.seq_len
        M = loss_positions(cfg)
        spec = jax.sharding.NamedSharding(mesh, mesh_lib.batch_spec(mesh, B))  # as the trainer lays it out
        row_fields = ("tokens", "positions", "segment_ids", "prefix_segment_ids")
        batch = {k: jax.ShapeDtypeStruct((B, T if k in row_fields else M),
                                         jnp.float32 if k == "loss_weights" else jnp.int32, sharding=spec)
                 for k in row_fields + ("loss_idx", "loss_targets", "loss_weights")}
        if cfg.lora.enabled and cfg.lora.dropout > 0:  # the training step drops (train.loss.make_loss_fn)
            batch["dropout_step"] = jax.ShapeDtypeStruct((B, 2), jnp.int32, sharding=spec)
        # the activations laid out as on an accelerator (where the batch is split: a replicated one fits no
        # constraint over the batch axes)
        constrained = partition.activation_constraints_on_cpu() if tuple(spec.spec) else contextlib.nullcontext()
        with constrained:
            compiled = nnx.jit(train_step, donate_argnames=("optimizer",)).lower(model, optimizer, batch).compile()
    ma = compiled.memory_analysis()
    arg, out, alias, temp = (ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                             ma.temp_size_in_bytes)
    state = sum(ours.term(k).bytes for k in ("base params", "LoRA params", "optimizer state", "batch inputs"))
    if cfg.train.grad_accum_steps > 1:
        state += ours.term("gradient accumulator").bytes
    return {
        "devices": n, "mesh": ours.mesh,
        "compiled": {"arguments": arg, "outputs": out, "aliased": alias, "temp": temp,
                     "peak": arg + out - alias + temp},
        "estimate": {"state": state, "transient": ours.term("gradients").bytes + ours.term("activations").bytes,
                     "peak": ours.total},
    }


def _random_sharded(family, cls, tcfg, mesh):
    """The model with random weights created straight into their shards (jit + out_shardings), annotated as
    the loader's (`replicate_indivisible`)."""
    import jax
    from flax import nnx

    from gemma_tpu.models.sharded_weights import replicate_indivisible

    with cheap_tracer_attribute_errors():
        abstract = nnx.eval_shape(lambda: replicate_indivisible(cls(tcfg, rngs=nnx.Rngs(params=0)), family,
                                                                dict(mesh.shape)))
        graphdef, abs_state = nnx.split(abstract)
        shardings = nnx.get_named_sharding(abs_state, mesh).to_pure_dict()
        values = jax.jit(lambda: nnx.state(cls(tcfg, rngs=nnx.Rngs(params=0))).to_pure_dict(),
                         out_shardings=shardings)()
    nnx.replace_by_pure_dict(abs_state, values)
    return nnx.merge(graphdef, abs_state)


# ---------------------------------------------------------------- output


def _gib(x: float) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1."""
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(x) >= div:
            return f"{x / div:8.2f} {unit}"
    return f"{x:8.0f} B  "


def count(n: int) -> str:
    """A parameter count as people write it: 107.1K, 268.1M, 30.70B (a tiny model was "0.00B")."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}" if unit == "B" else f"{n / div:.1f}{unit}"
    return str(n)


def format_plan(p: Plan) -> str:
    m = p.mesh
    lines = [
        f"plan: {p.model} ({p.family}), {count(p.total_params)} parameters, {p.dtype}, remat {p.remat}",
        f"mesh: data={m['data']} fsdp={m['fsdp']} tp={m['tp']} = {p.n_devices} devices of {p.accelerator}",
        "per device:",
    ]
    for t in p.terms:
        lines.append(f"  {t.name:<22}{_gib(t.bytes)}" + (f"   ({t.note})" if t.note else ""))
    lines.append(f"  {'total':<22}{_gib(p.total)}")
    if p.load_peak > p.total:
        lines.append(f"  {'load peak':<22}{_gib(p.load_peak)}   (base at {p.dtype} before quantization)")
    if p.hbm:
        lines.append(f"  {'HBM':<22}{_gib(p.hbm)}   usable {_gib(p.usable).strip()} after a {SAFETY_MARGIN:.0%} "
                     f"margin -> {'fits' if p.fits else 'DOES NOT FIT'} "
                     f"({max(p.total, p.load_peak) / p.hbm:.0%} of HBM)")
    else:
        lines.append("  HBM: no limit checked for cpu")
    lines.append(f"trainable parameters: {p.trainable_params:,}")
    lines.append(f"tokens per step: {p.tokens_per_step:,}")
    if p.data:
        d = p.data
        lines.append(f"data: {d['examples']:,} examples in {d['rows']:,} rows ({d['trees']:,} shared-prefix trees, "
                     f"data.share_prefix {d['share_prefix']}): {d['examples_per_row']:g} examples a row, "
                     f"{d['examples_per_step']:g} a step; {d['computed_tokens_per_example']:g} computed tokens per "
                     f"example ({d['computed_tokens_per_example_unshared']:g} one by one); loss buffer "
                     f"{d['max_loss']} a row")
    lines.append(f"FLOPs per step: {p.flops_per_step:.3e}")
    if p.step_time_s is not None:
        lines.append(f"step time: {p.step_time_s:.3f} s at {p.assumed_mfu:.0%} MFU of {p.n_devices} × "
                     f"{_peak(p.accelerator) / 1e12:.0f} TFLOP/s "
                     f"({p.tokens_per_step / p.step_time_s:,.0f} tokens/s)")
    for n in p.notes:
        lines.append(f"note: {n}")
    if p.compiled:
        c, e = p.compiled["compiled"], p.compiled["estimate"]
        lines.append(f"compiled on {p.compiled['devices']} local device(s), mesh {p.compiled['mesh']} "
                     f"(XLA memory_analysis, per device):")
        lines.append(f"  arguments {_gib(c['arguments'])}  outputs {_gib(c['outputs'])}  aliased "
                     f"{_gib(c['aliased'])}  temp {_gib(c['temp'])}  peak {_gib(c['peak'])}")
        lines.append(f"  our estimate for that mesh: state {_gib(e['state'])}  transient {_gib(e['transient'])}  "
                     f"peak {_gib(e['peak'])}  (estimate / compiled = {e['peak'] / max(c['peak'], 1):.2f})")
    return "\n".join(lines)


def _peak(acc: str) -> float:
    return ACCELERATORS[acc]["peak_flops"]


def _on_this_machine(cfg: RunConfig) -> bool:
    """`model.path` is a directory here or a prepared embedded model: the plan never downloads or prepares one."""
    from pathlib import Path

    from gemma_tpu.assets import embedded as assets

    spec = str(cfg.model.path)
    prepared = spec.startswith("embedded:") and assets.is_complete(assets.target_dir(spec[len("embedded:"):]))
    return Path(spec).expanduser().is_dir() or prepared


def check_weights_here(cfg: RunConfig) -> str | None:
    """The run's header-only weight checks (`gemma_tpu.models.loading.check_weight_files`: damaged headers,
    missing shards, shapes against config.json) where the model is on this machine; a note when they could
    not be made (a hub id, a directory of config.json alone)."""
    if not _on_this_machine(cfg):
        return "weights not checked: the model is not on this machine"
    from gemma_tpu.hf.safetensors_io import INDEX_FILE
    from gemma_tpu.models import resolve_model
    from gemma_tpu.models.loading import check_weight_files

    resolved = resolve_model(cfg.model.path, cfg.model.revision, cfg.model.family)
    d = resolved.local_dir
    if not (d / INDEX_FILE).is_file() and not any(d.glob("*.safetensors")):
        return f"weights not checked: {d} has no *.safetensors (a config.json to plan with)"
    check_weight_files(resolved, resolved.tunix_config())
    return None


def check_resume_here(cfg: RunConfig) -> None:
    """What the run refuses of an existing checkpoint.dir before loading anything (`gemma_tpu.train.resume`:
    another base, LoRA, dtype or optimizer tree); the caller knows the base's weights are on this machine.
    The dry run planned such a resume as one that fits, and the run then refused it."""
    from pathlib import Path

    from gemma_tpu.checkpoint.metadata import METADATA_FILE, build_metadata
    from gemma_tpu.models import resolve_model
    from gemma_tpu.train.resume import check_resume_compatible

    ckpt_dir = Path(cfg.checkpoint.dir)
    if not ckpt_dir.is_dir() or not any(p.name == METADATA_FILE or p.name.isdigit() for p in ckpt_dir.iterdir()):
        return  # a new run
    resolved = resolve_model(cfg.model.path, cfg.model.revision, cfg.model.family)
    check_resume_compatible(ckpt_dir, build_metadata(cfg, resolved), cfg.checkpoint.allow_base_mismatch)


def data_layout(cfg: RunConfig) -> dict | None:
    """The training split as the run will lay it out (rows, shared-prefix trees, examples per step, the
    loss buffer), or None when its tokenizer is not on this machine (a hub id not downloaded). Bad data
    raises, as it would at the start of the run."""
    if not cfg.data.train_path or not _on_this_machine(cfg):
        return None
    from gemma_tpu import data  # deferred: only the dry run reads the data
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from gemma_tpu.models import resolve_model
    from gemma_tpu.train.resume import check_data_position

    try:
        resolved = resolve_model(cfg.model.path, cfg.model.revision, cfg.model.family)
        tokenizer = load_tokenizer(resolved.local_dir)
    except UserError:
        return None
    renderer = data.make_renderer(tokenizer, cfg.data, resolved.family.chat_format, function_token_map(tokenizer),
                                  vocab_size=resolved.text_config.get("vocab_size"))
    split, ev = data.prepare_splits(renderer, cfg.data, cfg.train.seed, cfg.train.batch_size)  # what the run refuses
    check_data_position(cfg, split)  # a resume of checkpoint.dir from a position in other rows: refused too
    st = split.stats()
    per_row = st["examples_per_row"]
    return {"examples": st["examples_kept"], "rows": st["rows"], "trees": st["trees"], "examples_per_row": per_row,
            "examples_per_step": round(per_row * cfg.train.batch_size * cfg.train.grad_accum_steps, 2),
            "computed_tokens_per_example": st["computed_tokens_per_example"],
            "computed_tokens_per_example_unshared": st["computed_tokens_per_example_unshared"],
            "max_loss": split.max_loss, "share_prefix": cfg.data.share_prefix,
            # what the run warns of at its start, said by the dry run too
            "warnings": [w for w in (data.overlength_warning(split, cfg.data.overlength),
                                     data.duplicates_warning(split), data.overlap_warning(split, ev),
                                     data.epochs_warning(split, cfg.train.batch_size, cfg.train.grad_accum_steps,
                                                         cfg.data.num_epochs, cfg.train.max_steps)) if w]}


def run_dry(cfg: RunConfig, devices: int | None = None, assumed_mfu: float | None = None,
            compile_check: bool = True, out=None) -> int:
    """Print the plan; 0 when it fits, 2 (with the reason on stderr) when it does not."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    out = out or sys.stdout
    check_plan_args(devices, assumed_mfu)
    hf = config_json_for(cfg.model.path)
    where = f"{cfg.model.path} config.json"
    family = family_of(cfg, hf, where)
    # what the real run refuses (rank, seq_len) before planning it
    with naming_config_file(where):
        text = family.read_text_config(hf)
    validate_for_model(cfg, text, cfg.model.path, family.projection_shapes(text))
    if _on_this_machine(cfg):  # the run's directories apart from the base's and its steps, as the run checks them
        from gemma_tpu.models import resolve_model
        from gemma_tpu.train.run import check_run_dir_contents, check_run_dirs_apart, check_run_dirs_writable

        check_run_dirs_apart(cfg, resolve_model(cfg.model.path, cfg.model.revision, cfg.model.family).local_dir)
        check_run_dirs_writable(cfg)  # a file, a read-only disk (nothing is written)
        check_run_dir_contents(cfg)  # another run's records there, a directory named metrics.jsonl
    weights_note = check_weights_here(cfg)  # before the data, as the run does
    if weights_note is None:  # the base's weights are here: a resume of checkpoint.dir is checked as the run does
        check_resume_here(cfg)
    layout = data_layout(cfg)
    if layout:  # the loss buffer the run will use: what the data needs, or data.max_loss_tokens capped at seq_len
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_loss_tokens=layout["max_loss"]))
    with naming_config_file(where):
        p = make_plan(cfg, devices, assumed_mfu, hf_config=hf)
    settings = mesh_lib.distributed_settings(cfg.mesh)  # {}: a TPU pod's hosts, counted by JAX at the run's start
    if settings is None or settings:  # the batch layout the run refuses, for the processes it will have
        mesh_lib.check_batch_layout(cfg.train.batch_size, p.mesh, settings["num_processes"] if settings else 1)
    p.data = layout
    p.notes.extend(layout["warnings"] if layout else [])
    if layout is None and cfg.data.train_path:
        p.notes.append("data layout not counted: the model's tokenizer is not on this machine")
    if weights_note:
        p.notes.append(weights_note)
    if compile_check and p.total_params <= COMPILE_LIMIT:
        p.compiled = compiled_memory(cfg, hf)
    print(format_plan(p), file=out, flush=True)
    reason = p.refusal()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    return 0


def add_plan_arguments(ap, scope: str = "") -> None:
    """The plan's options, one home for `python -m gemma_tpu.plan` and `gemma_tpu.train --dry-run` (`scope`
    prefixes their help); the plan's own listed them with no help at all, neither said the assumed MFU."""
    ap.add_argument("--devices", type=int, default=None,
                    help=f"{scope}devices to plan for when a mesh axis is -1 (default: the local ones)")
    ap.add_argument("--assumed-mfu", type=float, default=None,
                    help=f"{scope}MFU, a fraction in (0, 1], for the step-time estimate (default: {DEFAULT_MFU})")
    ap.add_argument("--no-compile", action="store_true", help=f"{scope}skip the compiled memory analysis")


def main(argv: Sequence[str] | None = None) -> int:
    ap = cli.parser("python -m gemma_tpu.plan", __doc__, config="YAML run config (see configs/)")
    add_plan_arguments(ap)
    args = ap.parse_args(list(argv or []))
    cfg = cli.run_config(args)
    if cfg is None:
        return 0
    return run_dry(cfg, args.devices, args.assumed_mfu, not args.no_compile)
