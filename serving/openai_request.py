"""Checking an OpenAI chat-completion request before a server acts on it.

`transformers serve` answers many malformed requests with `500 Internal Server Error` (no messages, a
negative `max_tokens`, tool-call arguments that are not JSON, a content part without a type), ignores
others silently (`n`, `max_completion_tokens`, `logprobs`, `response_format`, `tool_choice` naming an
undeclared tool, the legacy `functions` / `function_call`, `presence_penalty`) and generates
past the model's context when asked. `check_chat_request` refuses what vLLM and the OpenAI API refuse,
with a message naming the field, and returns the body with `max_tokens` set (from
`max_completion_tokens`, or what the context leaves when neither is given). Standard library only, but
for the tool-declaration check it shares with training data (`gemma_tpu.formats.function_calling`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from gemma_tpu.core import strict_json
from gemma_tpu.core.errors import UserError
from gemma_tpu.formats.function_calling import TOOL_NAME, DeclarationError, check_call_arguments, check_tools

ROLES = ("system", "developer", "user", "assistant", "tool")
# where a server's context comes from (vLLM's --max-model-len, which a serving config's server.max_model_len sets)
CONTEXT_SOURCE = "the model's max_position_embeddings, or server.max_model_len when smaller"


class RequestError(ValueError):
    """A request the server refuses (HTTP 400); `param` names the field."""

    def __init__(self, param: str | None, message: str):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


# OpenAI's integer fields; vLLM (pydantic) takes an integral float there as the integer (`"max_tokens": 5.0`)
_INTEGERS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens", "top_logprobs", "best_of")


def _whole_numbers(body: dict) -> dict:
    """`body` with each integer field given as an integral float (5.0) as that integer (5), as vLLM reads it: it
    was refused as "not a whole number"; 5.5 still is."""
    fix = {k: int(v) for k in _INTEGERS if isinstance(v := body.get(k), float) and v.is_integer()}
    return {**body, **fix} if fix else body


def _text_parts(content: Any, where: str) -> None:
    """`content` a string, or a list of text parts (this is a text model)."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(where, f"expected a string or a list of text parts, got {_json_type(content)}")
    if not content:  # OpenAI refuses an empty array; it passed, and the model answered a turn holding nothing
        raise RequestError(where, "an empty list of parts: send at least one text part (or a string)")
    for k, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(f"{where}[{k}]", 'expected an object with a "type"')
        if part["type"] not in ("text", "input_text", "output_text"):
            raise RequestError(f"{where}[{k}].type", f"{part['type']!r} is not supported: this model reads text only")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{k}].text", "expected a string")


