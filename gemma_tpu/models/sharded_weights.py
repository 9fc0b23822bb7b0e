"""Load an HF safetensors checkpoint straight into sharded Tunix params, each process reading
only the slices that its own devices hold.

Why not Tunix's loader (`tunix.models.safetensors_loader`): it reads every tensor whole on every
host (its transpose/reshape/astype each copy the full tensor) and its Gemma preprocessing stacks
K and V with `jnp.stack` on the default device, so on a pod every host reads the whole checkpoint
and device 0 holds whole K/V weights. Here every Tunix param is built with
`jax.make_array_from_callback`: for each box of the param that a local device holds, the box is
mapped back through the registry's HF<->Tunix layout algebra (`Projection`/`Tensor`: which Tunix
axes each HF dimension groups, and for fused weights which HF tensor fills which index of the
fused axis) to a box of the HF tensor, and only that box is read from the file (a memory map, so
only the pages under it are touched). The same registry table converts full fine-tunes back to
HF, so loading and saving cannot disagree.

An HF dimension that groups several Tunix axes (q_proj's N*H rows) is viewed as those axes (a free
reshape of the row-major bytes), so any box is read exactly, whichever axes the mesh splits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from gemma_tpu.core.errors import UserError
from gemma_tpu.core.progress import Progress, human
from gemma_tpu.core.tracing import cheap_tracer_attribute_errors
from gemma_tpu.hf.safetensors_io import WeightsDir, is_computed_buffer
from gemma_tpu.models.registry import REPLICATED_WHEN_INDIVISIBLE, Family, Projection

log = logging.getLogger(__name__)

_READ_THREADS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Source:
    """One HF tensor that fills (part of) a Tunix param."""

    hf_key: str
    tunix_axes: tuple[str, ...]  # the Tunix param's axes, split axis included
    groups: tuple[tuple[str, ...], ...]  # HF dims, each a group of Tunix axes in row-major order
    split: tuple[str, int] | None = None  # (fused Tunix axis, this tensor's index along it)


def _source(hf_key: str, how: Any, rank: int) -> Source:
    if isinstance(how, Projection):
        return Source(hf_key, tuple(how.axes), (tuple(how.out_axes), tuple(how.in_axes)), how.split)
    if how.axes:
        return Source(hf_key, tuple(how.axes), tuple(tuple(g) for g in how.hf_axes))
    axes = tuple(f"_{i}" for i in range(rank))  # the same array on both sides
    return Source(hf_key, axes, tuple((a,) for a in axes))


@dataclasses.dataclass
class LoadStats:
    """What this process read: the test of "each host reads only what it needs"."""

    bytes_read: int = 0  # bytes of HF tensor data read from disk by this process
    checkpoint_bytes: int = 0  # bytes of every HF tensor the model needs (what a whole read costs)
    params: int = 0
    seconds: float = 0.0


LAST_STATS = LoadStats()  # of the most recent load in this process


class _Reader:
    """Boxes of HF tensors, read from memory maps of the safetensors files."""

    def __init__(self, weights):
        self.weights = weights  # gemma_tpu.hf.safetensors_io.WeightsDir
        self._maps: dict[Path, np.memmap] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def read(self, key: str, shape: tuple[int, ...], box: tuple[slice, ...]) -> np.ndarray:
        """`box` of tensor `key` viewed with `shape` (its dims split into Tunix axes: a free reshape
        of the C-ordered bytes), copied out: only the pages under the box are read."""
        t = self.weights[key]
        with self._lock:
            mm = self._maps.get(t.file)
            if mm is None:
                mm = np.memmap(t.file, dtype=np.uint8, mode="r")
                t.check_same(os.stat(t.file))  # the file mapped is the one its header came from
                self._maps[t.file] = mm
        view = mm[t.start:t.start + t.nbytes].view(t.np_dtype).reshape(shape)
        out = np.array(view[box])
        with self._lock:
            self.bytes_read += out.nbytes
        return out

    def close(self) -> None:
        self._maps.clear()


def _read_box(reader: _Reader, sources: list[Source], shape: tuple[int, ...],
              box: tuple[tuple[int, int], ...], dtype: np.dtype) -> np.ndarray:
    """The Tunix param's values in `box` ((start, stop) per axis), read from its HF sources."""
    first = sources[0]
    axes = first.tunix_axes
    sizes = dict(zip(axes, shape))
    ranges = dict(zip(axes, box))
    out = np.empty([e - s for s, e in box], dtype)
    split_axis = first.split[0] if first.split else None
    by_index = {src.split[1]: src for src in sources} if split_axis else {None: first}
    indices = range(*ranges[split_axis]) if split_axis else [None]
    for j in indices:
        src = by_index.get(j)
        if src is None:
            raise UserError(f"no checkpoint tensor fills index {j} of fused axis {split_axis} "
                            f"(from {first.hf_key})")
        order = [a for group in src.groups for a in group]  # HF dims split into Tunix axes
        block = reader.read(src.hf_key, tuple(sizes[a] for a in order), tuple(slice(*ranges[a]) for a in order))
        target = [a for a in axes if a != split_axis]
        block = np.transpose(block, [order.index(a) for a in target]).astype(dtype, copy=False)
        if split_axis is None:
            out[...] = block
        else:
            where = [slice(None)] * len(axes)
            where[axes.index(split_axis)] = j - ranges[split_axis][0]
            out[tuple(where)] = block
    return out


