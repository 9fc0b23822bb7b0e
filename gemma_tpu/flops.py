"""Analytic FLOP count of a training step and the accelerator table used for MFU and memory plans.

Per token of a decoder with L layers, model dim D, H heads of size Dh, K KV heads, MLP width F, at
sequence length T (multiply-add = 2 FLOPs):

    matmul params  P = L * (D*H*Dh + 2*D*K*Dh + H*Dh*D + 3*D*F)
    forward        2*P + 4*L*T*H*Dh            (the second term: QK^T and AV, full causal square)
    vocabulary     2*D*V per loss position      (we project only loss-bearing positions)

Training multiplies the forward by 3 when every weight gets a gradient (forward, activation
gradients, weight gradients) and by 2 when the base is frozen (LoRA: no weight gradients for the
base; the LoRA factors' own FLOPs, 6*r*(in+out) per projection, are added). This is the "model
FLOPs" convention: rematerialisation is not counted.
"""

from __future__ import annotations

import dataclasses

GiB = 2 ** 30

# One device as JAX sees it: per-chip peak dense bf16 FLOP/s and HBM, the vendors' published figures
# (checked November 2026 against cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e} and NVIDIA's H100/H200
# SXM datasheets). Google's pages give v5p as "95 GiB" and v5e as "16 GB"; NVIDIA gives "80 GB" and
# "141 GB". We read every figure as GiB: the planner's safety margin (gemma_tpu.plan) is wider than
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


@dataclasses.dataclass
class StepFlops:
    per_token: float  # FLOPs per (non-vocabulary) token position
    per_loss_token: float  # extra FLOPs per loss-bearing position (vocabulary projection)

    def step(self, tokens: int, loss_tokens: int) -> float:
        return self.per_token * tokens + self.per_loss_token * loss_tokens


def training_flops(tunix_cfg, seq_len: int, lora_rank: int | None, lora_targets: int = 7,
                   matmul_params: int | None = None, attn_dims: int | None = None) -> StepFlops:
    """FLOPs of one training step per token, from the model config (see module docstring).

    `matmul_params` (sum of every layer's projection weights) and `attn_dims` (sum over layers of
    heads × head size) override the uniform-layer formula when the caller has the exact shapes
    (Gemma 4's global layers have their own head size and KV heads; the planner passes them).
    """
    L, D, H, Dh, K, F, V = (tunix_cfg.num_layers, tunix_cfg.embed_dim, tunix_cfg.num_heads, tunix_cfg.head_dim,
                            tunix_cfg.num_kv_heads, tunix_cfg.hidden_dim, tunix_cfg.num_embed)
    params = matmul_params if matmul_params is not None else L * (D * H * Dh + 2 * D * K * Dh + H * Dh * D + 3 * D * F)
    fwd = 2 * params + 4 * seq_len * (attn_dims if attn_dims is not None else L * H * Dh)
    if lora_rank:
        per_proj = 6 * lora_rank * (2 * D)  # A and B, forward + both gradients, ~ in+out ≈ 2D
        return StepFlops(2 * fwd + L * lora_targets * per_proj, 2 * 2 * D * V)
    return StepFlops(3 * fwd, 3 * 2 * D * V)


def peak_flops(accelerator: str, n_devices: int) -> float:
    return ACCELERATORS.get(accelerator, ACCELERATORS["cpu"])["peak_flops"] * n_devices
