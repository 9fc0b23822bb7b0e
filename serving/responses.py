"""The OpenAI Responses API (`POST /v1/responses`) on top of chat completions, for the local server.

`transformers serve` (5.12.1) answers `/v1/responses` with a 500 when not streaming (its usage object misses a
field the pinned `openai` types require), cuts every stream off before `response.completed` for the same reason,
streams when `stream` is absent (OpenAI's default is no stream), never parses a Gemma 3 model's calls, and turns a
bad `max_output_tokens` into an error event inside a 200. `CheckedChatApp` therefore answers `/v1/responses`
itself: `chat_request` turns the request into a chat completion (checked like any other, so a malformed one is a
400 naming the field), the served chat completion (with its FunctionGemma calls already parsed) comes back through
`response_object` as a Response (`message` and `function_call` output items, a thinking model's `reasoning`
as a `reasoning` item before them, as vLLM's reasoning parser gives it; `status` `incomplete` when cut at
`max_output_tokens`). A streamed request streams: `ResponseStream` turns the chat completion's chunks into the
Response's events as they come. Standard library only.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from serving.openai_request import RequestError, _json_type

# vLLM's extensions of the Responses API that are a chat completion's fields too: passed on as they are, and checked
# (applied, or refused naming the field) as a chat completion's
_AS_CHAT = ("top_k", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "ignore_eos",
            "chat_template_kwargs", "skip_special_tokens", "include_stop_str_in_output", "priority")
# fields a chat completion cannot honour, where ignoring them would mislead the client
_REFUSED = {"previous_response_id": "this server keeps no responses: send the whole conversation in `input`",
            "conversation": "this server keeps no conversations: send the whole conversation in `input`",
            "background": "background responses are not supported here",
            "prompt": "this server keeps no prompt templates: send the instructions and input themselves",
            "top_logprobs": "log probabilities are not returned by this server"}
# the Responses API's other fields: read here, or harmless to leave unread (bookkeeping, hints, a text model's
# reasoning settings); `seed` and `stop` as vLLM reads them, and vLLM's `request_id` (the Response's id). Anything
# else is refused, as OpenAI refuses it: read as nothing, a chat completion's `max_tokens` here generated to the end
# of the context
# vLLM's chat extension `include_reasoning` is taken and read as nothing, as vLLM's ResponsesRequest (which has no such
# field) takes it: the Response keeps its reasoning item either way (vllm-project/vllm#56428)
_KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "seed", "stop", "stream", "stream_options", "text", "metadata", "store", "user",
          "safety_identifier", "service_tier", "prompt_cache_key", "reasoning", "truncation", "include",
          "max_tool_calls", "request_id", "include_reasoning", *_REFUSED, *_AS_CHAT}
# the JSON type of the fields read as nothing (or echoed) here, refused when another, as OpenAI refuses it (a
# `metadata: "x"` came back as {}); null is absent
_TYPED = {"text": (dict, "an object"), "metadata": (dict, "an object"), "reasoning": (dict, "an object"),
          "stream_options": (dict, "an object"), "store": (bool, "true or false"),
          "include_reasoning": (bool, "true or false"),
          "parallel_tool_calls": (bool, "true or false"), "max_tool_calls": (int, "a whole number"),
          **{k: (str, "a string") for k in ("truncation", "service_tier", "safety_identifier", "prompt_cache_key",
                                            "request_id")}}
# the fields among them that take one of a fixed set (OpenAI's, which vLLM's request model checks too)
_ONE_OF = {"truncation": ("auto", "disabled"), "service_tier": ("auto", "default", "flex", "scale", "priority")}
_INSTEAD = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
            "response_format": "text.format"}


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


def _messages(inp: Any) -> tuple[list[dict], list[tuple[str, list[str]]]]:
    """The chat messages of `input`, and where each came from: (the input item, the items of its calls)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}], [("input", [])]
    if not isinstance(inp, list) or not inp:
        raise RequestError("input", "expected a string or a non-empty list of input items")
    messages: list[dict] = []
    origins: list[tuple[str, list[str]]] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(where, "expected an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), f"{where}.content")})
            origins.append((where, []))
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise RequestError(f"{where}.{key}", "expected a non-empty string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)  # the text before it, parallel calls: one turn
                origins[-1][1].append(where)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append((where, [where]))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}.call_id", "expected a string")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _content(output, f"{where}.output")})
            origins.append((where, []))
        elif kind == "reasoning":
            continue  # a reasoning model's trace: nothing a Gemma chat template reads
        else:
            raise RequestError(f"{where}.type", f"{kind!r} is not supported (message, function_call, "
                                                f"function_call_output)")
    if not messages:  # reasoning items alone
        raise RequestError("input", "holds no message, function_call or function_call_output item (reasoning items "
                                    "are not read): nothing to answer")
    return messages, origins


_CALL_FIELDS = {"": "", ".function": "", ".function.name": ".name", ".function.arguments": ".arguments", ".id": ".call_id"}


def request_param(param: str | None, body: dict) -> str | None:
    """The field of the Responses request `body` that the chat completion's field `param` (named by an error of the
    chat check) came from: `messages[2].tool_calls[0].function.arguments` -> `input[1].arguments`, `tools[0].function.name`
    -> `tools[0].name`, `max_tokens` -> `max_output_tokens`; `param` itself when there is none."""
    import re

    if param in ("max_tokens", "response_format", "messages"):
        return {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}[param]
    m = re.fullmatch(r"messages\[(\d+)\](.*)", param or "", re.S)
    if m:
        origins = _messages(body.get("input"))[1]
        if isinstance(body.get("instructions"), str):
            origins.insert(0, ("instructions", []))
        i, rest = int(m.group(1)), m.group(2)
        if i >= len(origins):
            return param
        where, calls = origins[i]
        if where in ("instructions", "input"):
            return where  # a string: its role and content are the field itself
        call = re.fullmatch(r"\.tool_calls\[(\d+)\](.*)", rest, re.S)
        if call and int(call.group(1)) < len(calls) and call.group(2) in _CALL_FIELDS:
            return calls[int(call.group(1))] + _CALL_FIELDS[call.group(2)]
        if call and int(call.group(1)) < len(calls) and call.group(2).startswith(".function.arguments."):
            return calls[int(call.group(1))] + call.group(2)[len(".function"):]  # a path inside the arguments
        if rest == ".tool_call_id":
            return where + ".call_id"
        item = body["input"][int(where[len("input["):-1])]
        if rest.startswith(".content") and item.get("type") == "function_call_output":
            return where + ".output" + rest[len(".content"):]
        return where + rest
    tool = re.fullmatch(r"tools\[(\d+)\]\.function(.*)", param or "", re.S)
    tools = body.get("tools")
    if tool and isinstance(tools, list) and int(tool.group(1)) < len(tools) and \
            "function" not in tools[int(tool.group(1))]:
        return f"tools[{tool.group(1)}]{tool.group(2)}"
    if param == "tool_choice.function.name" and "function" not in (body.get("tool_choice") or {}):
        return "tool_choice.name"
    return param


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
        out.append({"type": "function", "function": {k2: t[k2] for k2 in ("name", "description", "parameters", "strict")
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
    for key in body:
        if key not in _KNOWN:
            instead = f": the Responses API names it `{_INSTEAD[key]}`" if key in _INSTEAD else ""
            raise RequestError(key, f"unknown parameter{instead}")
    for key, why in _REFUSED.items():
        if body.get(key):
            raise RequestError(key, why)
    for key, (kind, what) in _TYPED.items():
        v = body.get(key)
        if v is not None and (not isinstance(v, kind) or kind is int and isinstance(v, bool)):
            raise RequestError(key, f"expected {what}, got {_json_type(v)}")
    for key, allowed in _ONE_OF.items():  # it was taken, where OpenAI and vLLM answer 400
        if body.get(key) is not None and body[key] not in allowed:
            raise RequestError(key, f"{body[key]!r} is not one of {', '.join(allowed)}")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) for i in include)):
        raise RequestError("include", "expected a list of strings")
    if any("logprobs" in i for i in include or []):
        raise RequestError("include", _REFUSED["top_logprobs"])
    if "input" not in body:
        raise RequestError("input", "missing")
    messages = _messages(body["input"])[0]
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
    # without tools, "auto"/"none" and parallel_tool_calls say nothing (Responses clients send them by default);
    # a forcing choice still reaches the chat check, which refuses it
    if body.get("tool_choice") is not None and (tools or body["tool_choice"] not in ("auto", "none")):
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("model", "temperature", "top_p", "seed", "stop", "user", *_AS_CHAT) + (
            ("parallel_tool_calls",) if tools else ()):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise RequestError("stream", "expected true or false")
    return chat


def response_object(chat: dict, request: dict, model: str | None, count_tokens: Callable[[str], int] | None = None
                    ) -> dict:
    """The Response for a served chat completion `chat` (its calls already in `tool_calls`); `count_tokens(text)`:
    the tokens of a thought, its usage's reasoning_tokens (0 without it)."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    rid = str(chat.get("id") or f"{time.time_ns()}")
    output: list[dict] = []
    thought = _reasoning(message)
    if thought:  # first, as vLLM's reasoning parser puts it
        output.append(_reasoning_item(thought))
    text = message.get("content")
    if text or not (message.get("tool_calls") or thought):
        output.append(_message_item(text or ""))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        output.append(_call_item(call.get("id"), fn.get("name"), fn.get("arguments") or "{}"))
    return _response(rid, chat.get("created"), output, chat.get("usage") or {}, choice.get("finish_reason"),
                     request, model or chat.get("model"), _reasoning_tokens(output, count_tokens))


def _reasoning_tokens(output: list[dict], count_tokens: Callable[[str], int] | None) -> int:
    """The tokens of the thought in `output`'s reasoning items, as vLLM counts a reasoning parser's (the text's
    tokens, markers apart); 0 without a thought or a counter."""
    text = "".join(c.get("text") or "" for o in output if o["type"] == "reasoning" for c in o["content"])
    return count_tokens(text) if text and count_tokens else 0


def _reasoning(message: dict) -> str:
    """A thinking model's thought in a chat message or delta: transformers serve's `reasoning_content`, or vLLM's
    `reasoning`; "" for none."""
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str) and message[key]:
            return message[key]
    return ""


def _item_id(prefix: str) -> str:
    """An output item's id as vLLM writes it: `prefix` (rs_, msg_, fc_, call_) and a fresh uuid's 32 hex digits
    (its random_uuid); they were the prefix and the served chat completion's id (transformers serve's)."""
    import uuid

    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, status: str = "completed") -> dict:
    """A `reasoning` output item, as vLLM writes a reasoning parser's text (a `reasoning_text` part, no summary)."""
    return {"id": _item_id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"id": _item_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call_id: str | None, name: str | None, arguments: str, status: str = "completed") -> dict:
    """A `function_call` output item: its call_id the chat completion's tool call id (vLLM's tool parser's)."""
    cid = call_id or _item_id("call")
    return {"id": _item_id("fc"), "type": "function_call", "status": status, "call_id": cid, "name": name,
            "arguments": arguments}


