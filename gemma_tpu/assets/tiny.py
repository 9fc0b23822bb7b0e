"""Tiny random Gemma checkpoints written by `transformers` itself, for tests, CI and benchmarks.

They are real HF directories (config.json, safetensors, tokenizer), so every code path that reads a
user's checkpoint reads these the same way. The tokenizer is the embedded Gemma 3 one when it is
prepared, else a small word-level tokenizer with Gemma's special-token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_GEMMA3 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=16,
    max_position_embeddings=1024,
)

# Gemma's control tokens at their real ids, so rendering code is exercised as with real models.
_SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 105: "<start_of_turn>",
             106: "<end_of_turn>"}


def _write_small_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-fallback-free word/char tokenizer with Gemma's special ids; enough for tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for i in range(vocab_size):
        vocab[_SPECIALS.get(i, f"<unused{i}>")] = i
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    free = [i for i in range(vocab_size) if i not in _SPECIALS and i > 106]
    for ch, i in zip(chars, free):
        del vocab[f"<unused{i}>"]
        vocab[ch] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([_SPECIALS[i] for i in sorted(_SPECIALS)])
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(str(out))


def write_tiny_gemma3(out: str | Path, seed: int = 0, tokenizer_from: str | Path | None = None,
                      dtype: str = "float32", **overrides: Any) -> Path:
    """Write a random Gemma3ForCausalLM with `transformers` and return its directory."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = {**TINY_GEMMA3, **overrides}
    if tokenizer_from is not None:
        params["vocab_size"] = 262144 if "vocab_size" not in overrides else overrides["vocab_size"]
    cfg = Gemma3TextConfig(**params)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).to(getattr(torch, dtype))
    # transformers initialises norm weights to zero (= identity under Gemma's 1+w); randomise a
    # little so that a wrong norm mapping cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0).save_pretrained(str(out))
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_from)).save_pretrained(str(out))
    else:
        _write_small_tokenizer(out, params["vocab_size"])
    meta = {"kind": "tiny-gemma3", "seed": seed, "overrides": overrides}
    (out / "tiny.json").write_text(json.dumps(meta))
    return out


# Tiny Gemma 4 variants. Every one has sliding and global layers with different head sizes and
# windows shorter than the test prompts; the variants add what distinguishes the real models.
_G4_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TINY_GEMMA4: dict[str, dict[str, Any]] = {
    # like 31B: keys = values in global layers (K only), fewer global KV heads
    "dense": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=2, attention_k_eq_v=True, layer_types=_G4_TYPES,
        sliding_window=16, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
        max_position_embeddings=1024,
    ),
    # like E2B/E4B: per-layer embeddings, one KV head, the last layers reusing earlier layers'
    # keys and values (here not the last two non-shared layers, which Tunix alone would pick),
    # double-wide MLPs in those layers
    "ple": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "sliding_attention", "full_attention"],
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=512, sliding_window=16, final_logit_softcapping=30.0,
        max_position_embeddings=1024,
    ),
    # like 26B-A4B: a dense MLP plus routed experts in every layer
    "moe": dict(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=2, attention_k_eq_v=True, layer_types=_G4_TYPES,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
        sliding_window=16, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
        max_position_embeddings=1024,
    ),
}


def _tiny_gemma4_vision():
    from transformers import Gemma4VisionConfig

    return Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                              position_embedding_size=64)


def write_tiny_gemma4(out: str | Path, seed: int = 0, variant: str = "dense", multimodal: bool = False,
                      tokenizer_from: str | Path | None = None, dtype: str = "float32",
                      **overrides: Any) -> Path:
    """Write a random Gemma 4 with `transformers` and return its directory.

    `variant`: dense (31B-like), ple (E2B/E4B-like) or moe (26B-A4B-like). `multimodal`: a
    `Gemma4ForConditionalGeneration` with a tiny vision tower, the decoder under
    `model.language_model.`, as Google releases Gemma 4; else a text-only `Gemma4ForCausalLM`."""
    import torch
    from transformers import (
        Gemma4Config,
        Gemma4ForCausalLM,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        GenerationConfig,
    )

    if variant not in TINY_GEMMA4:
        raise ValueError(f"unknown tiny Gemma 4 variant {variant!r} (known: {', '.join(TINY_GEMMA4)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = {**TINY_GEMMA4[variant], **overrides}
    if tokenizer_from is not None and "vocab_size" not in overrides:
        params["vocab_size"] = params["vocab_size_per_layer_input"] = 262144
    text = Gemma4TextConfig(**params)
    torch.manual_seed(seed)
    if multimodal:
        v = params["vocab_size"]
        cfg = Gemma4Config(text_config=text, vision_config=_tiny_gemma4_vision(), audio_config=None,
                           image_token_id=v - 2, boi_token_id=v - 3, eoi_token_id=v - 4, video_token_id=v - 5,
                           boa_token_id=v - 6, eoa_token_index=v - 7, audio_token_id=v - 8)
        cfg.architectures = ["Gemma4ForConditionalGeneration"]
        model = Gemma4ForConditionalGeneration(cfg)
    else:
        text.architectures = ["Gemma4ForCausalLM"]
        model = Gemma4ForCausalLM(text)
    model = model.to(getattr(torch, dtype))
    # transformers initialises norms to one and the layer scalars to one; randomise everything
    # (scalars and the router's scales near one) so that a wrong mapping cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=2, eos_token_id=[1, 106, 50], pad_token_id=0).save_pretrained(str(out))
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_from)).save_pretrained(str(out))
    else:
        _write_small_tokenizer(out, params["vocab_size"])
    meta = {"kind": "tiny-gemma4", "seed": seed, "variant": variant, "multimodal": multimodal,
            "overrides": overrides}
    (out / "tiny.json").write_text(json.dumps(meta))
    return out
