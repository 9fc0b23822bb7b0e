"""Read examples (JSONL, JSON or Parquet) and normalise them into conversations.

Every example becomes `{"messages": [...], "tools": [...] | None, "where": "FILE:LINE"}`. Accepted
example shapes (`data.format`, auto-detected by their keys):
- `messages`: OpenAI/TRL chat messages, optionally with `tools` and tool calls (or OpenAI's legacy
  `functions`, `function_call` and `function` results).
- `prompt_completion`: TRL's prompt-completion rows, `{"prompt": str, "completion": str}` or with lists
  of messages on both sides; only the completion is trained (TRL's completion-only loss), so any
  assistant turns inside the prompt are context. A prompt ending in the start of the answer, continued by the
  completion (TRL's continue_final_message rows), is one answer whose start is context.
- `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}`, or chat messages
  (`role`/`content`) under that column name; ShareGPT turns under `messages` are read as ShareGPT too.
  LLaMA-Factory's `function_call` (a call or a list of calls, as JSON text) and `observation` (its result)
  turns are tool calls and results, checked against the row's `tools`.
- `instruction`: instruction pairs (Dolly columns by default) become a user turn and an assistant turn, after
  the earlier turns of LLaMA-Factory's `history` ([[instruction, response], ...]) when it is given.
- `text`: TRL's language-modeling rows, `{"text": str}` (`data.text_field`): no chat markup, every token
  trained, `{"text": ..., "where": ...}` instead of messages (rendered as TRL does: BOS, text, EOS).
A system prompt given in a field of its own (`"system"`, as LLaMA-Factory's ShareGPT and Alpaca rows and
Anthropic-style exports keep it, or OpenOrca's `"system_prompt"`) leads the conversation, as a first system
message would.
An assistant message may carry `"train": false` (or `"weight": 0`, or Axolotl's `"training": false`): it stays in
the context but carries
no loss, for multi-turn chats where only some answers are good. Problems are reported as
`FILE:LINE: what is wrong`, so a user can jump to the bad line.

Accepted files, all through `iter_raw`:
- `.jsonl` (or anything else): one JSON object a line; blank lines are skipped. Text that starts with '['
  is a JSON array whatever the name (as for `.json`).
- any of the text forms gzip-compressed (`.jsonl.gz`, `.json.gz`; told by its magic bytes).
  Other compressions and archives (zstd, bzip2, xz, zip, 7z) and UTF-16/32 text are refused saying so.
- `.json`: a JSON array of objects (each example's line is the line its object starts on), a single
  object, objects pretty-printed one after another (`jq . rows.jsonl`), or JSON Lines saved under a `.json` name.
- a `datasets` `save_to_disk` directory (or one of its `.arrow` shards): one example a row, as Parquet.
- `.parquet`: one example a row ("line" = row number, from 1). Parquet stores structs with the union
  of all their fields, so keys whose value is null are dropped from every object (a JSON null
  argument cannot be told apart from a field another row has); `messages`, `tools` and tool-call
  `arguments` may also be JSON strings, as many Hub datasets store them.
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from gemma_tpu.core import strict_json
from gemma_tpu.core.config import is_url
from gemma_tpu.core.errors import UserError, not_utf8, other_unicode, shown
from gemma_tpu.formats.function_calling import (
    FUNCTION_MARKERS,
    DeclarationError,
    arguments_problem,
    check_tools,
    find_lone_surrogate,
    plain_gemma_token_map,
)
from gemma_tpu.models import registry  # through the package, which registers every family

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
# Gemma's own name for the assistant turn; OpenAI's legacy function-calling result (with `functions` and
# `function_call`, read as `tools` and `tool_calls` in `normalise_messages`)
ROLE_ALIASES = {"model": "assistant", "function": "tool"}
# ShareGPT's own export names the assistant by the model that answered (chatgpt, bing, bard); speakers and roles
# are read whatever their case ("Human", "GPT", "User", "Assistant" in many exports)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
SHAREGPT_TOOL_TURNS = ("function_call", "observation")  # LLaMA-Factory's speakers of a call and its result


def message_role(m: dict) -> Any:
    """A message's role in our words: Gemma's `model` and OpenAI's legacy `function` mapped, any case (what every
    reader of chats, `serving.bench` included, takes a role to be)."""
    role = m.get("role")
    return ROLE_ALIASES.get(role.lower(), role.lower()) if isinstance(role, str) else role


class _Row(dict):
    """A Parquet/Arrow row without its null columns; `nulls` names them, so that an error about a field the row
    lacks says it was null there (pandas writes a missing value, NaN or None, as null)."""

    nulls: tuple[str, ...] = ()


def _row(obj: Any) -> Any:
    """`_strip_nulls` of a whole row, remembering its null columns."""
    if not isinstance(obj, dict):
        return _strip_nulls(obj)
    row = _Row(_strip_nulls(obj))
    row.nulls = tuple(str(k) for k, v in obj.items() if v is None)
    return row


def _strip_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


def _too_deep(where: str) -> UserError:
    """Python's JSON reader recurses once per level of nesting and raised RecursionError (a traceback)."""
    return UserError(f"{where}: not valid JSON for this reader (nested more than {sys.getrecursionlimit()} "
                     f"levels of arrays or objects deep)")


def _iter_json_array(p: Path, text: str) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array, each with the line its value starts on."""
    n = len(text)
    i = text.index("[") + 1
    line, counted = 1, 0

    def lineno(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    def ws(pos: int) -> int:
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        return pos

    i = ws(i)
    if i < n and text[i] == "]":
        return
    while True:
        i = ws(i)
        obj, end = _decode_at(p, text, i, lineno(i))
        yield lineno(i), obj
        i = ws(end)
        if i < n and text[i] == ",":
            i += 1
            continue
        if i < n and text[i] == "]":
            if ws(i + 1) < n:
                raise UserError(f"{p}:{lineno(ws(i + 1))}: not valid JSON (extra data after the array)")
            return
        where = lineno(min(i, n))
        raise UserError(f"{p}:{where}: not valid JSON (expected ',' or ']' after an array element)")


def _iter_json_stream(p: Path, text: str, i: int) -> Iterator[tuple[int, Any]]:
    """JSON values one after another from `i` (separated by whitespace alone), each with the line it starts on."""
    n, line, counted = len(text), 1, 0
    while True:
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n:
            return
        line, counted = line + text.count("\n", counted, i), i
        obj, i = _decode_at(p, text, i, line)
        yield line, obj


def _decode_at(p: Path, text: str, i: int, line: int) -> tuple[Any, int]:
    """The JSON value starting at `text[i]` (on line `line` of file `p`) and where it ends; an error names the line."""
    try:
        return strict_json.DECODER.raw_decode(text, i)
    except json.JSONDecodeError as e:
        raise UserError(f"{p}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise _too_deep(f"{p}:{line}") from None
    except strict_json.NotJSON as e:
        raise UserError(f"{p}:{line}: {e}") from None


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except (OSError, ValueError):  # a name too long for the file system
        return False


# a Hugging Face Hub dataset id as TRL's recipes give load_dataset (`trl-lib/Capybara`): owner/name, no file suffix
_HUB_DATASET = re.compile(r"[A-Za-z0-9][\w.-]*/[\w-]+(?:\.[\w-]+)*")


def not_found_hint(path: str | Path) -> str:
    """What a data path that names no file may have meant, as ' (...)', or '': a glob pattern or a comma-separated
    list of files that exist (one file is read), a URL or a Hugging Face Hub dataset id (neither is downloaded).
    `path` as given: a Path has lost a URL's '//'."""
    text, p = str(path), Path(path)
    if is_url(text):
        return " (a URL; data files are read from this machine's disk: download it first)"
    if _HUB_DATASET.fullmatch(text) and not p.parent.exists() and not re.search(
            r"\.(jsonl|json|parquet|arrow|gz|csv)$", text, re.IGNORECASE):
        return (f" (no such file here; a Hugging Face Hub dataset id is not downloaded: "
                f"datasets.load_dataset('{text}', split='train').to_json('train.jsonl') (or .save_to_disk(DIR)) and "
                f"give that file)")
    matches = sorted(p.parent.glob(p.name)) if re.search(r"[*?\[]", p.name) and p.parent.is_dir() else []
    if matches:
        return (f" (a pattern matching {len(matches)} files, e.g. {matches[0]}; patterns are not expanded: give one "
                f"file, the examples of all of them concatenated into one)")
    parts = [Path(part.strip()) for part in str(p).split(",")]
    if len(parts) > 1 and any(_is_file(part) for part in parts):  # `data.train_path=a.jsonl,b.jsonl`
        return (f" (a comma-separated list of {len(parts)} files; a single file is read: concatenate them into "
                f"one, e.g. cat {' '.join(str(part) for part in parts[:2])}{' ...' if len(parts) > 2 else ''} > "
                f"all.jsonl)")
    return ""


