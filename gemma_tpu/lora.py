"""LoRA (and QLoRA) through Qwix, with targets given in Hugging Face names.

Qwix matches modules by regex and says nothing when a rule matches nothing; we map the HF names
through the family registry, then check that every chosen projection of every layer received its
A and B factors, so a typo or a family mismatch fails loudly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any, Iterator

from gemma_tpu.core.config import LoraConfig
from gemma_tpu.core.errors import UserError
from gemma_tpu.core.tracing import cheap_tracer_attribute_errors
from gemma_tpu.models.registry import Family, Projection


def make_provider(family: Family, tunix_cfg: Any, lora: LoraConfig):
    projections = family.targets_to_modules(tunix_cfg, list(lora.targets))
    kwargs: dict[str, Any] = dict(
        module_path=family.tunix_module_regex(projections), rank=lora.rank, alpha=float(lora.alpha)
    )
    if lora.dropout:
        kwargs["dropout"] = float(lora.dropout)
    if lora.base_quantization:
        kwargs["weight_qtype"] = {"nf4": "nf4", "int8": "int8"}[lora.base_quantization]
    return _provider_class()(**kwargs), projections


_PROVIDER_CLASS = None
_dropout_active = False  # set only while a training step's loss is traced (`dropout_active`)


@contextlib.contextmanager
def dropout_active(model, key) -> Iterator[None]:
    """Inside the block, forwards of `model` apply LoRA dropout (`lora.dropout`), masks drawn from `key`.

    Qwix applies a rule's dropout on every call (always `deterministic=False`), evaluation and
    generation included, and draws its masks from rngs it expects on each module; outside a block
    like this it would fail or drop at inference. The provider below turns dropout off outside it, so
    only the training loss (`gemma_tpu.train.loss`, given a per-step key) drops. Use it inside a traced
    function on a model created at that trace level (nnx transforms give the loss function one).
    """
    global _dropout_active
    from flax import nnx

    model.set_attributes(qwix_rngs=nnx.Rngs(dropout=key))
    previous, _dropout_active = _dropout_active, True
    try:
        yield
    finally:
        _dropout_active = previous
        model.set_attributes(qwix_rngs=None)


def _provider_class():
    """`qwix.LoraProvider` with dropout only inside `dropout_active`, running each dot_general on
    activations flattened to [tokens, features].

    Dropout: qwix 0.1.8 reads every LoRA op's rule through one (private) lookup,
    `_get_current_rule_and_op_id`; outside `dropout_active` we return the rule with dropout 0 there,
    so evaluation, generation and Qwix's own initialising call never drop (nor need rngs).

    Flattening: activations are [batch, seq, features], so the LoRA weight gradients (dA = x^T g,
    dB = (xA)^T g) contract over two dimensions, and XLA canonicalises such dots by physically
    transposing the large operand (g: [batch, seq, 2048] in a 270M MLP), fused into the elementwise
    backward that produces it. On CPU those strided copies were a large part of a LoRA step (numbers in
    benchmarks/RESULTS.md, "Measurements behind design choices"). Merging the leading dimensions first (a
    free reshape) leaves one contracting dimension, which the dot kernels read transposed in place.
    Same products and sums; only the shapes XLA sees change.
    """
    global _PROVIDER_CLASS
    if _PROVIDER_CLASS is not None:
        return _PROVIDER_CLASS
    import jax
    import qwix

    class FlatLoraProvider(qwix.LoraProvider):
        def _get_current_rule_and_op_id(self, op_name, **kwargs):
            rule, op_id = super()._get_current_rule_and_op_id(op_name, **kwargs)
            if rule is not None and getattr(rule, "dropout", 0.0) and not _dropout_active:
                rule = dataclasses.replace(rule, dropout=0.0)
            return rule, op_id

        def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                        out_sharding=None):
            (lhs_c, rhs_c), (lhs_b, _) = dimension_numbers
            if (out_sharding is None and isinstance(lhs, jax.Array) and lhs.ndim > 2 and not lhs_b
                    and tuple(lhs_c) == (lhs.ndim - 1,)):
                lead = lhs.shape[:-1]
                out = super().dot_general(lhs.reshape(-1, lhs.shape[-1]), rhs, (((1,), tuple(rhs_c)), ((), ())),
                                          precision, preferred_element_type)
                return out.reshape(*lead, *out.shape[1:])
            return super().dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                       out_sharding=out_sharding)

    _PROVIDER_CLASS = FlatLoraProvider
    return _PROVIDER_CLASS


def apply_lora(model, family: Family, tunix_cfg: Any, lora: LoraConfig, seed: int = 0, mesh=None):
    """Return the model with LoRA factors on the chosen projections (B initialised to zero).

    With a mesh, the new arrays (LoRA factors; quantized weights for QLoRA) are computed by one
    jitted function straight into their shards (see `_apply_sharded`); the base weights are reused.
    """
    import qwix
    from flax import nnx

    provider, projections = make_provider(family, tunix_cfg, lora)
    inputs = model.get_model_input()

    def wrap(m):
        return qwix.apply_lora_to_model(m, provider, rngs=nnx.Rngs(seed), **inputs)

    if mesh is None or mesh.empty:
        lora_model = wrap(model)
    else:
        lora_model = _apply_sharded(model, wrap, mesh)
    check_lora_coverage(lora_model, family, tunix_cfg, projections)
    return lora_model


def _apply_sharded(model, wrap, mesh):
    """`wrap(model)` (Qwix's LoRA/QLoRA rewrite) for a model sharded over a mesh.

    Qwix runs the model once, eagerly, to create its parameters; on a multi-host mesh eager ops on
    arrays that span processes fail, and even on one host the new parameters would first land on a
    single device. Instead: trace `wrap` abstractly to learn the new parameters and their sharding
    metadata (LoRA factors inherit their base weight's axes), then compute exactly those in one
    jitted function whose outputs are placed by that metadata. Base weights are not copied.
    """
    import jax
    from flax import nnx

    _, state = nnx.split(model)
    old = {_key(p) for p, _ in nnx.to_flat_state(state)}
    with cheap_tracer_attribute_errors():
        abstract = nnx.eval_shape(wrap, model)
    graphdef, abs_state = nnx.split(abstract)
    shardings = dict(nnx.to_flat_state(nnx.get_named_sharding(abs_state, mesh)))
    new = {}
    sizes = dict(mesh.shape)
    for path, var in nnx.to_flat_state(abs_state):
        if _key(path) not in old:
            sh = shardings[path]
            sh = sh.get_value() if hasattr(sh, "get_value") else sh
            factor = _FACTOR.search(_key(path))
            if factor and isinstance(sh, jax.sharding.NamedSharding):
                spec = factor_spec(tuple(sh.spec), tuple(var.get_value().shape), sizes, factor.group(1))
                if spec != tuple(sh.spec):
                    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
                    var.set_metadata(out_sharding=spec)  # what the optimizer state and the train step follow
            new[_key(path)] = sh

    def create(model):
        flat = {_key(p): v for p, v in nnx.to_flat_state(nnx.state(wrap(model)))}
        return {k: flat[k].get_value() for k in new}

    with cheap_tracer_attribute_errors():
        values = nnx.jit(create, out_shardings=new)(model) if new else {}
    current = {_key(p): v for p, v in nnx.to_flat_state(state)}
    for path, var in nnx.to_flat_state(abs_state):
        k = _key(path)
        var.set_value(values[k] if k in values else current[k].get_value())
    return nnx.merge(graphdef, abs_state)


_FACTOR = re.compile(r"_lora_([ab])$")


def factor_spec(spec: tuple, shape: tuple[int, ...], mesh_sizes: dict[str, int], ab: str) -> tuple:
    """The placement of a LoRA factor whose inherited spec (`spec`, Qwix's: its base weight's axes) is `spec`.

    A factor inherits only part of its base's axes: B of q/k/v/gate/up and A of o/down keep just the tp axis,
    so on an fsdp-only mesh (tp=1) they were whole on every device, with their Adam state (hundreds of MB per
    device for a 27B at rank 64). A factor the inherited spec leaves unsplit on this mesh is split over fsdp on
    its first non-rank dimension that fsdp divides; one split over some axis keeps it.
    """
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    fsdp = mesh_sizes.get("fsdp", 1)
    used = [a for e, size in zip(spec, shape) if e is not None and size > 1
            for a in ((e,) if isinstance(e, str) else e) if mesh_sizes.get(a, 1) > 1]
    if used or fsdp <= 1:  # a size-1 dimension is never split (a single KV head's tp entry splits nothing)
        return spec
    rank_dim = len(shape) - 1 if ab == "a" else 0
    for dim, size in enumerate(shape):
        if dim != rank_dim and size > 1 and size % fsdp == 0:
            return spec[:dim] + ("fsdp",) + spec[dim + 1:]
    return spec


def _key(path) -> str:
    return ".".join(str(p) for p in path)


def lora_state_paths(model) -> dict[str, tuple[int, ...]]:
    """Flat 'layers.3.attn.q_einsum.w_lora_a' -> shape for every LoRA parameter of the model."""
    from flax import nnx

    state = nnx.state(model, nnx.LoRAParam)
    out = {}
    for path, leaf in nnx.to_flat_state(state):
        out[".".join(str(p) for p in path)] = tuple(leaf.get_value().shape) if hasattr(leaf, "get_value") else tuple(leaf.value.shape)
    return out


def check_lora_coverage(model, family: Family, tunix_cfg: Any, projections: list[Projection]) -> None:
    paths = lora_state_paths(model)
    expected = set()
    for layer, p in family.layer_sites(tunix_cfg, projections):
        a, b = p.tunix_lora_names()
        base = family.layer_path.format(layer=layer) + "." + p.tunix_module
        expected |= {f"{base}.{a}", f"{base}.{b}"}
    missing = sorted(expected - set(paths))
    if missing:
        raise UserError(f"LoRA was not applied to {missing[0]} (Qwix matched no module for it); "
                        f"check lora.targets")


def count_params(model, kind=None) -> int:
    import jax
    from flax import nnx

    state = nnx.state(model, kind) if kind is not None else nnx.state(model)
    return sum(math.prod(getattr(x, "shape", ())) for x in jax.tree.leaves(state))