def _check_shapes(weights: WeightsDir, name: str, sources: list[Source], shape: tuple[int, ...]) -> None:
    sizes = dict(zip(sources[0].tunix_axes, shape))
    if len(shape) != len(sources[0].tunix_axes):
        raise UserError(f"{sources[0].hf_key}: Tunix param {name} has rank {len(shape)}, the registry "
                        f"expects axes {sources[0].tunix_axes}")
    for src in sources:
        want = tuple(math.prod(sizes[a] for a in g) for g in src.groups)
        got = tuple(weights[src.hf_key].shape)
        if got != want:
            raise UserError(f"{weights[src.hf_key].file}: tensor {src.hf_key} has shape {list(got)}, "
                            f"config.json implies {list(want)} (Tunix {name})")


def _unique_boxes(sharding, shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """The distinct boxes of this param that this process's devices hold."""
    boxes = []
    for index in sharding.addressable_devices_indices_map(shape).values():
        box = tuple(s.indices(d)[:2] for s, d in zip(index, shape)) if index else ()
        if box not in boxes:
            boxes.append(box)
    return boxes


def _warn_unread(model_dir, family: Family, prefix: str, names, used: set[str]) -> None:
    """Decoder tensors the config does not read (per-layer embeddings of a config that has none, a layer past
    num_hidden_layers) mean config.json and the weights disagree: said once, as transformers says "unexpected
    keys", instead of a model silently built without them. Other towers (vision, audio) are not under `prefix`."""
    unread = sorted(n for n in names if n.startswith(prefix) and n not in used and not is_computed_buffer(n))
    if unread:
        log.warning("%s: %d checkpoint tensor%s under %r not read for this config.json (%s%s): the %s model is built "
                    "without %s; check config.json", model_dir, len(unread), "s" if len(unread) > 1 else "", prefix,
                    unread[0], f", ... {unread[-1]}" if len(unread) > 1 else "", family.name,
                    "them" if len(unread) > 1 else "it")


def replicate_indivisible(model, family: Family, mesh_sizes: dict[str, int]):
    """The model, each weight's sharding annotation without the mesh axes on a dimension that they do not divide
    and whose config.json field (`Family.dim_fields`) is in `REPLICATED_WHEN_INDIVISIBLE` (KV heads: Tunix
    annotates them 'tp' whatever their count; 2 KV heads at tp=4 failed to place). The LoRA factors Qwix adds
    and the optimizer state inherit the annotation; `gemma_tpu.train.partition.resolve` places them so."""
    from flax import nnx

    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        spec = var.get_metadata().get("out_sharding")
        shape = getattr(var.get_value(), "shape", None)
        fields = family.dim_fields(".".join(str(p) for p in path))
        if not spec or shape is None or len(spec) != len(shape) or not fields:
            continue
        def split(entry) -> int:
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            return math.prod(mesh_sizes.get(a, 1) for a in axes)

        fitted = tuple(None if d < len(fields) and fields[d] in REPLICATED_WHEN_INDIVISIBLE and size % split(e)
                       else e for d, (size, e) in enumerate(zip(shape, spec)))
        if fitted != tuple(spec):
            var.set_metadata(out_sharding=fitted)
    return model


def _abstract_state(family: Family, cfg: Any, mesh=None):
    """(graph def, abstract state) of `family.model_class()(cfg)`: shapes, dtypes, shardings, no memory."""
    from flax import nnx
    from tunix.utils import compat

    def build():
        model = family.model_class()(cfg, rngs=nnx.Rngs(params=0))
        return model if mesh is None else replicate_indivisible(model, family, dict(mesh.shape))

    ctx = compat.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    with ctx, cheap_tracer_attribute_errors():
        abstract = nnx.eval_shape(build)
    return nnx.split(abstract)


def _param_plan(family: Family, model_dir, weights: WeightsDir, cfg: Any, state: dict, warn: bool = False):
    """(Tunix param names in tree order, abstract leaves, HF sources per name), every name's sources present
    in the registry and every source tensor of the shape config.json implies: from the headers alone.
    `warn`: also name the decoder tensors this config does not read."""
    import jax

    prefix = family.text_prefix(weights.names())
    by_param: dict[str, list[tuple[str, Any]]] = {}
    for hf_key, tunix_name, how in family.weight_sources(cfg, prefix):
        by_param.setdefault(tunix_name, []).append((hf_key, how))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    names = [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in leaves]
    missing = [n for n in names if n not in by_param]
    if missing:
        raise UserError(f"{model_dir}: the {family.name} registry has no checkpoint tensor for Tunix param "
                        f"{missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for hf_key in (k for ks in by_param.values() for k, _ in ks):
        if hf_key not in weights:
            raise UserError(f"{model_dir}: weight '{hf_key}' is missing from the checkpoint")
        weights.require_float([hf_key])
    sources = {}
    for name, (_, leaf) in zip(names, leaves):
        shape = tuple(leaf.shape)
        sources[name] = [_source(k, how, len(shape)) for k, how in by_param[name]]
        _check_shapes(weights, name, sources[name], shape)
    if warn:
        _warn_unread(model_dir, family, prefix, weights.names(), {k for ks in by_param.values() for k, _ in ks})
    return names, leaves, sources


def check_weight_headers(family: Family, model_dir: str | Path, cfg: Any) -> None:
    """What can be known of `model_dir`'s weights without reading them: readable safetensors headers, the
    shards the index names, every tensor the model reads present with the shape config.json implies. Run
    before the training data is prepared (minutes on a large set), so a damaged or mismatched checkpoint
    is refused first; loading checks the same again."""
    _, abs_state = _abstract_state(family, cfg)
    _param_plan(family, model_dir, WeightsDir(model_dir), cfg, abs_state.to_pure_dict())


def load_sharded(family: Family, model_dir: str | Path, cfg: Any, mesh=None, dtype=None):
    """Build `family.model_class()(cfg)` with every weight read from `model_dir` into its sharding.

    Without a mesh every param goes to the first device (as Tunix's loader does)."""
    import jax
    from flax import nnx

    t0 = time.monotonic()
    weights = WeightsDir(model_dir)
    graph_def, abs_state = _abstract_state(family, cfg, mesh)
    state = abs_state.to_pure_dict()
    if mesh is not None:
        shardings = nnx.get_named_sharding(abs_state, mesh).to_pure_dict()
    else:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, state)
    names, leaves, sources_of = _param_plan(family, model_dir, weights, cfg, state, warn=True)
    shard_leaves = jax.tree.leaves(shardings)

    reader = _Reader(weights)
    plan = []
    local_bytes = checkpoint_bytes = 0
    for name, (_, leaf), sharding in zip(names, leaves, shard_leaves):
        shape = tuple(leaf.shape)
        out_dtype = np.dtype(dtype if dtype is not None else leaf.dtype)
        sources = sources_of[name]
        boxes = _unique_boxes(sharding, shape)
        plan.append((name, shape, out_dtype, sharding, sources, boxes))
        itemsize = weights[sources[0].hf_key].np_dtype.itemsize
        local_bytes += sum(math.prod(e - s for s, e in b) for b in boxes) * itemsize
        checkpoint_bytes += sum(weights[s.hf_key].nbytes for s in sources)

    progress = Progress(f"loading {Path(model_dir).name} (this process's shards)", local_bytes)
    arrays = []
    with concurrent.futures.ThreadPoolExecutor(_READ_THREADS) as pool:
        for name, shape, out_dtype, sharding, sources, boxes in plan:
            before = reader.bytes_read
            try:
                blocks = dict(zip(boxes, pool.map(lambda b: _read_box(reader, sources, shape, b, out_dtype), boxes)))
            except OSError as e:
                raise UserError(f"{model_dir}: reading {sources[0].hf_key} failed ({e})") from None

            def fetch(index, shape=shape, blocks=blocks):
                box = tuple(s.indices(d)[:2] for s, d in zip(index, shape)) if index else ()
                return blocks[box]

            arrays.append(jax.make_array_from_callback(shape, sharding, fetch))
            progress.update(reader.bytes_read - before)
    reader.close()
    progress_seconds = progress.finish()

    stats = LoadStats(reader.bytes_read, checkpoint_bytes, len(plan), time.monotonic() - t0)
    LAST_STATS.__dict__.update(dataclasses.asdict(stats))
    log.info("loaded %d params: read %s of %s in %.1f s (process %d of %d)", stats.params, human(stats.bytes_read),
             human(stats.checkpoint_bytes), progress_seconds, jax.process_index(), jax.process_count())
    treedef = jax.tree_util.tree_structure(state)
    return nnx.merge(graph_def, jax.tree_util.tree_unflatten(treedef, arrays))