def iter_raw(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each example of a .jsonl/.json/.parquet file."""
    p = Path(path)
    if p.is_dir():
        yield from _iter_saved_dataset(p)
        return
    if p.exists() and not p.is_file():  # was "not found", of a path that exists; it is opened more than once (its
        # head, then its rows), which a pipe cannot give
        raise UserError(f"data file {p} is not a regular file (a pipe or device, as a shell's <(...) gives); write "
                        f"the data to a file and give that")
    if not p.is_file():
        raise UserError(f"data file not found: {path}{not_found_hint(path)}")
    with p.open("rb") as f:
        head = f.read(6)
    magic = head[:2]
    gz = magic == b"\x1f\x8b"  # gzip, whatever the name says
    _refuse_other_encodings(p, head)
    opener = gzip.open if gz else open
    if gz:  # the text inside: UTF-16 gzipped was 'not UTF-8 text (byte 1 of the line: 0xff, 'ÿ' in Latin-1 ...)'
        try:
            with gzip.open(p, "rb") as f:
                form = other_unicode(f.read(6))
        except (OSError, EOFError):  # a corrupt stream: the reader below names it at its line
            form = None
        if form:
            raise UserError(f"{p}: gzip-compressed {form}; save the text as UTF-8")
    suffix = (Path(p.stem).suffix if gz and p.suffix.lower() == ".gz" else p.suffix).lower()
    if gz and suffix == ".parquet":
        raise UserError(f"{p}: a gzip-compressed Parquet file; Parquet compresses itself, write it uncompressed")
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover
            raise UserError(f"{p}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(p)
        except Exception as e:
            raise UserError(f"{p}: not a readable Parquet file ({type(e).__name__}: {str(e)[:200]})") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, _row(row)
        return
    if suffix == ".arrow" and not gz:  # one shard of a save_to_disk directory
        for i, row in enumerate(_arrow_rows(p, str(p)), start=1):
            yield i, _row(row)
        return
    if suffix != ".json" and _starts_an_array(p, opener):  # `json.dump(rows, open("train.jsonl", "w"))`
        suffix = ".json"  # was "expected a JSON object per example, got a list" (or, indented, "not valid JSON")
    if suffix == ".json":
        try:
            with opener(p, "rb") as f:
                data = f.read()
            text = data.decode("utf-8-sig")
        except (OSError, EOFError) as e:
            raise UserError(f"{p}: {'not a readable gzip file' if gz else 'cannot be read'} ({e})") from None
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise UserError(f"{p}:{line}: not UTF-8 text (byte offset {e.start}{not_utf8(data, e.start)}") from None
        head = text.lstrip()
        if head.startswith("["):
            yield from _iter_json_array(p, text)
            return
        if head.startswith("{"):
            first = text[: len(text) - len(head)].count("\n") + 1  # the line the object starts on
            try:
                obj = strict_json.DECODER.decode(text)
            except json.JSONDecodeError as e:
                if e.msg != "Extra data":  # "Extra data": several objects, i.e. JSON Lines
                    raise UserError(f"{p}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
                start = len(text) - len(head)
                if "\n" in text[start:strict_json.DECODER.raw_decode(text, start)[1]]:
                    # objects pretty-printed one after another (`jq . rows.jsonl > rows.json`, json.dump of each row
                    # with indent): refused as JSON Lines whose first line ends inside its object, told to name the
                    # file .json, which it was
                    yield from _iter_json_stream(p, text, start)
                    return
            except RecursionError:
                raise _too_deep(f"{p}:{first}") from None
            except strict_json.NotJSON as e:
                raise UserError(f"{p}:{first}: {e}") from None
            else:
                yield first, obj
                return
    yield from _iter_lines(p, opener)


# compressions and archives other than gzip, by their magic bytes: read as text they were "not UTF-8 text (byte 2 of
# the line)", or a zip's padding "NUL bytes, as a file cut short by a crash"
_OTHER_CONTAINERS = ((b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "zstd -d FILE"),
                     (b"BZh", "a bzip2-compressed file", "bunzip2 FILE"),
                     (b"\xfd7zXZ\x00", "an xz-compressed file", "unxz FILE"),
                     (b"PK\x03\x04", "a zip archive", "unzip FILE"),
                     (b"7z\xbc\xaf\x27\x1c", "a 7z archive", "7z x FILE"))


def _refuse_other_encodings(p: Path, head: bytes) -> None:
    """Refuse what the reader cannot read as UTF-8 (or gzip of it), by its first bytes, in one line that says what it
    is: another compression or an archive, UTF-16 or UTF-32 text (with a byte-order mark, or ASCII with every other
    byte NUL), which was "NUL bytes, as a file cut short by a crash"."""
    for magic, what, how in _OTHER_CONTAINERS:
        if head.startswith(magic):
            raise UserError(f"{p}: {what}; only gzip is read: decompress it ({how})")
    form = other_unicode(head)
    if form:
        raise UserError(f"{p}: {form}; save it as UTF-8")


def _starts_an_array(p: Path, opener) -> bool:
    """Whether a text file's first character (past whitespace and a BOM) is '[': a JSON array, whatever its
    name says (a JSON Lines example is an object, never a list) - unless its first line is a whole list of
    messages, JSON Lines of bare message lists, which the line reader refuses with how to wrap them."""
    try:
        with opener(p, "rb") as f:
            head = f.read(1 << 16)
    except (OSError, EOFError):  # reported by the reader that follows
        return False
    head = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    if not head.startswith(b"["):
        return False
    try:
        line = json.loads(head.split(b"\n", 1)[0])
    except (ValueError, RecursionError):
        return True
    return not (isinstance(line, list) and line and all(isinstance(m, dict) and "role" in m for m in line))


def _arrow_rows(f: Path, where: str) -> list[dict]:
    """The rows of one Arrow file: the IPC stream `datasets` writes, or the IPC file format."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(f)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{where}: not a readable Arrow file ({type(e).__name__}: {str(e)[:200]})") from None
    return table.to_pylist()


def _iter_saved_dataset(p: Path) -> Iterator[tuple[int, Any]]:
    """A `datasets` `save_to_disk` directory (state.json naming its Arrow shards): one example a row, rows
    numbered from 1 across the shards in order; nulls dropped as for Parquet."""
    if (p / "dataset_dict.json").is_file():  # a DatasetDict: one directory per split
        splits = sorted(c.name for c in p.iterdir() if (c / "state.json").is_file())
        raise UserError(f"data file {p} is a DatasetDict saved with save_to_disk; give one split's directory "
                        f"({', '.join(str(p / s) for s in splits) or 'it holds no split'})")
    state = p / "state.json"
    if not state.is_file():  # it exists: "not found" sent users looking for a typo
        try:  # a hub download's or a split's directory: the files it holds are named (one of them is meant)
            held = sorted(str(f) for f in p.iterdir() if f.is_file() and not f.name.startswith(".") and
                          f.name.lower().endswith((".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")))
        except OSError:
            held = []
        shown_held = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        files = (f"; it holds {held[0]}" if len(held) == 1 else f"; it holds {len(held)} data files ({shown_held}): "
                 f"give one, or their examples concatenated into one file" if held else "")
        raise UserError(f"data file {p} is a directory; give a .jsonl, .json or .parquet file or a "
                        f"datasets.save_to_disk directory (it has no state.json){files}")
    try:
        files = [d["filename"] for d in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
        if not all(isinstance(f, str) for f in files):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{state}: not the state.json of a datasets.save_to_disk directory "
                        f"(expected '_data_files': [{{'filename': ...}}])") from None
    row = 0
    for name in files:
        f = p / name
        if not f.is_file():
            raise UserError(f"{state}: names {name}, which is not in {p}")
        for obj in _arrow_rows(f, str(f)):
            row += 1
            yield row, _row(obj)


def _iter_lines(p: Path, opener) -> Iterator[tuple[int, Any]]:
    """JSON Lines (plain or gzip); bytes decoded line by line, so a bad byte is reported at its line."""
    lineno = 0
    first = True
    try:
        with opener(p, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8-sig")  # a BOM on any line: files that each had one, concatenated
                except UnicodeDecodeError as e:
                    raise UserError(f"{p}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line"
                                    f"{not_utf8(raw, e.start)}") from None
                if not line.strip():
                    continue
                try:
                    obj = strict_json.DECODER.decode(line)
                except json.JSONDecodeError as e:
                    # the first object spread over lines (pretty-printed) read "Expecting property name ... column 2"
                    spread = first and e.pos >= len(line.rstrip())
                    hint = ("; the line ends inside its object: JSON Lines holds one whole object a line, and a "
                            "pretty-printed JSON file is read as such when named .json" if spread else "")
                    table = next((x for x in (".csv", ".tsv") if x in map(str.lower, p.suffixes)), None)
                    if first and table:  # a spreadsheet export: 'not valid JSON' alone left it unexplained
                        sep = ", sep='\\t'" if table == ".tsv" else ""
                        hint = (f"; a {table[1:].upper()} file, which is not read: convert it to JSON Lines, e.g. "
                                f"pandas.read_csv(FILE{sep}).to_json('train.jsonl', orient='records', lines=True)")
                    elif e.msg == "Extra data" and line[e.pos:].strip() == ",":  # a JSON array's rows, one a line
                        hint = "; a comma after the object: JSON Lines separates objects by line breaks alone"
                    elif "\x00" in line:  # a file cut short by a crash is often padded with zeros up to its size
                        hint = (f"; the line holds {line.count(chr(0))} NUL bytes, as a file cut short by a crash or "
                                f"a copy is padded: re-export it")
                    elif e.msg == "Extra data" and "\r" in line[:e.pos] and "\n" not in line:
                        hint = "; lines end in CR alone (classic Mac line endings): convert them to LF"
                    raise UserError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno}{hint})") from None
                except RecursionError:
                    raise _too_deep(f"{p}:{lineno}") from None
                except strict_json.NotJSON as e:
                    raise UserError(f"{p}:{lineno}: {e}") from None
                first = False
                yield lineno, obj
    except (OSError, EOFError) as e:  # a truncated or corrupt gzip stream, an unreadable file
        what = "not a readable gzip file" if opener is gzip.open else "cannot be read"
        raise UserError(f"{p}:{lineno + 1}: {what} ({e})") from None


