"""The small OpenAI-compatible client shared by `gemma_tpu.evaluate.run --endpoint` and `serving.chat`.

Standard library only (urllib): JSON requests with one-line errors, the `/v1` base of any URL a user
gives, the served model's name, our normalised messages in OpenAI's shape, and a reply read from
`tool_calls` — or, when a server returns the model's raw text, parsed from the FunctionGemma format
in `content`. The streaming benchmark (serving/bench.py) uses httpx instead.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any

from gemma_tpu.core.errors import UserError
from gemma_tpu.formats.function_calling import ParsedReply, ToolCall, parse_reply, plain_gemma_token_map

log = logging.getLogger("gemma_tpu.infer.openai_client")


class Unreachable(UserError):
    """Nothing answers at the address (connection refused, unknown host, no answer in time)."""


def http_json(url: str, payload: dict | None = None, timeout: float = 300.0, api_key: str | None = None) -> dict:
    """POST `payload` (GET without one) and return the JSON object; failures are one-line UserErrors."""
    data = json.dumps(payload).encode() if payload is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if payload is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode(errors="replace")
            status, ctype = resp.status, resp.headers.get("Content-Type") or "none"
    except urllib.error.HTTPError as e:
        detail = " ".join(e.read().decode(errors="replace").split())[:300]
        raise UserError(f"{url}: HTTP {e.code} ({detail})") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise Unreachable(f"{url}: cannot reach the server ({getattr(e, 'reason', e)})") from None
    return json_object(body, lambda why: UserError(f"{url}: {why}"),
                       f"{describe_body(status, ctype, body)}; is this an OpenAI-compatible server?")


def json_object(text: str, error, context: str | None = None) -> dict:
    """`text` parsed as a JSON object; otherwise `error(reason)` is raised (reason quotes the text, or
    is `context`: what came back, e.g. status and content type)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise error(f"the answer is not JSON but {context}" if context else
                    f"the answer is not JSON ({' '.join(text.split())[:200]!r})") from None
    if not isinstance(obj, dict):
        raise error(f"expected a JSON object, got {text[:200]!r}")
    return obj


def describe_body(status: int, content_type: str, body: str) -> str:
    """`HTTP 200, Content-Type text/html: '<html><head><title>Welcome...'` (what came back, in one line)."""
    text = " ".join(body.split())
    return f"HTTP {status}, Content-Type {content_type}: {text[:120]!r}" if text else \
        f"HTTP {status}, Content-Type {content_type}, an empty body"


def api_base(url: str) -> str:
    """`http://h:p`, `http://h:p/v1` or `.../v1/chat/completions` -> `http://h:p/v1`."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{url!r} is not an http(s) server address (e.g. http://127.0.0.1:8000)")
    url = url.strip().rstrip("/")
    for suffix in ("/chat/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url + "/v1"


def served_model_name(base: str, api_key: str | None = None, timeout: float = 30.0) -> str | None:
    """The first model the server lists, or None when it lists none (or cannot: `transformers
    serve DIR` answers /v1/models from the hub cache only); the request then names no model and a
    server pinned to one model uses it."""
    try:
        models = http_json(f"{base}/models", timeout=timeout, api_key=api_key).get("data") or []
    except Unreachable:  # nothing will work: say so now, in one line
        raise
    except UserError as e:
        log.warning("%s; sending requests without a model name (pass the model name to choose)", e)
        return None
    first = models[0] if models and isinstance(models[0], dict) else {}
    return first.get("id")


def check_reachable(base: str, api_key: str | None = None, timeout: float = 30.0) -> None:
    """Refuse a server that does not answer at all (any HTTP answer, even an error, will do)."""
    try:
        http_json(f"{base}/models", timeout=timeout, api_key=api_key)
    except Unreachable:
        raise
    except UserError:
        pass


def openai_messages(messages: list[dict]) -> list[dict]:
    """Our normalised messages in OpenAI's shape (developer turns sent as system: more servers know it)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            calls = [c.get("function", c) for c in m["tool_calls"]]  # normalised or raw OpenAI shape
            msg["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(
                                      c.get("arguments"), str) else json.dumps(c.get("arguments") or {})}}
                                 for j, c in enumerate(calls)]
        if role == "tool":
            msg["tool_call_id"] = f"call_{i - 1}_0"
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def reply_from_message(message: dict) -> ParsedReply:
    """An OpenAI `choices[0].message` as a ParsedReply: structured calls first, else the content."""
    calls = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        raw = fn.get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) and raw.strip() else (raw or {})
        except json.JSONDecodeError:
            return ParsedReply("format_error", [], str(raw), "tool_calls arguments are not JSON")
        if not isinstance(args, dict) or not fn.get("name"):
            return ParsedReply("format_error", [], str(raw), "tool call without a name or an object of arguments")
        calls.append(ToolCall(fn["name"], args))
    if calls:
        return ParsedReply("call", calls, message.get("content") or "")
    # endpoint text may still carry the markers as a plain Gemma 3 vocabulary's <unusedN> tokens
    return parse_reply(message.get("content") or "", plain_gemma_token_map())


def first_message(resp: dict, url: str) -> dict:
    """`choices[0].message` of a chat completion, or a one-line error naming what came back."""
    try:
        message = resp["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise UserError(f"{url}: unexpected response {json.dumps(resp)[:200]}") from None
    if not isinstance(message, dict):
        raise UserError(f"{url}: unexpected message {json.dumps(message)[:200]}")
    return message
