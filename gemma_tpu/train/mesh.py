"""Device mesh from `mesh.*`: axes (data, fsdp, tp), -1 meaning the rest of the devices; multi-host setup.

* `data` - pure data parallelism (batch split, weights replicated); `dcn_data` multiplies it across
  slices (multi-slice: the slices talk over the data-centre network, so only the cheap gradient
  all-reduce of data parallelism should cross it).
* `fsdp` - batch split *and* weights sharded (ZeRO-3 style: all-gathered layer by layer).
* `tp` - tensor parallelism inside a layer (heads / MLP width).

Tunix's Gemma models annotate their weights with the axis names 'fsdp' and 'tp'; batches are sharded
over ('data', 'fsdp') together (`BATCH_SPEC`). `gemma_tpu.train.partition` holds the partition rules.

Multi-host: `initialize_distributed` must run before any other JAX call. It starts
`jax.distributed` when more than one process is present - a TPU pod slice (detected from the TPU
VM environment; JAX then finds the coordinator itself) or a coordinator address with a process
count above one, from `mesh.coordinator_address` / `mesh.num_processes` / `mesh.process_id` or the
environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`). On CPU it selects the
gloo collectives, without which cross-process computations cannot run.
"""

from __future__ import annotations

import logging
import math
import os
import re

from gemma_tpu.core.config import MeshConfig
from gemma_tpu.core.errors import UserError

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")
# Tunix's TrainingConfig.data_sharding_axis is splatted into a PartitionSpec: one tuple entry
# shards dimension 0 (the batch) over both axes. ("data", "fsdp") would shard the sequence over fsdp.
DATA_SHARDING_AXIS = (BATCH_AXES,)


def mesh_shape(m: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """(data × dcn_data, fsdp, tp) for `n_devices`, resolving the one axis that may be -1."""
    dcn = m.dcn_data if m.dcn_data > 0 else 1
    sizes = [m.data * dcn if m.data != -1 else -1, m.fsdp, m.tp]
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1:
        raise UserError("mesh: only one of data, fsdp, tp may be -1")
    fixed = math.prod(s for s in sizes if s != -1)
    # the config keys behind the fixed sizes, for the messages (dcn_data multiplies data unless that is -1)
    keys = [f"mesh.{k}={v}" for k, v in (("data", m.data), ("dcn_data", dcn), ("fsdp", m.fsdp), ("tp", m.tp))
            if v > 1 and not (k == "dcn_data" and m.data == -1)]
    named = " × ".join(keys) + (f" = {fixed}" if len(keys) > 1 else "")
    if free:
        if n_devices % fixed:
            raise UserError(f"mesh: {n_devices} devices are not divisible by the fixed axes {named}")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes) != n_devices:
        raise UserError(f"mesh: {' × '.join(keys) or 'every axis 1'} makes a mesh of {math.prod(sizes)} devices "
                        f"but there are {n_devices}")
    if sizes[0] % dcn:
        raise UserError(f"mesh: the data axis ({sizes[0]}) is not a multiple of mesh.dcn_data={dcn}")
    return tuple(sizes)  # type: ignore[return-value]


# ---------------------------------------------------------------- multi-host


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise UserError(f"environment variable {name}={v!r} is not an integer") from None