def check_surrogates(value: Any, where: str, path: str = "") -> None:
    """Refuse a string holding a lone UTF-16 surrogate (JSON's unpaired `\\ud800`): no tokenizer encodes one, and
    rendering failed with a TypeError from the tokenizer deep inside preparation."""
    hit = find_lone_surrogate(value, path)
    if hit:
        at, m = hit
        raise UserError(f"{where}: {at or 'the example'} holds a lone UTF-16 surrogate "
                        f"(\\u{ord(m.group()):04x} at character {m.start()}), which is not text any tokenizer "
                        f"encodes; pair it or remove it")


WORD_JOINER = "\u2060"  # invisible; breaks a control token written as text (`Markup.neutralise`)


class Markup:
    """Control-token spellings that must not appear in a message's text: inside it the tokenizer reads one as the
    control token, so an answer ending in a leaked end of turn (common in generated data) trained the end of turn
    twice, and a user text could open a model turn of its own. Which spellings depends on the model: the renderer
    builds the set from its tokenizer's special tokens and its chat format's markers (Gemma 4's `<|turn>`, a plain
    Gemma 3's `<unused2>` that the tool-call markers map onto); without a tokenizer, Gemma 3's own markup."""

    def __init__(self, tokens, calls: tuple[str, ...] = FUNCTION_MARKERS):
        self.calls = frozenset(calls)  # the ones to point at tool_calls
        by_first: dict[str, set[str]] = {}
        for t in tokens:
            if t:
                by_first.setdefault(t[0], set()).add(t)
        # candidates by first character, then one set lookup per distinct length: a regex alternation of the
        # ~6,000 special tokens of a Gemma vocabulary took 4 ms a kilobyte of text
        self._by_first = {c: (sorted({len(t) for t in ts}, reverse=True), ts) for c, ts in by_first.items()}
        self._starts = re.compile("[" + "".join(re.escape(c) for c in self._by_first) + "]") if by_first else None

    def search(self, text: str) -> tuple[int, str] | None:
        """(character, token) of the first control token in `text`, the longest one at that character."""
        if self._starts is None:
            return None
        for m in self._starts.finditer(text):
            i = m.start()
            lengths, tokens = self._by_first[m.group()]
            for n in lengths:
                if text[i:i + n] in tokens:
                    return i, text[i:i + n]
        return None

    def check_value(self, value: Any, where: str, path: str) -> None:
        """`check` every string (keys too) of a JSON value: tool declarations and call arguments are rendered into
        the text as well. Walked without recursion, as `find_lone_surrogate` walks."""
        stack = [(value, path)]
        while stack:
            v, at = stack.pop()
            if isinstance(v, str):
                self.check(v, f"{where}: {at}")
            elif isinstance(v, dict):
                for k, x in reversed(list(v.items())):
                    stack.append((x, f"{at}.{k}"))
                    stack.append((str(k), f"{at} key {str(k)!r}"))
            elif isinstance(v, list):
                stack.extend((x, f"{at}[{i}]") for i, x in reversed(list(enumerate(v))))

    def neutralise(self, text: str) -> str:
        """`text` with each control token broken by a word joiner (U+2060, invisible) after its first character:
        what the model or a tool wrote, carried back into the next prompt as text, not as markup (a JSON escape would
        not do: the renderer decodes JSON values into the call syntax)."""
        while (hit := self.search(text)) is not None:
            at, _token = hit
            text = f"{text[:at + 1]}{WORD_JOINER}{text[at + 1:]}"
        return text

    def neutralised(self, value: Any) -> Any:
        """`neutralise` every string (keys too) of a JSON value, as a new value (the given one is left as it is)."""
        if isinstance(value, str):
            return self.neutralise(value)
        if isinstance(value, dict):
            return {self.neutralise(k) if isinstance(k, str) else k: self.neutralised(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.neutralised(v) for v in value]
        return value

    def check(self, text: str, where: str, answer: bool = False) -> None:
        """Refuse a control token in `text`; `answer`: an assistant's, where a tool-call marker means a call
        written as text (pointed at tool_calls; in a tool result or a declaration that hint misled)."""
        hit = self.search(text)
        if hit:
            at, token = hit
            raise UserError(f"{where}: the text holds {token!r} at character {at}, the chat markup's own "
                            f"control token, which the tokenizer would read as markup; remove it"
                            f"{' (tool calls go in tool_calls)' if answer and token in self.calls else ''}")


# Gemma 3's own markup as the family registry lists it (`Family.markup_tokens`: the turns, FunctionGemma's markers and
# the reserved tokens a plain Gemma 3 vocabulary writes them as, `<unused2>` for `<start_function_call>`, ..., `<pad>`
# and the media markers): what message text is checked against where no tokenizer is at hand (a row normalised
# alone, the fitness dataset's lengths). A second list here had missed `<pad>` and the media markers, which a Gemma 3
# tokenizer reads as its control ids.
GEMMA_MARKUP = Markup(registry.get_family("gemma3").markup_tokens,
                      calls=(*FUNCTION_MARKERS, *plain_gemma_token_map().values()))


@functools.cache
def served_markup() -> Markup:
    """Every model family's chat markup (the registry's `Family.markup_tokens`): what a client of an OpenAI-compatible
    server refuses in message text, not knowing the served model's vocabulary. The server renders the messages with
    its chat template and tokenizes the prompt whole, control tokens read as such: Gemma's own markup alone let a
    Gemma 4's `<|turn>` or `<tool_call|>` through to open a turn or a call of its own."""
    tokens = [t for f in registry.families().values() for t in f.markup_tokens]
    # a call written as text in an answer is pointed at tool_calls: FunctionGemma's markers, Gemma 4's `<|tool_call>`
    calls = (*FUNCTION_MARKERS, *plain_gemma_token_map().values(), *(t for t in tokens if "tool_call" in t))
    return Markup(dict.fromkeys(tokens), calls=calls)


# content parts that are not pictures or sound but were refused as such ("training here is text only"): Anthropic's
# tool blocks and the Responses API's call items, and reasoning blocks
TOOL_PARTS = ("tool_use", "tool_result", "function_call", "function_call_output")
REASONING_PARTS = ("thinking", "redacted_thinking", "reasoning")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type", "text") if isinstance(part, dict) else None
            # OpenAI's Responses API (and exports of it) name text parts input_text / output_text
            if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "refusal":  # OpenAI's part for a declined request: text, under another key
                raise UserError(f"{where}: content[{k}] is a 'refusal' part (OpenAI's, for a declined request); to "
                                f"train its text, give it as a text part {{'type': 'text', 'text': ...}}")
            elif kind in TOOL_PARTS:  # Anthropic-style (and Responses API) tool blocks: not a picture
                raise UserError(f"{where}: content[{k}] is a {kind!r} part; give tool calls as the assistant's "
                                f"tool_calls and results as tool messages (OpenAI's chat form), which are rendered")
            elif kind in REASONING_PARTS:  # extended thinking beside the answer: was "training here is text only"
                raise UserError(f"{where}: content[{k}] is a {kind!r} part, a model's reasoning, which is not "
                                f"rendered: remove it, or give it as text to train it")
            elif isinstance(kind, str) and kind != "text":  # image, image_url, audio, ...: no tower is trained
                raise UserError(f"{where}: content[{k}] is a {shown(kind)} part; training here is text only (the "
                                f"language model of a multimodal checkpoint): remove the non-text parts or put "
                                f"what they say into text")
            else:
                raise UserError(f"{where}: content[{k}]: expected a text part {{'type': 'text', 'text': ...}}, "
                                f"got {part!r:.60}")
        return "".join(parts)
    if isinstance(content, (dict, int, float, bool)):
        return json.dumps(content, ensure_ascii=False)
    raise UserError(f"{where}: content must be a string, got {_json_type(content)}")


def _text_parts(content: Any, message: dict) -> list[str] | None:
    """The texts of a message's content parts where it has two or more (`_text` joins them): vLLM hands the parts to
    the chat template as they are (the content format `openai`, serving's default), and a template may write each
    its own way (Google's Gemma 3 template trims each part), so the template is given them as parts
    (`render.template_messages`). None for text content or a single part; a normalised message's own, normalised
    again, are kept."""
    if isinstance(content, list) and len(content) > 1:
        return [part["text"] for part in content]  # every one a text part: `_text` refuses any other
    kept = message.get("text_parts")
    if isinstance(kept, list) and len(kept) > 1 and all(isinstance(p, str) for p in kept) \
            and "".join(kept) == content:
        return list(kept)
    return None


def _json_type(value: Any) -> str:
    """What a JSON value is, in JSON's words (an error names what it got)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a number")


def _decode_embedded(text: str, what: str, where: str) -> Any:
    """JSON kept as a string inside a row (a column, tool-call arguments), read as strictly as the file: a key
    given twice, NaN/Infinity, a lone surrogate or nesting past the stack were kept silently (or raised a
    traceback) here though refused at the file's own level."""
    try:
        value = strict_json.DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: '{what}' is a string but not valid JSON ({e.msg})") from None
    except RecursionError:
        raise _too_deep(f"{where}: '{what}'") from None
    except strict_json.NotJSON as e:
        raise UserError(f"{where}: '{what}' (a JSON string): {e}") from None
    check_surrogates(value, where, what)
    return value


def _check_tool_result(content: str, where: str) -> None:
    """A tool result the prompt renders as JSON (`format_response`, and Hugging Face templates, read it with Python's
    lenient json) is read as strictly as the file: `{"r": 1e999}` was rendered `{r:Infinity}`, `NaN` kept (neither is
    JSON) and one of a key given twice dropped, so the model trained on a result the file never held. A bare value is
    read alike: `1e999`, `NaN` or `-Infinity` alone is rendered `{result:Infinity}` (`{result:NaN}`), a JSON number in
    the prompt and the served template alike, not the text the file holds (which would be `<escape>NaN<escape>`)."""
    problem = strict_json.lenient_only(content)  # None for a text that is not JSON: rendered as the text it is
    if problem is not None:
        raise UserError(f"{where}: the tool result's content, read as JSON to render it: {problem}")


def _maybe_json(value: Any, what: str, where: str) -> Any:
    """Hub datasets often store nested columns as JSON strings; decode those."""
    if isinstance(value, str):
        return _decode_embedded(value, what, where) if value.strip() else None
    return value


def _tool_names(tools: Any, where: str, field: str = "tools") -> list[str]:
    """The names `tools` declares, checked as the local server checks a request's (`check_tools`): a row whose
    declarations the server would refuse (a schema's properties not an object, strict "yes", a 65-character name)
    trained a model on declarations it is never sent."""
    if tools is None:
        return []
    for k, t in enumerate(tools if isinstance(tools, list) else []):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("parameters"), str):  # a schema kept as a JSON string
            fn["parameters"] = _maybe_json(fn["parameters"], f"{field}[{k}].parameters", where)
    try:
        return check_tools(tools, bare=True)
    except DeclarationError as e:  # `field`: OpenAI's legacy `functions`, checked as the tools they become
        raise UserError(f"{where}: {field}{str(e).removeprefix('tools')}") from None


