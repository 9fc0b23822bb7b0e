"""Export a fine-tuned (or any) Gemma 3 text model as one GGUF file that llama.cpp runs.

    python -m convert.export_gguf --checkpoint RUN [--step N] [--base DIR] --out FILE.gguf
        [--type f16|bf16|q8_0|q4_0] [--overwrite]
    python -m convert.export_gguf --merged DIR --out FILE.gguf [--type ...] [--overwrite]

`--checkpoint` merges the LoRA factors (or takes a full fine-tune's tensors) on the fly, tensor by
tensor, with the same code as `convert.merge_orbax` (no merged directory is written first);
`--merged` reads an HF directory (a merged export, a base model, FunctionGemma). Only families whose
registry entry carries `gguf` facts are exported (Gemma 3 text: 270M, 1B, FunctionGemma, the text
tower of 4B/12B); others are refused by name.

What goes into the file, following llama.cpp's own conventions for Gemma 3:
* tensors under llama.cpp's names (`Family.gguf.tensors`), norm scales stored as `1 + w` in f32,
  no `output.weight` when the embedding is tied (llama.cpp reuses `token_embd`), no q/k
  permutation (llama.cpp runs Gemma's rotary embedding in the same half-split layout);
* `--type`: f16 / bf16 for every matrix; q8_0 (8.5 bits/weight); q4_0 (4.5 bits/weight, the
  tied embedding, which is also the output projection, kept at q8_0 as llama.cpp's quantizer
  keeps its output tensor at a higher precision). A matrix whose rows are not a multiple of the
  32-value block falls back to f16. Quantization is the `gguf` package's (bit-exact with ggml's);
* hyperparameters (`gemma3.*`), the SentencePiece vocabulary with scores and piece types, the
  special ids, `add_bos`, the chat template, and the stop tokens: `<eos>`, `<end_of_turn>` (eot)
  and, for tool-calling models, `<start_function_response>` as end-of-message (eom), so that
  generation stops where the tool runner takes over. When the fine-tune mapped FunctionGemma's
  markers onto reserved `<unusedN>` tokens (`token_map` in the checkpoint), those entries carry
  the markers' published names, marked user-defined so that llama.cpp prints them in its output
  (control tokens are not printed) and matches them in prompts.

Streaming: one tensor in flight, read (and merged) in row chunks of 16 MB, converted and
appended to the file; peak memory is a few chunks plus the vocabulary, whatever the model size.
Everything is checked first (inputs, family, every tensor, free space); the file is written as a
hidden temp file beside `--out` and renamed into place at the end, so a failed or interrupted
export leaves nothing at `--out`.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see convert.merge_orbax

import argparse
import dataclasses
import datetime
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from convert import merge_math
from convert.merge_orbax import MergedTensors
from convert.merge_orbax import plan_tensors as plan_merge_tensors
from convert.source import open_checkpoint
from convert.tool_tokens import check_added_tokens, check_tokenizer_json
from gemma_tpu.core import cli
from gemma_tpu.core.atomic import AtomicFile, check_file_target, check_space
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError, read_json_object
from gemma_tpu.core.progress import Progress, human
from gemma_tpu.formats.function_calling import FUNCTION_MARKERS, START_RESPONSE, is_reserved, tool_chat_template
from gemma_tpu.hf import safetensors_io as sio
from gemma_tpu.hf.directory import naming_config_file
from gemma_tpu.models.loading import resolve_model
from gemma_tpu.models.registry import Family, GGUFFacts, families, output_projection_prefixes, text_config

TYPES = ("f16", "bf16", "q8_0", "q4_0")
CHUNK_BYTES = 16 << 20  # float32 bytes per row chunk
SPACE = "\u2581"  # SentencePiece's visible space
# SentencePiece piece types, which GGUF's token types reuse.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


# ------------------------------------------------------------------------------ vocabulary


@dataclasses.dataclass
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos: int
    eos: int
    unk: int
    pad: int
    add_bos: bool

    def id_of(self, token: str) -> int | None:
        try:
            return self.tokens.index(token)
        except ValueError:
            return None

    @property
    def nbytes(self) -> int:
        return sum(len(t.encode()) + 8 + 8 for t in self.tokens)


def _tokenizer_config(tok_dir: Path) -> dict:
    path = tok_dir / "tokenizer_config.json"
    return read_json_object(path, f"{path}: missing") if path.is_file() else {}


def _pieces_from_sentencepiece(path: Path) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise UserError(f"{path}: not a SentencePiece model ({e})") from None
    t = proto.trainer_spec
    special = {"bos": t.bos_id, "eos": t.eos_id, "unk": t.unk_id, "pad": t.pad_id}
    return ([p.piece for p in proto.pieces], [float(p.score) for p in proto.pieces],
            [int(p.type) for p in proto.pieces], special)


def _pieces_from_tokenizer_json(path: Path, n_rows: int) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """A tokenizer.json-only directory: pieces by id; Unigram scores as given, BPE merge ranks
    turned into scores (an earlier merge scores higher), WordLevel all zero. Added tokens past the embedding's
    `n_rows` are left out, as for a tokenizer.model (`read_vocab`): padding up to an id of 10**9 took all memory."""
    tok = read_json_object(path, f"{path}: missing")
    check_tokenizer_json(path, tok)
    model = tok.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # Unigram
        pieces, scores = [v[0] for v in vocab], [float(v[1]) for v in vocab]
    elif isinstance(vocab, dict):
        pieces = [""] * (max(vocab.values(), default=-1) + 1)
        for piece, i in vocab.items():
            pieces[int(i)] = piece
        scores = [0.0] * len(pieces)
        rank = {}
        for r, m in enumerate(model.get("merges") or []):
            left, right = m.split(" ", 1) if isinstance(m, str) else m
            rank.setdefault(left + right, r)
        for i, p in enumerate(pieces):
            if p in rank:
                scores[i] = -float(rank[p] + 1)
    else:
        raise UserError(f"{path}: no vocabulary in model.vocab")
    types = [BYTE if len(p) == 6 and p.startswith("<0x") and p.endswith(">") else NORMAL for p in pieces]
    for e in tok.get("added_tokens") or []:
        i = int(e["id"])
        if i >= n_rows:
            continue
        while i >= len(pieces):
            pieces.append(f"[PAD{len(pieces)}]")
            scores.append(0.0)
            types.append(UNUSED)
        pieces[i] = e["content"]
        types[i] = CONTROL if e.get("special") else USER_DEFINED
    return pieces, scores, types, {}


def _json_member(path: Path, key: str):
    """The first member named `key` of a large JSON file, decoded alone from a window of the file
    (Gemma's tokenizer.json is ~100 MB, mostly merges: decoding or even reading all of it would
    cost hundreds of MB for the few thousand added tokens we need)."""
    import mmap

    needle = json.dumps(key).encode() + b":"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = m.find(needle)
        if pos < 0:
            return None
        start, window = pos + len(needle), 1 << 20
        while True:
            text = m[start:start + window].decode("utf-8", errors="ignore").lstrip()
            try:
                return json.JSONDecoder().raw_decode(text)[0]
            except json.JSONDecodeError:
                if start + window >= len(m):
                    raise UserError(f"{path}: {key} is not valid JSON") from None
                window *= 4


def _added_tokens(tok_dir: Path, cfg: dict) -> dict[int, tuple[str | None, bool]]:
    """id -> (content, special) for the tokenizer's added tokens (tokenizer.json's `added_tokens`, which
    transformers 5 writes, and tokenizer_config.json's `added_tokens_decoder`, which 4.x wrote)."""
    out: dict[int, tuple[str | None, bool]] = {}
    tj = tok_dir / "tokenizer.json"
    entries = _json_member(tj, "added_tokens") if tj.is_file() else []
    check_added_tokens(tj, entries or [])
    entries = list(entries or [])
    decoder = cfg.get("added_tokens_decoder") or {}
    bad = next((i for i in decoder if not (isinstance(i, str) and i.isascii() and i.isdigit())), None) \
        if isinstance(decoder, dict) else decoder
    if bad is not None:  # 'abc' was a ValueError traceback, '-2' silently retyped the second-last piece
        raise UserError(f"{tok_dir / 'tokenizer_config.json'}: added_tokens_decoder "
                        f"{'has the key' if isinstance(decoder, dict) else 'is'} {bad!r:.40}, not token ids")
    entries += [{**e, "id": int(i)} for i, e in decoder.items() if isinstance(e, dict)]
    for e in entries:
        content = e.get("content")
        out[int(e["id"])] = (content if isinstance(content, str) and content else None, bool(e.get("special")))
    return out


