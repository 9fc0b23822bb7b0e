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

from gemma_tpu.core.accelerators import ACCELERATORS


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