class OutOfTurn(UserError):
    """A message refused for where it stands (`_check_turn_order`), not for what it holds."""


def _check_turn_order(before: list[dict], role: str, answered: int, calls: int, mw: str) -> None:
    """Refuse a turn the chat template would refuse or the renderer would have to guess at (`OutOfTurn`).

    Gemma's chat template takes one leading system message and then strictly alternating user and
    model turns (it raises otherwise); tool results sit inside the model turn, after its calls."""
    prev = before[-1]["role"] if before else None
    if role in ("system", "developer"):
        if before:
            raise OutOfTurn(f"{mw}: a {role} message is allowed only as the first message (Gemma folds it into the "
                            f"first user turn); this one follows {prev}")
        return
    if prev is None or prev in ("system", "developer"):
        if role != "user":
            raise OutOfTurn(f"{mw}: the conversation must start with a user turn (after an optional system "
                            f"message), as Gemma's chat template requires; it starts with {role}")
        return
    if role == "user":
        if prev == "user":
            raise OutOfTurn(f"{mw}: two user turns in a row; Gemma's chat template requires user and assistant turns "
                            f"to alternate (join them into one message)")
        if prev == "tool" or before[-1].get("tool_calls"):
            raise OutOfTurn(f"{mw}: a user turn follows unanswered tool calls or a tool result; the assistant must "
                            f"answer first")
    elif role == "assistant":
        if prev == "assistant" and not before[-1].get("tool_calls"):
            raise OutOfTurn(f"{mw}: two assistant turns in a row; Gemma's chat template requires user and assistant "
                            f"turns to alternate (join them into one message)")
        if prev == "assistant" or (prev == "tool" and answered < calls):
            raise OutOfTurn(f"{mw}: the assistant continues before every tool call of its previous turn has a result "
                            f"({answered if prev == 'tool' else 0} of {calls} answered)")
    elif role == "tool" and not (prev == "tool" or before[-1].get("tool_calls")):
        raise OutOfTurn(f"{mw}: a tool result must follow an assistant turn with tool_calls (or another tool result); "
                        f"it follows {prev}")