def _added_type(content: str | None, special: bool) -> int:
    """An added token's GGUF type as llama.cpp's converter gives it: control when special or spelled like one
    (the reserved `<unusedN>`, `<|...|>`, and a few names some tokenizers leave unmarked), else user-defined."""
    text = content or ""
    looks = (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
             or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
             or is_reserved(text))
    return CONTROL if special or looks else USER_DEFINED


def read_vocab(tok_dir: Path, n_rows: int, token_map: dict[str, str], markers: Sequence[str]) -> Vocab:
    """The vocabulary as llama.cpp's SentencePiece ("llama") tokenizer wants it.

    Pieces, scores and types come from `tokenizer.model` (else `tokenizer.json`); the added
    tokens of `tokenizer_config.json` are control tokens when special, user-defined otherwise
    (`_added_type`), those past the model's pieces with their own text (they were `[PADn]`),
    and user-defined pieces are stored with plain spaces (llama.cpp matches them in raw text).
    `token_map` ({marker: "<unusedN>"}) renames reserved tokens; every tool-call marker present
    becomes user-defined. Padded with unused `[PADn]` entries up to the embedding's rows."""
    sp_path, tj_path = tok_dir / "tokenizer.model", tok_dir / "tokenizer.json"
    if sp_path.is_file():
        pieces, scores, types, special = _pieces_from_sentencepiece(sp_path)
        source = sp_path
    elif tj_path.is_file():
        pieces, scores, types, special = _pieces_from_tokenizer_json(tj_path, n_rows)
        source = tj_path
    else:
        raise UserError(f"{tok_dir}: no tokenizer.model or tokenizer.json; the GGUF needs the vocabulary")
    cfg = _tokenizer_config(tok_dir)
    for i, (content, special_token) in sorted(_added_tokens(tok_dir, cfg).items()):
        if i >= len(pieces):  # past the SentencePiece pieces (Gemma 3 4B-27B's <image_soft_token>): kept by its text
            if content is None or i >= n_rows:
                continue  # nothing to name it by, or beyond the embedding (llama.cpp's converter skips those too)
            for j in range(len(pieces), i):
                pieces.append(f"[PAD{j}]")
                scores.append(-1000.0)
                types.append(UNUSED)
            pieces.append(content)
            scores.append(-1000.0)
            types.append(UNUSED)
        types[i] = _added_type(content if content is not None else pieces[i], special_token)
    index = {p: i for i, p in enumerate(pieces)}
    for marker, reserved in (token_map or {}).items():
        if marker in index:
            continue
        if reserved not in index:
            raise UserError(f"{source}: the checkpoint's token map names {reserved} for {marker}, but the "
                            f"tokenizer has no such token")
        i = index.pop(reserved)
        pieces[i] = marker
        index[marker] = i
    for marker in markers:
        if marker in index:
            types[index[marker]] = USER_DEFINED
    pieces = [p.replace(SPACE, " ") if ty == USER_DEFINED else p for p, ty in zip(pieces, types)]
    if len(pieces) > n_rows:
        raise UserError(f"{source}: {len(pieces)} tokens but the embedding has {n_rows} rows")
    for i in range(len(pieces), n_rows):
        pieces.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(UNUSED)
    if len(set(pieces)) != len(pieces):
        dup = next(p for p in pieces if pieces.count(p) > 1)
        raise UserError(f"{source}: token {dup!r} appears twice in the vocabulary")

    def special_id(name: str, key: str, default: int) -> int:
        value = cfg.get(f"{name}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value in index:
            return index[value]
        got = special.get(key, -1)
        return got if got is not None and got >= 0 else default

    add_bos = cfg.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):  # bool("false") is True: it was written as true
        raise UserError(f"{tok_dir / 'tokenizer_config.json'}: add_bos_token={add_bos!r} is not true or false")
    return Vocab(pieces, scores, types, bos=special_id("bos", "bos", 2), eos=special_id("eos", "eos", 1),
                 unk=special_id("unk", "unk", 3), pad=special_id("pad", "pad", 0),
                 add_bos=True if add_bos is None else add_bos)


