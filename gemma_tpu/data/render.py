"""Render conversations to token ids and a loss mask, per chat format.

A renderer produces text segments, each marked trainable or not; the whole text is tokenized once
(so ids equal what `apply_chat_template` + the tokenizer give) and a token is loss-bearing when its
characters fall in a trainable segment. Assistant turns are trainable including `<end_of_turn>`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from gemma_tpu.errors import UserError

BOS_ID = 2


@dataclasses.dataclass
class Rendered:
    ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]; True where the token is a training target
    text: str


def _fmt_value(v: Any) -> str:
    """FunctionGemma argument values: strings escaped, numbers/booleans bare, containers recursive."""
    if isinstance(v, str):
        return f"<escape>{v}<escape>"
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_fmt_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_fmt_value(x) for x in v) + "]"
    return f"<escape>{v}<escape>"


def format_call(name: str, args: dict) -> str:
    return f"<start_function_call>call:{name}{_fmt_value(args)}<end_function_call>"


def format_declaration(tool: dict) -> str:
    fn = tool.get("function", tool)
    body = {"description": fn.get("description", "")}
    if fn.get("parameters"):
        body["parameters"] = fn["parameters"]
    return f"<start_function_declaration>declaration:{fn['name']}{_fmt_value(body)}<end_function_declaration>"


def format_response(name: str, content: str) -> str:
    try:
        value = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        value = {"result": content}
    if not isinstance(value, dict):
        value = {"result": value}
    return f"<start_function_response>response:{name}{_fmt_value(value)}<end_function_response>"


def gemma_segments(conv: dict, add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
    """Gemma 3 turns; system/developer text folds into the first user turn; tools in FunctionGemma
    form (declarations in a developer turn, calls and responses inside the model turn)."""
    msgs = list(conv["messages"])
    segs: list[tuple[str, bool]] = []
    preamble = ""
    if msgs and msgs[0]["role"] in ("system", "developer"):
        preamble = msgs.pop(0)["content"]
    tools = conv.get("tools")
    if tools:
        decl = "".join(format_declaration(t) for t in tools)
        segs.append((f"<start_of_turn>developer\n{preamble}{decl}<end_of_turn>\n", False))
        preamble = ""
    in_model_turn = False
    for i, m in enumerate(msgs):
        role = m["role"]
        if role in ("user", "system", "developer"):
            if in_model_turn:
                segs.append(("<end_of_turn>\n", False))
                in_model_turn = False
            text = m["content"]
            if preamble:
                text = f"{preamble}\n\n{text}"
                preamble = ""
            segs.append((f"<start_of_turn>user\n{text}<end_of_turn>\n", False))
        elif role == "assistant":
            if not in_model_turn:
                segs.append(("<start_of_turn>model\n", False))
            body = m["content"] + "".join(format_call(c["name"], c["arguments"]) for c in m.get("tool_calls", []))
            if m.get("tool_calls"):
                # The model ends a call by emitting <start_function_response>; the tool's answer follows.
                segs.append((body + "<start_function_response>", True))
                in_model_turn = True
            else:
                segs.append((body + "<end_of_turn>", True))
                segs.append(("\n", False))
                in_model_turn = False
        elif role == "tool":
            resp = format_response(m.get("name") or "", m["content"])
            # the opening marker was already emitted (and trained) at the end of the call
            segs.append((resp[len("<start_function_response>"):], False))
            in_model_turn = True
    if in_model_turn and add_generation_prompt:
        pass
    elif add_generation_prompt:
        segs.append(("<start_of_turn>model\n", False))
    return segs


class Renderer:
    """Tokenize rendered segments with one tokenizer call, mapping trainable spans to tokens."""

    def __init__(self, tokenizer, chat_format: str = "gemma", loss_on: str = "assistant",
                 token_map: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.loss_on = loss_on
        # Markers the vocabulary lacks (plain Gemma 3 has no FunctionGemma tokens) are mapped onto
        # reserved <unusedN> tokens by text substitution before tokenization.
        self.token_map = token_map or {}
        if chat_format not in ("gemma", "functiongemma"):
            raise UserError(f"data.chat_format {chat_format!r} is not supported (gemma, functiongemma)")

    def segments(self, conv: dict, add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
        return gemma_segments(conv, add_generation_prompt)

    def map_markers(self, text: str) -> str:
        for marker, repl in self.token_map.items():
            text = text.replace(marker, repl)
        return text

    def render(self, conv: dict, add_generation_prompt: bool = False) -> Rendered:
        segs = [(self.map_markers(t), tr) for t, tr in self.segments(conv, add_generation_prompt)]
        text = "".join(t for t, _ in segs)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = [BOS_ID] + list(enc["input_ids"])
        spans, pos = [], 0
        for t, trainable in segs:
            if trainable:
                spans.append((pos, pos + len(t)))
            pos += len(t)
        mask = [self.loss_on == "all"]
        for start, end in enc["offset_mapping"]:
            if self.loss_on == "all":
                mask.append(True)
            else:
                mask.append(any(s <= start < e for s, e in spans) if end > start else False)
        return Rendered(np.asarray(ids, np.int32), np.asarray(mask, bool), text)


FUNCTION_MARKERS = (
    "<start_function_declaration>", "<end_function_declaration>", "<start_function_call>",
    "<end_function_call>", "<start_function_response>", "<end_function_response>", "<escape>",
)


def function_token_map(tokenizer) -> dict[str, str]:
    """Map FunctionGemma markers the vocabulary lacks onto reserved `<unusedN>` tokens, in order.

    FunctionGemma's tokenizer has the markers as real tokens (empty map); the plain Gemma 3
    vocabulary does not, so `<start_function_declaration>` -> `<unused0>` ... `<escape>` -> `<unused6>`.
    The map is recorded in the checkpoint metadata and in the merged tokenizer files.
    """
    vocab = tokenizer.get_vocab()
    mapping, n = {}, 0
    for marker in FUNCTION_MARKERS:
        if marker in vocab:
            continue
        while f"<unused{n}>" not in vocab:
            n += 1
            if n > 10_000:
                return {}
        mapping[marker] = f"<unused{n}>"
        n += 1
    return mapping
