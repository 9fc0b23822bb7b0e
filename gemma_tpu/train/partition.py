"""Partition rules: which mesh axes every weight, LoRA factor, optimizer state and activation is split over.

One table per family (`Family.partition_rules`, in the registry): an ordered list of (regex over the Tunix parameter path, spec);
the first full match wins. A spec names, per array dimension, the mesh axis (or axes) that dimension
is split over, None for replicated. The weight specs are the ones Tunix's Gemma models annotate their
parameters with (`ShardingConfig.get_default_sharding()`), so the loader places each weight directly
into its shards; `tests/test_sharding.py` checks every parameter against this table on several
meshes. The planner (`gemma_tpu.train.plan`) reads the same table to count per-device bytes.

Derived rules, never written out per family:

* a LoRA factor follows its base weight (what Qwix does): A = (spec of the base's input axes..., None),
  B = (None, spec of the base's output axes...), from the family's `Projection` axes; one that this leaves
  unsplit on the mesh (B of q/k/v/gate/up, A of o/down where tp=1) is split over fsdp where it divides
  (`placed_spec`, `gemma_tpu.lora.factor_spec`);
* a QLoRA base weight keeps the base spec (`<w>.array.qvalue`); its scale has the contracted dims
  collapsed to 1, which are replicated;
* optimizer state (Adam's mu and nu, the accumulated gradient of gradient accumulation) has the spec
  of the parameter it belongs to;
* RMSNorm scales are replicated (`TUNIX_WEIGHTS` makes Tunix's annotation agree);
* a dimension of size 1 is never split (Tunix itself replicates a single KV head); a KV-head dimension
  that its axes do not divide (2 KV heads at tp=4) is replicated, queries still split, as vLLM and MaxText
  do (`registry.REPLICATED_WHEN_INDIVISIBLE`; `sharded_weights.replicate_indivisible` annotates the model so);
  any other dimension that a named axis does not divide is an error, raised before anything is loaded.

Activations: Tunix constrains them to ('fsdp', None, 'tp'), which on a mesh with a data axis
would re-gather every data-parallel batch shard (each data replica recomputing its neighbours'
examples). `ACTIVATIONS` splits the batch over ('data', 'fsdp') instead, the same axes the input
batch is split over (`mesh.DATA_SHARDING_AXIS`); `with_activation_rules` puts them into the Tunix
config. (Tunix skips activation constraints on CPU, so on CPU only the weight rules are observable.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any, Iterable, Sequence

from gemma_tpu.core.errors import UserError
from gemma_tpu.models.registry import REPLICATED_WHEN_INDIVISIBLE
from gemma_tpu.train.mesh import BATCH_AXES

Axis = str | tuple[str, ...] | None
Spec = tuple[Axis, ...]

# Tunix ShardingConfig fields for activations: batch over (data, fsdp), model dims over tp.
ACTIVATIONS: dict[str, Spec] = {
    "act_btd": (BATCH_AXES, None, "tp"),
    "act_btf": (BATCH_AXES, None, "tp"),
    "act_btnh": (BATCH_AXES, None, "tp", None),
}

# Tunix ShardingConfig fields for weights where the families' rules differ from Tunix's own annotation: RMSNorm
# scales replicated (Tunix: 'tp' over the hidden size, which a tp that does not divide it refused; a few KB a layer).
TUNIX_WEIGHTS: dict[str, Spec] = {"rms_norm_weight": ()}

_LORA = re.compile(r"^(?P<base>.+)_lora_(?P<ab>[ab])$")
_QUANT = re.compile(r"^(?P<base>.+)\.array\.(?P<part>qvalue|scale)$")


def base_spec(family, path: str) -> Spec:
    """The rule spec of a (non-LoRA, unquantized) parameter path, e.g. 'layers.3.attn.q_einsum.w'."""
    for pattern, spec in family.partition_rules:
        if re.fullmatch(pattern, path):
            return spec
    raise UserError(f"no partition rule of family {family.name} matches parameter {path!r}")


def config_fields(family, path: str, tunix_cfg=None) -> tuple[str | None, ...]:
    """The config.json field giving each dimension of parameter `path` (its family's `partition_dims`; () where
    the registry does not say): a quantized weight's are its weight's (the scale's collapsed dims are of size 1,
    never split), a LoRA factor's those of its weight's axes it keeps (its rank none; needs `tunix_cfg`)."""
    m = _QUANT.match(path)
    if m:
        return config_fields(family, m.group("base"), tunix_cfg)
    m = _LORA.match(path)
    if m:
        proj = _projection_for(family, tunix_cfg, m.group("base")) if tunix_cfg is not None else None
        if proj is None:
            return ()
        fields = config_fields(family, m.group("base"), tunix_cfg)
        return _factor_dims(proj, dict(zip(proj.axes, _pad(fields, len(proj.axes)))), m.group("ab"))
    return family.dim_fields(path)


def _factor_dims(proj, by_axis: dict, ab: str) -> tuple:
    """A LoRA factor's dimensions as its weight's (`by_axis`: the weight's axis -> entry): A = the input axes then the
    rank, B = the rank then the output axes (Qwix's layout; the rank's entry None)."""
    if ab == "a":
        return tuple(by_axis[a] for a in proj.axes if a in proj.in_axes) + (None,)
    return (None,) + tuple(by_axis[a] for a in proj.axes if a not in proj.in_axes)


def _projection_for(family, tunix_cfg, module_path: str):
    """The registry Projection whose Tunix weight is `module_path` ('layers.3.attn.q_einsum.w')."""
    m = re.fullmatch(r"layers\.\d+\.(?P<mod>.+)\.(?P<param>\w+)", module_path)
    if not m:
        return None
    for p in family.projections(tunix_cfg):
        if p.tunix_module == m.group("mod") and p.tunix_param == m.group("param"):
            return p
    return None


def spec_for(family, tunix_cfg, path: str, ndim: int) -> Spec:
    """The rule spec of any parameter of a (possibly LoRA-wrapped, possibly quantized) model."""
    m = _LORA.match(path)
    if m:
        base = m.group("base")
        proj = _projection_for(family, tunix_cfg, base)
        if proj is None:
            raise UserError(f"LoRA factor {path!r} is on a weight the {family.name} registry does not know")
        bspec = _pad(base_spec(family, base), len(proj.axes))
        return _factor_dims(proj, dict(zip(proj.axes, bspec)), m.group("ab"))
    m = _QUANT.match(path)
    if m:
        return _pad(base_spec(family, m.group("base")), ndim)  # scale: collapsed dims are size 1
    return _pad(base_spec(family, path), ndim)


def _pad(spec: Spec, ndim: int) -> Spec:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _axes(entry: Axis) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def resolve(spec: Spec, shape: Sequence[int], mesh_sizes: dict[str, int], path: str = "",
            fields: Sequence[str | None] = ()) -> Spec:
    """The spec as placed: size-1 dims and size-1 axes dropped; an axis that does not divide its
    dimension is a UserError naming the parameter and, where `fields` (`config_fields`) says, the config.json
    field that sets that dimension."""
    spec = _pad(spec, len(shape))
    out: list[Axis] = []
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        names = tuple(a for a in _axes(entry) if mesh_sizes.get(a, 1) > 1)
        if size == 1 or not names:
            out.append(None)
            continue
        n = math.prod(mesh_sizes[a] for a in names)
        if size % n and (size, dim) in replicated_dims(spec, shape, mesh_sizes, fields):
            out.append(None)  # KV heads: every tp shard holds them all (registry.REPLICATED_WHEN_INDIVISIBLE)
            continue
        if size % n:
            over = " × ".join(f"mesh.{a}={mesh_sizes[a]}" for a in names)  # the config keys that set them
            field = f", config.json {fields[dim]}" if dim < len(fields) and fields[dim] else ""
            raise UserError(f"{path or 'a parameter'}: dimension {dim} (size {size}{field}) cannot be split over "
                            f"{over}; choose " + (f"a mesh.{names[0]} that divides {size}" if len(names) == 1
                                                  else f"mesh sizes whose product divides {size}"))
        out.append(names[0] if len(names) == 1 else names)
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def replicated_dims(spec: Spec, shape: Sequence[int], mesh_sizes: dict[str, int],
                    fields: Sequence[str | None] = ()) -> dict[tuple[int, int], str]:
    """(size, dimension) -> config.json field, for the dimensions of `spec` that `resolve` replicates rather than
    refuses: a field of `REPLICATED_WHEN_INDIVISIBLE` (KV heads) that its mesh axes do not divide."""
    out = {}
    for dim, (size, entry) in enumerate(zip(shape, _pad(spec, len(shape)))):
        field = fields[dim] if dim < len(fields) else None
        n = math.prod(mesh_sizes.get(a, 1) for a in _axes(entry))
        if field in REPLICATED_WHEN_INDIVISIBLE and size > 1 and size % n:
            out[(size, dim)] = field
    return out


def shards(spec: Spec, mesh_sizes: dict[str, int]) -> int:
    """How many ways a resolved spec splits the array (per-device size = size / shards)."""
    return math.prod(mesh_sizes.get(a, 1) for e in spec for a in _axes(e))


def normalize(spec: Any, mesh_sizes: dict[str, int]) -> Spec:
    """A PartitionSpec as placed, with size-1 axes dropped (for comparing with `resolve`)."""
    out: list[Axis] = []
    for entry in tuple(spec):
        names = tuple(a for a in _axes(entry) if mesh_sizes.get(a, 1) > 1)
        out.append(None if not names else names[0] if len(names) == 1 else names)
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def placed_spec(family, tunix_cfg, path: str, shape: Sequence[int], mesh_sizes: dict[str, int]) -> Spec:
    """The resolved spec a parameter is placed with on this mesh: its rule's, except that a LoRA factor the
    rule leaves unsplit is split over fsdp where it divides (`lora.factor_spec`, which places it)."""
    from gemma_tpu.lora import factor_spec

    shape = tuple(shape)
    fields = config_fields(family, path, tunix_cfg)
    spec = resolve(spec_for(family, tunix_cfg, path, len(shape)), shape, mesh_sizes, path, fields)
    m = _LORA.match(path)
    if m:
        spec = resolve(factor_spec(spec, shape, mesh_sizes, m.group("ab")), shape, mesh_sizes, path, fields)
    return spec


def expected_specs(family, tunix_cfg, flat: Iterable[tuple[str, tuple[int, ...]]],
                   mesh_sizes: dict[str, int]) -> dict[str, Spec]:
    """path -> placed spec for (path, shape) pairs."""
    return {path: placed_spec(family, tunix_cfg, path, shape, mesh_sizes) for path, shape in flat}


# ---------------------------------------------------------------- applying the rules


def with_activation_rules(tunix_cfg):
    """The Tunix config with our activation specs (batch over data and fsdp) and weight specs (`TUNIX_WEIGHTS`)."""
    shd = getattr(tunix_cfg, "shd_config", None)
    if shd is None:
        return tunix_cfg
    fields = {f.name for f in dataclasses.fields(shd)}
    return dataclasses.replace(tunix_cfg, shd_config=dataclasses.replace(
        shd, **{k: v for k, v in {**ACTIVATIONS, **TUNIX_WEIGHTS}.items() if k in fields}))


@contextlib.contextmanager
def activation_constraints_on_cpu():
    """Inside the block, Tunix's activation sharding constraints (`ACTIVATIONS`) apply on CPU too.

    Tunix skips them on CPU (`tunix.utils.sharding_utils.shard`), and XLA then kept an fsdp mesh's activations
    partly unsplit: the dry run's compiled check on 8 CPU devices measured 2-3x the estimate's peak, a layout
    no accelerator run has. With them, the CPU compile lays activations out as a TPU run does."""
    import jax
    from jax.interpreters import pxla
    from tunix.utils import sharding_utils

    original = sharding_utils.shard

    def shard(x, s, eager=False):
        mesh = pxla.thread_resources.env.physical_mesh
        if mesh.empty:
            return jax.numpy.asarray(x)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s))
        return jax.device_put(x, sharding) if eager else jax.lax.with_sharding_constraint(x, sharding)

    sharding_utils.shard = shard
    try:
        yield
    finally:
        sharding_utils.shard = original


def with_rules(family):
    """The family, its Tunix config carrying our activation rules (what `load_model` builds from)."""
    base = family.tunix_config

    def tunix_config(hf_config, dtype):
        return with_activation_rules(base(hf_config, dtype))

    return dataclasses.replace(family, tunix_config=tunix_config)


def flat_params(model) -> list[tuple[str, Any]]:
    """('layers.0.attn.q_einsum.w', array) for every variable of an nnx model or state."""
    from flax import nnx

    state = model if isinstance(model, nnx.State) else nnx.state(model)
    out = []
    for path, var in nnx.to_flat_state(state):
        val = var.get_value() if hasattr(var, "get_value") else var
        out.append((".".join(str(p) for p in path), val))
    return out


def check_divisible(family, tunix_cfg, model, mesh) -> None:
    """Every parameter of the (abstract or real) model can be split as the rules say."""
    sizes = dict(mesh.shape)
    for path, val in flat_params(model):
        placed_spec(family, tunix_cfg, path, tuple(val.shape), sizes)


def fit_factored_state_annotations(optimizer, mesh) -> None:
    """nnx.Optimizer gives every state array its parameter's sharding annotation. Adafactor's factored
    second moments (a row and a column vector for a matrix, a (1,) placeholder for vectors) do not
    have the parameter's shape, so that annotation can be invalid (wrong rank, or a dimension the mesh
    axes do not divide) and Tunix's resharding fails; such state is annotated replicated (it is the
    small part of the state). `mesh` None: checked by rank alone."""
    import math

    from flax import nnx

    sizes = dict(mesh.shape) if mesh is not None else {}

    def fits(names, shape) -> bool:
        if len(names) != len(shape):
            return False
        for dim, axes in zip(shape, names):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            if dim % math.prod(sizes.get(a, 1) for a in axes):
                return False
        return True

    state = nnx.state(optimizer, nnx.optimizer.OptState)
    for _, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding") if hasattr(var, "get_metadata") else None
        value = var.get_value() if hasattr(var, "get_value") else getattr(var, "value", None)
        shape = getattr(value, "shape", None)
        if names is not None and shape is not None and not fits(tuple(names), tuple(shape)):
            var.set_metadata(out_sharding=None)


def shard_optimizer_state(optimizer, mesh) -> None:
    """Place every optimizer-state array with the spec of the parameter it belongs to.

    nnx.Optimizer builds its state with `zeros_like` outside jit, which puts it on one device;
    Tunix reshards it only when the train step is first jitted. Doing it right away keeps device 0
    from holding the whole state (full fine-tuning) and makes the placement inspectable.
    """
    import jax
    import numpy as np
    from flax import nnx

    if mesh is None or mesh.empty:
        return
    fit_factored_state_annotations(optimizer, mesh)
    state = nnx.state(optimizer, nnx.optimizer.OptState)
    specs = nnx.get_partition_spec(state)

    def place(x, spec):
        if not isinstance(x, jax.Array) or x.ndim == 0:
            spec = jax.sharding.PartitionSpec()
        sharding = jax.sharding.NamedSharding(mesh, spec if spec is not None else jax.sharding.PartitionSpec())
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if isinstance(x, jax.Array) and x.sharding.device_set != sharding.device_set and x.is_fully_addressable:
            # restored by Orbax onto the one device the fresh state's step count sat on (Tunix replicates them only
            # when some state array is already on the mesh: not SGD's): a jit refuses to move a committed array
            # to other devices (an SGD resume on a multi-device mesh failed so)
            value = np.asarray(x)
            return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
        return jax.jit(lambda v: v, out_shardings=sharding)(x)

    placed = jax.tree.map(place, state, specs, is_leaf=lambda v: v is None)
    nnx.update(optimizer, placed)


def keep_placement(step, model, optimizer, wrt):
    """`step(model, optimizer, inputs)` (a train step, to be jitted) with the trainable params and optimizer state
    it updates constrained to the placement they have now. Unconstrained, XLA may hand an update back in another
    layout than it came in (a Gemma 4 E2B-like single-KV-head LoRA B came back split over tp), and the next step
    compiled again for it. The step keeps its name (the compile counter watches it by name)."""
    import functools

    import jax
    from flax import nnx

    kinds = (wrt, nnx.optimizer.OptState)
    now = [[x.sharding if isinstance(x, jax.Array) else None for x in jax.tree.leaves(nnx.state(obj, kind))]
           for obj, kind in zip((model, optimizer), kinds)]

    @functools.wraps(step)
    def constrained(model, optimizer, inputs):
        out = step(model, optimizer, inputs)
        for obj, kind, shardings in zip((model, optimizer), kinds, now):
            leaves, tree = jax.tree.flatten(nnx.state(obj, kind))
            if len(leaves) != len(shardings):  # not the state it was built for: left as XLA placed it
                continue
            nnx.update(obj, jax.tree.unflatten(tree, [x if s is None else jax.lax.with_sharding_constraint(x, s)
                                                      for x, s in zip(leaves, shardings)]))
        return out

    return constrained
