"""A generic tool-calling loop: question -> model reply -> run the called tool -> feed the result back,
until the model answers in words or the call budget is spent.

The model side is a callable, so the same loop drives a local `Generator` (the fitness chat) and any OpenAI-compatible endpoint (`serving.chat`); the tools are a
`Toolset`: the declarations sent with each request, a runner, the system prompt and what each user turn
carries besides the question. Every call of a turn is run, in order ("steps yesterday and today?" is two
calls), and their results answer them in one turn, as the chat template renders parallel calls. A malformed call, an unknown tool, wrong arguments or a tool that raises (its service
down, say) are reported in the returned text, not raised, so a chat session goes on. A turn of several calls naming a
tool the declarations do not is refused whole before any runs; a later call failing says which calls of its turn ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gemma_tpu.core import strict_json
from gemma_tpu.formats.function_calling import ParsedReply

MAX_CALLS = 3  # tool calls per question before the model is stopped

# messages so far -> the model's reply, parsed, and its raw text (shown when it does not parse)
NextReply = Callable[[list[dict]], tuple[ParsedReply, str]]


class ToolCallError(Exception):
    """A call the tools cannot run (unknown tool, arguments of the wrong shape): the loop reports it."""


@dataclasses.dataclass(frozen=True)
class Toolset:
    """The tools a chat offers the model."""

    schemas: list[dict]  # the declarations sent with every request (OpenAI `tools` format)
    call: Callable[[str, dict[str, Any]], Any]  # (name, arguments) -> a JSON-able result; raises ToolCallError
    system_prompt: Callable[[], str] | None = None  # the developer turn, made afresh for each question
    user_turn: Callable[[str], str] | None = None  # question -> the user message (adds context such as the date)


def result_json(result: Any) -> str:
    """Tool results travel as JSON strings in `tool` messages. A NaN or infinite float (the mean of no days) is null,
    named in `nonfinite` (`strict_json.dumps`): json.dumps wrote `NaN`, which is no JSON, and which the data reader
    refuses in a tool result (the generated data held it)."""
    return strict_json.dumps(result, ensure_ascii=False, default=str)  # a date or a Decimal as text, not a crash


def first_messages(question: str, toolset: Toolset) -> list[dict]:
    """The messages a question starts with: the toolset's developer turn, if any, and the user turn."""
    messages = [{"role": "developer", "content": toolset.system_prompt()}] if toolset.system_prompt else []
    messages.append({"role": "user", "content": toolset.user_turn(question) if toolset.user_turn else question})
    return messages


def declared_names(schemas: list[dict]) -> set[str]:
    """The tool names `schemas` declares (OpenAI's `{"type": "function", "function": {...}}` or a flat declaration)."""
    names = set()
    for t in schemas or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def run_tool_loop(question: str, toolset: Toolset, next_reply: NextReply, *, max_calls: int = MAX_CALLS,
                  log: Callable[[str], None] | None = None) -> str:
    """Answer one question; each tool call is traced through `log` (`-> name(arg=...) = {...}`)."""
    log = log or (lambda _text: None)
    messages = first_messages(question, toolset)
    made = 0
    while True:
        reply, raw = next_reply(messages)
        if reply.kind == "format_error":
            return f"(the model produced a malformed tool call: {reply.error}; raw output: {str(raw).strip()[:200]!r})"
        if reply.kind == "text":  # an answer cut at the token limit says so (`cut_short`)
            # the note in brackets: its own text has parentheses ("(raise --max-new-tokens)"), which nested
            return (reply.text or "(the model gave an empty answer)") + (f" [{reply.error}]" if reply.error else "")
        if made + len(reply.calls) > max_calls:
            if not made:  # one turn of parallel calls past the budget: it did not keep calling, it asked too much
                return (f"(the model asked for {len(reply.calls)} tool calls at once, more than the {max_calls} "
                        f"allowed per question; none was run)")
            return f"(the model kept calling tools; stopped after {made} call{'s' if made != 1 else ''})"
        declared = declared_names(toolset.schemas)
        unknown = [c.name for c in reply.calls if declared and c.name not in declared]
        if unknown and len(reply.calls) > 1:  # refused whole, before any runs: not half the turn done, unanswered
            return (f"(the model called unknown tool {unknown[0]} among its {len(reply.calls)} calls of one turn; "
                    f"none was run)")
        results = []
        for i, call in enumerate(reply.calls):
            shown = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
            ran = ("; " + ", ".join(c.name for c in reply.calls[:i]) + f" of the same turn ran first, "
                   f"{'its result' if i == 1 else 'their results'} not used") if i else ""
            try:
                result = toolset.call(call.name, call.arguments)
            except ToolCallError as e:
                log(f"-> {call.name}({shown}): {e}")
                return f"({e}{ran})"
            except Exception as e:  # noqa: BLE001 - a failing tool (service down, a bug) ends the question, not the chat
                what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log(f"-> {call.name}({shown}) failed: {what}")
                return f"(the tool {call.name} failed: {what[:200]}{ran})"
            log(f"-> {call.name}({shown}) = {result_json(result)}")
            results.append({"role": "tool", "name": call.name, "content": result_json(result)})
        made += len(reply.calls)
        messages.append({"role": "assistant", "content": reply.text or "",
                         "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in reply.calls]})
        messages.extend(results)