def normalise_messages(obj: dict, where: str, markup: Markup = GEMMA_MARKUP) -> dict:
    """Validate a chat example: roles, contents, tool calls against declared tools; `markup`: the control
    tokens its text must not hold (see `Markup`)."""
    messages = _maybe_json(obj.get("messages"), "messages", where)
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list, got "
                        f"{'an empty list' if messages == [] else _json_type(messages)}")
    if all(isinstance(t, dict) and "from" in t and "role" not in t for t in messages):
        # ShareGPT turns (`from`/`value`) under the chat column's name, as converters leave them: each was
        # "unknown role None"; read as ShareGPT, errors naming the row's own field
        try:
            return normalise_sharegpt({**obj, "conversations": messages}, where, markup)
        except UserError as e:
            raise UserError(str(e).replace(": conversations[", ": messages[", 1)) from None
    tools = _maybe_json(obj.get("tools"), "tools", where)
    functions = _maybe_json(obj.get("functions"), "functions", where)
    if functions is not None:  # OpenAI's legacy declarations: each one the `function` of a tool
        if tools is not None:
            raise UserError(f"{where}: both 'tools' and 'functions' (OpenAI's legacy name for them); give one")
        if not isinstance(functions, list):
            raise UserError(f"{where}: 'functions' must be a list of function declarations")
        _tool_names(functions, where, "functions")  # refused naming the field the row has
        tools = [{"type": "function", "function": f} for f in functions]
    names = _tool_names(tools, where)
    markup.check_value(tools, where, "tools")
    declared = {fn.get("name"): fn.get("parameters") for fn in (t.get("function", t) for t in tools or [])}
    out = _system_field(obj, messages, where, markup)
    pending: list[tuple[str | None, str]] = []  # (id, name) of the latest calls, for nameless tool results
    answered = 0
    done: set[int] = set()  # the calls of `pending` answered so far
    for i, m in enumerate(messages):
        mw = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise UserError(f"{mw}: expected an object with 'role' and 'content'")
        role = message_role(m)
        if m.get("role") is None:  # was "unknown role None", of a key misspelt (`rol`) or left out
            has = "its 'role' is null" if "role" in m else f"it has {', '.join(map(str, m)) or 'no keys'}"
            raise UserError(f"{mw}: a message needs 'role', one of {', '.join(ROLES)} ({has})")
        if role not in ROLES:
            raise UserError(f"{mw}: unknown role {shown(m.get('role'))} (expected one of {', '.join(ROLES)})")
        if m.get("content") is None and role != "assistant":  # an assistant turn may be only tool calls
            has = "its 'content' is null" if "content" in m else f"it has {', '.join(map(str, m))}"
            raise UserError(f"{mw}: a {role} message needs 'content' ({has})")
        content = m.get("content")
        if role == "tool" and isinstance(content, list) and content and not any(
                isinstance(p, dict) and "type" in p for p in content):
            # a JSON array result ([1, 2], [{"steps": 5}]), as an object or a number result is read: it was refused
            # as "content[0]: expected a text part", read as OpenAI's list of content parts
            content = json.dumps(content, ensure_ascii=False)
        msg: dict[str, Any] = {"role": role, "content": _text(content, mw)}
        parts = _text_parts(content, m)
        if parts:
            msg["text_parts"] = parts
        markup.check(msg["content"], mw, answer=role == "assistant")
        if role in ("system", "developer") and not msg["content"].strip():
            # ShareGPT exports often carry {"from": "system", "value": ""}: it says nothing, and Gemma's template
            # would fold only separators into the first user turn; left out, not refused
            continue
        if role == "user" and not msg["content"].strip():
            # as for an assistant answer: the model would learn to answer an empty prompt
            raise UserError(f"{mw}: {role} message is empty{' (only whitespace)' if msg['content'] else ''}; "
                            f"give it text or remove the row")
        _check_turn_order(out, role, answered, len(pending), mw)
        if not _trained(m, role, mw):
            msg["train"] = False
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if m.get("function_call") is not None:  # OpenAI's legacy single call: it was dropped silently
                if calls:
                    raise UserError(f"{mw}: both tool_calls and function_call (OpenAI's legacy form of one call); "
                                    f"give one")
                calls = [{"function": m["function_call"]}]
            if not isinstance(calls, list):
                raise UserError(f"{mw}: tool_calls must be a list")
            norm_calls = []
            for j, c in enumerate(calls):
                fn = c.get("function", c) if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise UserError(f"{mw}.tool_calls[{j}]: needs function.name")
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    args = _decode_embedded(args, f"tool_calls[{j}].function.arguments", mw) if args.strip() else {}
                if args is None:
                    args = {}
                if not isinstance(args, dict):
                    twice = isinstance(args, str) and args.lstrip().startswith("{")  # json.dumps of json.dumps
                    raise UserError(f"{mw}.tool_calls[{j}]: arguments must be an object, got {_json_type(args)}"
                                    + (" holding JSON text (encoded twice: decode it once)" if twice else ""))
                ids = [d.get("id") for d in calls[:j] if isinstance(d, dict)]
                if isinstance(c, dict) and c.get("id") is not None and c["id"] in ids:
                    raise UserError(f"{mw}.tool_calls[{j}]: id {shown(c['id'])} is also the id of tool_calls"
                                    f"[{ids.index(c['id'])}]; each call of a turn needs its own id")
                if not names:
                    raise UserError(f"{mw}.tool_calls[{j}]: calls {shown(fn['name'])} but the example declares no "
                                    f"'tools'")
                if fn["name"] not in names:
                    raise UserError(f"{mw}.tool_calls[{j}]: calls {shown(fn['name'])}, which is not in 'tools' "
                                    f"({', '.join(names)})")
                markup.check_value(args, mw, f"tool_calls[{j}].arguments")
                problem = arguments_problem(declared.get(fn["name"]), args)
                if problem:
                    raise UserError(f"{mw}.tool_calls[{j}]: calls {fn['name']} with arguments its declaration in "
                                    f"'tools' refuses: {problem}")
                norm_calls.append({"name": fn["name"], "arguments": args})
            if not msg["content"].strip() and not norm_calls and isinstance(m.get("refusal"), str) \
                    and m["refusal"].strip():  # an OpenAI export of a declined request: the text is elsewhere
                raise UserError(f"{mw}: the answer is in 'refusal' (OpenAI's field for a declined request) and its "
                                f"content is empty; to train that answer, put its text in 'content'")
            if not msg["content"].strip() and not norm_calls:  # whitespace alone would train an empty answer
                raise UserError(f"{mw}: assistant message has neither content nor tool_calls"
                                f"{' (only whitespace)' if msg['content'] else ''}")
            if norm_calls:
                msg["tool_calls"] = norm_calls
                pending = [(c.get("id") if isinstance(c, dict) else None, nc["name"])
                           for c, nc in zip(calls, norm_calls)]
                answered, done = 0, set()
        elif role == "tool":
            name = m.get("name")
            call_id = m.get("tool_call_id")
            k = None  # the call of the latest assistant turn it answers
            if call_id is not None:  # must answer a call of the latest assistant turn, once, by its id
                k = next((j for j, (cid, _) in enumerate(pending) if cid is not None and cid == call_id), None)
                if k is None:
                    ids = [repr(cid) for cid, _ in pending if cid is not None]
                    have = (f"its call ids: {', '.join(ids)}" if ids else
                            "its calls have no ids" if pending else "it made no calls")
                    raise UserError(f"{mw}: tool_call_id {shown(call_id)} matches no call of the preceding assistant "
                                    f"turn ({have})")
                if k in done:
                    raise UserError(f"{mw}: tool_call_id {shown(call_id)} was already answered")
                if name and name != pending[k][1]:
                    raise UserError(f"{mw}: tool result named {shown(name)} answers tool_call_id {shown(call_id)}, "
                                    f"a call to {pending[k][1]!r}")
            if answered >= len(pending):  # it answers no call: an OpenAI-format export gave it an id never issued
                n = len(pending)
                raise UserError(f"{mw}: a tool result past the {n} call{'s' if n != 1 else ''} of the preceding "
                                f"assistant turn (each result answers one call); remove it or add its call")
            if k is None:
                # a result without an id answers the first call still open (of its name, where it has one): the calls
                # in order, and after results by id out of order, the call they left (not the call in its position,
                # answered twice while another went unanswered); the tool chat template reads it alike
                left = [j for j in range(len(pending)) if j not in done]
                k = next((j for j in left if pending[j][1] == name), left[0])
            done.add(k)
            name = name or pending[k][1]
            if not isinstance(name, str) or not name:
                raise UserError(f"{mw}: tool message has no 'name' and answers no earlier tool call")
            if names and name not in names:
                raise UserError(f"{mw}: tool result for {shown(name)}, which is not in 'tools' ({', '.join(names)})")
            msg["name"] = name
            _check_tool_result(msg["content"], mw)
            answered += 1
        out.append(msg)
    if not any(m["role"] == "assistant" and m.get("train", True) for m in out):
        raise UserError(f"{where}: no assistant message to learn from" +
                        (" (every one is marked train: false)" if any(m["role"] == "assistant" for m in out) else ""))
    return {"messages": out, "tools": tools if names else None, "where": where}


SYSTEM_FIELDS = ("system", "system_prompt")  # LLaMA-Factory and Anthropic-style exports; OpenOrca's column


def _system_field(obj: dict, messages: list, where: str, markup: Markup) -> list[dict]:
    """The system prompt a row gives in a field of its own, as a leading system message ([] for none): LLaMA-Factory's
    ShareGPT and Alpaca rows and Anthropic-style exports (`{"system": ..., "messages": [...]}`) keep it in `system`,
    OpenOrca in `system_prompt`, and it was dropped without a word (the model trained without the prompt it is
    served with)."""
    given = [(k, _text(obj[k], f"{where}: '{k}'")) for k in SYSTEM_FIELDS if obj.get(k) is not None]
    given = [(k, text) for k, text in given if text.strip()]
    if not given:
        return []
    if len(given) > 1:
        raise UserError(f"{where}: both 'system' and 'system_prompt' hold a system prompt; give one")
    key, text = given[0]
    markup.check(text, f"{where}: '{key}'")
    first = messages[0] if messages else None
    if isinstance(first, dict) and message_role(first) in ("system", "developer") and \
            not (isinstance(first.get("content"), str) and not first["content"].strip()):
        raise UserError(f"{where}: both a '{key}' field and a {message_role(first)} message opening the conversation; "
                        f"give the system prompt once")
    return [{"role": "system", "content": text}]


# a message's loss flags: ours, Axolotl's per-message `training` (its message_field_training default: it was ignored
# as an unknown key, and the answers it kept out were trained) and ShareGPT exports' `weight`
TRAIN_FLAGS = ("train", "training", "weight")


def _trained(m: dict, role: str, mw: str) -> bool:
    """Whether a message carries loss: `"train": false` (`"training": false`) or `"weight": 0` keeps an answer as
    context only. A null flag is no flag (OpenHermes-style exports write `"weight": null` on every turn; Parquet drops
    such nulls anyway)."""
    flags = {k: m[k] for k in TRAIN_FLAGS if m.get(k) is not None}
    if not flags:
        return True
    for key in ("train", "training"):
        if key in flags and not isinstance(flags[key], bool):
            raise UserError(f"{mw}: '{key}' must be true or false, got {flags[key]!r:.40}")
    if "weight" in flags and (isinstance(flags["weight"], bool) or flags["weight"] not in (0, 1)):
        raise UserError(f"{mw}: 'weight' must be 0 or 1, got {flags['weight']!r:.40}")
    trained = {bool(v) for v in flags.values()}
    if len(trained) > 1:
        raise UserError(f"{mw}: {' and '.join(repr(k) for k in flags)} disagree ({flags})")
    if role != "assistant" and True in trained:  # a false flag on another turn says what is so anyway
        raise UserError(f"{mw}: {'/'.join(flags)} can mark assistant messages only (a {role} turn is never trained)")
    return trained.pop()