def read_chat_template(tok_dir: Path) -> str | None:
    path = tok_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = _tokenizer_config(tok_dir).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        bad = next((t for t in template if not isinstance(t, dict)), None)
        if bad is not None:  # an AttributeError traceback before
            raise UserError(f"{tok_dir / 'tokenizer_config.json'}: chat_template is a list holding {bad!r:.40}, "
                            f"not a {{\"name\": ..., \"template\": ...}} object")
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


# ------------------------------------------------------------------------------ planning


@dataclasses.dataclass
class OutTensor:
    name: str  # GGUF name
    hf_key: str
    shape: tuple[int, ...]  # numpy (row-major) shape, as in safetensors
    qtype: Any  # gguf.GGMLQuantizationType
    plus_one: bool

    @property
    def nbytes(self) -> int:
        import gguf

        return int(np.prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype)))


@dataclasses.dataclass
class ExportPlan:
    family: Family
    facts: GGUFFacts
    config: dict  # the full config.json
    text: dict  # its text part
    weights: sio.WeightsDir  # merged dir, or the base when merging a checkpoint on the fly
    tensors: list[OutTensor]
    vocab: Vocab
    chat_template: str | None
    tool_calling: bool
    out: Path
    type: str
    merge: Any = None  # convert.merge_orbax.MergePlan when exporting a checkpoint
    provenance: dict = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)

    @property
    def tensor_bytes(self) -> int:
        return sum(sio_pad(t.nbytes) for t in self.tensors)


