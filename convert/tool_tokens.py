"""Publish a tool-calling fine-tune's vocabulary: FunctionGemma markers as real tokens.

A plain Gemma 3 vocabulary has no `<start_function_call>` etc.; training maps each marker onto a reserved
`<unusedN>` token and records that map in the checkpoint metadata (`token_map`). A merged model that
still calls those ids `<unusedN>` would decode its tool calls as `<unused1>call:...<unused2>`, which no
server's tool parser recognises (vLLM's `functiongemma` parser looks for the literal marker strings). So
the merged tokenizer renames those ids to the markers - the ids, and therefore the weights, do not change -
and the directory gets a chat template that renders `tools`, `tool_calls` and tool responses in the format
the model was trained on, plus `<start_function_response>` as a stop id (after a call the model hands
over to the tool runner).

Files touched, when present in the output: tokenizer.json (added tokens and the model vocabulary),
tokenizer_config.json (added_tokens_decoder; an embedded chat_template is replaced by chat_template.jinja),
tokenizer.model (SentencePiece pieces), chat_template.jinja, generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from gemma_tpu.core.atomic import write_file
from gemma_tpu.core.errors import UserError, read_json_object
from gemma_tpu.formats.function_calling import START_RESPONSE, tool_chat_template


def check_added_tokens(path: Path, added) -> None:
    """tokenizer.json's `added_tokens` is a list of tokens with an id, as the `tokenizers` library writes it (and
    loads it): `null`, an entry without an integer id or with a negative one were a TypeError or KeyError traceback
    (a negative id, in the GGUF export, silently renamed a piece counted from the end)."""
    bad = [e for e in added if not (isinstance(e, dict) and type(e.get("id")) is int and e["id"] >= 0)] \
        if isinstance(added, list) else [added]
    if bad:
        shown = json.dumps(bad[0])
        raise UserError(f"{path}: added_tokens {'holds' if isinstance(added, list) else 'is'} "
                        f"{shown[:60] + ('...' if len(shown) > 60 else '')}, not a list of tokens with an id (a file "
                        f"the tokenizers library cannot load either)")


def check_tokenizer_json(path: Path, tok: dict) -> None:
    """The parts of tokenizer.json that the markers' renaming and the GGUF export read have the shapes the
    `tokenizers` library writes: `added_tokens` (`check_added_tokens`), a `model.vocab` that is an object of ids or a
    list of [piece, score] pairs, `model.merges` of "a b" strings or [a, b] pairs; other shapes were tracebacks."""
    check_added_tokens(path, tok.get("added_tokens", []))
    model = tok.get("model") or {}
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pairs = isinstance(vocab, list) and all(isinstance(v, list) and v and isinstance(v[0], str) for v in vocab)
    ids = isinstance(vocab, dict) and all(type(i) is int and i >= 0 for i in vocab.values())
    if not isinstance(model, dict) or isinstance(vocab, (list, dict)) and not (pairs or ids):
        raise UserError(f"{path}: model.vocab is neither an object of token ids nor a list of [piece, score] pairs")
    merges = model.get("merges") or []
    if not isinstance(merges, list) or not all(
            isinstance(m, str) and " " in m or isinstance(m, list) and len(m) == 2 for m in merges):
        raise UserError(f"{path}: model.merges is not a list of \"a b\" strings or [a, b] pairs")


def _rename_tokenizer_json(path: Path, token_map: dict[str, str], write: bool = True) -> dict[str, int]:
    """Rename in tokenizer.json (only check that it can be done, with write=False); return marker -> id."""
    tok = read_json_object(path, f"{path}: missing")
    try:
        check_tokenizer_json(path, tok)
    except UserError as e:
        raise UserError(f"{e}; the tool-call markers cannot be published in it") from None
    by_old = {old: new for new, old in token_map.items()}
    ids: dict[str, int] = {}
    for entry in tok.get("added_tokens", []):
        new = by_old.get(entry.get("content"))
        if new is not None:
            entry["content"] = new
            ids[new] = int(entry["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for old, new in by_old.items():
            if old in vocab:
                ids.setdefault(new, int(vocab[old]))
                vocab[new] = vocab.pop(old)
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        for i, item in enumerate(vocab):
            new = by_old.get(item[0])
            if new is not None:
                item[0] = new
                ids.setdefault(new, i)
    # Markers must be atomic: a token only in the model vocabulary would be split by the pre-tokenizer.
    added = {int(e["id"]) for e in tok.get("added_tokens", [])}
    for marker, i in sorted(ids.items(), key=lambda kv: kv[1]):
        if i not in added:
            tok.setdefault("added_tokens", []).append(
                {"id": i, "content": marker, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True})
    missing = sorted(set(token_map) - set(ids))
    if missing:
        raise UserError(f"{path}: the checkpoint's token map names {token_map[missing[0]]} for {missing[0]}, "
                        f"but the tokenizer has no such token")
    if write:
        write_file(path, json.dumps(tok, ensure_ascii=False))
    return ids


def _rename_tokenizer_config(path: Path, token_map: dict[str, str]) -> None:
    cfg = read_json_object(path, f"{path}: missing")
    by_old = {old: new for new, old in token_map.items()}
    for entry in (cfg.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, dict) and entry.get("content") in by_old:
            entry["content"] = by_old[entry["content"]]
    cfg.pop("chat_template", None)  # chat_template.jinja is the one template
    write_file(path, json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _read_sentencepiece(path: Path):
    """The SentencePiece model proto of `path`, None if sentencepiece's proto is unavailable; a file it cannot
    parse is one line naming it (it was a protobuf DecodeError traceback, after the whole merge)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as sp_pb2
    except ImportError:
        return None
    proto = sp_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise UserError(f"{path}: not a SentencePiece model ({e}); the tool-call markers cannot be published in "
                        f"it (remove it: tokenizer.json is the tokenizer transformers loads)") from None
    return proto


