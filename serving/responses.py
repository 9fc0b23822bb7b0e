"""The OpenAI Responses API (`POST /v1/responses`) on top of chat completions, for the local server.

`transformers serve` (5.12.1) answers `/v1/responses` with a 500 when not streaming (its usage object misses a
field the pinned `openai` types require), cuts every stream off before `response.completed` for the same reason,
streams when `stream` is absent (OpenAI's default is no stream), never parses a Gemma 3 model's calls, and turns a
bad `max_output_tokens` into an error event inside a 200. `CheckedChatApp` therefore answers `/v1/responses`
itself: `chat_request` turns the request into a chat completion (checked like any other, so a malformed one is a
400 naming the field), the served chat completion (with its FunctionGemma calls already parsed) comes back through
`response_object` as a Response (`message` and `function_call` output items, `status` `incomplete` when cut at
`max_output_tokens`), and `response_events` writes a stream's events from it (the whole text in one delta: the
answer is generated first). Standard library only.
"""

from __future__ import annotations

import json
import time
from typing import Any

from serving.openai_request import RequestError, _json_type

# fields a chat completion cannot honour, where ignoring them would mislead the client
_REFUSED = {"previous_response_id": "this server keeps no responses: send the whole conversation in `input`",
            "conversation": "this server keeps no conversations: send the whole conversation in `input`",
            "background": "background responses are not supported here"}


def _content(content: Any, where: str) -> Any:
    """A Responses message content (a string, or input_text / output_text parts) as chat content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"expected a string or a list of text parts, got {_json_type(content)}")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise RequestError(f"{where}[{k}].type", f"{kind!r} is not supported: this model reads text only")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{k}].text", "expected a string")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _messages(inp: Any) -> list[dict]:
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise RequestError("input", "expected a string or a non-empty list of input items")
    messages: list[dict] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(where, "expected an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise RequestError(f"{where}.{key}", "expected a non-empty string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)  # the text before it, parallel calls: one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}.call_id", "expected a string")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _content(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's trace: nothing a Gemma chat template reads
        else:
            raise RequestError(f"{where}.type", f"{kind!r} is not supported (message, function_call, "
                                                f"function_call_output)")
    return messages


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "expected a list")
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"tools[{k}].type", f"{kind!r} is not supported here (only \"function\" tools)")
        if isinstance(t.get("function"), dict):  # the chat completions shape, sent here by mistake: read it too
            out.append({"type": "function", "function": t["function"]})
            continue
        out.append({"type": "function", "function": {k2: t[k2] for k2 in ("name", "description", "parameters")
                                                      if t.get(k2) is not None}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_request(body: Any) -> dict:
    """The chat completion request that answers a Responses request `body` (RequestError when malformed)."""
    if not isinstance(body, dict):
        raise RequestError(None, f"the request body must be a JSON object, got {_json_type(body)}")
    for key, why in _REFUSED.items():
        if body.get(key):
            raise RequestError(key, why)
    if "input" not in body:
        raise RequestError("input", "missing")
    messages = _messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions", "expected a string")
        messages.insert(0, {"role": "system", "content": instructions})
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    chat: dict[str, Any] = {"messages": messages, "stream": False}
    if fmt is not None:
        chat["response_format"] = fmt  # refused by the chat check unless {"type": "text"}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("model", "temperature", "top_p", "seed", "stop", "parallel_tool_calls"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise RequestError("stream", "expected true or false")
    return chat


def response_object(chat: dict, request: dict, model: str | None) -> dict:
    """The Response for a served chat completion `chat` (its calls already in `tool_calls`)."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    rid = str(chat.get("id") or f"{time.time_ns()}")
    output: list[dict] = []
    text = message.get("content")
    if text or not message.get("tool_calls"):
        output.append({"id": f"msg_{rid}", "type": "message", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": text or "", "annotations": []}]})
    for k, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        cid = call.get("id") or f"call_{rid}_{k}"
        output.append({"id": f"fc_{cid}", "type": "function_call", "status": "completed", "call_id": cid,
                       "name": fn.get("name"), "arguments": fn.get("arguments") or "{}"})
    usage = chat.get("usage") or {}
    cut = choice.get("finish_reason") == "length"
    tools = _tools(request.get("tools")) or []
    return {"id": f"resp_{rid}", "object": "response", "created_at": int(chat.get("created") or time.time()),
            "model": model or chat.get("model"), "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": request.get("instructions"), "output": output,
            "output_text": "".join(c["text"] for o in output if o["type"] == "message" for c in o["content"]),
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "tool_choice": request.get("tool_choice") or "auto",
            "tools": [{"type": "function", **t["function"]} for t in tools],
            "temperature": request.get("temperature"), "top_p": request.get("top_p"),
            "max_output_tokens": request.get("max_output_tokens"),
            "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage.get("completion_tokens", 0),
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage.get("total_tokens", 0)}}


def response_events(resp: dict) -> bytes:
    """The server-sent events of a streamed Response, from the finished one: created, in_progress, each
    output item (a message's text as one delta; a call's arguments as one delta), then `response.completed`
    (its status says `incomplete` when cut short)."""
    seq = 0
    out = []

    def emit(kind: str, **fields) -> None:
        nonlocal seq
        out.append(f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": seq, **fields},
                                                          ensure_ascii=False) + "\n\n")
        seq += 1

    pending = {**resp, "status": "in_progress", "output": [], "output_text": "", "usage": None,
               "incomplete_details": None}
    emit("response.created", response=pending)
    emit("response.in_progress", response=pending)
    for index, item in enumerate(resp["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                         "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)
            if text:
                emit("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                     delta=text, logprobs=[])
            emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                 logprobs=[])
            emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                 part={**part, "text": text})
        else:
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                         "arguments": ""})
            emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                 delta=item["arguments"])
            emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                 name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.completed", response=resp)  # also when incomplete, as vLLM ends it (and the SDK's helper needs)
    return "".join(out).encode()