def sio_pad(n: int, align: int = 32) -> int:
    return (n + align - 1) // align * align


def gguf_facts(family: Family, where: str) -> GGUFFacts:
    if family.gguf is None:
        raise UserError(f"{where}: GGUF export supports {', '.join(supported_families())}; "
                        f"this is a {family.name} model")
    return family.gguf


def supported_families() -> list[str]:
    return sorted(name for name, f in families().items() if f.gguf is not None)


def check_config(family: Family, facts: GGUFFacts, config: dict, text: dict, where: str) -> None:
    for key in facts.require_unset:
        if text.get(key) not in (None, 0, 0.0, False):
            raise UserError(f"{where}: {key}={text[key]} cannot be expressed in llama.cpp's {facts.arch}")
    for problem in (facts.check(config, text) if facts.check else []):
        # "query_pre_attn_scalar=32 differs from head_dim=256" blamed a key the user set on one they never wrote
        raise UserError(f"{where}: {problem}{omitted_note(config, text, problem)}")
    for _, key, kind, default in facts.hparams:
        if text.get(key) is None and default is None:
            raise UserError(f"{where}: missing key '{key}'")
        value = text.get(key, default)
        if kind == "u32" and value is not None and not (isinstance(value, int) and 0 < value < 2**32):
            # a negative one died in the writer's struct.pack ("argument out of range"), with a traceback
            raise UserError(f"{where}: {key}={value!r} must be a positive integer")
        if kind == "f32" and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and math.isfinite(value) and value > 0):
            # rms_norm_eps -1.0, 0.0, NaN or null was written as given: a file whose every norm divides by ~0 or NaN
            raise UserError(f"{where}: {key}={value!r} must be a positive number")
    departure = family.pattern_departure(text, facts.swa_period) if facts.swa_period else None
    if departure:  # the key config.json has (layer_types, or sliding_window_pattern) and what it needs
        raise UserError(f"{where}: {departure} does not follow llama.cpp's {facts.arch} pattern (every "
                        f"{facts.swa_period}th layer global)")


SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def check_shapes(family: Family, config: dict, text: dict, tensors: list, where: str, prefix: str) -> None:
    """The weights' shapes agree with the sizes the file will declare (the family's `projection_shapes`, its
    `tensor_shapes` for the norms, the embedding's width): a config.json that omits hidden_size (or heads,
    intermediate_size) took transformers' default (2304 for Gemma 3), and the GGUF declared it over 64-wide tensors,
    a file llama.cpp cannot load; a norm of another length (a merged directory edited or cut) was written as it was.
    The embedding's rows are the vocabulary's, which the tokenizer gives (config.json's vocab_size is not read)."""
    shapes = family.projection_shapes(text) if family.projection_shapes else {}
    others = family.tensor_shapes(text) if family.tensor_shapes else {}
    hidden = text.get("hidden_size")
    rows = next((t.shape[0] for t in tensors if t.name == "token_embd.weight"), None)
    for t in tensors:
        want = shapes.get(t.hf_key.rsplit(".", 2)[-2], ()) if t.hf_key.endswith(".weight") else ()
        if t.hf_key.startswith(prefix) and t.hf_key[len(prefix):] in others:
            want = (others[t.hf_key[len(prefix):]],)
        if t.name == "token_embd.weight" and isinstance(hidden, int):
            want = ((t.shape[0], hidden),)
        if t.name == "output.weight" and isinstance(hidden, int):  # an untied lm_head of another shape was written
            want = ((rows, hidden),)
        if want and tuple(t.shape) not in want:
            raise UserError(f"{where}: tensor {t.hf_key} is {list(t.shape)}, but the config's sizes make it "
                            f"{list(want[0])}{omitted_note(config, text)}")


def omitted_note(config: dict, text: dict, mentioned: str | None = None) -> str:
    """'; config.json omits K, which then takes transformers' default (K=V)' for the size keys config.json leaves
    out (only those `mentioned` names, when given), else ''."""
    raw = text_config(config)
    omitted = [k for k in SIZE_KEYS if k not in raw and (mentioned is None or re.search(rf"\b{k}\b", mentioned))]
    return (f"; config.json omits {', '.join(omitted)}, which then take{'s' if len(omitted) == 1 else ''} "
            f"transformers' default ({', '.join(f'{k}={text.get(k)}' for k in omitted)})") if omitted else ""


def choose_qtype(out_type: str, name: str, shape: tuple[int, ...], tied_output: bool):
    import gguf

    Q = gguf.GGMLQuantizationType
    if len(shape) < 2:
        return Q.F32  # norm scales: llama.cpp keeps 1-D tensors in f32
    if out_type == "f16":
        return Q.F16
    if out_type == "bf16":
        return Q.BF16
    want = Q.Q8_0 if out_type == "q8_0" else Q.Q4_0
    if out_type == "q4_0" and (name == "output.weight" or (tied_output and name == "token_embd.weight")):
        want = Q.Q8_0
    block = gguf.GGML_QUANT_SIZES[want][0]
    return want if shape[-1] % block == 0 else Q.F16


def plan_tensors(facts: GGUFFacts, text: dict, weights: sio.WeightsDir, prefix: str, out_type: str,
                 tied: bool, where: str) -> tuple[list[OutTensor], list[str]]:
    """Every GGUF tensor, in llama.cpp's order, from the HF tensors; refuses a decoder tensor
    that has no place in the GGUF. Returns (tensors, skipped HF keys)."""
    n_layers = int(text["num_hidden_layers"])
    out, used = [], set()
    # llama.cpp's order: the model's own tensors, then block by block
    order = [(t, None) for t in facts.tensors if "{i}" not in t.gguf]
    order += [(t, i) for i in range(n_layers) for t in facts.tensors if "{i}" in t.gguf]
    heads = output_projection_prefixes(prefix)  # language_model.lm_head. was refused as missing
    for t, i in order:
        hf = t.hf.format(i=i)
        key = hf if hf.startswith("lm_head.") else prefix + hf
        if hf.startswith("lm_head."):
            key = next((k for k in (h + hf.removeprefix("lm_head.") for h in heads) if k in weights), key)
        name = t.gguf.format(i=i)
        if key not in weights:
            if hf.startswith("lm_head.") and tied:
                continue  # tied: llama.cpp reuses token_embd as the output projection
            if hf.startswith("lm_head."):  # was written as tied: transformers gives such a model a random lm_head
                raise UserError(f"{where}: tie_word_embeddings is false, but there is no {key} tensor (the output "
                                f"projection an untied model needs)")
            raise UserError(f"{where}: tensor {key} is missing (needed for {name})")
        if hf.startswith("lm_head.") and tied:
            used.add(key)
            continue
        shape = tuple(weights[key].shape)
        out.append(OutTensor(name, key, shape, choose_qtype(out_type, name, shape, tied), t.plus_one))
        used.add(key)
    leftovers = [k for k in weights.names() if k not in used]
    stray = [k for k in leftovers if k.startswith(prefix) and not sio.is_computed_buffer(k)]  # llama.cpp's skips them
    if stray:
        raise UserError(f"{where}: tensor {stray[0]} has no place in llama.cpp's {facts.arch}")
    return out, leftovers