def _arguments(raw: Any, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise RequestError(where, "expected a JSON object as a string")
    try:
        value = strict_json.loads_finite(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError(where, f"not valid JSON ({e.msg} at character {e.pos})") from None
    except strict_json.NotJSON as e:  # rendered into the prompt as Infinity / NaN
        raise RequestError(where, str(e)) from None
    except RecursionError:
        raise RequestError(where, "nested too deeply") from None
    if not isinstance(value, dict):
        twice = isinstance(value, str) and value.lstrip().startswith("{")  # json.dumps of json.dumps, as the data
        raise RequestError(where, f"expected a JSON object, got {raw[:80]!r}" + (  # reader says it too
            " (JSON text encoded twice: decode it once)" if twice else ""))
    return value


def _message(m: Any, i: int) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(where, "expected an object")
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    if m.get("name") is not None and not isinstance(m["name"], str):  # vLLM and OpenAI refuse it (400)
        raise RequestError(f"{where}.name", f"expected a string, got {_json_type(m['name'])}")
    content = m.get("content")
    calls = m.get("tool_calls")
    if role == "assistant":
        if content is not None and (content != [] or not calls):  # [] beside tool_calls: no text, as null says
            _text_parts(content, f"{where}.content")
        if calls is not None:
            if not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls", "expected a list")
            for k, c in enumerate(calls):
                cw = f"{where}.tool_calls[{k}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise RequestError(cw, 'expected an object with a "function" object')
                if not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise RequestError(f"{cw}.function.name", "expected a non-empty string")
                _tool_name(fn["name"], f"{cw}.function.name")
                args = _arguments(fn.get("arguments", "{}"), f"{cw}.function.arguments")
                try:  # the template writes the call as the renderer does: a key with ':' or a value holding
                    # <escape> read back as another call (training data refuses them, `format_call`)
                    check_call_arguments(args, "arguments")
                except UserError as e:
                    at, detail = str(e).split(": ", 1)
                    raise RequestError(f"{cw}.function.{at}", detail) from None
                if "id" in c and not isinstance(c["id"], str):
                    raise RequestError(f"{cw}.id", "expected a string")
                ids = [d.get("id") for d in calls[:k] if isinstance(d, dict)]
                if c.get("id") is not None and c["id"] in ids:  # one result answered both, under the later's name
                    raise RequestError(f"{cw}.id", f"{c['id']!r} is also the id of tool_calls[{ids.index(c['id'])}]: "
                                                   f"each call of a turn needs its own id")
        if content is None and not calls:
            raise RequestError(f"{where}.content", "an assistant message needs content or tool_calls")
        return
    if calls is not None:
        raise RequestError(f"{where}.tool_calls", f"only assistant messages carry tool calls, not {role!r}")
    if content is None:
        raise RequestError(f"{where}.content", "missing")
    _text_parts(content, f"{where}.content")
    if role == "tool":  # text parts are rendered joined (`{"steps": 5, ` and `"steps": 6}` one JSON result)
        _result_json(content if isinstance(content, str) else "".join(p["text"] for p in content), f"{where}.content")
    if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
        raise RequestError(f"{where}.tool_call_id", "expected a string")
    if role == "tool" and m.get("name"):  # the template writes it as the response's name
        _tool_name(m["name"], f"{where}.name")


def _result_json(content: str, where: str) -> None:
    """Refuse a tool result the data reader refuses in a row (`strict_json.lenient_only`): a key given twice (the
    template renders both, Python's reader keeps the last), NaN, Infinity or a number past a 64-bit float, bare or
    inside an object (the template renders `{r:NaN}`, `{result:Infinity}`, as vLLM would with it: a result no
    training row can hold, and no JSON tool writes). Anything that is not JSON is the result's text, rendered as
    written."""
    problem = strict_json.lenient_only(content)
    if problem is not None:
        raise RequestError(where, f"the tool result, read as JSON: {problem}")


def _tool_name(name: str, where: str) -> None:
    """A name an earlier call or a tool result gives, as a declaration's must be (`TOOL_NAME`): the template wrote
    `call:get weather{}` or `response:天气{...}` into the prompt, a call no declaration could have taught (a name the
    model's call text cannot carry back)."""
    if not TOOL_NAME.fullmatch(name):
        raise RequestError(where, f"{name[:80]!r} is not a tool name (1 to 64 letters, digits, '_', '.' or '-', not "
                                  f"starting with '.' or '-')")


def _tools(tools: Any) -> list[str]:
    """The declared names; the declarations checked by the one check training rows also pass (`check_tools`)."""
    try:
        return check_tools(tools)
    except DeclarationError as e:
        raise RequestError(e.path, e.detail) from None


def _tool_choice(choice: Any, names: list[str]) -> None:
    if choice is None or choice == "none":
        return
    if not names:  # as OpenAI and vLLM refuse it: the client believes the model may call tools it was never shown
        raise RequestError("tool_choice", f"{json.dumps(choice)[:80]} needs tools; this request declares none")
    if choice == "auto":
        return
    if choice == "required":
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or choice.get("type", "function") != "function":
        raise RequestError("tool_choice", 'expected "none", "auto", "required" or '
                                          '{"type": "function", "function": {"name": ...}}')
    if fn["name"] not in names:
        raise RequestError("tool_choice.function.name", f"{fn['name']!r} is not among the declared tools "
                                                        f"({', '.join(names) or 'none'})")


def _range(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> None:
    v = body.get(key)
    if v is None:
        return
    if not _is_number(v) or v > hi or (v <= lo if lo_open else v < lo):
        raise RequestError(key, f"{v!r} is not a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")


def _settings(body: dict, vocab_size: int | None, check_generation_config, chat: bool = False) -> None:
    """The generation settings chat and text completions share (`chat`: a chat completion's)."""
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            raise RequestError(key, f"{v!r} is not a whole number of at least 1")
    for key in ("user", "request_id"):  # vLLM (and OpenAI: its user) refuse another type (400)
        if body.get(key) is not None and not isinstance(body[key], str):
            raise RequestError(key, f"expected a string, got {_json_type(body[key])}")
    if body.get("n") is not None and (not _is_int(body["n"]) or body["n"] != 1):
        raise RequestError("n", f"{body['n']!r}: this server returns one choice (n=1)")
    # fields transformers serve accepts and ignores, where ignoring them breaks what the client relies on
    # a text completion's `logprobs` is a count, and 0 still asks for the chosen token's log probability (OpenAI,
    # vLLM); a chat completion's is true/false, and vLLM reads 0 there as false (it was refused as asking for them).
    # Either, asked for, came back without any
    lp = body.get("logprobs")
    asked = lp is True or (_is_int(lp) and not (chat and lp == 0))
    if asked or body.get("top_logprobs"):
        raise RequestError("logprobs" if asked else "top_logprobs",
                           "log probabilities are not returned by this server")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError("response_format", f"only {{\"type\": \"text\"}} is supported here (no constrained "
                                              f"JSON output), got {json.dumps(fmt)[:80]}")
    for key in ("stream", "parallel_tool_calls"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise RequestError(key, "expected true or false")
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):  # OpenAI's and vLLM's rule; the usage chunk it asks for never comes otherwise
            raise RequestError("stream_options", "is only allowed with \"stream\": true")
        if not isinstance(options, dict):
            raise RequestError("stream_options", "expected an object such as {\"include_usage\": true}")
        for key in ("include_usage", "continuous_usage_stats"):
            if options.get(key) is not None and not isinstance(options[key], bool):
                raise RequestError(f"stream_options.{key}", "expected true or false")
        if options.get("continuous_usage_stats"):  # vLLM's extension: taken and ignored, each chunk's usage null
            raise RequestError("stream_options.continuous_usage_stats", "usage on every chunk is not counted by this "
                                                                        "server (vLLM counts it): leave it out, and "
                                                                        "read the usage of the last chunk "
                                                                        "(include_usage)")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("stop", "expected a string or a list of strings")
    if stop == "" or isinstance(stop, list) and "" in stop:  # vLLM's SamplingParams._verify_args refuses it (400)
        raise RequestError("stop", "stop cannot contain an empty string (it would end every answer at once): leave "
                                   "it out")
    # [0, 2] as OpenAI's, and vLLM's since v0.24 (SamplingParams._verify_args, vllm-project/vllm#44965): the pinned
    # vllm-tpu 0.27 answers 400 above 2 too, so a temperature of 3 that passed here would fail on the TPU VM
    _range(body, "temperature", 0.0, 2.0)
    _range(body, "top_p", 0.0, 1.0, lo_open=True)
    _range(body, "frequency_penalty", -2.0, 2.0)
    if body.get("frequency_penalty") is not None and body["frequency_penalty"] <= -1:
        raise RequestError("frequency_penalty", f"{body['frequency_penalty']!r}: this server applies it as a "
                                                f"repetition penalty of 1 + value, which must be positive: use a "
                                                f"value above -1")
    _range(body, "presence_penalty", -2.0, 2.0)
    if body.get("presence_penalty"):  # transformers' generate has no such penalty: it was silently dropped
        raise RequestError("presence_penalty", f"{body['presence_penalty']!r}: the local server cannot apply a "
                                               f"presence penalty (vLLM can); send 0 or leave it out, or use "
                                               f"repetition_penalty")
    if body.get("seed") is not None and not (_is_int(body["seed"]) and -2**63 <= body["seed"] < 2**63):
        raise RequestError("seed", f"{body['seed']!r} is not a whole number in [-2^63, 2^63)")
    bias = body.get("logit_bias")  # a bias past [-100, 100] is taken at the bound (`_normalise_settings`)
    if bias is not None and not (isinstance(bias, dict) and all(
            re.fullmatch(r"\d+", str(k)) and _is_number(v) for k, v in bias.items())):
        raise RequestError("logit_bias", "expected an object of token ids to numbers (-100 to 100)")
    long = next((str(k) for k in bias or () if len(str(k)) > 20), None)
    if long is not None:  # int() refuses over 4,300 digits (a ValueError: a bare 500), and no vocabulary is so large
        raise RequestError("logit_bias", f"key {long[:12]}... ({len(long)} digits) is not a token id")
    if bias and vocab_size and any(int(k) >= vocab_size for k in bias):
        raise RequestError("logit_bias", f"token id {max(int(k) for k in bias)} is past the vocabulary "
                                         f"({vocab_size} tokens)")
    for key in ("chat_template_kwargs",):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise RequestError(key, "expected an object")
    for key in _TEMPLATE_OWN:  # were "the chat template refused the conversation (TypeError: got multiple values...)"
        if key in (body.get("chat_template_kwargs") or {}):
            raise RequestError(f"chat_template_kwargs.{key}", _TEMPLATE_OWN[key])
    gen = body.get("generation_config")
    if gen is not None:
        try:
            parsed = json.loads(gen) if isinstance(gen, str) else None
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise RequestError("generation_config", "expected a JSON object as a string")
        if check_generation_config:
            check_generation_config(parsed)


_OWN = "the server passes it to the chat template itself"
# apply_chat_template's own arguments, which the server sets (and the template's `messages`): a request's
# chat_template_kwargs may not give them again or replace the served template (vLLM refuses `chat_template` there too,
# unless started with --trust-request-chat-template)
# vLLM's `add_generation_prompt` / `continue_final_message`, as the chat rendering is to end the prompt, carried in
# chat_template_kwargs under this key ("continue": the final message is continued; "closed": the conversation ends
# closed, no generation prompt) and made apply_chat_template's own arguments again by `prompt_end_arguments`
PROMPT_END_KWARG = "_gemma_tpu_prompt_end"
_TEMPLATE_OWN = {"messages": f"{_OWN}; send the conversation as the request's messages",
                 PROMPT_END_KWARG: "set by the server from add_generation_prompt and continue_final_message; send "
                                   "those",
                 "conversation": f"{_OWN}; send the conversation as the request's messages",
                 "tools": f"{_OWN}; send the declarations as the request's tools",
                 "chat_template": "a request may not replace the served model's chat template",
                 # transformers lets these kwargs replace the tokenizer's own in the template: bos_token "x" began the
                 # prompt with 'x' after the <bos> the server adds, a text the model never saw in training
                 **{k: "the served tokenizer's own special token, which the server passes to the chat template"
                    for k in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")},
                 **{k: _OWN for k in ("documents", "add_generation_prompt", "continue_final_message", "tokenize",
                                      "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs", "load_audio_from_video")}}


# vLLM's request extensions (its ChatCompletionRequest / CompletionRequest fields) at the value this server behaves
# as: clients built for vLLM send them at their defaults (`skip_special_tokens: true`, `add_generation_prompt: true`,
# `echo: false`), which vLLM takes and this server refused as unexpected fields. Dropped, as they change nothing here;
# another value is refused by name (transformers serve reads none of them). A chat completion's prompt end is read
# before (`_prompt_end`).
_VLLM_AT_DEFAULT = {"echo": False, "add_generation_prompt": True, "continue_final_message": False,
                    "skip_special_tokens": True, "spaces_between_special_tokens": True,
                    "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
                    "stop_token_ids": [], "bad_words": [], "priority": 0, "return_tokens_as_token_ids": False,
                    "return_token_ids": False}


def _prompt_end(body: dict) -> None:
    """vLLM's `continue_final_message: true` (the model continues the final message, TRL's continue rows and
    prefilled answers) and `add_generation_prompt: false` (the conversation rendered closed) put into
    chat_template_kwargs for the chat rendering (`PROMPT_END_KWARG`); at their defaults they are dropped. As in
    vLLM, continuing needs `add_generation_prompt: false` beside it (vLLM's template call refuses the pair)."""
    given = {k: body.pop(k) for k in ("add_generation_prompt", "continue_final_message") if k in body}
    for key, value in given.items():
        if not isinstance(value, bool):
            raise RequestError(key, f"{json.dumps(value)[:80]} is not true or false")
    if given.get("continue_final_message") and given.get("add_generation_prompt", True):
        raise RequestError("continue_final_message", "true needs add_generation_prompt: false beside it (the "
                                                     "final message is continued, no new turn is opened), as vLLM "
                                                     "needs it")
    end = "continue" if given.get("continue_final_message") else (
        "closed" if given.get("add_generation_prompt") is False else None)
    if end is None:
        return
    if body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict):
        raise RequestError("tool_choice", f"{json.dumps(body['tool_choice'])[:80]} is forced at a generation prompt; "
                                          "this server cannot force it where the prompt continues or ends closed "
                                          "(add_generation_prompt: false): send tool_choice \"auto\"")
    body["chat_template_kwargs"] = {**(body.get("chat_template_kwargs") or {}), PROMPT_END_KWARG: end}


def prompt_end_arguments(kwargs: dict) -> dict:
    """chat_template_kwargs with the server's `PROMPT_END_KWARG` made apply_chat_template's own
    `add_generation_prompt` / `continue_final_message` (they override the caller's generation prompt)."""
    kwargs = dict(kwargs)
    end = kwargs.pop(PROMPT_END_KWARG, None)
    if end is not None:
        kwargs.update(add_generation_prompt=False, continue_final_message=end == "continue")
    return kwargs


def _vllm_defaults(body: dict, chat: bool) -> None:
    """Drop the vLLM extensions `body` gives at the value this server behaves as (`_VLLM_AT_DEFAULT`); refuse one
    at another value, naming it. `add_special_tokens` is vLLM's false for a chat completion (the template writes
    <bos>) and true for a text completion (the tokenizer adds it), as this server tokenizes them."""
    for key, default in {**_VLLM_AT_DEFAULT, "add_special_tokens": not chat}.items():
        if key not in body:
            continue
        value = body[key]
        same = value == default and type(value) is type(default) or (
            isinstance(default, float) and _is_number(value) and value == default)
        if not same:
            raise RequestError(key, f"{json.dumps(value)[:80]}: vLLM reads it; this server serves only its default "
                                    f"({json.dumps(default)}): leave it out, or send the request to vLLM")
        del body[key]


def _include_reasoning(body: dict) -> None:
    """vLLM's `include_reasoning` (default true): false leaves a thinking model's thought out of the answer, whole and
    streamed, as vLLM leaves it out (the server drops it: `ReasoningName`, `whole_completion`); kept in the body only
    when false."""
    if "include_reasoning" not in body:
        return
    if not isinstance(body["include_reasoning"], bool):
        raise RequestError("include_reasoning", f"expected true or false, got {json.dumps(body['include_reasoning'])}")
    if body["include_reasoning"]:
        del body["include_reasoning"]


MIN_TEMPERATURE = 0.01  # vLLM's least temperature above 0 (SamplingParams raises a smaller one to it)


def _normalise_settings(body: dict, chat: bool = False) -> None:
    """Spellings OpenAI accepts that transformers serve answered with 500 (an empty stop list, integer biases, a
    temperature of 1e-300); a field given as null is absent, as OpenAI reads it (`"chat_template_kwargs": null` was a
    500), and so is a seed of -1, as vLLM reads it. An empty stop string (it ended every text after its first token
    there), alone or in a list, is refused before this (`_settings`), as vLLM refuses it."""
    for key in [k for k, v in body.items() if v is None]:
        del body[key]
    if body.get("seed") == -1:  # vLLM's "no seed" (SamplingParams: -1 -> None): each answer sampled afresh
        del body["seed"]
    if chat:
        _prompt_end(body)
        _include_reasoning(body)
    _vllm_defaults(body, chat)
    if body.get("stop") == []:
        del body["stop"]
    if body.get("logit_bias"):  # clamped to [-100, 100], as vLLM clamps it (it was refused here, taken there)
        body["logit_bias"] = {str(k): min(100.0, max(-100.0, float(v))) for k, v in body["logit_bias"].items()}
    # a temperature in (0, 0.01) samples at 0.01, as vLLM raises it (SamplingParams: its _MAX_TEMP, against inf or nan
    # logits): 1e-300 sampled here with infinite logits (a 500), and then, below 1e-5, was read as greedy
    if body.get("temperature") is not None and 0 < body["temperature"] < MIN_TEMPERATURE:
        body["temperature"] = MIN_TEMPERATURE


# vLLM's sampling extensions (its clients and `vllm bench` send them; `serving.bench --ignore-eos` too), which
# transformers serve refused with 422 {"detail": "Unexpected fields ..."}: read into its `generation_config`
_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")


def _sampled(body: dict) -> bool:
    """Whether the request asks for sampling: a temperature above 0, or none (vLLM's default of 1, or the model's
    generation_config temperature, which generate fills in; this server answered greedily there unless the model's
    generation_config said `do_sample`, which vLLM does not read). transformers serve applied the temperature but
    sampled only when the model's generation_config.json says `do_sample` (ours, and Gemma's, do not): every
    `temperature: 0.8, seed: N` answer was the greedy one."""
    if body.get("temperature") is not None:
        return body["temperature"] > 0
    return True


def _extensions(body: dict, check_generation_config) -> None:
    """`top_k`, `min_p`, `repetition_penalty`, `min_tokens` and `ignore_eos` (generate `max_tokens` whatever the
    end-of-sequence token says) moved into `generation_config`, after `max_tokens` is resolved; and sampling turned
    on where the request asks for it (see `_sampled`)."""
    given = {k: body.pop(k) for k in _EXTENSIONS if k in body}
    own = json.loads(body["generation_config"]) if body.get("generation_config") else {}
    # transformers serve applies frequency_penalty as repetition_penalty = 1 + value, after the generation_config:
    # OpenAI's 0 ("none") reset a repetition_penalty the request or the model's generation_config gave to 1, and a
    # non-zero one replaced it, where vLLM applies both
    if body.get("frequency_penalty") == 0:
        del body["frequency_penalty"]
    if body.get("frequency_penalty") is not None and ("repetition_penalty" in given or "repetition_penalty" in own):
        raise RequestError("frequency_penalty", "this server applies frequency_penalty as a repetition penalty of "
                                                "1 + value, which would replace the repetition_penalty also given: "
                                                "send one of them")
    sampled = _sampled(body) and "do_sample" not in own
    if not given and not sampled:
        return
    gen: dict[str, Any] = {"do_sample": True} if sampled else {}
    if "top_k" in given:
        v = given["top_k"]
        if not _is_int(v) or v < -1:
            raise RequestError("top_k", f"{v!r} is not a whole number of at least -1 (-1 or 0: no top-k)")
        # 0, not None: transformers fills an unset top_k from the model's generation_config, else its default of 50,
        # so vLLM's "-1: no top-k" sampled from the 50 likeliest tokens; 0 turns the top-k warper off (left out of
        # a greedy request, where transformers warns of a top_k it does not read)
        if v > 0 or sampled or own.get("do_sample"):
            gen["top_k"] = max(v, 0)
    if "min_p" in given:
        if not _is_number(given["min_p"]) or not 0 <= given["min_p"] <= 1:
            raise RequestError("min_p", f"{given['min_p']!r} is not a number in [0, 1]")
        gen["min_p"] = given["min_p"] or None
    if "repetition_penalty" in given:
        if not _is_number(given["repetition_penalty"]) or given["repetition_penalty"] <= 0:
            raise RequestError("repetition_penalty", f"{given['repetition_penalty']!r} is not a positive number")
        gen["repetition_penalty"] = float(given["repetition_penalty"])
    if "min_tokens" in given:
        if not _is_int(given["min_tokens"]) or given["min_tokens"] < 0:
            raise RequestError("min_tokens", f"{given['min_tokens']!r} is not a whole number of at least 0")
        if body.get("max_tokens") is not None and given["min_tokens"] > body["max_tokens"]:
            raise RequestError("min_tokens", f"{given['min_tokens']} is more than max_tokens ({body['max_tokens']})")
        gen["min_new_tokens"] = given["min_tokens"]
    if "ignore_eos" in given:
        if not isinstance(given["ignore_eos"], bool):
            raise RequestError("ignore_eos", "expected true or false")
        if given["ignore_eos"] and body.get("max_tokens") is not None:
            gen["min_new_tokens"] = body["max_tokens"]  # no stop before max_tokens: what ignoring the EOS does
    merged = {**own, **gen}
    if check_generation_config:
        check_generation_config(merged)
    body["generation_config"] = json.dumps(merged)


def _bound(body: dict, context: int | None, prompt: int, field: str, asked: str = "max_tokens") -> None:
    """`max_tokens` (sent as `asked`) bounded by what the context leaves after a prompt of `prompt` tokens (vLLM's
    rule); the default is all of it."""
    if not context:
        return
    if prompt >= context:
        raise RequestError(field, f"the prompt is {prompt} tokens; this server's context is {context} "
                                  f"tokens ({CONTEXT_SOURCE}): shorten the {field}")
    room = context - prompt
    if body.get("max_tokens") is None:
        body["max_tokens"] = room
    elif body["max_tokens"] > room:
        raise RequestError(asked, f"{body['max_tokens']} new tokens after a prompt of {prompt} pass this "
                                  f"server's context of {context} tokens: ask for at most {room}")


def check_chat_request(body: Any, context: int | None = None,
                       count_prompt: Callable[[dict], int] | None = None, vocab_size: int | None = None,
                       check_generation_config: Callable[[dict], None] | None = None) -> dict:
    """The request `body` checked (RequestError otherwise), with `max_tokens` resolved: from
    `max_completion_tokens` when that is given (it wins over `max_tokens`, as in vLLM), and bounded by `context`
    (the model's positions) less the prompt's tokens (`count_prompt(body)`), as vLLM bounds it. `vocab_size` bounds the token ids
    of `logit_bias`; `check_generation_config(obj)` raises RequestError for a `generation_config` the
    server cannot use."""
    if not isinstance(body, dict):
        raise RequestError(None, f"the request body must be a JSON object, got {_json_type(body)}")
    body = _whole_numbers(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "expected a non-empty list of messages")
    open_ids: list | None = None  # the ids of the latest assistant turn's calls (None: no call to answer)
    pending: list[tuple[int, int, Any, Any]] = []  # its calls not answered yet: (message, call, id, name)
    answers: dict[int, tuple[int, int]] = {}  # a tool message without tool_call_id -> the call it answers
    for i, m in enumerate(messages):
        _message(m, i)
        unanswered = [k for _, _, k, _ in pending if k is not None]  # calls without an id: not held to it
        if unanswered and m["role"] != "tool":
            # OpenAI's rule: every call answered before the conversation goes on (the model saw a call with no result)
            raise RequestError(f"messages[{i}]", f"the tool call{'s' if len(unanswered) > 1 else ''} "
                                                 f"{', '.join(map(str, unanswered))} of the assistant message before "
                                                 f"it got no tool message answering it (each call needs one, with "
                                                 f"its tool_call_id)")
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            open_ids = [c.get("id") for c in calls] or None
            pending = [(i, j, c.get("id"), c["function"]["name"]) for j, c in enumerate(calls)]
        elif m["role"] == "tool":
            if open_ids is None:
                raise RequestError(f"messages[{i}].role", "a tool message must answer a preceding assistant "
                                                          "message's tool_calls")
            ref = m.get("tool_call_id")
            if ref is not None and any(open_ids) and ref not in open_ids:
                raise RequestError(f"messages[{i}].tool_call_id", f"{ref!r} names none of the calls of the assistant "
                                                                  f"message before it ({', '.join(map(str, open_ids))})")
            if ref is not None and ref in open_ids and ref not in unanswered:
                raise RequestError(f"messages[{i}].tool_call_id", f"{ref!r} was answered already: one tool message "
                                                                  f"per call")
            if ref is not None:
                pending = [p for p in pending if p[2] != ref]
            elif pending:  # no id: the call of its name, else the calls in order
                call = next((p for p in pending if p[3] == m.get("name")), pending[0])
                pending.remove(call)
                answers[i] = call[:2]
        else:
            open_ids, pending = None, []
    unanswered = [k for _, _, k, _ in pending if k is not None]
    if unanswered and messages[-1]["role"] == "assistant":  # OpenAI refuses it too: the results are what comes next
        raise RequestError(f"messages[{len(messages) - 1}]", f"the conversation ends with tool call"
                                                             f"{'s' if len(unanswered) > 1 else ''} "
                                                             f"{', '.join(map(str, unanswered))} unanswered: send a "
                                                             f"tool message with each call's result after it")
    for key, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(key) is not None:  # transformers serve ignored them: the model saw no declarations at all
            raise RequestError(key, f"the legacy function-calling field is not supported here; send `{instead}` "
                                    f"(and read the calls from message.tool_calls)")
    if body.get("tools") == []:
        # an empty declaration, as clients that always send `tool_choice: "auto"` (and parallel_tool_calls) send a
        # turn without tools: nothing to call, which "auto"/"none" ask for, so all three are dropped, as the Responses
        # path drops them (it was a 400, "needs tools"). OpenAI (and vLLM since it refuses `tools: []`) answer 400, but
        # the answer is the same text either way; a forcing choice still needs tools and is refused below
        body = {k: v for k, v in body.items() if k not in ("tools", "parallel_tool_calls") and not (
            k == "tool_choice" and v in ("auto", "none"))}
    names = _tools(body["tools"]) if body.get("tools") is not None else []
    _tool_choice(body.get("tool_choice"), names)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError("model", "expected a string")
    _settings(body, vocab_size, check_generation_config, chat=True)
    if body.get("parallel_tool_calls") is not None and not names:
        raise RequestError("parallel_tool_calls", "is only allowed with tools; this request declares none")
    body = dict(body)
    _normalise_settings(body, chat=True)
    # a message as the OpenAI SDK dumps one it returned (`"tool_calls": null`, `"refusal": null`, ...) or with
    # `"tool_calls": []`: transformers serve failed on the null (500) and dropped the content beside the empty list
    body["messages"] = [{k: v for k, v in m.items() if k in ("role", "content") or (
        v is not None and not (k == "tool_calls" and v == []))} for m in body["messages"]]
    # a result without tool_call_id names the call it answers by id (a call without one gets one): transformers serve
    # drops a tool message's `name`, and the chat template, given neither, read the results in order
    body["messages"] = _linked(body["messages"], answers)
    # call arguments given as an object or as an empty string: transformers serve reads a JSON string
    body["messages"] = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(_arguments(
        c["function"].get("arguments", "{}"), ""), ensure_ascii=False)}} for c in m["tool_calls"]]}
                        if m.get("tool_calls") else m for m in body["messages"]]
    asked = body.pop("max_completion_tokens", None)
    field = "max_tokens"
    if asked is not None:  # OpenAI's newer field wins over the deprecated one, as vLLM reads them
        body["max_tokens"], field = asked, "max_completion_tokens"  # an error names the field the client sent
    _bound(body, context, count_prompt(body) if context and count_prompt else 0, "messages", field)
    _extensions(body, check_generation_config)
    return body


