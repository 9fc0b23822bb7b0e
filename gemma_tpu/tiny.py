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
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
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