def plan_export(args: argparse.Namespace) -> ExportPlan:
    """Validate everything and decide every output tensor and key; writes nothing."""
    if args.type not in TYPES:
        raise UserError(f"--type {args.type}: unknown (known: {', '.join(TYPES)})")
    if args.out.endswith(("/", os.sep)):  # Path() drops the slash, and the file was written under the folder's name
        raise UserError(f"--out {args.out}: names a directory; give the file to write (e.g. {args.out}coach.gguf)")
    out = Path(args.out)
    merge = None
    token_map: dict[str, str] = {}
    if args.merged:
        src = Path(args.merged)
        if not src.is_dir():
            raise UserError(f"--merged {src}: no such directory")
        resolved = resolve_model(str(src))  # the family its merge recorded, else the one config.json describes
        config, family, where = resolved.hf_config, resolved.family, str(src / "config.json")
        facts = gguf_facts(family, where)
        weights = sio.WeightsDir(src)
        tok_dir, protected = src, [src]
        provenance = {"merged": str(src.resolve())}
    else:
        source = open_checkpoint(args.checkpoint, args.step)  # fail fast on the family, before the base
        where = f"{args.checkpoint} (base family)"
        facts = gguf_facts(source.family, f"{args.checkpoint}")
        merge = plan_merge_tensors(args.checkpoint, args.step, args.base, dtype="float32",
                                   allow_base_mismatch=args.allow_base_mismatch)
        family, config, weights = merge.source.family, merge.base_config, merge.weights
        where = str(merge.base_dir / "config.json")
        tok_dir, protected = merge.base_dir, [merge.base_dir, merge.source.dir]
        token_map = dict(merge.source.meta.get("token_map") or {})
        provenance = {"checkpoint": str(merge.source.dir.resolve()), "step": merge.source.step,
                      "base": str(merge.base_dir.resolve()),
                      "kind": "lora" if merge.source.is_lora else "full"}
    check_file_target(out, args.overwrite, protected=protected, magic=GGUF_MAGIC)
    with naming_config_file(where):  # keys config.json omits at the values transformers gives them
        text = family.read_text_config(config)
    check_config(family, facts, config, text, where)
    if facts.rope is not None:
        facts.rope(text)  # refuses what llama.cpp cannot express
    prefix = family.text_prefix(weights.names())
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))
    tensors, skipped = plan_tensors(facts, text, weights, prefix, args.type, tied, where)
    check_shapes(family, config, text, tensors, where, prefix)
    weights.require_float([t.hf_key for t in tensors])  # an int8 or fp8 matrix was exported as its raw integers
    embed = next(t for t in tensors if t.name == "token_embd.weight")
    vocab = read_vocab(tok_dir, embed.shape[0], token_map, FUNCTION_MARKERS)
    tool_calling = vocab.id_of(START_RESPONSE) is not None
    chat_template = read_chat_template(tok_dir)
    if args.merged:  # config.json, the merge record, the headers and the tokenizer of one published directory
        resolved.check_unchanged()
    if token_map or (chat_template or "").strip() == tool_chat_template(None).strip():
        # the markers now have their published names; without the template's JSON reader for tool results, which
        # uses Jinja that llama.cpp's own C++ template engine is not known to have ('%c' | format, int(base)).
        # Also for --merged of a tool-calling merge, whose directory holds the template with the reader: its file
        # differed from the --checkpoint export of the same run
        chat_template = tool_chat_template(None, parse_json=False)
    plan = ExportPlan(family, facts, config, text, weights, tensors, vocab, chat_template, tool_calling, out,
                      args.type, merge, provenance, skipped)
    check_space(out, plan.tensor_bytes + vocab.nbytes + len(chat_template or "") + (1 << 20))
    return plan