def _rename_sentencepiece(path: Path, token_map: dict[str, str]) -> bool:
    """Rename pieces in a SentencePiece model; False if sentencepiece's proto is unavailable."""
    proto = _read_sentencepiece(path)
    if proto is None:
        return False
    by_old = {old: new for new, old in token_map.items()}
    for piece in proto.pieces:
        if piece.piece in by_old:
            piece.piece = by_old[piece.piece]
    write_file(path, proto.SerializeToString())
    return True


def check_tool_token_files(tok_dir: Path, token_map: dict[str, str]) -> None:
    """Refuse, before any output is written, tokenizer files `install_tool_tokens` could not publish the
    markers in: no tokenizer.json, a tokenizer.json / tokenizer_config.json that is not a JSON object, a
    mapped token the vocabulary lacks, a tokenizer.model that does not parse or lacks a mapped token at
    tokenizer.json's id (one line naming the file)."""
    if not token_map:
        return
    tj = Path(tok_dir) / "tokenizer.json"
    if not tj.is_file():
        raise UserError(f"{tok_dir}: the base has no tokenizer.json, so the tool-call token map "
                        f"({len(token_map)} markers) cannot be published")
    ids = _rename_tokenizer_json(tj, token_map, write=False)
    tc = Path(tok_dir) / "tokenizer_config.json"
    if tc.is_file():
        read_json_object(tc, f"{tc}: missing")
    sp = Path(tok_dir) / "tokenizer.model"
    proto = _read_sentencepiece(sp) if sp.is_file() else None
    if proto is not None:
        # a tokenizer.model of another vocabulary had nothing renamed in it, silently: the merged directory then
        # held two tokenizers that disagree, and a GGUF made from it (which reads tokenizer.model) had no markers
        pieces = {p.piece: i for i, p in enumerate(proto.pieces)}
        for marker, i in sorted(ids.items(), key=lambda kv: kv[1]):
            old = token_map[marker]
            if pieces.get(old, pieces.get(marker)) != i:
                where = f"at id {pieces[old]}" if old in pieces else "no such piece"
                raise UserError(f"{sp}: {old} (for {marker}) is token {i} in tokenizer.json but {where} here, so "
                                f"the markers cannot be published in it (the two tokenizer files disagree: remove "
                                f"tokenizer.model, or give the base's own)")


def install_tool_tokens(out_dir: Path, token_map: dict[str, str]) -> dict[str, int]:
    """Rename the mapped `<unusedN>` tokens to their markers in every tokenizer file of `out_dir`,
    write the tool-calling chat template and add `<start_function_response>` to the stop ids.
    Returns marker -> token id (empty when there is nothing to do)."""
    if not token_map:
        return {}
    tj = out_dir / "tokenizer.json"
    if not tj.is_file():
        raise UserError(f"{out_dir}: the base has no tokenizer.json, so the tool-call token map "
                        f"({len(token_map)} markers) cannot be published")
    ids = _rename_tokenizer_json(tj, token_map)
    if (out_dir / "tokenizer_config.json").is_file():
        _rename_tokenizer_config(out_dir / "tokenizer_config.json", token_map)
    sp = out_dir / "tokenizer.model"
    if sp.is_file() and not _rename_sentencepiece(sp, token_map):
        sp.unlink()  # a stale slow-tokenizer file would contradict tokenizer.json
    write_file(out_dir / "chat_template.jinja", tool_chat_template(None) + "\n")
    gen_path = out_dir / "generation_config.json"
    if gen_path.is_file() and START_RESPONSE in ids:
        gen = read_json_object(gen_path, f"{gen_path}: missing")
        eos = gen.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if ids[START_RESPONSE] not in eos:
            eos.append(ids[START_RESPONSE])
        gen["eos_token_id"] = eos
        write_file(gen_path, json.dumps(gen, indent=2) + "\n")
    return ids