def _messages_or_text(value: Any, what: str, where: str) -> Any:
    """A prompt or completion: text, or a list of messages (also as a JSON string, as Parquet files
    from the Hub store them); text that merely looks like JSON stays text. A list of messages is read
    as strictly as the file (a key twice, NaN were kept; nesting past the stack raised RecursionError)."""
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        try:
            decoded = json.loads(value)
        except (ValueError, RecursionError):  # not JSON (or a number Python will not read): text
            return value
        if isinstance(decoded, list) and all(isinstance(m, dict) and "role" in m for m in decoded):
            return _decode_embedded(value, what, where)
    return value


_PREFERENCE_HINT = ("; this is a preference row (chosen/rejected, for DPO-style training): to fine-tune on the "
                    "preferred answers, write 'chosen' as 'completion' (or as 'messages' when it holds the prompt)")


def normalise_prompt_completion(obj: dict, where: str, markup: Markup = GEMMA_MARKUP) -> dict:
    """TRL's prompt-completion rows: strings (a user turn, an assistant turn) or message lists; only
    the completion is trained."""
    if obj.get("label") is False:  # TRL's unpaired preference rows (KTO): it was trained as a good answer
        raise UserError(f"{where}: 'label': false marks an undesirable completion (TRL's unpaired preference rows, "
                        f"for KTO); fine-tuning would train it as a good answer: leave such rows out (label true "
                        f"rows train as they are)")
    prompt, completion = (_messages_or_text(obj.get(k), k, where) for k in ("prompt", "completion"))
    for key, value in (("prompt", prompt), ("completion", completion)):
        if value is None:
            raise UserError(f"{where}: missing field '{key}' (prompt-completion rows need both 'prompt' and "
                            f"'completion'){_PREFERENCE_HINT if 'chosen' in obj else ''}")
        if not isinstance(value, (str, list)):
            raise UserError(f"{where}: '{key}' must be a string or a list of messages, got {_json_type(value)}")
    if isinstance(prompt, str) != isinstance(completion, str):
        raise UserError(f"{where}: 'prompt' and 'completion' must both be strings or both be lists of messages")
    if isinstance(prompt, str):
        if not completion.strip():
            raise UserError(f"{where}: field 'completion' is empty")
        for key, text in (("prompt", prompt), ("completion", completion)):
            hit = markup.search(text)
            if hit:  # named by the row's field (it was "prompt[0]", and "remove it" of one token after another)
                raise UserError(f"{where}: '{key}' holds {hit[1]!r} at character {hit[0]}, a control token of the "
                                f"chat markup: text prompt-completion rows are rendered as a user turn and an "
                                f"assistant turn, so text already rendered with a chat template (as TRL's "
                                f"apply_chat_template writes it) goes in as lists of messages; else remove it")
        prompt = [{"role": "user", "content": prompt}]
        completion = [{"role": "assistant", "content": completion}]
    for key, value in (("prompt", prompt), ("completion", completion)):
        for i, m in enumerate(value):
            if not isinstance(m, dict):
                raise UserError(f"{where}: {key}[{i}]: expected an object with 'role' and 'content'")
    if not any(message_role(m) == "assistant" for m in completion):
        raise UserError(f"{where}: 'completion' has no assistant message to learn from")
    prompt, completion, given = _continued_answer(prompt, completion, where, markup)
    context = [{**m, "train": False} if message_role(m) == "assistant"
               and all(m.get(k) is None for k in TRAIN_FLAGS) else m for m in prompt]
    try:
        conv = normalise_messages({"messages": context + completion, "tools": obj.get("tools"),
                                   **{k: obj[k] for k in SYSTEM_FIELDS if k in obj}}, where, markup)
    except UserError as e:  # name the message by the field the row has, not by the joined list
        # an answer whose start the prompt gives stands where its start stands: refused there, it is the prompt's
        # message out of turn (it was named completion[0], a message in its place)
        start = len(prompt) + (given > 0 and isinstance(e, OutOfTurn))

        def field(m: re.Match) -> str:
            i = int(m.group(1))
            return f"prompt[{i}]" if i < start else f"completion[{i - len(prompt)}]"

        raise UserError(re.sub(r"(?<=: )messages\[(\d+)\]", field, str(e), count=1)) from None
    answers = [m for m in conv["messages"] if m["role"] == "assistant"]
    n_context = sum(message_role(m) == "assistant" for m in prompt)
    if any(m.get("train", True) for m in answers[:n_context]):
        raise UserError(f"{where}: an assistant turn in 'prompt' is marked trained; only the completion is trained")
    if given:  # the prompt's start of the answer is context; the completion's continuation of it is trained
        answers[n_context]["given"] = given
    return conv


def _continued_answer(prompt: list, completion: list, where: str, markup: Markup) -> tuple[list, list, int]:
    """TRL's "continue final message" rows: a prompt that ends in the start of the assistant's answer, continued by a
    completion that opens with an assistant message, is one answer (they were refused as two assistant turns in a
    row). Returned as (prompt without that start, completion with the start joined to its first message, the start's
    length in characters): the start is context, as a server renders it with continue_final_message=True, and the
    continuation is what it generates after it. Other rows are returned as they are, with 0."""
    last, first = (prompt[-1] if prompt else None), completion[0]
    if not (isinstance(last, dict) and message_role(last) == "assistant" and message_role(first) == "assistant"
            and last.get("tool_calls") is None and last.get("function_call") is None):
        return prompt, completion, 0
    k = len(prompt) - 1
    if any(last.get(k) is not None for k in TRAIN_FLAGS) and \
            _trained(last, "assistant", f"{where}: prompt[{k}]"):
        raise UserError(f"{where}: an assistant turn in 'prompt' is marked trained; only the completion is trained")
    start = _text(last.get("content"), f"{where}: prompt[{k}]")
    markup.check(start, f"{where}: prompt[{k}]", answer=True)
    rest = _text(first.get("content"), f"{where}: completion[0]")
    # checked apart and across the join: the joined answer's check named a character of a text the file does not hold
    markup.check(rest, f"{where}: completion[0]", answer=True)
    hit = markup.search(start + rest)
    if hit:
        at, token = hit
        raise UserError(f"{where}: prompt[{k}]'s end and completion[0]'s start join into {token!r} (from prompt[{k}]'s "
                        f"character {at}), the chat markup's own control token, which the tokenizer would read as "
                        f"markup; remove it{' (tool calls go in tool_calls)' if token in markup.calls else ''}")
    if not rest.strip() and not first.get("tool_calls") and first.get("function_call") is None:
        raise UserError(f"{where}: completion[0] continues the prompt's final assistant message with nothing"
                        f"{' (only whitespace)' if rest else ''}: give the text that follows it, or end the prompt "
                        f"with the user's turn")
    return prompt[:k], [{**first, "content": start + rest}, *completion[1:]], len(start)


def normalise_sharegpt(obj: dict, where: str, markup: Markup = GEMMA_MARKUP) -> dict:
    """ShareGPT rows (`conversations` of `from`/`value` turns, as Axolotl and LLaMA-Factory read them)."""
    turns = _maybe_json(obj.get("conversations"), "conversations", where)
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'conversations' must be a non-empty list, got "
                        f"{'an empty list' if turns == [] else _json_type(turns)}")
    if all(isinstance(t, dict) and "role" in t and "from" not in t for t in turns):
        # chat messages under the ShareGPT column name, as many Hub datasets and converters leave them
        return _as_conversations(turns, obj, where, markup)
    messages: list[dict] = []
    turn_of: list[int] = []  # the turn each message comes from (one observation may answer several calls)
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise UserError(f"{where}: conversations[{i}]: expected an object with 'from' and 'value'")
        if t["value"] is None:  # was "a user message needs 'content' (it has role, content)": neither is its field
            raise UserError(f"{where}: conversations[{i}]: 'value' is null; a {t['from']!r} turn needs text")
        speaker = t["from"].lower() if isinstance(t["from"], str) else None
        flags = {k: t[k] for k in TRAIN_FLAGS if k in t}
        if speaker in SHAREGPT_TOOL_TURNS:  # LLaMA-Factory's tool turns: a call (or a list of them), its result
            tw = f"{where}: conversations[{i}]"
            if speaker == "observation" and _answers_parallel_calls(messages, turns, i):
                results = _parallel_results(t["value"], len(messages[-1]["tool_calls"]), tw)
            else:
                results = [t["value"]]
            for value in results:
                messages.append(_sharegpt_tool_turn(speaker, value, tw) | flags)
                turn_of.append(i)
            continue
        role = SHAREGPT_ROLES.get(speaker)
        if role is None:
            raise UserError(f"{where}: conversations[{i}]: unknown speaker {shown(t['from'])} (expected one of "
                            f"{', '.join((*SHAREGPT_ROLES, *SHAREGPT_TOOL_TURNS))})")
        messages.append({"role": role, "content": t["value"], **flags})
        turn_of.append(i)
    return _as_conversations(messages, obj, where, markup, turn_of)