def _tpu_pod_env() -> bool:
    """A TPU VM that is one of several hosts of a slice (or of several slices)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return True
    return bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def distributed_settings(m: MeshConfig) -> dict | None:
    """The `jax.distributed.initialize` arguments this run needs, or None for a single process.

    Config keys win over the environment. An empty dict means 'let JAX detect the cluster' (TPU pods).
    """
    address = m.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num = m.num_processes if m.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = m.process_id if m.process_id is not None else _env_int("JAX_PROCESS_ID")
    if num is not None and num < 1:
        raise UserError(f"mesh.num_processes must be positive, got {num}")
    if address and (num or 1) > 1:
        if pid is None:
            raise UserError("mesh.coordinator_address is set for several processes but mesh.process_id "
                            "(or JAX_PROCESS_ID) is not")
        if not 0 <= pid < num:
            raise UserError(f"mesh.process_id={pid} is not in [0, {num})")
        return {"coordinator_address": address, "num_processes": num, "process_id": pid}
    if (num or 1) > 1:
        raise UserError(f"mesh.num_processes={num} needs mesh.coordinator_address (or JAX_COORDINATOR_ADDRESS)")
    if _tpu_pod_env():
        return {}
    given = [f"mesh.{k}={v}" for k, v in (("coordinator_address", m.coordinator_address),
                                           ("process_id", m.process_id)) if v not in (None, "")]
    if given and num is None:  # else each host ran the whole run alone, as a single process, without a word
        raise UserError(f"{' and '.join(given)} set without mesh.num_processes (or JAX_NUM_PROCESSES): give the "
                        f"number of processes (1 for a single-process run)")
    return None


_INITIALIZED = False


def initialize_distributed(m: MeshConfig) -> bool:
    """Start multi-process JAX when this run has several processes; True when it did.

    Call before anything asks JAX for devices. Safe to call twice.
    """
    global _INITIALIZED
    import jax

    settings = distributed_settings(m)
    if settings is None or _INITIALIZED:
        return _INITIALIZED
    # CPU processes need a collectives implementation to talk to each other; it only concerns the
    # CPU client, so it is harmless on TPU and GPU hosts.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("jax.distributed.initialize(%s)", ", ".join(f"{k}={v}" for k, v in settings.items()) or "auto-detect")
    jax.distributed.initialize(**settings)
    _INITIALIZED = True
    log.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return True


# ---------------------------------------------------------------- the mesh


def untuned_gemm_warning(platform: str, xla_flags: str) -> str | None:
    """A warning when XLA_FLAGS turns GPU autotuning off for training: it saves compile time, but on a lent
    H100 it made the Gemma 3 1B LoRA step 1.96 s instead of ~0.15 s (benchmarks/RESULTS.md,
    "2026-11-26 (afternoon)")."""
    if platform != "gpu":
        return None
    levels = re.findall(r"--xla_gpu_autotune_level=(\d+)", xla_flags or "")
    if not levels or int(levels[-1]) != 0:  # XLA reads the last one
        return None
    return ("XLA_FLAGS has --xla_gpu_autotune_level=0: GEMM fusions run untuned (a 1B LoRA step on an H100 ran "
            "13x slower); drop it for training, keep it for short compile-bound checks")


def build_mesh(m: MeshConfig, devices=None):
    """The (data, fsdp, tp) mesh over `devices` (default: all), laid out for ICI locality.

    One slice: `jax.make_mesh`, which orders devices so that the innermost axes (tp, then fsdp) are
    physically adjacent on the TPU torus. Several slices (`dcn_data` > 1): a hybrid mesh whose data
    axis is dcn_data slices × the per-slice data axis, so only data parallelism crosses the DCN.
    """
    import jax
    import numpy as np

    devices = list(devices) if devices is not None else jax.devices()
    warning = untuned_gemm_warning(devices[0].platform, os.environ.get("XLA_FLAGS", ""))
    if warning:
        log.warning(warning)
    shape = mesh_shape(m, len(devices))
    # Auto axes: Tunix's models place weights with sharding annotations and let XLA propagate.
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    dcn = m.dcn_data if m.dcn_data > 0 else 1
    if dcn > 1:
        # The DCN groups: TPU slices; on GPU or CPU hosts each process is one, as multi-node GPU
        # clusters are laid out (fast links inside a host, network between).
        by_process = devices[0].platform != "tpu"
        groups = {d.process_index if by_process else getattr(d, "slice_index", 0) for d in devices}
        if len(groups) != dcn:
            what = "process(es)" if by_process else "slice(s)"
            raise UserError(f"mesh.dcn_data={dcn} but the devices form {len(groups)} {what}")
        from jax.experimental import mesh_utils

        ici = (shape[0] // dcn, shape[1], shape[2])
        grid = mesh_utils.create_hybrid_device_mesh(ici, (dcn, 1, 1), devices, process_is_granule=by_process)
        owner = (lambda d: d.process_index) if by_process else (lambda d: getattr(d, "slice_index", 0))
        log.info("mesh.dcn_data=%d (%s): the %s of each data row %s (only the data axis crosses them)", dcn,
                 " ".join(f"{a}={n}" for a, n in zip(AXES, np.asarray(grid).shape)),
                 "process" if by_process else "slice", [sorted({owner(d) for d in row.flat}) for row in grid])
        return jax.sharding.Mesh(np.asarray(grid), AXES, axis_types=auto)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, AXES, axis_types=auto)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def check_batch_layout(batch_size: int, mesh_sizes: dict[str, int], process_count: int) -> str | None:
    """The global batch is split over (data, fsdp), each process feeding its own rows to its own devices: refused
    (UserError) where the processes cannot do that; the warning for a batch the devices cannot split (replicated
    then, every device computing every example: single process only), else None."""
    ways = mesh_sizes.get("data", 1) * mesh_sizes.get("fsdp", 1)
    if ways % process_count:  # else a ValueError traceback at the first batch, after the model loaded
        raise UserError(f"mesh data×fsdp = {ways} does not split the batch over the {process_count} processes: each "
                        f"process feeds its own rows to its own devices, so data×fsdp must be a multiple of "
                        f"{process_count} (keep mesh.tp={mesh_sizes.get('tp', 1)} within one host's devices)")
    if batch_size % ways == 0:
        return None
    msg = f"train.batch_size={batch_size} is not divisible by mesh data×fsdp = {ways}; the batch cannot be split " \
          f"over the devices"
    if process_count > 1:
        raise UserError(msg)
    return f"{msg}: every device will compute the whole batch"


def batch_spec(mesh, rows: int):
    """How a global batch of `rows` lies on the mesh: split over (data, fsdp), or replicated where
    those devices cannot split it evenly (single process only; see train.check_batch_divisible)."""
    from jax.sharding import PartitionSpec

    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    return PartitionSpec(*DATA_SHARDING_AXIS) if rows % ways == 0 else PartitionSpec()


def global_batch(mesh, batch: dict) -> dict:
    """This process's rows of a batch (numpy) -> one global array per field, rows split over
    (data, fsdp), from per-process data (`jax.make_array_from_process_local_data`).

    Every process passes the same number of rows; process p's rows land on its own devices. (Tunix's
    `shard_input` would do this, but it checks divisibility on the *local* row count and silently
    replicates a process's rows as if they were the whole batch.) A batch the (data, fsdp) devices
    cannot split evenly is replicated instead (single process only; see train.check_batch_divisible).
    """
    import jax
    from jax.sharding import NamedSharding

    n = jax.process_count()
    out = {}
    for k, v in batch.items():
        rows = v.shape[0] * n
        out[k] = jax.make_array_from_process_local_data(NamedSharding(mesh, batch_spec(mesh, rows)), v,
                                                        (rows, *v.shape[1:]))
    return out