GGUF_MAGIC = b"GGUF"  # what every GGUF file starts with: --overwrite replaces only such a file (or an empty one)


# ------------------------------------------------------------------------------ writing


def add_metadata(w, plan: ExportPlan) -> None:
    import gguf

    arch, text, vocab = plan.facts.arch, plan.text, plan.vocab
    w.add_type("model")
    name = plan.config.get("_name_or_path") or plan.out.stem
    w.add_name(str(name))
    ftype = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[plan.type]
    for key, cfg_key, kind, default in plan.facts.hparams:
        value = text.get(cfg_key, default)
        if kind == "u32":
            w.add_uint32(f"{arch}.{key}", int(value))
        else:
            w.add_float32(f"{arch}.{key}", float(value))
    for key, value in (plan.facts.rope(text) if plan.facts.rope else {}).items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", float(value))
    w.add_tokenizer_model("llama")  # llama.cpp's name for a SentencePiece vocabulary
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_unk_token_id(vocab.unk)
    w.add_pad_token_id(vocab.pad)
    eot = vocab.id_of(plan.family.end_of_turn_token)
    if eot is not None:
        w.add_eot_token_id(eot)
    if plan.tool_calling:
        w.add_eom_token_id(vocab.id_of(START_RESPONSE))
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_sep_token(False)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if plan.chat_template:
        w.add_chat_template(plan.chat_template)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(ftype))
    prov = {"tool": "convert.export_gguf", "type": plan.type,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **plan.provenance}
    w.add_string("gemma_tpu.export", json.dumps(prov))


def encode(rows: np.ndarray, qtype) -> np.ndarray:
    import gguf

    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return rows.astype(np.float32, copy=False)
    if qtype == Q.F16:
        with np.errstate(over="ignore"):  # past float16's range: refused by name (merge_math.check_float16_range)
            return rows.astype(np.float16)
    return gguf.quants.quantize(rows, qtype)


def source_chunks(plan: ExportPlan, merged: MergedTensors | None, ops: dict, t: OutTensor) -> Iterator[np.ndarray]:
    """The HF tensor in float32 row chunks: merged on the fly for a checkpoint's LoRA sites and
    full fine-tunes, else read from the safetensors."""
    if merged is not None:
        op = ops.get(t.hf_key)
        if op is not None and op.kind in ("lora", "full"):
            yield from merged.chunks(op, np.dtype(np.float32), CHUNK_BYTES)
            return
    src = plan.weights[t.hf_key]
    for start, stop in sio.row_chunks(src.shape, 4, CHUNK_BYTES):
        yield plan.weights.read_rows(t.hf_key, start, stop).astype(np.float32)


def write_gguf(plan: ExportPlan, path: Path) -> int:
    """Header, metadata and tensor infos first, then each tensor's data streamed in row chunks."""
    import gguf

    w = gguf.GGUFWriter(path, plan.facts.arch)
    add_metadata(w, plan)
    for t in plan.tensors:
        byte_shape = gguf.quant_shape_to_byte_shape(t.shape, t.qtype)
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    w.write_padding(f, f.tell())
    progress = Progress("gguf", plan.tensor_bytes)
    merged = MergedTensors(plan.merge) if plan.merge is not None else None
    ops = {op.name: op for op in plan.merge.ops} if plan.merge is not None else {}
    try:
        for t in plan.tensors:
            written = 0
            for chunk in source_chunks(plan, merged, ops, t):
                rows = chunk.reshape(-1) if len(t.shape) == 1 else chunk.reshape(-1, t.shape[-1])
                if t.plus_one:
                    rows = rows + np.float32(1.0)
                data = np.ascontiguousarray(encode(rows, t.qtype))
                merge_math.check_float16_range(data, f"{t.hf_key} ({t.name})", "use --type bf16")
                f.write(memoryview(data).cast("B"))
                written += data.nbytes
                progress.update(data.nbytes)
            if written != t.nbytes:
                raise RuntimeError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")
            w.write_padding(f, written)
    finally:
        if merged is not None:
            merged.__exit__(None, None, None)
        w.close()
    progress.finish()
    return path.stat().st_size