def _linked(messages: list[dict], answers: dict[int, tuple[int, int]]) -> list[dict]:
    """`messages` with `tool_call_id` on each tool message of `answers` (message -> (assistant message, call)),
    and an id (`call_<message>_<call>`) on the calls those answer that had none."""
    if not answers:
        return messages
    out = [dict(m) for m in messages]
    for i, (a, j) in answers.items():
        calls = out[a]["tool_calls"] = [dict(c) for c in out[a]["tool_calls"]]
        if not isinstance(calls[j].get("id"), str):
            calls[j]["id"] = f"call_{a}_{j}"
        out[i]["tool_call_id"] = calls[j]["id"]
    return out


# a text completion's max_tokens when the request leaves it out: vLLM's CompletionRequest default (and OpenAI's);
# a chat completion's default is what the context leaves, in both
COMPLETION_MAX_TOKENS = 16


def check_completion_request(body: Any, context: int | None = None,
                             count_prompt: Callable[[str], int] | None = None, vocab_size: int | None = None,
                             check_generation_config: Callable[[dict], None] | None = None) -> dict:
    """A text completion (`/v1/completions`) checked like a chat completion: `prompt` a string (what
    transformers serve reads; a list of one string is that string), the same generation settings, `max_tokens`
    bounded by the context; left out, it is COMPLETION_MAX_TOKENS (given as null: what the context leaves)."""
    if not isinstance(body, dict):
        raise RequestError(None, f"the request body must be a JSON object, got {_json_type(body)}")
    body = _whole_numbers(body)
    if "max_tokens" not in body:  # vLLM's and OpenAI's default: it ran on to the end of the context
        body = {**body, "max_tokens": COMPLETION_MAX_TOKENS}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        body = {**body, "prompt": prompt[0]}  # a batch of one, as LangChain and the SDK's list form send it
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise RequestError("prompt", f"a batch of {len(prompt)} prompts: this server completes one prompt a "
                                     f"request; send them one by one")
    elif isinstance(prompt, list) and prompt and all(
            _is_int(t) or isinstance(t, list) and t and all(_is_int(u) for u in t) for t in prompt):
        raise RequestError("prompt", "token ids: this server completes a text prompt only (vLLM takes token ids); "
                                     "send the text")
    elif not isinstance(prompt, str):
        raise RequestError("prompt", f"expected a string (or a list of one), got {_json_type(prompt)}")
    if body["prompt"] == "":  # vLLM refuses it (400); it was taken, and the model went on from its BOS alone
        raise RequestError("prompt", "is empty: send the text to complete")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError("model", "expected a string")
    # accepted and ignored by transformers serve: the client would read a text without its prompt, or one choice
    # as the best of several
    if body.get("echo"):
        raise RequestError("echo", "this server returns the completion without the prompt (echo is not supported)")
    if body.get("suffix"):  # transformers serve appended it to the text, which the model wrote without seeing it
        raise RequestError("suffix", "this model does not fill in the middle: send the prompt only (vLLM refuses a "
                                     "suffix too)")
    if body.get("best_of") is not None and body["best_of"] != 1:
        raise RequestError("best_of", f"{body['best_of']!r}: this server generates one completion (best_of=1)")
    _settings(body, vocab_size, check_generation_config)
    body = dict(body)
    _normalise_settings(body)
    if body.get("logit_bias"):  # transformers serve applies it to chat completions only, and ignored it here
        gen = json.loads(body["generation_config"]) if body.get("generation_config") else {}
        gen["sequence_bias"] = [[[int(k)], v] for k, v in body.pop("logit_bias").items()]
        body["generation_config"] = json.dumps(gen)
    _bound(body, context, count_prompt(body["prompt"]) if context and count_prompt else 0, "prompt")
    _extensions(body, check_generation_config)
    return body
