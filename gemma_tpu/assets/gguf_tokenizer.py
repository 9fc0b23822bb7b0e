"""Rebuild a faithful tokenizer from a GGUF's SentencePiece vocabulary (pieces, scores, piece types):
a SentencePiece model proto (`tokenizer.model`) and an equivalent fast tokenizer (`tokenizer.json`,
BPE merges derived from the scores), checked against each other on hard strings. (The tokenizer
transformers derives from a Gemma GGUF encodes character by character and adds no `<bos>`.)"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from gemma_tpu.assets.build import AssetError, log, log_step

SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# GGUF token types use SentencePiece's piece-type numbering.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclasses.dataclass
class GGUFVocab:
    """The SentencePiece vocabulary stored in a GGUF's `tokenizer.ggml.*` fields."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    add_bos: bool
    add_space_prefix: bool


def read_gguf_vocab(gguf_path: str | os.PathLike) -> GGUFVocab:
    """Read the vocabulary, undoing llama.cpp's one change to it.

    llama.cpp stores user-defined pieces "pre-normalized" (`▁` turned back into spaces, so that
    it can match them in raw text). SentencePiece matches them in normalized text, so the
    `▁` form is restored here ("  " -> "▁▁").
    """
    from gguf import GGUFReader

    with log_step(f"reading tokenizer vocabulary from {Path(gguf_path).name}"):
        reader = GGUFReader(str(gguf_path))
        fields = reader.fields

        def value(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        model = value("tokenizer.ggml.model")
        if model != "llama":  # llama.cpp's name for SentencePiece vocabularies
            raise AssetError(f"{gguf_path}: tokenizer.ggml.model is {model!r}; only SentencePiece ('llama') is supported")
        tokens = list(value("tokenizer.ggml.tokens"))
        scores = [float(s) for s in value("tokenizer.ggml.scores")]
        types = [int(t) for t in value("tokenizer.ggml.token_type")]
    if not (len(tokens) == len(scores) == len(types)):
        raise AssetError(f"{gguf_path}: tokens/scores/token_type lengths differ")
    pieces = [t.replace(" ", SPACE) if ty == USER_DEFINED else t for t, ty in zip(tokens, types)]
    if len(set(pieces)) != len(pieces):
        raise AssetError(f"{gguf_path}: duplicate pieces in the vocabulary")
    vocab = GGUFVocab(
        pieces=pieces,
        scores=scores,
        types=types,
        bos_id=int(value("tokenizer.ggml.bos_token_id", 2)),
        eos_id=int(value("tokenizer.ggml.eos_token_id", 1)),
        unk_id=int(value("tokenizer.ggml.unknown_token_id", 3)),
        pad_id=int(value("tokenizer.ggml.padding_token_id", 0)),
        add_bos=bool(value("tokenizer.ggml.add_bos_token", True)),
        add_space_prefix=bool(value("tokenizer.ggml.add_space_prefix", False)),
    )
    from collections import Counter

    log.info("vocabulary: %d pieces, types %s, bos=%d eos=%d unk=%d pad=%d, add_bos=%s add_space_prefix=%s",
             len(pieces), dict(sorted(Counter(types).items())), vocab.bos_id, vocab.eos_id, vocab.unk_id,
             vocab.pad_id, vocab.add_bos, vocab.add_space_prefix)
    return vocab


def build_sentencepiece_model(vocab: GGUFVocab) -> bytes:
    """A serialized SentencePiece BPE ModelProto with Gemma's settings.

    Gemma's normalizer is the identity (no NFKC) that only turns " " into "▁", with no dummy
    prefix and no whitespace collapsing; unknown characters fall back to `<0xNN>` byte pieces.
    `split_digits` only matters for training: the vocabulary has no multi-digit pieces, so every
    digit is its own token either way.
    """
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    for i, (piece, score, kind) in enumerate(zip(vocab.pieces, vocab.scores, vocab.types)):
        p = proto.pieces.add()
        p.piece = piece
        p.score = score
        # llama.cpp marks <unk> as CONTROL; SentencePiece needs exactly one UNKNOWN piece.
        p.type = UNKNOWN if i == vocab.unk_id else kind
    t = proto.trainer_spec
    t.model_type = sp_pb2.TrainerSpec.BPE
    t.vocab_size = len(vocab.pieces)
    t.byte_fallback = True
    t.split_digits = True
    t.allow_whitespace_only_pieces = True
    t.unk_id, t.bos_id, t.eos_id, t.pad_id = vocab.unk_id, vocab.bos_id, vocab.eos_id, vocab.pad_id
    t.unk_piece, t.bos_piece = vocab.pieces[vocab.unk_id], vocab.pieces[vocab.bos_id]
    t.eos_piece, t.pad_piece = vocab.pieces[vocab.eos_id], vocab.pieces[vocab.pad_id]
    n = proto.normalizer_spec
    n.name = "identity"
    n.precompiled_charsmap = b""
    n.add_dummy_prefix = vocab.add_space_prefix
    n.remove_extra_whitespaces = False
    n.escape_whitespaces = True
    return proto.SerializeToString()


def derive_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven BPE.

    SentencePiece repeatedly joins the adjacent pair whose concatenation is the best-scoring
    normal piece. A merge list with every split (left, right) of every normal piece, both halves
    normal pieces, ranked by the score of the joined piece, makes `tokenizers` do the same.
    """
    normal = [i for i, kind in enumerate(vocab.types) if kind == NORMAL]
    normal.sort(key=lambda i: (-vocab.scores[i], i))
    known = {vocab.pieces[i] for i in normal}
    merges = []
    t = time.monotonic()
    for i in normal:
        piece = vocab.pieces[i]
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in known and right in known:
                merges.append((left, right))
    dt = time.monotonic() - t
    log.info("derived %d merges from %d normal pieces in %.1f s (%.0f pieces/s)", len(merges), len(normal), dt,
             len(normal) / max(dt, 1e-9))
    return merges


def build_tokenizer(vocab: GGUFVocab, out: Path, chat_template: str) -> None:
    """Write `tokenizer.model`, `tokenizer.json`, `tokenizer_config.json` and the chat template.

    The fast tokenizer is transformers' own `GemmaTokenizer` pipeline (" " -> "▁", BPE with
    byte fallback, `<bos>` prepended) fed with our vocabulary and merges. Control pieces become
    special added tokens (matched in text, dropped by `skip_special_tokens`); user-defined pieces
    (newline/tab/space runs, HTML tags) become normal added tokens, matched after normalization,
    as SentencePiece matches them.
    """
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    (out / "tokenizer.model").write_bytes(build_sentencepiece_model(vocab))
    merges = derive_merges(vocab)
    with log_step("building the fast tokenizer"):
        names = {k: vocab.pieces[i] for k, i in (("bos_token", vocab.bos_id), ("eos_token", vocab.eos_id),
                                                 ("unk_token", vocab.unk_id), ("pad_token", vocab.pad_id))}
        tok = GemmaTokenizer(
            vocab={p: i for i, p in enumerate(vocab.pieces)},
            merges=merges,
            add_bos_token=vocab.add_bos,
            add_eos_token=False,
            **names,
        )
        added = []
        for i, (piece, kind) in enumerate(zip(vocab.pieces, vocab.types)):
            if kind in (CONTROL, UNKNOWN) or i == vocab.unk_id:
                added.append(AddedToken(piece, special=True, normalized=False))
            elif kind == USER_DEFINED:
                added.append(AddedToken(piece, special=False, normalized=True))
        tok.add_tokens(added)
        if len(tok) != len(vocab.pieces):
            raise AssetError(f"tokenizer has {len(tok)} tokens, vocabulary {len(vocab.pieces)}")
        tok.chat_template = chat_template
        tok.save_pretrained(str(out))
    # Make the intent explicit for every loader (not only for the post-processor in tokenizer.json),
    # and keep the template in tokenizer_config.json too for tools that only read that file.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=vocab.add_bos, add_eos_token=False, chat_template=chat_template)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(chat_template)


# A few strings with the hard cases: no dummy prefix, whitespace runs, digits, bytes, scripts.
_SELF_CHECK = [
    "The capital of France is",
    "  two leading, three trailing   ",
    "tabs\tand\t\tnewlines\n\n\nend",
    "1234567890 3.14159",
    "naïve café, Straße, 中文, 日本語, Русский, العربية",
    "emoji 🏋️‍♂️💪 and a rare char \U0001d539",
    "def f(x):\n    return x ** 2  # <b>bold</b>",
]


def check_tokenizer(out: Path) -> None:
    """Load what was written the way users will and check it against SentencePiece."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    with log_step("checking the tokenizer"):
        tok = AutoTokenizer.from_pretrained(str(out))
        sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        for text in _SELF_CHECK:
            ids = tok(text).input_ids
            want = [sp.bos_id()] + sp.encode(text)
            if ids != want:
                raise AssetError(f"tokenizer self-check: {text!r} -> {ids}, SentencePiece gives {want}")
            if tok.decode(ids, skip_special_tokens=True) != text:
                raise AssetError(f"tokenizer self-check: {text!r} does not round-trip")
        for special in ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"):
            ids = tok(special, add_special_tokens=False).input_ids
            if ids != [tok.convert_tokens_to_ids(special)]:
                raise AssetError(f"tokenizer self-check: {special} is not one token ({ids})")