# how LLaMA-Factory's own converter of OpenAI chats joins the results of parallel calls into one observation
LLAMA_FACTORY_RESULTS_JOIN = "\n</tool_response>\n<tool_response>\n"


def _answers_parallel_calls(messages: list[dict], turns: list, i: int) -> bool:
    """Whether observation turn `i` is the one result of a function_call turn of several calls: LLaMA-Factory's
    rows alternate strictly (human/observation, gpt/function_call), so a turn of parallel calls is answered by one
    observation. Several observations in a row answer the calls one each, as tool messages do."""
    nxt = turns[i + 1] if i + 1 < len(turns) else None
    again = isinstance(nxt, dict) and isinstance(nxt.get("from"), str) and nxt["from"].lower() == "observation"
    return bool(messages) and len(messages[-1].get("tool_calls") or []) > 1 and not again


def _parallel_results(value: Any, n: int, tw: str) -> list[Any]:
    """The results of `n` parallel calls held by one observation, in the calls' order: a JSON list of `n` results
    (as text or as a list; each one its text, or its JSON text), or `n` results joined as LLaMA-Factory's converter
    of OpenAI chats joins them (`LLAMA_FACTORY_RESULTS_JOIN`). They were refused at the answer after them, as an
    assistant continuing before every call had a result (1 of n answered)."""
    listed = value
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            json.loads(value)
        except (ValueError, RecursionError):  # text that only starts like a list
            pass
        else:  # read as strictly as the file (a NaN or a key twice in it refused)
            listed = _decode_embedded(value, "value", tw)
    if isinstance(listed, list) and len(listed) == n:
        # each result is read as a tool message's content is (strictly, where it is rendered as JSON)
        return [x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in listed]
    if isinstance(value, str) and value.count(LLAMA_FACTORY_RESULTS_JOIN) == n - 1:
        return value.split(LLAMA_FACTORY_RESULTS_JOIN)
    got = (f"a list of {len(listed)}" if isinstance(listed, list) else
           f"{value.count(LLAMA_FACTORY_RESULTS_JOIN) + 1} joined as LLaMA-Factory joins them"
           if isinstance(value, str) and LLAMA_FACTORY_RESULTS_JOIN in value else "one result")
    raise UserError(f"{tw}: one observation answers the {n} parallel calls of the function_call turn before it, but "
                    f"holds {got}: give a JSON list of {n} results in the calls' order (or one observation per call)")


def _sharegpt_tool_turn(speaker: str, value: Any, tw: str) -> dict:
    """A LLaMA-Factory ShareGPT tool turn as a chat message: `function_call` holds a call `{"name": ...,
    "arguments": {...}}` (or a list of calls) as JSON text, `observation` the result; the calls are checked against
    the row's `tools` as any chat's are. They were refused as unknown speakers."""
    if speaker == "observation":
        return {"role": "tool", "content": value}
    calls = _decode_embedded(value, "value", tw) if isinstance(value, str) else value
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) for c in calls):
        raise UserError(f"{tw}: a function_call turn's value must be a call {{\"name\": ..., \"arguments\": {{...}}}} "
                        f"or a list of them, got {_json_type(calls)}")
    return {"role": "assistant", "content": "", "tool_calls": [{"function": c} for c in calls]}


def _fields(obj: dict) -> str:
    """The keys a row has, for an error that says what it lacks."""
    return ", ".join(map(str, obj)) or "no fields"


def _as_conversations(messages: list, obj: dict, where: str, markup: Markup,
                      turn_of: list[int] | None = None) -> dict:
    """`normalise_messages` of a ShareGPT row's turns, its errors naming conversations[i] (the row's field);
    `turn_of`: the turn of each message, where they differ (an observation split into its results)."""
    try:
        return normalise_messages({"messages": messages, "tools": obj.get("tools"),
                                   **{k: obj[k] for k in SYSTEM_FIELDS if k in obj}}, where, markup)
    except UserError as e:
        def turn(m: re.Match) -> str:
            k = int(m.group(1))
            return f"conversations[{turn_of[k] if turn_of and k < len(turn_of) else k}]"

        raise UserError(re.sub(r"(?<=: )messages\[(\d+)\]", turn, str(e), count=1)) from None


def detect_format(obj: dict, instruction_field: str, text_field: str = "text") -> str | None:
    """The example shape of `obj` by its keys (None: none of them)."""
    if "messages" in obj:
        return "messages"
    if "prompt" in obj and "completion" in obj:
        return "prompt_completion"
    if "conversations" in obj:
        return "sharegpt"
    if instruction_field in obj:  # data.instruction_field may itself be "prompt"
        return "instruction"
    if text_field in obj:
        return "text"
    return "prompt_completion" if "prompt" in obj or "completion" in obj else None


def normalise_instruction(obj: dict, where: str, instruction: str, context: str | None, response: str,
                          markup: Markup = GEMMA_MARKUP) -> dict:
    alpaca = ("; Alpaca rows: data.response_field=output data.context_field=input"
              if {"instruction", "input", "output"} <= set(obj) else "")
    for field, key in ((instruction, "data.instruction_field"), (response, "data.response_field")):
        if field not in obj:
            raise UserError(f"{where}: missing field '{field}' ({key}; the example has "
                            f"{_fields(obj)}{alpaca})")
        if not isinstance(obj[field], str):  # a null or a number: was an AttributeError traceback ('.strip')
            raise UserError(f"{where}: field '{field}' must be a string, got {_json_type(obj[field])}")
    if context and context not in obj and context != "input" and isinstance(obj.get("input"), str) \
            and obj["input"].strip():
        # an Alpaca row read with data.response_field=output alone: its input was left out of every prompt silently
        raise UserError(f"{where}: the row has an 'input' field but no '{context}' (data.context_field), so the "
                        f"input would be left out of the prompt; set data.context_field=input (null: leave it out)")
    prompt = obj[instruction]
    ctx = obj.get(context) if context else None
    if ctx is not None and not isinstance(ctx, str):
        raise UserError(f"{where}: field '{context}' (data.context_field) must be a string, got {_json_type(ctx)}")
    if not prompt.strip():
        raise UserError(f"{where}: field '{instruction}' is empty")
    if ctx and ctx.strip():
        prompt = f"{prompt}\n\n{ctx}"
    if not obj[response].strip():
        raise UserError(f"{where}: field '{response}' is empty")
    for field in (instruction, context, response):
        if field and isinstance(obj.get(field), str):
            markup.check(obj[field], f"{where}: field '{field}'")
    turns = _history(obj, where, markup) + [{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": obj[response]}]
    return {"messages": _system_field(obj, turns, where, markup) + turns, "tools": None, "where": where}


def _history(obj: dict, where: str, markup: Markup) -> list[dict]:
    """The earlier turns of an instruction row, LLaMA-Factory's `history` ([[instruction, response], ...]): they
    were dropped without a word, and the answer trained without the conversation it answers. Trained as every
    assistant turn of a chat is."""
    history = _maybe_json(obj.get("history"), "history", where)
    if history is None:
        return []
    if not isinstance(history, list):
        raise UserError(f"{where}: 'history' must be a list of [instruction, response] pairs, got "
                        f"{_json_type(history)}")
    turns = []
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) and t.strip() for t in pair)):
            raise UserError(f"{where}: history[{i}] must be an [instruction, response] pair of non-empty strings, "
                            f"got {pair!r:.80}")
        for text in pair:
            markup.check(text, f"{where}: history[{i}]")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns


def normalise_text(obj: dict, where: str, field: str) -> dict:
    """A language-modeling row: its text is trained whole, as TRL trains a `text` dataset."""
    if field not in obj:
        raise UserError(f"{where}: missing field '{field}' (data.text_field; the example has "
                        f"{_fields(obj)})")
    text = obj[field]
    if not isinstance(text, str):
        raise UserError(f"{where}: field '{field}' must be a string, got {_json_type(text)}")
    if not text.strip():
        raise UserError(f"{where}: field '{field}' is empty")
    return {"text": text, "tools": None, "where": where}


def _shape_fields(kind: str | None, data_cfg) -> list[str]:
    """The fields a row of shape `kind` is read from."""
    return {"messages": ["messages"], "sharegpt": ["conversations"], "prompt_completion": ["prompt", "completion"],
            "instruction": [data_cfg.instruction_field, data_cfg.response_field],
            "text": [data_cfg.text_field]}.get(kind or "", [])


