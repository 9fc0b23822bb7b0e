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

# Per-chip peak dense bf16 FLOP/s and HBM bytes (vendor figures).
ACCELERATORS: dict[str, dict[str, float]] = {
    "v4": {"peak_flops": 275e12, "hbm_bytes": 32e9},
    "v5e": {"peak_flops": 197e12, "hbm_bytes": 16e9},
    "v5p": {"peak_flops": 459e12, "hbm_bytes": 95e9},
    "v6e": {"peak_flops": 918e12, "hbm_bytes": 32e9},
    "h100": {"peak_flops": 989e12, "hbm_bytes": 80e9},
    "h200": {"peak_flops": 989e12, "hbm_bytes": 141e9},
    "cpu": {"peak_flops": 0.0, "hbm_bytes": 0.0},
}


@dataclasses.dataclass
class StepFlops:
    per_token: float  # FLOPs per (non-vocabulary) token position
    per_loss_token: float  # extra FLOPs per loss-bearing position (vocabulary projection)

    def step(self, tokens: int, loss_tokens: int) -> float:
        return self.per_token * tokens + self.per_loss_token * loss_tokens


def training_flops(tunix_cfg, seq_len: int, lora_rank: int | None, lora_targets: int = 7) -> StepFlops:
    """FLOPs of one training step per token, from the model config (see module docstring)."""
    L, D, H, Dh, K, F, V = (tunix_cfg.num_layers, tunix_cfg.embed_dim, tunix_cfg.num_heads, tunix_cfg.head_dim,
                            tunix_cfg.num_kv_heads, tunix_cfg.hidden_dim, tunix_cfg.num_embed)
    params = L * (D * H * Dh + 2 * D * K * Dh + H * Dh * D + 3 * D * F)
    fwd = 2 * params + 4 * L * seq_len * H * Dh
    if lora_rank:
        per_proj = 6 * lora_rank * (2 * D)  # A and B, forward + both gradients, ~ in+out ≈ 2D
        return StepFlops(2 * fwd + L * lora_targets * per_proj, 2 * 2 * D * V)
    return StepFlops(3 * fwd, 3 * 2 * D * V)


def peak_flops(accelerator: str, n_devices: int) -> float:
    return ACCELERATORS.get(accelerator, ACCELERATORS["cpu"])["peak_flops"] * n_devices