def _response(rid: str, created: Any, output: list[dict], usage: dict, finish_reason: str | None, request: dict,
              model: str | None, reasoning_tokens: int = 0) -> dict:
    cut = finish_reason == "length"
    tools = _tools(request.get("tools")) or []
    rid_given = request.get("request_id")  # vLLM's extension: the Response's id, as given
    return {"id": rid_given if isinstance(rid_given, str) else f"resp_{rid}", "object": "response",
            "created_at": int(created or time.time()),
            "model": model, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": request.get("instructions"), "output": output,
            # echoed as vLLM's ResponsesResponse.from_request echoes it: null when the request gives none
            "metadata": request["metadata"] if isinstance(request.get("metadata"), dict) else None,
            "output_text": "".join(c["text"] for o in output if o["type"] == "message" for c in o["content"]),
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "tool_choice": request.get("tool_choice") or "auto",
            "tools": [{"type": "function", **t["function"]} for t in tools],
            "temperature": request.get("temperature"), "top_p": request.get("top_p"),
            "max_output_tokens": request.get("max_output_tokens"),
            # the request's other settings echoed, as vLLM (ResponsesResponse.from_request) echoes them: `text` as
            # given, null when left out (OpenAI writes its default format there, vLLM the request's field)
            "text": request.get("text"),
            "truncation": request.get("truncation") or "disabled", "reasoning": request.get("reasoning"),
            "service_tier": request.get("service_tier") or "auto", "user": request.get("user"),
            "max_tool_calls": request.get("max_tool_calls"), "background": False, "previous_response_id": None,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                      # both counts, as the openai SDK's types require them (a client validating refused it)
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": usage.get("completion_tokens", 0),
                      "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                      "total_tokens": usage.get("total_tokens", 0)}}


class ResponseStream:
    """The events of a streamed Response written as its chat completion streams: `chunk(obj)` for each chat
    chunk (its calls already parsed into `tool_calls` deltas), `finish()` at the end. Text deltas become
    `response.output_text.delta` events as they come (before, the whole answer was generated first); a call
    opens a `function_call` item. The finished Response in `response.completed` holds the same items, ids and
    usage (the chat stream's last chunk carries it)."""

    def __init__(self, request: dict, model: str | None, count_tokens: Callable[[str], int] | None = None):
        self.request, self.model = request, model
        self.count_tokens = count_tokens  # a thought's tokens (`response_object`)
        self.seq = 0
        self.rid: str | None = None
        self.created: Any = None
        self.output: list[dict] = []  # items in the order they opened (finished ones completed)
        self.text_at: int | None = None  # index of the message item still open
        self.thought_at: int | None = None  # index of the reasoning item still open
        self.calls: dict[int, int] = {}  # the chat delta's tool call index -> output index
        self.finish_reason: str | None = None
        self.usage: dict = {}
        self.error: str | None = None  # the chat stream's error event: the generation failed midway

    def _emit(self, kind: str, **fields) -> str:
        event = f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": self.seq, **fields},
                                                      ensure_ascii=False) + "\n\n"
        self.seq += 1
        return event

    def _pending(self) -> dict:
        return {**_response(self.rid or "", self.created, [], {}, None, self.request, self.model),
                "status": "in_progress", "usage": None}

    def _start(self, chunk: dict) -> str:
        if self.rid is not None:
            return ""
        self.rid = str(chunk.get("id") or time.time_ns())
        self.created = chunk.get("created")
        return self._emit("response.created", response=self._pending()) + self._emit(
            "response.in_progress", response=self._pending())

    def _open_thought(self) -> str:
        if self.thought_at is not None:
            return ""
        index = len(self.output)
        item = _reasoning_item("", "in_progress")
        self.output.append(item)
        self.thought_at = index
        return self._emit("response.output_item.added", output_index=index, item={**item, "content": []})

    def _close_thought(self) -> str:
        if self.thought_at is None:
            return ""
        index, self.thought_at = self.thought_at, None
        item = self.output[index]
        item["status"] = "completed"
        return (self._emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=item["content"][0]["text"])
                + self._emit("response.output_item.done", output_index=index, item=item))

    def _open_text(self) -> str:
        if self.text_at is not None:
            return ""
        out = self._close_thought()
        index = len(self.output)
        item = _message_item("", "in_progress")
        self.output.append(item)
        self.text_at = index
        return out + self._emit("response.output_item.added", output_index=index, item={**item, "content": []}) + \
            self._emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []})

    def _close_text(self) -> str:
        if self.text_at is None:
            return ""
        index, self.text_at = self.text_at, None
        item = self.output[index]
        item["status"] = "completed"
        text = item["content"][0]["text"]
        return (self._emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=[])
                + self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                             content_index=0, part=item["content"][0])
                + self._emit("response.output_item.done", output_index=index, item=item))

    def chunk(self, chunk: dict) -> bytes:
        out = self._start(chunk)
        if chunk.get("error") is not None:
            error = chunk["error"]
            self.error = str(error.get("message") or error) if isinstance(error, dict) else str(error)
            return out.encode()
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choice = (chunk.get("choices") or [None])[0]
        if not isinstance(choice, dict):
            return out.encode()
        delta = choice.get("delta") or {}
        thought = _reasoning(delta)
        if thought:
            out += self._close_text() + self._open_thought()
            index = self.thought_at
            self.output[index]["content"][0]["text"] += thought
            out += self._emit("response.reasoning_text.delta", item_id=self.output[index]["id"], output_index=index,
                              content_index=0, delta=thought)
        if delta.get("content"):
            out += self._open_text()
            index = self.text_at
            self.output[index]["content"][0]["text"] += delta["content"]
            out += self._emit("response.output_text.delta", item_id=self.output[index]["id"], output_index=index,
                              content_index=0, delta=delta["content"], logprobs=[])
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            k = tc.get("index", len(self.calls))
            if k not in self.calls:
                out += self._close_thought() + self._close_text()
                self.calls[k] = len(self.output)
                item = _call_item(tc.get("id"), fn.get("name"), "", "in_progress")
                self.output.append(item)
                out += self._emit("response.output_item.added", output_index=self.calls[k], item=item)
            index = self.calls[k]
            if fn.get("arguments"):
                self.output[index]["arguments"] += fn["arguments"]
                out += self._emit("response.function_call_arguments.delta", item_id=self.output[index]["id"],
                                  output_index=index, delta=fn["arguments"])
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return out.encode()

    def finish(self) -> bytes:
        out = self._start({}) + self._close_thought() + self._close_text()
        for index in self.calls.values():
            item = self.output[index]
            item["status"] = "completed"
            item["arguments"] = item["arguments"] or "{}"
            out += self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=item["arguments"])
            out += self._emit("response.output_item.done", output_index=index, item=item)
        if not self.output:  # no text and no call: one empty message, as a finished Response holds
            out += self._open_text() + self._close_text()
        resp = _response(self.rid or "", self.created, self.output, self.usage, self.finish_reason, self.request,
                         self.model, _reasoning_tokens(self.output, self.count_tokens))
        if self.error is not None:  # it ended in `response.completed`, the answer cut short read as whole
            resp.update(status="failed", incomplete_details=None, error={"code": "server_error", "message": self.error})
            return (out + self._emit("response.failed", response=resp)).encode()
        return (out + self._emit("response.completed", response=resp)).encode()

