"""Device mesh from `mesh.*`: axes (data, fsdp, tp), -1 meaning the rest of the devices.

Tunix's Gemma models annotate their weights with the axis names 'fsdp' and 'tp'; batches are
sharded over ('data', 'fsdp').
"""

from __future__ import annotations

import math

from gemma_tpu.config import MeshConfig
from gemma_tpu.errors import UserError

AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")


def mesh_shape(m: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    sizes = [m.data * (m.dcn_data if m.dcn_data > 0 else 1), m.fsdp, m.tp]
    if m.data == -1:
        sizes[0] = -1
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1:
        raise UserError("mesh: only one of data, fsdp, tp may be -1")
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if n_devices % fixed:
            raise UserError(f"mesh: {n_devices} devices are not divisible by the fixed axes ({fixed})")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes) != n_devices:
        raise UserError(f"mesh: data×fsdp×tp = {math.prod(sizes)} but there are {n_devices} devices")
    return tuple(sizes)  # type: ignore[return-value]


def build_mesh(m: MeshConfig):
    import jax

    shape = mesh_shape(m, jax.device_count())
    # Auto axes: Tunix's models place weights with sharding annotations and let XLA propagate.
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto)