def _detect(obj: dict, data_cfg) -> str | None:
    """`detect_format`, by the fields that hold something where the shape's own fields are all null: a mixed-schema
    JSON Lines file written from a table (pandas' to_json of concatenated sets) gives every row every shape's column,
    null where the row is of another shape, and `{"messages": null, "conversations": [...]}` was refused as "'messages'
    must be a non-empty list, got null"."""
    kind = detect_format(obj, data_cfg.instruction_field, data_cfg.text_field)
    fields = _shape_fields(kind, data_cfg)
    if fields and all(obj.get(k) is None for k in fields):
        other = detect_format({k: v for k, v in obj.items() if v is not None}, data_cfg.instruction_field,
                              data_cfg.text_field)
        kind = other or kind
    return kind


def _check_null_columns(obj: dict, kind: str | None, where: str, data_cfg) -> None:
    """A Parquet/Arrow row whose text column is null (pandas writes a missing value, NaN or None, as null): said as
    such. Its nulls are dropped before the row is read, so it was "no 'messages' ... field (the example has no
    fields)", or a missing field, as if the file had no such column."""
    nulls = getattr(obj, "nulls", ())
    if not nulls:
        return
    if kind is None:  # the shape the row would have with its null columns
        kind = detect_format({**obj, **dict.fromkeys(nulls)}, data_cfg.instruction_field, data_cfg.text_field)
    null = [k for k in _shape_fields(kind, data_cfg) if k in nulls and k not in obj]
    if null:
        raise UserError(f"{where}: '{null[0]}' is null in this row (a missing value: pandas writes NaN and None as "
                        f"null); fill it in or drop the row")


def normalise_row(obj: Any, where: str, data_cfg, markup: Markup = GEMMA_MARKUP) -> dict:
    """One example of any shape the reader knows (told apart by its keys, or `data_cfg.format`) as a normalised
    conversation; `where` names it in errors (FILE:LINE)."""
    if not isinstance(obj, dict):
        looks_like_turns = isinstance(obj, list) and obj and all(isinstance(m, dict) and "role" in m for m in obj)
        hint = ' (a list of messages: wrap each example as {"messages": [...]})' if looks_like_turns else ""
        raise UserError(f"{where}: expected a JSON object per example, got {_json_type(obj)}{hint}")
    check_surrogates(obj, where)
    try:
        return _normalise_shape(obj, where, data_cfg, markup)
    except UserError as e:  # a table written column by column: each field holds every example's value
        columns = _column_oriented(obj)
        if columns is None:
            raise
        raise UserError(f"{e}; {columns}") from None


def _column_oriented(obj: dict) -> str | None:
    """What to say of a row that is a whole table written column by column, else None: pandas' `DataFrame.to_json()`
    (orient='columns', its default: each field an object of row index -> value) or a `to_dict()` / orient='list'
    dump (each field a list of every row's value). Its error named the first field's type alone ("'prompt' must be a
    string or a list of messages, got an object")."""
    values = list(obj.values())
    if not values:
        return None
    if all(isinstance(v, dict) and v and all(isinstance(k, str) and k.isdigit() for k in v) for v in values):
        how, n = "each field an object of row number -> value, as pandas' DataFrame.to_json() writes by default", \
            len(values[0])
    elif all(isinstance(v, list) and len(v) == len(values[0]) > 1 and not any(
            isinstance(x, dict) and ("role" in x or "from" in x) for x in v) for v in values):
        how, n = "each field a list of every row's value, as a to_dict() dump holds it", len(values[0])
    else:
        return None
    return (f"this looks like a table of {n} rows written column by column ({how}): write one object per example, "
            f"to_json(orient='records') (a JSON array) or to_json(orient='records', lines=True) (JSON Lines)")


def _normalise_shape(obj: dict, where: str, data_cfg, markup: Markup) -> dict:
    """`normalise_row` of a JSON object: its shape told apart (or `data_cfg.format`), then read as that shape."""
    kind = data_cfg.format
    if kind == "auto":
        kind = _detect(obj, data_cfg)
    _check_null_columns(obj, kind, where, data_cfg)
    if kind is None:
        rows = [k for k, v in obj.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
        # a chat under a name of its own (lmsys-chat-1m's 'conversation'): no setting names a chat's field
        chats = [(k, "from" in obj[k][0]) for k in rows if all("role" in m or "from" in m for m in obj[k])]
        if chats and "chosen" not in obj:
            hint = (f"; its '{chats[0][0]}' holds a chat's {'ShareGPT turns' if chats[0][1] else 'messages'}: name "
                    f"that field '{'conversations' if chats[0][1] else 'messages'}', which no setting renames")
        else:
            hint = "; set data.format and the field names" + (
                _PREFERENCE_HINT if "chosen" in obj else
                f"; its '{rows[0]}' holds a list of {len(obj[rows[0]])} objects: if those are the examples, give that "
                f"list itself (a JSON array) or JSON Lines" if rows else "")
        raise UserError(f"{where}: no 'messages', 'prompt'/'completion', 'conversations', "
                        f"'{data_cfg.instruction_field}' or '{data_cfg.text_field}' field (the example has "
                        f"{_fields(obj)}{hint})")
    column = {"messages": "messages", "sharegpt": "conversations"}.get(kind)
    if column and column not in obj:  # data.format forced onto a row of another shape
        raise UserError(f"{where}: no '{column}' field for data.format={kind} (the example has "
                        f"{_fields(obj)}; data.format=auto tells the shapes apart "
                        f"by their keys)")
    if kind == "messages":
        return normalise_messages(obj, where, markup)
    if kind == "prompt_completion":
        return normalise_prompt_completion(obj, where, markup)
    if kind == "sharegpt":
        return normalise_sharegpt(obj, where, markup)
    if kind == "text":
        return normalise_text(obj, where, data_cfg.text_field)
    return normalise_instruction(obj, where, data_cfg.instruction_field, data_cfg.context_field,
                                 data_cfg.response_field, markup)


# where chat exports put a model's reasoning beside its answer (DeepSeek-R1 / vLLM, OpenRouter, others)
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def _reasoning(obj: Any) -> str | None:
    """`messages[i].KEY` of the first message of a row that carries non-empty reasoning, else None."""
    if not isinstance(obj, dict):
        return None
    for column in ("messages", "conversations", "prompt", "completion"):
        messages = obj.get(column)
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            for key in REASONING_KEYS if isinstance(m, dict) else ():
                if m.get(key) not in (None, "", [], {}):
                    return f"{column}[{i}].{key}"
    return None


def _why_no_rows(path: str | Path) -> str:
    """What a file without rows holds: a file of blank lines was called an "empty file" by a user looking at lines."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return "empty file"
    if not head:
        return "empty file"
    if not str(path).endswith(".gz") and not head.strip():
        return "only blank lines"
    return "no rows in it"


def load_conversations(path: str | Path, data_cfg, markup: Markup = GEMMA_MARKUP,
                       limit: int | None = None) -> list[dict]:
    """All examples of a file as normalised conversations; an empty file is an error. `markup`: the control
    tokens message text must not hold (`Renderer.markup` for the model's tokenizer; Gemma 3's by default).
    `limit`: the first N examples only; the rows after them are not read (evaluate --limit 5 of a large file read
    and checked every row, and a bad row past the fifth refused the run).
    Reasoning beside an answer (`reasoning_content`, R1-style exports) is not rendered: said once per file (it was
    dropped like any unknown key, without a word)."""
    out = []
    reasoning: list[str] = []
    for lineno, obj in iter_raw(path) if limit is None or limit > 0 else ():
        out.append(normalise_row(obj, f"{path}:{lineno}", data_cfg, markup))
        found = _reasoning(obj)
        if found:
            reasoning.append(f"{path}:{lineno}: {found}")
        if limit is not None and len(out) >= limit:
            break  # before the next row is parsed
    if not out:
        raise UserError(f"{path}: no examples ({_why_no_rows(path)})")
    texts = [c["where"] for c in out if "text" in c]
    if texts and len(texts) < len(out):  # a pretraining shard concatenated to a chat set, or one chat row missing
        log.warning("%s: %d of %d examples are language-modeling rows (a '%s' field and none of a chat's: the first "
                    "is %s), trained on every token without chat markup, beside %d chats; if that is not meant, fix "
                    "those rows or set data.format", path, len(texts), len(out), data_cfg.text_field, texts[0],
                    len(out) - len(texts))
    if reasoning:
        log.warning("%s: %d of %d examples carry a model's reasoning beside an answer (first: %s); it is left out "
                    "of the rendered text, so not trained (a message renders its content and tool calls): to train on "
                    "it, put it in the content", path, len(reasoning), len(out), reasoning[0])
    return out
