"""Accelerator facts (peak dense bf16 FLOP/s, memory per JAX device) used for MFU and memory plans."""

from __future__ import annotations

GiB = 2 ** 30

# One device as JAX sees it: per-chip peak dense bf16 FLOP/s and HBM, the vendors' published figures
# (checked November 2026 against cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e} and NVIDIA's H100/H200
# SXM datasheets). Google's pages give v5p as "95 GiB" and v5e as "16 GB"; NVIDIA gives "80 GB" and
# "141 GB". We read every figure as GiB: the planner's safety margin (gemma_tpu.train.plan) is wider than
# the 7% between the two readings. TPU v4 and v5p chips have two TensorCores run as one device
# (megacore), so a "v5p-8" (8 TensorCores) is 4 chips = 4 JAX devices on one host. `cpu` has no
# meaningful peak or memory limit (host RAM), so plans for it only report.
ACCELERATORS: dict[str, dict[str, float]] = {
    "v4": {"peak_flops": 275e12, "hbm_bytes": 32 * GiB},
    "v5e": {"peak_flops": 197e12, "hbm_bytes": 16 * GiB},
    "v5p": {"peak_flops": 459e12, "hbm_bytes": 95 * GiB},
    "v6e": {"peak_flops": 918e12, "hbm_bytes": 32 * GiB},
    "h100": {"peak_flops": 989e12, "hbm_bytes": 80 * GiB},
    "h200": {"peak_flops": 989e12, "hbm_bytes": 141 * GiB},
    "cpu": {"peak_flops": 0.0, "hbm_bytes": 0.0},
}