# ------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m convert.export_gguf", __doc__, overrides=False)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=cli.input_path_of("checkpoint directory"),
                     help="gemma-tpu checkpoint dir (with gemma_tpu_run.json)")
    src.add_argument("--merged", type=cli.input_path_of("model directory"),
                     help="a Hugging Face model directory (e.g. the output of convert.merge_orbax)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--base", type=cli.input_path_of("base model"),
                   help="base HF dir or hub id (default: the one recorded in the checkpoint)")
    p.add_argument("--out", required=True, type=cli.output_path_of("output .gguf file"), help="output .gguf file")
    p.add_argument("--type", default="q8_0", type=str.lower,  # Q8_0 as llama-quantize spells it
                   help=f"weight type: {', '.join(TYPES)} (default q8_0; either case)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (atomically)")
    p.add_argument("--allow-base-mismatch", action="store_true",
                   help="export even if the base no longer matches the fingerprint the run recorded")
    return p


def unquantized(plan: "ExportPlan") -> list["OutTensor"]:
    """The matrices a q8_0 / q4_0 export keeps at f16 (rows not a multiple of the quantization block)."""
    import gguf

    if plan.type not in ("q8_0", "q4_0"):
        return []
    return [t for t in plan.tensors if len(t.shape) > 1 and t.qtype == gguf.GGMLQuantizationType.F16]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merged and (args.step is not None or args.base):
        raise UserError("--step and --base apply to --checkpoint, not --merged")
    plan = plan_export(args)
    what = (f"{plan.provenance['checkpoint']} step {plan.provenance['step']} ({plan.provenance['kind']}) + base "
            f"{plan.provenance['base']}" if plan.merge is not None else plan.provenance["merged"])
    print(f"gguf: {what} -> {plan.out} ({plan.type}, {plan.facts.arch}, {len(plan.tensors)} tensors, "
          f"{human(plan.tensor_bytes)}, {len(plan.vocab.tokens)} tokens"
          f"{', tool-calling' if plan.tool_calling else ''})", file=sys.stderr)
    if plan.skipped:  # (one was "1 tensors ..., e.g. X")
        n = len(plan.skipped)
        print(f"gguf: not exported ({n} tensor{'s' if n != 1 else ''} outside the text decoder"
              f"{': ' if n == 1 else ', e.g. '}{plan.skipped[0]})", file=sys.stderr)
    if plan.chat_template is None:  # llama.cpp then chats in its default format (ChatML), not Gemma's turns
        print(f"gguf: no chat template in {plan.provenance.get('merged') or plan.provenance.get('base')} "
              f"(chat_template.jinja or tokenizer_config.json's chat_template): llama.cpp's chat will use its default "
              f"format, not Gemma's turns (fine for a pretrained model used for completion)", file=sys.stderr)
    kept = unquantized(plan)
    if kept:  # the file came out larger than the type promises, and nothing said why
        print(f"gguf: {len(kept)} of {sum(len(t.shape) > 1 for t in plan.tensors)} matrices stay f16: their rows are "
              f"not a multiple of {plan.type}'s 32-value block (e.g. {kept[0].name} {list(kept[0].shape)})",
              file=sys.stderr)
    af = AtomicFile(plan.out, args.overwrite, magic=GGUF_MAGIC)
    with af as tmp:
        size = write_gguf(plan, tmp)
        af.publish()
        # said in the block, so that a stop after the publish still finds it said (gemma_tpu.core.atomic)
        print(f"gguf: wrote {plan.out} ({human(size)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
