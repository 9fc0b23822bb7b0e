"""Read examples (JSONL, JSON or Parquet) and normalise them into conversations.

Every example becomes `{"messages": [...], "tools": [...] | None}`; instruction pairs (Dolly
columns by default) become a user turn and an assistant turn. Problems are reported as
`FILE:LINE: what is wrong`, so a user can jump to the bad line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from gemma_tpu.errors import UserError

ROLES = ("system", "developer", "user", "assistant", "tool")


def iter_raw(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each example of a .jsonl/.json/.parquet file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"data file not found: {p}")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover
            raise UserError(f"{p}: reading Parquet needs pyarrow") from None
        try:
            table = pq.read_table(p)
        except Exception as e:
            raise UserError(f"{p}: not a readable Parquet file ({e})") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    text = p.read_text(encoding="utf-8", errors="strict") if p.stat().st_size < (1 << 31) else None
    if suffix == ".json" and text is not None and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
        for i, row in enumerate(items, start=1):
            yield i, row
        return
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise UserError(f"{where}: only text content parts are supported, got {part!r:.60}")
        return "".join(parts)
    if isinstance(content, (dict, int, float, bool)):
        return json.dumps(content, ensure_ascii=False)
    raise UserError(f"{where}: content must be a string, got {type(content).__name__}")


def _tool_names(tools: Any, where: str) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise UserError(f"{where}: 'tools' must be a list of function declarations")
    names = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise UserError(f"{where}: each tool needs a function name, got {t!r:.80}")
        names.append(fn["name"])
    return names


def normalise_messages(obj: dict, where: str) -> dict:
    """Validate a chat example: roles, contents, tool calls against declared tools."""
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list")
    tools = obj.get("tools")
    names = _tool_names(tools, where)
    out = []
    for i, m in enumerate(messages):
        mw = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise UserError(f"{mw}: expected an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise UserError(f"{mw}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), mw)}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise UserError(f"{mw}: tool_calls must be a list")
            norm_calls = []
            for j, c in enumerate(calls):
                fn = c.get("function", c) if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise UserError(f"{mw}.tool_calls[{j}]: needs function.name")
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise UserError(f"{mw}.tool_calls[{j}]: arguments is not a JSON object") from None
                if not isinstance(args, dict):
                    raise UserError(f"{mw}.tool_calls[{j}]: arguments must be an object")
                if names and fn["name"] not in names:
                    raise UserError(f"{mw}.tool_calls[{j}]: calls {fn['name']!r}, which is not in 'tools' "
                                    f"({', '.join(names)})")
                if not names:
                    raise UserError(f"{mw}.tool_calls[{j}]: calls {fn['name']!r} but the example declares no 'tools'")
                norm_calls.append({"name": fn["name"], "arguments": args})
            if not msg["content"] and not norm_calls:
                raise UserError(f"{mw}: assistant message has neither content nor tool_calls")
            if norm_calls:
                msg["tool_calls"] = norm_calls
        elif role == "tool":
            msg["name"] = m.get("name") or m.get("tool_call_id") or ""
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise UserError(f"{where}: no assistant message to learn from")
    return {"messages": out, "tools": tools if names else None}


def normalise_instruction(obj: dict, where: str, instruction: str, context: str | None, response: str) -> dict:
    for field in (instruction, response):
        if field not in obj:
            raise UserError(f"{where}: missing field '{field}' (data.instruction_field / data.response_field)")
        if not isinstance(obj[field], str):
            raise UserError(f"{where}: field '{field}' must be a string")
    prompt = obj[instruction]
    ctx = obj.get(context) if context else None
    if ctx:
        prompt = f"{prompt}\n\n{ctx}"
    if not obj[response].strip():
        raise UserError(f"{where}: field '{response}' is empty")
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": obj[response]}],
            "tools": None}


def load_conversations(path: str | Path, data_cfg) -> list[dict]:
    """All examples of a file as normalised conversations; an empty file is an error."""
    out = []
    fmt = data_cfg.format
    for lineno, obj in iter_raw(path):
        where = f"{path}:{lineno}"
        if not isinstance(obj, dict):
            raise UserError(f"{where}: expected a JSON object per line")
        kind = fmt
        if kind == "auto":
            kind = "messages" if "messages" in obj else "instruction" if data_cfg.instruction_field in obj else None
            if kind is None:
                raise UserError(f"{where}: neither 'messages' nor '{data_cfg.instruction_field}' present "
                                f"(set data.format and the field names)")
        if kind == "messages":
            out.append(normalise_messages(obj, where))
        else:
            out.append(normalise_instruction(obj, where, data_cfg.instruction_field, data_cfg.context_field,
                                             data_cfg.response_field))
    if not out:
        raise UserError(f"{path}: no examples (empty file)")
    return out
