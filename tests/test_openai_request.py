"""The local server's request checks (`serving.openai_request`, `serving.local.CheckedChatApp`): malformed chat
completions are 400 with a message naming the field, as OpenAI and vLLM answer, where `transformers serve`
alone answered 500 (no messages, max_tokens 0 or negative, call arguments that are not JSON, a content part
without a type), ignored them (n=2, max_completion_tokens, an undeclared tool_choice) or generated past the
model's context (max_tokens 100000 held the server for minutes)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from serving.openai_request import RequestError, check_chat_request, check_completion_request

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_steps", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body, param, needle", [
    ([1, 2], None, "JSON object, got a list"),
    (None, None, "JSON object, got null"),
    ({}, "messages", "non-empty list"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "'wizard'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or a list of text parts, got a number"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100000}}]}]},
     "messages[0].tool_calls[0].function.arguments", "nested too deeply"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]", '"type"'),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "text only"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "content or tool_calls"),
    # empty-ish input OpenAI refuses, which passed: the model answered a turn holding nothing, or named a call kind
    # that is not one
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "empty list of parts"),
    ({"messages": USER + [{"role": "assistant", "content": []}] + USER}, "messages[1].content", "empty list"),
    ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "allowed", "function": {"name": "get_steps"}}},
     "tool_choice", '{"type": "function"'),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '"{\\"a\\": 1}"'}}]}]},
     "messages[0].tool_calls[0].function.arguments", "(JSON text encoded twice: decode it once)"),
    # read as the data reader reads a row's: 1e999 was rendered into the prompt as Infinity, NaN kept
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"r": 1e999}'}}]}]},
     "messages[0].tool_calls[0].function.arguments", "1e999 is beyond the range of a 64-bit float"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"r": NaN}'}}]}]},
     "messages[0].tool_calls[0].function.arguments", "NaN is not JSON (only finite numbers are)"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"r": 1' + "0" * 4300
                                                                                      + "}"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "a number of 4301 digits (Python reads integers of at most 4300)"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name", "non-empty"),
    # a name no declaration may have: the template wrote `call:get weather{}` / `response:météo{...}` into the prompt
    *[({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": name, "arguments": "{}"}}]}]},
       "messages[0].tool_calls[0].function.name", "is not a tool name") for name in ("météo", "天气", "get weather")],
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]},
                          {"role": "tool", "tool_call_id": "a", "name": "f g", "content": "5"}]},
     "messages[2].name", "'f g' is not a tool name"),
    # a JSON result giving a key twice: the template rendered both, the data reader refuses such a row
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]},
                          {"role": "tool", "tool_call_id": "a", "content": '[{"steps": 5, "steps": 6}]'}]},
     "messages[2].content", "the tool result, read as JSON: key 'steps' appears twice"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]},
                          {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": '{"steps": 5, '},
                                                                            {"type": "text", "text": '"steps": 6}'}]}]},
     "messages[2].content", "the tool result, read as JSON: key 'steps' appears twice"),
    # a result holding NaN, Infinity or 1e999, bare or inside: the template rendered `{r:NaN}`, `{result:Infinity}`
    # (as it does on vLLM), a result the data reader refuses in a row (records._check_tool_result)
    *[({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]},
                            {"role": "tool", "tool_call_id": "a", "content": content}]},
       "messages[2].content", f"the tool result, read as JSON: {needle}")
      for content, needle in (("NaN", "NaN is not JSON"), ("1e999", "1e999 is beyond the range of a 64-bit float"),
                              (' -Infinity', "-Infinity is not JSON"), ('{"r": NaN}', "NaN is not JSON"),
                              ('{"r": {"s": [1, 1e999]}}', "1e999 is beyond"), ("[Infinity]", "Infinity is not JSON"))],
    # two calls of a turn with one id: one result answered both (rendered as the later call's), the other none
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}},
                                                               {"id": "a", "function": {"name": "g"}}]},
                          {"role": "tool", "tool_call_id": "a", "content": "5"}]},
     "messages[1].tool_calls[1].id", "'a' is also the id of tool_calls[0]"),
    # arguments the call text cannot carry: the template wrote call:f{time:zone:<escape>UTC<escape>}, another call
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                 "arguments": '{"time:zone": 1}'}}]}]},
     "messages[0].tool_calls[0].function.arguments", "key 'time:zone' cannot be written in a FunctionGemma call"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"o": {
        "q": ["a", "x<escape>y"]}}}}]}]}, "messages[0].tool_calls[0].function.arguments.o.q[1]", "contains <escape>"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"messages": USER, "max_tokens": -1}, "max_tokens", "at least 1"),
    ({"messages": USER, "max_tokens": "8"}, "max_tokens", "whole number"),
    ({"messages": USER, "max_completion_tokens": 1.5}, "max_completion_tokens", "whole number"),
    ({"messages": USER, "temperature": -1}, "temperature", "[0, 2]"),
    ({"messages": USER, "temperature": 3}, "temperature", "[0, 2]"),
    ({"messages": USER, "top_p": 0}, "top_p", "(0, 1]"),
    ({"messages": USER, "n": 2}, "n", "one choice"),
    ({"messages": USER, "stop": 5}, "stop", "string"),
    ({"messages": USER, "stream": "yes"}, "stream", "true or false"),
    ({"messages": USER, "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"messages": USER, "tools": {"name": "f"}}, "tools", "list"),
    ({"messages": USER, "tools": [{"name": "f"}]}, "tools[0]", "function"),
    # another API's built-in tool: read as a function declaration, "None is not a tool name" in a training row
    ({"messages": USER, "tools": [{"type": "code_interpreter"}]}, "tools[0].type", 'only "function" tools'),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "not a tool name"),
    ({"messages": USER, "tools": [TOOL, TOOL]}, "tools[1].function.name", "twice"),
    # OpenAI refuses these (400); they were taken: strict "yes" as set, a number rendered as the description, a name
    # past OpenAI's 64 characters, one the call parser cannot read back (a call of "-x" came back as text)
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools[0].function.strict", 'expected true or false, got "yes"'),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
     "tools[0].function.description", "expected a string, got a number"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name",
     "not a tool name (1 to 64"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "-x"}}]}, "tools[0].function.name",
     "not starting with '.' or '-'"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "caf\u00e9"}}]},
     "tools[0].function.name", "not a tool name"),
    # what the server passes to the chat template itself: a TypeError ("got multiple values for keyword argument")
    # reported as the template refusing `messages`, or the served template replaced by the request's
    ({"messages": USER, "chat_template_kwargs": {"tools": [TOOL]}}, "chat_template_kwargs.tools",
     "send the declarations as the request's tools"),
    ({"messages": USER, "chat_template_kwargs": {"messages": USER}}, "chat_template_kwargs.messages",
     "passes it to the chat template itself"),
    ({"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt", "passes it to the chat template itself"),
    ({"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs.chat_template",
     "may not replace the served model's chat template"),
    # transformers renders the request's bos_token in place of the tokenizer's: the prompt opened with its text
    ({"messages": USER, "chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs.bos_token",
     "the served tokenizer's own special token"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "object"),
    # a schema OpenAI refuses (400), which was rendered into the prompt as a declaration of nothing
    ({"messages": USER, "tools": [TOOL, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": "x"}}}]}, "tools[1].function.parameters.properties", "got a string"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": "string"}}}}]}, "tools[0].function.parameters.properties.a", "JSON Schema object"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": "a"}}}]}, "tools[0].function.parameters.required",
     "list of property names"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "string"}}, "required": ["a", 1]}}}]}, "tools[0].function.parameters.required[1]",
     "expected a property name, got a number"),
    # property names no call can carry (FunctionGemma's call text parses `time:zone:` as another key), in nested
    # objects too, and a required parameter the schema does not declare (a typo): rendered as declared
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"time:zone": {"type": "string"}}}}}]},
     "tools[0].function.parameters.properties", "property name 'time:zone' cannot be written in a FunctionGemma call"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "object", "properties": {" b": {}}}}}}}}]},
     "tools[0].function.parameters.properties.a.items.properties", "property name ' b'"),
    # ... and in pydantic's $defs, reached through a $ref (were not checked)
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"at": {"$ref": "#/$defs/Place"}},
        "$defs": {"Place": {"type": "object", "properties": {"time:zone": {"type": "string"}}}}}}}]},
     "tools[0].function.parameters.$defs.Place.properties", "property name 'time:zone'"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"date": {"type": "string"}}, "required": ["dat"]}}}]},
     "tools[0].function.parameters.required[0]", "'dat' is not a declared property (properties: date)"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"date": {"type": "string"}}, "required": ["date", "date"]}}}]},
     "tools[0].function.parameters.required[1]", "'date' is listed twice"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": USER, "tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": USER, "tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "needs tools"),
    # OpenAI's (and vLLM's) rules, which passed here: a tool choice or parallel calls without tools, a schema that
    # is not an object's, stream options without a stream (the usage chunk they ask for never came)
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice", '"auto" needs tools; this request declares none'),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
    ({"messages": USER, "parallel_tool_calls": True}, "parallel_tool_calls", "only allowed with tools"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters.type", 'must have type "object", got "string"'),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", '"stream": true'),
    ({"messages": USER, "stream": True, "stream_options": True}, "stream_options", "expected an object"),
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "true or false"),
    # vLLM's extension (usage on every chunk), which this server cannot count: it was taken and ignored
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "usage on every chunk is not counted by this server"),
    ({"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats", "true or false"),
    ({"messages": USER, "tool_choice": "sometimes", "tools": [TOOL]}, "tool_choice", '"auto"'),
    ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice.function.name", "'get_weather' is not among the declared tools (get_steps)"),
    ({"messages": USER, "generation_config": "{x"}, "generation_config", "JSON object"),
    ({"messages": USER, "logprobs": True}, "logprobs", "not returned"),
    ({"messages": USER, "logprobs": 1}, "logprobs", "not returned"),
    ({"messages": USER, "seed": 2**70}, "seed", "[-2^63, 2^63)"),
    ({"messages": USER, "frequency_penalty": -1.5}, "frequency_penalty", "above -1"),
    ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty", "cannot apply a presence penalty"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "not returned"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ({"messages": USER + [{"role": "tool", "content": "5"}]}, "messages[1].role", "preceding assistant"),
    # the legacy function calling, which transformers serve ignored (the model saw no declarations)
    ({"messages": USER, "functions": [TOOL["function"]]}, "functions", "send `tools`"),
    ({"messages": USER, "tools": [TOOL], "function_call": "auto"}, "function_call", "send `tool_choice`"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]},
                          {"role": "tool", "tool_call_id": "b", "content": "5"}]},
     "messages[2].tool_call_id", "'b' names none of the calls"),
    # a call left without its result, or one answered twice (OpenAI refuses both; they passed, and the model read a
    # call with no result before the next user turn)
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}},
                                                               {"id": "b", "function": {"name": "g"}}]},
                          {"role": "tool", "tool_call_id": "a", "content": "5"}] + USER},
     "messages[3]", "the tool call b of the assistant message before it got no tool message"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}},
                                                               {"id": "b", "function": {"name": "g"}}]},
                          {"role": "tool", "tool_call_id": "a", "content": "5"},
                          {"role": "tool", "tool_call_id": "a", "content": "6"}]},
     "messages[3].tool_call_id", "'a' was answered already"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}] + USER},
     "messages[2]", "the tool call a of"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}]},
     "messages[1]", "the conversation ends with tool call a unanswered"),
])
def test_malformed_requests_are_refused_naming_the_field(body, param, needle):
    with pytest.raises(RequestError) as e:
        check_chat_request(body)
    assert e.value.param == param and needle in str(e.value)


@pytest.mark.parametrize("key", ["9" * 5000, "0" * 4999 + "5", "1" * 40],
                         ids=["5000-digits", "zero-padded", "40-digits"])
def test_a_logit_bias_key_of_thousands_of_digits_is_refused_naming_the_field(key):
    """Python's int() refuses a text of over 4,300 digits (ValueError): the local server answered a bare 500 "Internal
    Server Error"; and an id of 40 digits went on to transformers serve, past any vocabulary."""
    for check, body in ((check_chat_request, {"messages": USER}), (check_completion_request, {"prompt": "x"})):
        for vocab in (512, None):
            with pytest.raises(RequestError) as e:
                check({**body, "logit_bias": {key: 1}}, vocab_size=vocab)
            assert e.value.param == "logit_bias" and "is not a token id" in str(e.value)
            assert len(str(e.value)) < 200


def test_legitimate_odd_requests_pass_and_max_tokens_is_resolved():
    # logprobs: 0 in a chat completion is false, as vLLM reads it (it was refused as asking for log probabilities)
    ok = {"messages": [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                       {"role": "user", "content": [{"type": "text", "text": "שלום 👋"}]},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "c1", "type": "function", "function": {"name": "get_steps", "arguments": ""}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": ""}],
          "tools": [TOOL, {"type": "function", "function": {"name": "noparams"}}], "tool_choice": "none",
          "stop": ["\n"], "temperature": 0, "top_p": 1, "n": 1, "stream": True, "logprobs": 0,
          "response_format": {"type": "text"}, "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": False}}
    two = [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}, {"id": "b", "function": {
        "name": "g"}}]}]
    for results in ([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}],  # no ids: in order
                    [{"role": "tool", "tool_call_id": k, "content": "1"} for k in "ba"]):  # any order
        assert len(check_chat_request({"messages": USER + two + results + USER})["messages"]) == 5
    assert check_chat_request(ok)["messages"][3]["tool_calls"][0]["function"]["arguments"] == "{}"
    ok["messages"][3]["tool_calls"][0]["function"]["arguments"] = "{}"
    assert check_chat_request(ok) == ok  # unchanged, no context given
    # what transformers serve answered with 500: an empty stop list, integer biases, arguments as an object or ""
    fixed = check_chat_request({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": {"x": "é"}}}]}, {"role": "tool", "tool_call_id": "a",
                                                                              "content": "1"}],
        "stop": [], "logit_bias": {"5": -100}})
    assert "stop" not in fixed and fixed["logit_bias"] == {"5": -100.0}
    # a bias past [-100, 100] at its bound, as vLLM takes it (SamplingParams clamps it): it was refused here
    assert check_chat_request({"messages": USER, "logit_bias": {"5": 200, "6": -1e300, "7": 3}})["logit_bias"] == {
        "5": 100.0, "6": -100.0, "7": 3.0}
    assert json.loads(check_completion_request({"prompt": "x", "logit_bias": {"5": 1000}}, 50, len)[
        "generation_config"])["sequence_bias"] == [[[5], 100.0]]
    # an empty stop string, bare or in a list, is refused as vLLM refuses it (SamplingParams._verify_args: 400 "stop
    # cannot contain an empty string"): it was dropped here (as OpenAI takes it), so a client passed here, failed there
    for stop in ("", [""], ["", "##"], ["##", ""]):
        with pytest.raises(RequestError, match=r"^stop: stop cannot contain an empty string"):
            check_chat_request({"messages": USER, "stop": stop})
        with pytest.raises(RequestError, match="stop cannot contain an empty string"):
            check_completion_request({"prompt": "x", "stop": stop}, 50, len)
    assert check_chat_request({"messages": USER, "stop": ["##"]})["stop"] == ["##"]
    assert check_completion_request({"prompt": "x", "stop": "##"}, 50, len)["stop"] == "##"
    assert check_chat_request({"messages": USER, "chat_template_kwargs": None, "tools": None, "temperature": 0}) == {
        "messages": USER, "temperature": 0}
    # schemas unusual but sound: a property name with an inner space or non-ASCII letters (a call carries them),
    # enums, nested objects and unions, a required name that additionalProperties lets in
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "time zone": {"type": "string", "enum": ["UTC", "CET"]}, "città": {"type": "object", "properties": {
            "n": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"k": {}}, "required": ["k"]}]}}},
        "tags": {"type": "array", "items": {"enum": [1, 2]}}}, "required": ["time zone"]}}}
    loose = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": True, "required": ["x"]}}}
    assert check_chat_request({"messages": USER, "tools": [odd, loose]})["tools"] == [odd, loose]
    # an empty tool list with the "auto" (or "none", parallel calls) a client always sends: no tools, as the
    # Responses path reads it (it was a 400, "needs tools")
    for extra in ({"tool_choice": "auto"}, {"tool_choice": "none", "parallel_tool_calls": True}, {}):
        assert check_chat_request({"messages": USER, "tools": [], "temperature": 0, **extra}) == {
            "messages": USER, "temperature": 0}, extra
    assert fixed["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"x": "é"}'
    assert check_chat_request({"messages": USER, "max_completion_tokens": 7})["max_tokens"] == 7
    assert check_chat_request({"messages": USER, "max_completion_tokens": 7, "max_tokens": 9})["max_tokens"] == 7
    # an answer sent back as the SDK dumps it (None fields; transformers serve: 500) or with an empty call list
    # (transformers serve dropped its content): the text and the role only
    dumped = {"content": "Hi!", "refusal": None, "role": "assistant", "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}
    for sent in (dumped, {"role": "assistant", "content": "Hi!", "tool_calls": []}):
        assert check_chat_request({"messages": USER + [sent] + USER})["messages"][1] == {"role": "assistant",
                                                                                         "content": "Hi!"}
    # the context bounds max_tokens (vLLM's rule): the default is what the prompt leaves
    assert check_chat_request({"messages": USER}, 100, lambda b: 30)["max_tokens"] == 70
    with pytest.raises(RequestError, match="at most 70") as e:
        check_chat_request({"messages": USER, "max_tokens": 71}, 100, lambda b: 30)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="at most 70") as e:  # named max_tokens, which the client never sent
        check_chat_request({"messages": USER, "max_completion_tokens": 71}, 100, lambda b: 30)
    assert e.value.param == "max_completion_tokens" and str(e.value).startswith("max_completion_tokens: 71 ")
    with pytest.raises(RequestError, match="the prompt is 100 tokens") as e:
        check_chat_request({"messages": USER}, 100, lambda b: 100)
    assert e.value.param == "messages"


def test_generation_settings_the_server_cannot_honour_are_refused():
    """transformers serve's `generation_config`: beam search was a 500 (every answer streams, and a streamer takes no
    beams), several sequences came back as one choice with their texts run together (completion_tokens doubled)."""
    pytest.importorskip("transformers")
    from serving.local import check_generation_config

    for gen, needle in (({"num_beams": 2}, "num_beams=2: beam search cannot stream"),
                        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2: this server returns "
                                                                         "one choice")):
        for check, body in ((check_chat_request, {"messages": USER}), (check_completion_request, {"prompt": "x"})):
            with pytest.raises(RequestError, match=needle) as e:
                check({**body, "generation_config": json.dumps(gen)}, check_generation_config=check_generation_config)
            assert e.value.param == "generation_config"
    body = check_chat_request({"messages": USER, "generation_config": '{"num_beams": 1, "num_return_sequences": 1}',
                               "temperature": 0}, check_generation_config=check_generation_config)
    assert json.loads(body["generation_config"]) == {"num_beams": 1, "num_return_sequences": 1}


def test_text_completions_are_checked_alike():
    for body, param in (({}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "x", "max_tokens": 0},
                        "max_tokens"), ({"prompt": "x", "temperature": 9}, "temperature"), ({"prompt": "x", "n": 3}, "n"),
                        # ignored by transformers serve: the text came back without the prompt asked for
                        ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "best_of": 3}, "best_of"),
                        # appended to the text by transformers serve ("UUU" + "x"), the model never saw it
                        ({"prompt": "x", "suffix": "y"}, "suffix"),
                        # 0 asks for the chosen token's log probability: it passed as falsy, and none came back
                        ({"prompt": "x", "logprobs": 0}, "logprobs"), ({"prompt": "x", "logprobs": 2}, "logprobs")):
        with pytest.raises(RequestError) as e:
            check_completion_request(body)
        assert e.value.param == param
    assert check_completion_request({"prompt": "héllo", "stop": [], "max_tokens": None, "temperature": 0.0}, 50,
                                    len) == {"prompt": "héllo", "max_tokens": 45, "temperature": 0.0}
    # a batch of one (LangChain's OpenAI LLM always sends a list) is that prompt; it was a 400
    assert check_completion_request({"prompt": ["héllo"], "max_tokens": 45, "temperature": 0}, 50, len) == {
        "prompt": "héllo", "max_tokens": 45, "temperature": 0}
    assert check_completion_request({"prompt": "x", "echo": False, "best_of": 1, "suffix": ""})["prompt"] == "x"
    assert check_completion_request({"prompt": "x", "logprobs": None})["prompt"] == "x"
    # token ids (vLLM takes them, one prompt or a batch) were "expected a string (or a list of one), got a list"
    for ids in ([2, 9, 14], [[2, 9], [2, 14]]):
        with pytest.raises(RequestError, match=r"^prompt: token ids: this server completes a text prompt only "
                                               r"\(vLLM takes token ids\); send the text"):
            check_completion_request({"prompt": ids})
    # an empty prompt (alone or as a batch of one) is refused, as vLLM refuses it: the model went on from BOS alone
    for prompt in ("", [""]):
        with pytest.raises(RequestError, match="prompt: is empty"):
            check_completion_request({"prompt": prompt})
    assert check_completion_request({"prompt": " "})["prompt"] == " "
    # an assistant turn with calls and `content: []` has no text, as with null
    calls = [{"id": "a", "function": {"name": "get_steps", "arguments": "{}"}}]
    check_chat_request({"messages": USER + [{"role": "assistant", "content": [], "tool_calls": calls},
                                            {"role": "tool", "tool_call_id": "a", "content": "5"}]})
    # logit_bias: transformers serve ignores it on text completions; it goes in as the generation's sequence_bias
    body = check_completion_request({"prompt": "x", "logit_bias": {"112": -100}, "generation_config": '{"top_k": 3}',
                                     "temperature": 0})
    assert "logit_bias" not in body and json.loads(body["generation_config"]) == {"top_k": 3,
                                                                                  "sequence_bias": [[[112], -100.0]]}
    for prompt, needle in ((["a", "b"], "one by one"), ([[1, 2]], "token ids"), ([], "or a list of one")):
        with pytest.raises(RequestError, match=needle):
            check_completion_request({"prompt": prompt})
    with pytest.raises(RequestError, match="at most 45"):
        check_completion_request({"prompt": "héllo", "max_tokens": 46}, 50, len)


def _post(url: str, payload: bytes, content_type: str = "application/json") -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=payload, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            code, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        code, text = e.code, e.read().decode()
    try:
        return code, json.loads(text)
    except json.JSONDecodeError:
        return code, text


def test_local_server_answers_malformed_requests_with_400(tiny_dir, tmp_path):
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    pytest.importorskip("uvicorn", reason="needs transformers[serving]")
    from serving.local import LocalServer

    with LocalServer(tiny_dir, name="tiny", log=tmp_path / "serve.log") as server:
        url = server.base_url + "/chat/completions"
        for payload, param in [(b'{"messages": [{"role": "user"', None), (b'{"messages": []}', "messages"),
                               (b"[" * 100000 + b"]" * 100000, None), (b'{"messages": "\xff"}', None),
                               (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', "max_tokens"),
                               (json.dumps({"messages": USER, "max_tokens": 100000}).encode(), "max_tokens"),
                               (json.dumps({"messages": [{"role": "user", "content": "ab " * 1500}],
                                            "max_tokens": 2}).encode(), "messages"),
                               (json.dumps({"messages": [{"role": "assistant", "tool_calls": [
                                   {"function": {"name": "f", "arguments": "{bad"}}]}]}).encode(),
                                "messages[0].tool_calls[0].function.arguments"),
                               # a lone surrogate (JSON's unpaired \ud800): the tokenizer failed, a bare 500
                               (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content")]:
            code, body = _post(url, payload)
            assert code == 400 and isinstance(body, dict), (payload, code, body)
            assert body["error"]["param"] == param and body["error"]["message"], body
        for odd in ({"stop": []}, {"logit_bias": {"5": -100}}, {"chat_template_kwargs": None}, {"messages": USER + [{"role": "assistant", "content": "x",
                                                                                   "tool_calls": None}] + USER},
                    {"messages": USER + [{"role": "assistant", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
                {"role": "tool", "tool_call_id": "1", "content": "x"}], "tools": [TOOL]}):
            code, body = _post(url, json.dumps({"messages": USER, "max_tokens": 2, **odd}).encode())
            assert code == 200, (odd, body)  # each was a 500
        for odd, param in (({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"seed": 2**70}, "seed"),
                           ({"frequency_penalty": -2}, "frequency_penalty"),
                           ({"generation_config": json.dumps({"max_new_tokens": -5})}, "generation_config")):
            code, body = _post(url, json.dumps({"messages": USER, "max_tokens": 2, **odd}).encode())
            assert code == 400 and body["error"]["param"] == param, (odd, body)  # each was a 500
        # text completions: transformers serve gave 500 for max_tokens -1 and ran 100000 tokens on for minutes
        for odd, param in (({"prompt": "hi", "max_tokens": -1}, "max_tokens"), ({"prompt": "hi", "max_tokens": 100000},
                            "max_tokens"), ({"max_tokens": 2}, "prompt")):
            code, body = _post(server.base_url + "/completions", json.dumps(odd).encode())
            assert code == 400 and body["error"]["param"] == param, (odd, body)
        code, body = _post(server.base_url + "/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": 0}')
        assert code == 200 and body["usage"]["completion_tokens"] == 2
        plain = body["choices"][0]["text"]
        # a temperature above 0 samples (transformers serve kept the model's greedy do_sample and answered `plain`
        # whatever the temperature and seed); the seed makes it repeatable
        sampled = [_post(server.base_url + "/completions", json.dumps({"prompt": "hi", "max_tokens": 6, "temperature": 2,
                                                                       "seed": seed}).encode())[1] for seed in (1, 2, 1)]
        texts = [b["choices"][0]["text"] for b in sampled]
        assert texts[0] == texts[2] and texts[0] != texts[1], texts
        # ... also when another request with a seed arrives while it generates (its seed re-seeded this one midway,
        # and each got a text neither gets alone)
        import threading
        import time

        def sampled_chat(tokens, seed=7):
            body = {"messages": USER, "max_tokens": tokens, "temperature": 1.5, "seed": seed, "ignore_eos": True}
            return _post(url, json.dumps(body).encode())[1]["choices"][0]["message"]["content"]

        alone = [sampled_chat(200), sampled_chat(20)]
        together: list = [None, None]
        first = threading.Thread(target=lambda: together.__setitem__(0, sampled_chat(200)))
        first.start()
        time.sleep(0.3)  # the first is generating
        together[1] = sampled_chat(20)
        first.join()
        assert together == alone and alone[0] != sampled_chat(200, seed=8), (together, alone)
        code, body = _post(server.base_url + "/completions", b'{"prompt": "hi", "max_tokens": 3, "ignore_eos": true, '
                                                            b'"top_k": 4}')  # vLLM's extensions: a 422 before
        assert code == 200 and body["usage"]["completion_tokens"] == 3, body
        from gemma_tpu.hf.tokenizer import load_tokenizer

        first = load_tokenizer(tiny_dir)(plain, add_special_tokens=False)["input_ids"][0]
        code, body = _post(server.base_url + "/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "temperature": 0,
                                                                         "logit_bias": {str(first): -100}}).encode())
        assert code == 200 and body["choices"][0]["text"] != plain, body  # the bias was ignored: the same text
        # a stop string is not part of the text (transformers serve returned it)
        stop = plain[1:2] or plain[:1]
        code, body = _post(server.base_url + "/completions", json.dumps({"prompt": "hi", "max_tokens": 4,
                                                                         "stop": stop}).encode())
        assert code == 200 and stop not in body["choices"][0]["text"], body
        # a stop string no token of the vocabulary can end (the tiny one has no emoji): transformers' generate
        # refused it, a 500; it is now matched on the decoded text (never written here: max_tokens)
        for stops in ("👋", ["👋", "🙂"]):
            code, body = _post(url, json.dumps({"messages": USER, "max_tokens": 2, "temperature": 0,
                                                "stop": stops}).encode())
            assert code == 200 and body["usage"]["completion_tokens"] == 2, body
        # /v1/models names the served model (it listed nothing), and that name is accepted
        with urllib.request.urlopen(server.base_url + "/models", timeout=30) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny"]
        with urllib.request.urlopen(server.base_url + "/models/tiny", timeout=30) as resp:  # models.retrieve: was 404
            assert json.loads(resp.read())["id"] == "tiny"
        assert _post(url, json.dumps({"messages": USER, "max_tokens": 1, "model": "tiny"}).encode())[0] == 200
        assert "1006" in _post(url, json.dumps({"messages": USER, "max_tokens": 100000}).encode())[1]["error"]["message"]
        # a client that gives up on a whole (unstreamed) answer stops its generation, as a stream's does: transformers
        # serve generated it to the end, holding its one generation thread (a request after waited it out)
        import socket
        import time

        # as long as the context allows (1006 tokens): with 300 the whole answer took 0.32 s on a fast CPU, and
        # a one-token request's own 0.25 s passed half of it (flaky); unstopped, the next one waits ~3/4 of it
        long = json.dumps({"messages": USER, "temperature": 0, "max_tokens": 1000, "ignore_eos": True}).encode()
        start = time.monotonic()
        assert _post(url, long)[1]["usage"]["completion_tokens"] == 1000
        whole = time.monotonic() - start
        with socket.create_connection((server.host, server.port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(long), long))
            time.sleep(whole / 4)
        start = time.monotonic()
        assert _post(url, json.dumps({"messages": USER, "max_tokens": 1}).encode())[0] == 200
        assert time.monotonic() - start < whole * 0.6, (time.monotonic() - start, whole)
        # /v1/responses: transformers serve answered 500 (and cut streams before response.completed)
        code, body = _post(server.base_url + "/responses", json.dumps({"input": "hi", "max_output_tokens": 2}).encode())
        assert code == 200 and body["status"] == "incomplete" and body["usage"]["output_tokens"] == 2, body
        code, text = _post(server.base_url + "/responses", json.dumps({"input": "hi", "max_output_tokens": 2,
                                                                       "stream": True}).encode())
        events = [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if e.strip()]
        assert code == 200 and events[-1]["type"] == "response.completed", text[-500:]
        final = events[-1]["response"]
        assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 2, final
        assert final["output_text"] == "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        # good requests still work, streaming or not, the content type's parameters aside (a text/plain body is
        # refused, as vLLM refuses it); max_completion_tokens is honoured
        good = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "héllo 👋"}]}],
                           "max_completion_tokens": 3, "temperature": 0}).encode()
        code, body = _post(url, good, "application/json; charset=utf-8")
        assert code == 200 and body["usage"]["completion_tokens"] == 3, body
        code, body = _post(url, good, "text/plain")
        assert code == 400 and "application/json" in body["error"]["message"], body
        code, text = _post(url, json.dumps({**json.loads(good), "stream": True}).encode())
        # it ends with data: [DONE], as OpenAI's and vLLM's streams do (transformers serve just closed it)
        assert code == 200 and text.rstrip().endswith("}\n\ndata: [DONE]") and '"finish_reason":"length"' in text
        # a named tool_choice opens the call in the prompt (the served template's forced_call): one more prompt token
        # or so, and the tiny model's continuation, which parses as no call, comes back as text
        body = {"messages": USER, "tools": [TOOL], "max_tokens": 2, "temperature": 0}
        free = _post(url, json.dumps(body).encode())[1]["usage"]["prompt_tokens"]
        code, forced = _post(url, json.dumps({**body, "tool_choice": {"type": "function", "function": {
            "name": "get_steps"}}}).encode())
        assert code == 200 and forced["usage"]["prompt_tokens"] > free, forced
        # an assistant's text beside its calls is in the prompt, as vLLM renders it (transformers serve dropped it)
        call = {"id": "c1", "type": "function", "function": {"name": "get_steps", "arguments": "{}"}}
        said = [_post(url, json.dumps({**body, "messages": USER + [
            {"role": "assistant", "content": text, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"steps": 5}'}]}).encode())[1]["usage"]["prompt_tokens"]
            for text in (None, "Let me look that up for you.")]
        assert said[1] > said[0] + 3, said
        # text parts joined as training joined them (nothing between), not with spaces
        joined = [_post(url, json.dumps({**body, "messages": [{"role": "user", "content": content}]}).encode())[1][
            "usage"]["prompt_tokens"] for content in ("Howmanystepstoday", "How many steps today", [
                {"type": "text", "text": w} for w in ("How", "many", "steps", "today")])]
        assert joined[2] == joined[0] != joined[1], joined
        # streamed with tools, the events pass through the call rewriting (StreamedCalls) whole
        code, text = _post(url, json.dumps({**json.loads(good), "stream": True, "tools": [TOOL]}).encode())
        events = [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e.strip() and "[DONE]" not in e]
        assert code == 200 and events[-1]["choices"][0]["finish_reason"] == "length", text
        assert sum(len(e["choices"][0]["delta"].get("content") or "") for e in events[:-1]) > 0


JSON_HEADERS = [(b"content-type", b"application/json")]  # what clients send (vLLM refuses a body without it)


def _asgi(app, body: dict, path: str = "/v1/chat/completions", raw: bool = False, method: str = "POST",
          headers: list | None = None):
    """One POST (or `method`) of `path` (default /v1/chat/completions) through an ASGI app, without a server:
    (status, parsed body). `headers`: the request's (default: a JSON content type)."""
    import asyncio

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": JSON_HEADERS if headers is None else headers}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if not raw or b"content-length" in dict(start["headers"]):  # a stream (raw) may go without one
        assert dict(start["headers"])[b"content-length"] == str(len(data)).encode()
    return start["status"], data.decode() if raw else json.loads(data)


def _no_ids(obj):
    """`obj` without its "id" and "call_id" keys, at any depth: tool calls and Response items get fresh ids per
    answer (as vLLM's do), so two answers compare equal without them."""
    if isinstance(obj, dict):
        return {k: _no_ids(v) for k, v in obj.items() if k not in ("id", "call_id")}
    return [_no_ids(v) for v in obj] if isinstance(obj, list) else obj


def _streamed_chat(deltas_of, usage: dict, finish_reason: str = "stop"):
    """An ASGI chat server (transformers serve's place) streaming the deltas `deltas_of(request body)` gives, then
    an end (`finish_reason`) with `usage`."""
    async def inner(scope, receive, send):
        deltas = deltas_of(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for d in deltas:
            chunk = {"id": "r1", "created": 5, "choices": [{"index": 0, "delta": d}]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
        end = {"id": "r1", "created": 5, "choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}],
               "usage": usage}
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(end).encode() + b"\n\n"})

    return inner


def test_a_text_completion_without_max_tokens_generates_vllms_default_of_16():
    """vLLM's (and OpenAI's) text completion generates 16 tokens when the request leaves max_tokens out
    (CompletionRequest.max_tokens = 16); here it ran on to the end of the context (thousands of tokens where vLLM
    answers 16). Given as null it is what the context leaves, in vLLM too; a chat completion's default stays all of
    it; a prompt leaving fewer than 16 is refused, as vLLM refuses it."""
    assert check_completion_request({"prompt": "héllo"}, 50, len)["max_tokens"] == 16
    assert check_completion_request({"prompt": "héllo", "max_tokens": None}, 50, len)["max_tokens"] == 45
    assert check_completion_request({"prompt": "héllo", "max_tokens": 3}, 50, len)["max_tokens"] == 3
    assert check_chat_request({"messages": USER}, 50, lambda b: 10)["max_tokens"] == 40
    with pytest.raises(RequestError, match="16 new tokens after a prompt of 40 .* ask for at most 10") as e:
        check_completion_request({"prompt": "x" * 40}, 50, len)
    assert e.value.param == "max_tokens"


def test_a_refused_request_carries_its_status_as_the_error_code_as_vllm_writes_it():
    """vLLM's ErrorResponse gives the HTTP status as `error.code` (400 for a request it refuses); the local server's
    refusal of a malformed request said `"code": null` (its other errors said the status), so a client reading the
    code read nothing."""
    from serving.local import CheckedChatApp

    async def inner(scope, receive, send):  # never reached
        raise AssertionError(scope["path"])

    app = CheckedChatApp(inner, model_name="tiny")
    for path, body, param in (("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
                              ("/v1/completions", {"prompt": ""}, "prompt"),
                              ("/v1/responses", {"input": "hi", "max_output_tokens": -1}, "max_output_tokens")):
        code, resp = _asgi(app, body, path)
        assert code == 400 and resp["error"]["code"] == 400 and resp["error"]["param"] == param, (path, resp)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_body_not_sent_as_json_is_refused_as_vllm_refuses_it(path):
    """vLLM's OpenAI server refuses a POST whose Content-Type is not application/json (its validate_json_request:
    400, "Unsupported Media Type: Only 'application/json' is allowed"), before reading the body; the local server
    answered it (text/plain, curl -d's form encoding, no header at all), so a client that worked here failed
    there. The media type's parameters and case do not matter."""
    from serving.local import CheckedChatApp

    answered = []

    async def inner(scope, receive, send):  # the served app: reached only by a request that passes
        answered.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"id":"r","choices":[{"index":0,"delta":'
                                                            b'{"content":"x"},"text":"x","finish_reason":"stop"}]}'
                                                            b'\n\ndata: [DONE]\n\n'})

    body = {"/v1/chat/completions": {"messages": USER, "max_tokens": 1}, "/v1/completions": {
        "prompt": "hi", "max_tokens": 1}, "/v1/responses": {"input": "hi", "max_output_tokens": 1}}[path]
    app = CheckedChatApp(inner)
    for headers, shown in (([(b"content-type", b"text/plain")], "'text/plain'"),
                           ([(b"content-type", b"application/x-www-form-urlencoded")], "'application/x-www-form"),
                           ([], "(none)"), ([(b"content-type", b"application/jsonl")], "'application/jsonl'")):
        code, resp = _asgi(app, body, path, headers=headers)
        assert code == 400 and resp["error"]["type"] == "BadRequestError", resp
        assert shown in resp["error"]["message"] and "Content-Type: application/json" in resp["error"]["message"]
    assert answered == []
    for ctype in (b"application/json", b"Application/JSON; charset=utf-8"):
        code, resp = _asgi(app, body, path, headers=[(b"content-type", ctype)])
        assert code == 200, resp
    assert answered == [path if path != "/v1/responses" else "/v1/chat/completions"] * 2


def test_calls_in_the_models_text_come_back_as_tool_calls():
    """transformers serve returns a Gemma 3 model's call as raw text in `content` (it knows no parser for
    gemma3_text): an OpenAI client saw no `tool_calls` and finish_reason `length`/`stop`. vLLM's functiongemma
    parser returns them structured; the local server now does too (not streamed)."""
    from serving.local import CheckedChatApp

    content = ("Sure. <unused2>call:get_steps{date:<unused6>yesterday<unused6>,n:3}<unused3>"
               "<unused2>call:3d{}<unused3>")
    token_map = {"<start_function_call>": "<unused2>", "<end_function_call>": "<unused3>", "<escape>": "<unused6>"}

    async def inner(scope, receive, send):
        body = json.loads((await receive())["body"])
        text = content if body.get("tools") else "plain"
        data = json.dumps({"id": "r1", "object": "chat.completion", "model": "coach@main", "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    app = CheckedChatApp(inner, token_map=token_map)
    code, resp = _asgi(app, {"messages": USER, "tools": [TOOL]})
    choice = resp["choices"][0]
    assert code == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_steps", {"date": "yesterday", "n": 3}), ("function", "3d", {})]
    # ids as vLLM's tool parsers write them (make_tool_call_id), not transformers serve's "r1_tool_call_0"
    assert all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", c["id"]) for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert _asgi(app, {"messages": USER})[1]["choices"][0]["message"] == {"role": "assistant", "content": "plain"}
    # parallel_tool_calls: false gets the first call only, as vLLM answers it (both came back)
    code, resp = _asgi(app, {"messages": USER, "tools": [TOOL], "parallel_tool_calls": False})
    assert [c["function"]["name"] for c in resp["choices"][0]["message"]["tool_calls"]] == ["get_steps"]
    code, resp = _asgi(app, {"messages": USER, "tools": [TOOL], "tool_choice": "none"})  # calls not parsed
    assert resp["choices"][0]["message"]["content"] == content and "tool_calls" not in resp["choices"][0]["message"]
    code, resp = _asgi(app, {"messages": []})
    assert code == 400 and resp["error"]["param"] == "messages"
    # another model's name: 404 in OpenAI's shape, as vLLM answers (transformers serve: 400 {"detail": ...})
    named = CheckedChatApp(inner, token_map=token_map, model_name="coach")
    # the served name in the answer, as vLLM gives it (transformers serve: coach@main)
    assert _asgi(named, {"messages": USER, "model": "coach"})[1]["model"] == "coach"
    assert _asgi(named, {"messages": USER, "tools": [TOOL]})[1]["model"] == "coach"
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        code, resp = _asgi(named, {"messages": USER, "prompt": "x", "input": "x", "model": "gpt-4o"}, path)
        assert code == 404 and resp["error"]["param"] == "model" and "`gpt-4o` does not exist" in resp["error"]["message"]
    # a lone surrogate anywhere (JSON's unpaired \ud800) is a 400 naming where, on every path; the tokenizer or the inner
    # server failed on it with a bare 500
    for path, body, param in (("/v1/chat/completions", {"messages": USER, "stop": ["x", "\ud800"]}, "stop[1]"),
                              ("/v1/completions", {"prompt": "a\udfffb"}, "prompt"),
                              ("/v1/responses", {"input": [{"role": "user", "content": "\ud83d"}]}, "input[0].content")):
        code, resp = _asgi(named, body, path)
        assert code == 400 and resp["error"]["param"] == param and "lone UTF-16 surrogate" in resp["error"]["message"]
    # NaN / Infinity anywhere in the body (Python's json took them; a tool declaration rendered `default:NaN`)
    nan_default = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"r": {"type": "number", "default": float("nan")}}}}}
    code, resp = _asgi(named, {"messages": USER, "tools": [nan_default]})
    assert code == 400 and "the request body is not valid JSON (NaN is not JSON" in resp["error"]["message"]
    # GET /v1/models/NAME (the SDK's models.retrieve) describes the served model; another name is a 404 in kind
    code, card = _asgi(named, {}, "/v1/models/coach", method="GET")
    assert code == 200 and {k: v for k, v in card.items() if k != "created"} == {
        "id": "coach", "object": "model", "owned_by": "vllm", "root": "coach", "parent": None, "max_model_len": None}
    # as vLLM's ModelCard: the context requests are bounded by, which a client sizes max_tokens by (it was missing)
    bounded = CheckedChatApp(inner, token_map=token_map, model_name="coach", context=2048)
    for path in ("/v1/models/coach", "/v1/models"):
        code, listed = _asgi(bounded, {}, path, method="GET")
        card = listed if path != "/v1/models" else listed["data"][0]
        assert code == 200 and card["max_model_len"] == 2048 and isinstance(card["created"], int) and \
            card["created"] > 1_700_000_000, listed
    code, resp = _asgi(named, {}, "/v1/models/gpt-4o", method="GET")
    assert code == 404 and "`gpt-4o` does not exist" in resp["error"]["message"]


def test_an_empty_model_name_is_the_served_model_as_vllm_reads_it():
    """vLLM serves its model to a request whose `model` is "" as to one naming none (its `_is_model_supported`); the
    local server answered 404 "The model `` does not exist" (and transformers serve, pinned to its model, 400)."""
    from serving.local import CheckedChatApp

    seen = []

    async def inner(scope, receive, send):  # as transformers serve pinned to "coach" answers
        body = json.loads((await receive())["body"])
        seen.append(body)
        if "model" in body and body["model"] != "coach":
            data, status = json.dumps({"detail": f"Server is pinned to 'coach'; requested '{body['model']}'."}), 400
        else:
            chunk = {"id": "r", "model": "coach@main", "choices": [
                {"index": 0, "delta": {"content": "hi"}, "text": "hi", "finish_reason": "stop"}]}
            data, status = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n", 200
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": data.encode()})

    app = CheckedChatApp(inner, model_name="coach")
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"}),
                       ("/v1/responses", {"input": "x"})):
        code, resp = _asgi(app, {**body, "model": ""}, path)
        assert code == 200 and resp["model"] == "coach", (path, resp)
    assert len(seen) == 3


def _stream_through(app, body: dict) -> tuple[int, list[dict]]:
    """POST a streaming request through `app`: the events that come out, parsed ([DONE] checked and dropped)."""
    import asyncio

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": JSON_HEADERS}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert b"content-length" not in dict(start["headers"])
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
    events = [e for e in data.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    assert events.pop() == "data: [DONE]" and "data: [DONE]" not in events, events  # once, last
    return start["status"], [json.loads(e[len("data: "):]) for e in events]


def test_streamed_calls_come_back_as_tool_call_deltas():
    """A streamed completion held the call as raw text deltas (`<unused2>call:...`) and finished with `stop`:
    an OpenAI client streaming with tools saw no tool call. Now the text before a call streams as content, the
    call comes as one `tool_calls` delta, the finish is `tool_calls` - whatever the chunking of the markers and
    of the events (split mid-marker, mid-event, several events in one body message)."""
    from serving.local import CheckedChatApp

    token_map = {"<start_function_call>": "<unused2>", "<end_function_call>": "<unused3>", "<escape>": "<unused6>"}
    deltas = ["Sure", ". <unu", "sed2>call:get_", "steps{date:<unused6>yester", "day<unused6>,n:3}<unu", "sed3>",
              "<unused2>call:3d{}<unused3> ok <", "unused2>call:bad{", " <unused3> tail <unused2>call:cut{"]

    def chunk(delta, finish=None):
        return {"id": "r1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    events = [chunk({"role": "assistant"})] + [chunk({"content": d}) for d in deltas] + [
        {**chunk({}, "stop"), "usage": {"completion_tokens": 9}}]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    cuts = [0, 5, 60, 61, 300, 301, 302, 700, len(stream)]  # mid-prefix, mid-JSON, mid-separator
    pieces = [stream[a:b] for a, b in zip(cuts, cuts[1:])]

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for k, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": k < len(pieces) - 1})

    app = CheckedChatApp(inner, token_map=token_map)
    code, out = _stream_through(app, {"messages": USER, "tools": [TOOL], "stream": True})
    assert code == 200 and out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in out)
    calls = [tc for c in out for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert content == "Sure.  ok <unused2>call:bad{ <unused3> tail <unused2>call:cut{"  # unparsed calls stay text
    assert "<unused2>call:get_steps" not in content and not any("<unu" == c["choices"][0]["delta"].get("content")
                                                                  for c in out)
    assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
        (0, "get_steps", {"date": "yesterday", "n": 3}), (1, "3d", {})]
    assert all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", t["id"]) for t in calls) and calls[0]["id"] != calls[1]["id"]
    # usage only when stream_options.include_usage asks for it, as OpenAI and vLLM stream it (transformers serve put
    # it on the finishing chunk always)
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls" and not any("usage" in c for c in out)
    assert len({c["id"] for c in out}) == 1 and all(c["object"] == "chat.completion.chunk" for c in out)
    assert re.fullmatch("chatcmpl-[0-9a-f]{32}", out[0]["id"]), out[0]  # vLLM's id, not the served app's "r1"
    code, counted = _stream_through(app, {"messages": USER, "tools": [TOOL], "stream": True,
                                          "stream_options": {"include_usage": True}})
    assert counted[-1] == {"id": counted[0]["id"], "object": "chat.completion.chunk", "created": 1, "model": "m",
                           "choices": [], "usage": {"completion_tokens": 9}}
    assert _no_ids([c["choices"] for c in counted[:-1]]) == _no_ids([c["choices"] for c in out])
    assert all(c["usage"] is None for c in counted[:-1])
    code, out = _stream_through(app, {"messages": USER, "tools": [TOOL], "stream": True, "parallel_tool_calls": False})
    assert [t["function"]["name"] for c in out for t in c["choices"][0]["delta"].get("tool_calls") or []] == [
        "get_steps"] and out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    named = CheckedChatApp(inner, token_map=token_map, model_name="served")
    assert {c["model"] for c in _stream_through(named, {"messages": USER, "stream": True})[1]} == {"served"}
    # the same stream without tools in the request passes untouched, but for the null fields transformers serve
    # leaves out (`NullFields`)
    plain = CheckedChatApp(inner, token_map=token_map)
    import asyncio

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": json.dumps({"messages": USER, "stream": True}).encode()}

    async def send(message):
        sent.append(message)

    asyncio.run(plain({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": JSON_HEADERS},
                      receive, send))
    out = [e[len(b"data: "):] for e in b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
           .split(b"\n\n") if e.strip()]
    assert out.pop() == b"[DONE]"
    shaped = [{**e, "id": json.loads(out[0])["id"], "choices": [{"finish_reason": None, "logprobs": None,
                                                                  **e["choices"][0]}]} for e in events]
    shaped[0]["choices"][0]["delta"]["content"] = ""
    shaped[-1]["choices"][0]["stop_reason"] = None  # vLLM's, on the finishing chunk
    del shaped[-1]["usage"]  # nobody asked for it
    assert [json.loads(e) for e in out] == shaped


def test_a_system_message_the_template_drops_is_refused(tiny_dir):
    """Gemma has no system role: the template folds a system message into the first user turn, and a conversation
    with none (and no tools) lost it: the prompt was `<bos><start_of_turn>model\n` and the model answered as if nothing
    had been sent. The server renders every request to count its tokens; now a system text left out is a 400."""
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.formats.function_calling import function_token_map, tool_chat_template
    from serving.local import prompt_counter

    tok = load_tokenizer(tiny_dir)
    tok.chat_template = tool_chat_template(function_token_map(tok))  # as the server serves a model without one
    count = prompt_counter(tok)
    system = {"role": "developer", "content": "Answer in French."}
    for messages in ([system], [system, {"role": "assistant", "content": "Oui."}]):
        with pytest.raises(RequestError, match="leaves this developer message out of the prompt") as e:
            check_chat_request({"messages": messages}, 4096, count)
        assert e.value.param == "messages[0]"
    # kept: before a user turn, after an assistant turn (the first user turn takes it), with tools (a developer turn)
    for messages, tools in (([system] + USER, None), ([system, {"role": "assistant", "content": "Oui."}] + USER, None),
                            ([system], [TOOL]), ([{**system, "content": "   "}] + USER, None)):
        assert check_chat_request({"messages": messages, "tools": tools}, 4096, count)["max_tokens"] > 0


def test_a_tool_the_template_cannot_render_is_named(tiny_dir):
    """A tool whose parameters nest deeper than the template renders (RecursionError at ~100 levels) was refused as
    `param: "messages"`, "the chat template refused the conversation": the client looked for the fault in its
    messages. The tool is named (`tools[k]`); a conversation the template refuses is still `messages`."""
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.formats.function_calling import function_token_map, tool_chat_template
    from serving.local import prompt_counter

    tok = load_tokenizer(tiny_dir)
    tok.chat_template = tool_chat_template(function_token_map(tok))
    count = prompt_counter(tok)
    schema: dict = {"type": "string"}
    for _ in range(500):
        schema = {"type": "object", "properties": {"a": schema}}
    deep = {"type": "function", "function": {"name": "deep", "parameters": schema}}
    with pytest.raises(RequestError, match=r"tools\[1\]: the chat template cannot render this tool \(RecursionError"
                       ) as e:
        check_chat_request({"messages": USER, "tools": [TOOL, deep]}, 4096, count)
    assert e.value.param == "tools[1]"
    tok.chat_template = "{{ raise_exception('no such role') if messages[0].role == 'user' else '' }}"
    with pytest.raises(RequestError, match="refused the conversation") as e:
        check_chat_request({"messages": USER, "tools": [TOOL]}, 4096, prompt_counter(tok))
    assert e.value.param == "messages"


def test_tool_results_without_ids_answer_the_calls_they_name(tiny_dir):
    """A tool message that names its call but has no tool_call_id (or neither): transformers serve drops the name, and
    the template read the results in order, so results sent in another order were rendered as answers of the wrong
    calls. The server now links each to its call by id (giving an id to a call without one)."""
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.formats.function_calling import function_token_map, tool_chat_template
    from serving.local import _template_messages

    tok = load_tokenizer(tiny_dir)
    tok.chat_template = tool_chat_template(function_token_map(tok))
    calls = [{"id": "a", "type": "function", "function": {"name": "get_heart_rate", "arguments": "{}"}},
             {"type": "function", "function": {"name": "get_steps", "arguments": "{}"}}]
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": calls},
                       {"role": "tool", "name": "get_steps", "content": "5"},
                       {"role": "tool", "name": "get_heart_rate", "content": "170"}]
    body = check_chat_request({"messages": messages, "tools": [TOOL]})
    assert [m.get("tool_call_id") for m in body["messages"][2:]] == ["call_1_1", "a"]
    assert [c["id"] for c in body["messages"][1]["tool_calls"]] == ["a", "call_1_1"]
    text = tok.apply_chat_template(_template_messages(body["messages"]), tools=[TOOL], tokenize=False)
    assert "response:get_steps{result:5}" in text and "response:get_heart_rate{result:170}" in text, text
    # neither name nor id: the calls in order
    plain = check_chat_request({"messages": messages[:2] + [{"role": "tool", "content": "170"},
                                                            {"role": "tool", "content": "5"}], "tools": [TOOL]})
    assert [m.get("tool_call_id") for m in plain["messages"][2:]] == ["a", "call_1_1"]


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(tiny_dir):
    """A 30 MB prompt took the local server two minutes to refuse (tokenizing it to count its tokens, in the event
    loop: /health and every other request waited). A text with more characters than the context can hold in
    tokens of the vocabulary's longest is refused at once; shorter ones are still counted exactly."""
    import time

    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.formats.function_calling import function_token_map, tool_chat_template
    from serving.local import prompt_counter, token_counter

    tok = load_tokenizer(tiny_dir)
    tok.chat_template = tool_chat_template(function_token_map(tok))
    count, text = prompt_counter(tok, 512), token_counter(tok, 512)
    huge = "ab " * 1_000_000
    start = time.monotonic()
    with pytest.raises(RequestError, match=r"the prompt is 30000\d\d characters, more than 512 tokens") as e:
        check_chat_request({"messages": [{"role": "user", "content": huge}]}, 512, count)
    assert e.value.param == "messages"
    with pytest.raises(RequestError, match="3000000 characters") as e:
        check_completion_request({"prompt": huge}, 512, text)
    assert e.value.param == "prompt" and time.monotonic() - start < 3  # tokenizing it alone took ~9 s
    with pytest.raises(RequestError, match="the prompt is 601 tokens"):  # exact where it can be counted
        check_completion_request({"prompt": "a" * 600}, 512, text)
    assert check_completion_request({"prompt": "a" * 500, "max_tokens": None}, 512, text)["max_tokens"] == 11


def streamed_choices(token_map: dict, text: str, size: int) -> list[dict]:
    """The choices `StreamedCalls` sends for `text` streamed `size` characters a chunk, then a finishing chunk."""
    from serving.local import StreamedCalls

    f = StreamedCalls(token_map)
    events = [{"id": "r", "choices": [{"index": 0, "delta": {"content": text[k:k + size]}}]}
              for k in range(0, len(text), size)] + [{"id": "r", "choices": [{"index": 0, "delta": {},
                                                                               "finish_reason": "stop"}]}]
    out = f.feed(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)) + f.close()
    return [json.loads(e[len("data: "):])["choices"][0] for e in out.decode().split("\n\n") if e.strip()]


def test_streamed_content_around_calls_is_the_unstreamed_content():
    """The text before a call was streamed as it came ("Sure. "), while the unstreamed answer strips it ("Sure."):
    a client (and `/v1/responses`' output_text) got a different text streaming. Trailing whitespace is now held
    until text follows it; whatever the chunking, the streamed content is the unstreamed one."""
    from serving.local import CheckedChatApp, StreamedCalls

    token_map = {"<start_function_call>": "<unused2>", "<end_function_call>": "<unused3>", "<escape>": "<unused6>"}
    call = "<unused2>call:get_steps{}<unused3>"
    app = CheckedChatApp(None, token_map=token_map)
    for text in ("Sure. " + call, "Sure.  \n" + call + " ", " " + call + "\n", "a " + call + " b " + call + "  ",
                 "no call, trailing space ", " lead and trail "):
        whole = json.loads(app.tool_calls(json.dumps({"id": "r", "choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": text}}]}).encode()))
        want = whole["choices"][0]["message"]["content"] or ""
        for size in (1, 2, 5, len(text)):
            deltas = [c["delta"] for c in streamed_choices(token_map, text, size)]
            content = "".join(d.get("content") or "" for d in deltas)
            assert content == want, (text, size, content, want)
            assert sum(len(d.get("tool_calls") or []) for d in deltas) == text.count(call)
    # a stream cut off before its finishing chunk still sends the whitespace it held (no call came)
    f = StreamedCalls(token_map)
    out = f.feed(b'data: {"id": "r", "choices": [{"index": 0, "delta": {"content": "ok "}}]}\n\n') + f.close()
    assert "".join(json.loads(e[len("data: "):])["choices"][0]["delta"].get("content") or ""
                   for e in out.decode().split("\n\n") if e.strip()) == "ok "


def test_a_call_cut_at_max_tokens_finishes_as_vllm_says_it():
    """A call whose end marker came with the last token max_tokens allowed (finish "length") finished "tool_calls"
    here whatever the tool_choice; vLLM's whole answer says "tool_calls" for an "auto" call but "length" for a
    "required" one (only a "stop" becomes "tool_calls" there), and its stream says "length" for both."""
    from serving.local import CheckedChatApp

    token_map = {"<start_function_call>": "<unused2>", "<end_function_call>": "<unused3>", "<escape>": "<unused6>"}
    inner = _streamed_chat(lambda body: [{"role": "assistant"}, {"content": "<unused2>call:get_steps{}"},
                                         {"content": "<unused3>"}],
                           {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, "length")
    app = CheckedChatApp(inner, token_map=token_map)
    for choice, whole_finish in (("auto", "tool_calls"), ("required", "length")):
        body = {"messages": USER, "tools": [TOOL], "tool_choice": choice, "max_tokens": 4}
        code, resp = _asgi(app, body)
        assert code == 200 and [c["function"]["name"] for c in resp["choices"][0]["message"]["tool_calls"]] == [
            "get_steps"], resp
        assert resp["choices"][0]["finish_reason"] == whole_finish, (choice, resp)
        code, events = _stream_through(app, {**body, "stream": True})
        assert [t["function"]["name"] for e in events for t in e["choices"][0]["delta"].get("tool_calls") or []] == [
            "get_steps"], events
        assert events[-1]["choices"][0]["finish_reason"] == "length", (choice, events)


def test_malformed_calls_read_alike_streamed_and_whole():
    """The unstreamed answer was parsed whole (`parse_reply`) and the stream call by call, so on malformed model
    output they disagreed: a valid call then a broken one came back as a call streamed but as plain text whole
    (the valid call lost); a call cut just before its end marker was a call whole but text streamed; a call
    followed by a stray end marker lost that marker whole only. Both now read by one set of rules
    (`StreamedCalls`): each call that parses between its markers is a call, anything else is text as written."""
    from gemma_tpu.formats.function_calling import plain_gemma_token_map
    from serving.local import CheckedChatApp

    token_map = plain_gemma_token_map()
    start, end, response = "<unused2>", "<unused3>", "<unused4>"
    good = start + "call:get_steps{n:1}" + end
    cases = [  # model text -> (content, calls) on both paths
        ("Sure. " + good + " " + start + "call:get_steps{n:" + end,
         ("Sure.  " + start + "call:get_steps{n:" + end, ["get_steps"])),
        (start + "call:oops{" + end + " then " + good, (start + "call:oops{" + end + " then", ["get_steps"])),
        (good + " then " + end + " x", ("then " + end + " x", ["get_steps"])),
        ("Sure. " + start + "call:get_steps{n:1}", ("Sure.", ["get_steps"])),  # cut right before its end marker
        (start + "call:get_steps{n:1}" + response, (None, ["get_steps"])),
        ("Sure. " + start + "call:get_steps{n:1", ("Sure. " + start + "call:get_steps{n:1", [])),  # cut midway
        (good + " and " + start, ("and " + start, ["get_steps"])),
        ("Hi " + end + " there " + start, ("Hi " + end + " there " + start, [])),
        ("call:get_steps{n:1}", ("call:get_steps{n:1}", [])),  # no markers: text, as vLLM's parser reads it
    ]
    app = CheckedChatApp(None, token_map=token_map)
    for text, (want_content, want_calls) in cases:
        whole = json.loads(app.tool_calls(json.dumps({"id": "r", "choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": text}}]}).encode()))
        message = whole["choices"][0]["message"]
        got = (message["content"], [c["function"]["name"] for c in message.get("tool_calls") or []])
        assert got == (want_content, want_calls), (text, got)
        assert whole["choices"][0]["finish_reason"] == ("tool_calls" if want_calls else "stop")
        for size in (1, 2, 5, len(text)):
            choices = streamed_choices(token_map, text, size)
            deltas = [c["delta"] for c in choices]
            streamed = ("".join(d.get("content") or "" for d in deltas) or None,
                        [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or []])
            assert streamed == (want_content, want_calls), (text, size)
            assert [t["function"]["arguments"] for d in deltas for t in d.get("tool_calls") or []] == [
                t["function"]["arguments"] for t in message.get("tool_calls") or []]
            assert choices[-1]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_a_long_check_does_not_hold_other_requests():
    """Rendering and counting a prompt ran in the server's event loop: while a long prompt was counted (seconds),
    every other request - a stream's next token, /health, /v1/models - waited. The checks now run in a thread."""
    import asyncio
    import time

    from serving.local import CheckedChatApp

    def slow_count(body):
        time.sleep(1.0)
        return 5

    async def inner(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    app = CheckedChatApp(inner, context=100, count_prompt=slow_count, model_name="m")
    done: dict[str, float] = {}

    async def call(name, method, path, body):
        async def receive():
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        async def send(message):
            pass

        await app({"type": "http", "method": method, "path": path, "headers": JSON_HEADERS}, receive, send)
        done[name] = time.monotonic()

    async def both():
        start = time.monotonic()
        await asyncio.gather(call("chat", "POST", "/v1/chat/completions", {"messages": USER}),
                             call("models", "GET", "/v1/models", {}))
        return start

    start = asyncio.run(both())
    assert done["models"] - start < 0.5 <= done["chat"] - start, (done, start)


def test_whole_answers_are_put_together_from_the_stream():
    """The local server asks transformers serve for a stream every time (a client that goes away then stops the
    generation); a whole answer is the stream put together: text, finish_reason, usage, and the calls and reasoning
    transformers serve parses itself (Gemma 4), as its own whole answer holds them (the reasoning named as vLLM names
    it); an error event stays an error."""
    from serving.local import whole_completion

    def sse(*chunks):
        return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"

    head = {"id": "r", "created": 5, "model": "m", "object": "chat.completion.chunk"}
    chat = sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
               {**head, "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
               {**head, "choices": [{"index": 0, "delta": {"content": "Hé "}}]},
               {**head, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "r_tool_call_0",
                                     "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}]},
               {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
    assert json.loads(whole_completion(chat)) == {
        "id": "r", "created": 5, "model": "m", "object": "chat.completion", "usage": {
            "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "stop_reason": None,
                     "token_ids": None, "message": {
            "role": "assistant", "content": "Hé ", "reasoning": "hm", "refusal": None, "annotations": None,
            "audio": None, "function_call": None, "tool_calls": [
                {"id": "r_tool_call_0", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}]}
    text = sse({"id": "t", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]},
               {"id": "t", "object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    assert json.loads(whole_completion(text))["choices"] == [{
        "index": 0, "finish_reason": "length", "logprobs": None, "text": "a", "stop_reason": None, "token_ids": None,
        "prompt_token_ids": None}]
    assert json.loads(whole_completion(b'data: {"error": "boom"}\n\n'))["error"]["message"] == "boom"
    assert whole_completion(b'{"already": "whole"}') == b'{"already": "whole"}'
    # through the server: a generation that fails midway is a 500 in OpenAI's shape, chat or Responses
    from serving.local import CheckedChatApp

    async def inner(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        partial = b"data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"content": "x"}}]}).encode()
        await send({"type": "http.response.body", "body": partial + b'\n\ndata: {"error": "out of memory"}\n\n'})

    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/responses", {"input": "hi"})):
        code, resp = _asgi(CheckedChatApp(inner), body, path)
        assert code == 500 and resp["error"]["message"] == "out of memory", (path, resp)


def test_a_thinking_models_reasoning_is_named_reasoning_as_vllm_names_it():
    """A thinking model's thought (Gemma 4: transformers serve sends it as `reasoning_content`) came back from a chat
    completion as `reasoning_content`, whole or streamed, where vLLM (with a reasoning parser, e.g. extra_args
    `--reasoning-parser gemma4`) names it `reasoning` since it dropped the old name: a client written for the VM read
    no thought from --local. Now `reasoning`, in the message and in each delta."""
    from serving.local import CheckedChatApp

    async def inner(scope, receive, send):
        deltas = [{"role": "assistant"}, {"reasoning_content": "5 steps "}, {"reasoning_content": "is few."},
                  {"content": "Walk more."}]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for d in deltas:
            chunk = {"id": "r1", "created": 5, "choices": [{"index": 0, "delta": d}]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
        end = {"id": "r1", "created": 5, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(end).encode() + b"\n\n"})

    app = CheckedChatApp(inner, model_name="tiny")
    code, whole = _asgi(app, {"messages": USER})
    message = whole["choices"][0]["message"]
    assert code == 200 and message["reasoning"] == "5 steps is few." and "reasoning_content" not in message, whole
    assert message["content"] == "Walk more."
    code, text = _asgi(app, {"messages": USER, "stream": True}, raw=True)
    deltas = [json.loads(e.split("data: ", 1)[1])["choices"][0]["delta"] for e in text.split("\n\n")
              if e.startswith("data: {") and '"choices": [{' in e.replace('":[{', '": [{')]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "5 steps is few.", deltas
    assert not any("reasoning_content" in d for d in deltas), deltas


def test_a_thinking_models_reasoning_is_a_reasoning_item_of_the_response():
    """A thinking model's chat completion (Gemma 4: transformers serve sends its thought as `reasoning_content`
    deltas) came back from `/v1/responses` without the thought: the output held the message alone, whole or
    streamed. vLLM with a reasoning parser answers a `reasoning` item first (its text a `reasoning_text` part),
    streamed as `response.reasoning_text.delta` events; the message item follows."""
    from serving.local import CheckedChatApp

    inner = _streamed_chat(lambda body: [{"role": "assistant"}, {"reasoning_content": "5 steps "},
                                         {"reasoning_content": "is few."}, {"content": "Walk "}, {"content": "more."}],
                           {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9})
    app = CheckedChatApp(inner, model_name="tiny")
    code, whole = _asgi(app, {"input": "hi"}, "/v1/responses")
    assert code == 200 and [o["type"] for o in whole["output"]] == ["reasoning", "message"], whole
    thought = whole["output"][0]
    assert thought["content"] == [{"type": "reasoning_text", "text": "5 steps is few."}] and thought["summary"] == []
    assert thought["id"].startswith("rs_") and whole["output_text"] == "Walk more."
    code, text = _asgi(app, {"input": "hi", "stream": True}, "/v1/responses", raw=True)
    events = [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if e.strip()]
    kinds = [e["type"] for e in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "5 steps is few."
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta"), kinds
    assert [e["text"] for e in events if e["type"] == "response.reasoning_text.done"] == ["5 steps is few."]
    final = events[-1]["response"]
    assert kinds[-1] == "response.completed" and _no_ids(final["output"]) == _no_ids(whole["output"]), final
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]
    # vLLM's chat extension `include_reasoning` is no field of its ResponsesRequest: taken (false was refused here)
    # and read as nothing there, the reasoning item kept, whole and streamed
    for include in (False, True):
        code, kept = _asgi(app, {"input": "hi", "include_reasoning": include}, "/v1/responses")
        assert code == 200 and [o["type"] for o in kept["output"]] == ["reasoning", "message"], kept
        code, text = _asgi(app, {"input": "hi", "include_reasoning": include, "stream": True}, "/v1/responses",
                           raw=True)
        final = [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if e.strip()][-1]["response"]
        assert [o["type"] for o in final["output"]] == ["reasoning", "message"], final
    code, bad = _asgi(app, {"input": "hi", "include_reasoning": "no"}, "/v1/responses")
    assert code == 400 and bad["error"]["param"] == "include_reasoning", bad


def test_include_reasoning_false_leaves_the_thought_out_as_vllm_does():
    """vLLM's chat `include_reasoning: false` leaves a thinking model's thought out of the answer, whole and streamed;
    the local server refused it. The thought is dropped here (the inner server, which refuses the field, never sees
    it); the answer's text is unchanged."""
    from serving.local import CheckedChatApp

    seen = []

    def deltas(body):
        seen.append(body)
        return [{"role": "assistant"}, {"reasoning_content": "5 steps "}, {"reasoning_content": "is few."},
                {"content": "Walk "}, {"content": "more."}]

    app = CheckedChatApp(_streamed_chat(deltas, {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}),
                         model_name="tiny")
    for include in (True, False):
        code, whole = _asgi(app, {"messages": USER, "include_reasoning": include})
        message = whole["choices"][0]["message"]
        assert code == 200 and message["content"] == "Walk more.", whole
        assert message.get("reasoning") == ("5 steps is few." if include else None), message
        code, text = _asgi(app, {"messages": USER, "include_reasoning": include, "stream": True}, raw=True)
        chunks = [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e.strip() and "[DONE]" not in e]
        delta_keys = [k for c in chunks for k in c["choices"][0]["delta"]]
        assert ("reasoning" in delta_keys) is include and "reasoning_content" not in delta_keys, chunks
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Walk more."
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert seen and all("include_reasoning" not in b for b in seen)


def test_a_responses_thought_is_counted_as_reasoning_tokens(tiny_dir):
    """A thinking model's Response said `output_tokens_details.reasoning_tokens: 0` beside its reasoning item, whole
    and streamed; vLLM counts the thought's tokens there (its reasoning parser's count_reasoning_tokens). The served
    tokenizer counts the thought's text now; an answer without a thought still says 0."""
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from serving.local import CheckedChatApp, token_counter

    thought = "5 steps is few, so walk more today."

    inner = _streamed_chat(lambda body: [{"role": "assistant"}] + (
        [{"reasoning_content": thought[:7]}, {"reasoning_content": thought[7:]}]
        if body["messages"][-1]["content"] == "think" else []) + [{"content": "Walk more."}],
        {"prompt_tokens": 3, "completion_tokens": 40, "total_tokens": 43})

    tok = load_tokenizer(tiny_dir)
    expected = len(tok(thought, add_special_tokens=False)["input_ids"])
    assert expected > 3
    app = CheckedChatApp(inner, model_name="tiny", count_text=token_counter(tok))
    code, whole = _asgi(app, {"input": "think"}, "/v1/responses")
    assert code == 200 and whole["usage"]["output_tokens_details"] == {"reasoning_tokens": expected}, whole["usage"]
    code, text = _asgi(app, {"input": "think", "stream": True}, "/v1/responses", raw=True)
    final = json.loads(text.strip().split("\n\n")[-1].split("data: ", 1)[1])["response"]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": expected}, final["usage"]
    code, whole = _asgi(app, {"input": "answer"}, "/v1/responses")
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}, whole["usage"]


def test_responses_validate_against_the_pinned_openai_sdk():
    """A Response (whole, and each event of a stream) read by the pinned `openai` SDK's own types: its usage lacked
    `input_tokens_details.cache_write_tokens`, which those types require, so `Response.model_validate` (a client
    checking what it got, a framework built on the types) refused every answer of the local server."""
    pytest.importorskip("openai")
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from serving.local import CheckedChatApp

    inner = _streamed_chat(lambda body: [{"role": "assistant"}, {"reasoning_content": "hm"},
                                         {"content": "Walk more."}],
                           {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, "length")
    app = CheckedChatApp(inner, model_name="tiny")
    code, whole = _asgi(app, {"input": "hi", "max_output_tokens": 4}, "/v1/responses")
    resp = Response.model_validate(whole)
    assert code == 200 and resp.output_text == "Walk more." and resp.usage.output_tokens == 4
    assert resp.status == "incomplete" and [o.type for o in resp.output] == ["reasoning", "message"]
    code, text = _asgi(app, {"input": "hi", "stream": True}, "/v1/responses", raw=True)
    events = [TypeAdapter(ResponseStreamEvent).validate_python(json.loads(e.split("data: ", 1)[1]))
              for e in text.split("\n\n") if e.strip()]
    assert events[-1].type == "response.completed" and events[-1].response.usage.input_tokens == 3


def test_responses_api_is_answered_through_a_chat_completion():
    """`/v1/responses` went to transformers serve, which answered 500 without `stream`, cut every stream off before
    `response.completed` (the openai SDK's helpers raise), streamed when `stream` was absent and left calls as text.
    Now the request becomes a checked chat completion and its answer a Response: calls as function_call items,
    `incomplete` when cut at max_output_tokens, the events of a stream ending in response.completed."""
    from serving.local import CheckedChatApp

    seen: list[dict] = []
    token_map = {"<start_function_call>": "<unused2>", "<end_function_call>": "<unused3>", "<escape>": "<unused6>"}

    async def inner(scope, receive, send):
        assert scope["path"] == "/v1/chat/completions"
        body = json.loads((await receive())["body"])
        seen.append(body)
        text = "Sure. <unused2>call:get_steps{date:<unused6>today<unused6>}<unused3>" if body.get("tools") else "hé"
        finish = "length" if body.get("max_tokens") == 2 else "stop"
        usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
        if body.get("stream"):  # as transformers serve streams: deltas, then the finish reason with the usage
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for k in range(0, len(text), 4):
                chunk = {"id": "r1", "created": 5, "choices": [{"index": 0, "delta": {"content": text[k:k + 4]}}]}
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                            "more_body": True})
            end = {"id": "r1", "created": 5, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": usage}
            return await send({"type": "http.response.body", "body": b"data: " + json.dumps(end).encode() + b"\n\n"})
        data = json.dumps({"id": "r1", "created": 5, "model": "m", "choices": [{"index": 0, "finish_reason": finish,
                           "message": {"role": "assistant", "content": text}}], "usage": usage}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    app = CheckedChatApp(inner, token_map=token_map, model_name="tiny")
    tool = {"type": "function", "name": "get_steps", "parameters": {"type": "object", "properties": {}}}
    code, resp = _asgi(app, {"model": "tiny", "instructions": "be brief", "tools": [tool], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "steps?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_steps", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"role": "user", "content": "and today?"}]}, "/v1/responses")
    assert seen[-1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "steps?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_steps", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "user", "content": "and today?"}]
    assert seen[-1]["tools"] == [{"type": "function", "function": {k: tool[k] for k in ("name", "parameters")}}]
    assert code == 200 and resp["status"] == "completed" and resp["output_text"] == "Sure."
    call = resp["output"][1]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call", "get_steps", {"date": "today"})
    # ids as vLLM writes them: the chat's tool call id (its tool parser's), each item a fresh uuid's hex digits
    # (they were `msg_` / `fc_` before transformers serve's chat id)
    assert re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", call["call_id"]), call
    assert re.fullmatch("msg_[0-9a-f]{32}", resp["output"][0]["id"]) and re.fullmatch("fc_[0-9a-f]{32}", call["id"])
    assert resp["usage"]["input_tokens"] == 7 and resp["usage"]["output_tokens"] == 2 and resp["model"] == "tiny"
    code, resp = _asgi(app, {"input": "hi", "max_output_tokens": 2}, "/v1/responses")
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"][0]["content"][0]["text"] == "hé" and seen[-1]["stream"] is True  # streamed inside
    code, text = _asgi(app, {"input": "hi", "stream": True}, "/v1/responses", raw=True)
    events = [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if e.strip()]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "hé"
    assert events[-1]["response"]["output_text"] == "hé" and seen[-1]["stream"] is True  # it streams through
    assert events[-1]["response"]["usage"]["output_tokens"] == 2
    # a streamed call: the text before it, then a function_call item; the same items as unstreamed
    code, text = _asgi(app, {"model": "tiny", "tools": [tool], "input": "steps?", "stream": True}, "/v1/responses",
                       raw=True)
    events = [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if e.strip()]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_text.delta") < kinds.index("response.function_call_arguments.delta")
    assert kinds[-1] == "response.completed" and kinds.count("response.output_item.done") == 2, kinds
    final = events[-1]["response"]
    whole = _asgi(app, {"model": "tiny", "tools": [tool], "input": "steps?"}, "/v1/responses")[1]
    # the same text too: the space before the call was streamed before the call was seen ("Sure. "); now held
    assert _no_ids(final["output"]) == _no_ids(whole["output"]) and final["output_text"] == whole["output_text"] == \
        "Sure."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Sure."
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"] and json.loads(done[1]["arguments"]) == {"date": "today"}
    for body, param in (({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"), ({"input": []}, "input"),
                        ({}, "input"), ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
                        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
                        # read as nothing before: max_tokens generated to the end of the context (71 s on the tiny
                        # model), logprobs never came, a stored prompt was never applied
                        ({"input": "hi", "max_tokens": 3}, "max_tokens"), ({"input": "hi", "foo": 1}, "foo"),
                        ({"input": "hi", "top_logprobs": 2}, "top_logprobs"), ({"input": "hi", "prompt": {"id": "p"}},
                                                                               "prompt"),
                        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include")):
        code, resp = _asgi(app, body, "/v1/responses")
        assert code == 400 and resp["error"]["param"] == param, (body, resp)
    assert "`max_output_tokens`" in _asgi(app, {"input": "hi", "max_tokens": 3}, "/v1/responses")[1]["error"]["message"]
    # an error of the chat check names the Responses field it came from; it named the chat completion's field
    # (`messages[2].role` for input[1] after instructions, `tools[0].function.name`), which the client never sent
    call = {"type": "function_call", "call_id": "c", "name": "get_steps", "arguments": "{}"}
    for body, param in (
            ({"instructions": "x", "input": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
             "input[1].role"),
            ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, call,
                        {**call, "call_id": "d", "arguments": "[1]"}]}, "input[3].arguments"),
            ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, call,
                        {**call, "call_id": "d", "arguments": '{"o": {"a:b": 1}}'}]}, "input[3].arguments.o"),
            ({"input": [{"role": "user", "content": "hi"}, call, {"type": "function_call_output", "call_id": "zz",
                                                                   "output": "5"}]}, "input[2].call_id"),
            ({"input": [{"role": "user", "content": "hi"}, call, {"role": "user", "content": "x"}]}, "input[2]"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": "5"}]}, "input[0].role"),
            ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
            ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"properties": "x"}}]},
             "tools[0].parameters.properties"),
            # dropped on the way to the chat completion, so a strict OpenAI refuses (400) was taken
            ({"input": "hi", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict"),
            ({"input": "hi", "tools": [tool], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name")):
        code, resp = _asgi(app, body, "/v1/responses")
        assert code == 400 and resp["error"]["param"] == param and resp["error"]["message"].startswith(param + ":"), resp
    # reasoning items alone (a reasoning model's trace, not read): no conversation; the chat check's "messages: expected
    # a non-empty list of messages" came back as "input: expected a non-empty list of input"
    code, resp = _asgi(app, {"input": [{"type": "reasoning", "summary": []}]}, "/v1/responses")
    assert (code, resp["error"]["param"]) == (400, "input"), resp
    assert resp["error"]["message"] == ("input: holds no message, function_call or function_call_output item "
                                        "(reasoning items are not read): nothing to answer"), resp
    # fields read as nothing when of the wrong type (metadata "x" echoed back as {}), where OpenAI (and vLLM's request
    # model) refuse them
    for key, value, kind in (("text", "x", "an object"), ("metadata", "x", "an object"), ("reasoning", [], "an object"),
                             ("store", "no", "true or false"), ("max_tool_calls", True, "a whole number"),
                             ("truncation", 1, "a string"), ("service_tier", {}, "a string")):
        code, resp = _asgi(app, {"input": "hi", key: value}, "/v1/responses")
        assert (code, resp["error"]["param"]) == (400, key), resp
        assert resp["error"]["message"].startswith(f"{key}: expected {kind}, got "), resp
    # a value outside the field's fixed set, which OpenAI and vLLM (its request model's Literal) refuse: it was taken
    for key, value, allowed in (("truncation", "on", "auto, disabled"),
                                ("service_tier", "fast", "auto, default, flex, scale, priority")):
        code, resp = _asgi(app, {"input": "hi", key: value}, "/v1/responses")
        assert (code, resp["error"]["param"]) == (400, key), resp
        assert resp["error"]["message"] == f"{key}: {value!r} is not one of {allowed}", resp
    n = len(seen)  # what clients send along, harmless unread, still passes
    code, resp = _asgi(app, {"input": "hi", "metadata": {"a": "b"}, "store": False, "user": "u", "reasoning": {},
                             "include": [], "truncation": "disabled", "service_tier": "auto", "top_logprobs": 0,
                             "tool_choice": "auto", "parallel_tool_calls": True}, "/v1/responses")
    assert code == 200 and resp["metadata"] == {"a": "b"}  # echoed, as OpenAI does (it was left out)
    assert len(seen) == n + 1
    code, resp = _asgi(app, {"input": "hi", "tool_choice": "required"}, "/v1/responses")  # forcing: still refused
    assert code == 400 and resp["error"]["param"] == "tool_choice" and len(seen) == n + 1


def test_stop_strings_are_cut_from_the_text():
    """transformers serve returned the stop string that ended the text (`stop: ["\\n\\nUser:"]` gave "...\\n\\nUser:");
    OpenAI and vLLM return the text before it. Cut alike for chat and text completions, streamed (a stop string
    split over deltas is held until settled) or not, and before the calls are read."""
    from serving.local import CheckedChatApp

    token_map = {"<start_function_call>": "<unused2>", "<end_function_call>": "<unused3>", "<escape>": "<unused6>"}
    text = "Hello ## there<unused2>call:get_steps{}<unused3>"
    deltas = ["Hel", "lo #", "# the", "re", "<unused2>call:get_", "steps{}<unused3>"]

    def sse(objs):
        return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"

    async def inner(scope, receive, send):  # the server asks transformers serve for a stream, whole answers too
        body = json.loads((await receive())["body"])
        assert body["stream"] is True
        chat = scope["path"] == "/v1/chat/completions"

        def ev(piece, finish=None):
            ch = {"index": 0, "finish_reason": finish}
            ch.update({"delta": {"content": piece} if piece is not None else {}} if chat else {"text": piece or ""})
            return {"id": "r", "choices": [ch]}
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": sse([ev(d) for d in deltas] + [ev(None, finish[0])])})

    finish = ["stop"]
    app = CheckedChatApp(inner, token_map=token_map)
    code, resp = _asgi(app, {"messages": USER, "stop": ["zz", "##"]})
    assert code == 200 and resp["choices"][0]["message"]["content"] == "Hello "
    assert _asgi(app, {"prompt": "x", "stop": "<unused2>"}, "/v1/completions")[1]["choices"][0]["text"] == "Hello ## there"
    code, resp = _asgi(app, {"messages": USER, "stop": "call", "tools": [TOOL]})  # the call is not read past the stop
    message = resp["choices"][0]["message"]
    assert message["content"] == "Hello ## there<unused2>" and "tool_calls" not in message, message
    assert _asgi(app, {"messages": USER})[1]["choices"][0]["message"]["content"] == text  # no stop: untouched
    for path, body, field in (("/v1/chat/completions", {"messages": USER}, "content"), ("/v1/completions",
                                                                                          {"prompt": "x"}, "text")):
        for stop, want in (("##", "Hello "), ("# t", "Hello #"), ("lo", "Hel"), ("#x", text)):
            code, raw = _asgi(app, {**body, "stream": True, "stop": stop}, path, raw=True)
            events = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.strip() and "[DONE]" not in e]
            pieces = [(e["choices"][0].get("delta") or e["choices"][0]).get(field) or "" for e in events]
            assert "".join(pieces) == want and events[-1]["choices"][0]["finish_reason"] == "stop", (stop, raw)
            assert raw.rstrip().endswith("data: [DONE]")
    # the stop string came with the last token max_tokens allowed: transformers serve says "length", and the whole
    # answer kept the stop string (a stream cut it)
    finish[0] = "length"
    for stream in (False, True):
        code, raw = _asgi(app, {"messages": USER, "stop": "there", "stream": stream}, raw=True)
        if stream:
            events = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.strip() and "[DONE]" not in e]
            got = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            reason = events[-1]["choices"][0]["finish_reason"]
        else:
            got, reason = json.loads(raw)["choices"][0]["message"]["content"], json.loads(raw)["choices"][0][
                "finish_reason"]
        assert (got, reason) == ("Hello ## ", "stop"), (stream, raw)
    assert _asgi(app, {"messages": USER, "stop": "zz"})[1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_generate_cannot_match_ends_the_generation(tiny_dir):
    """A stop string no token can end (an emoji a small vocabulary spells in bytes) is refused by transformers'
    generate (ValueError); it was dropped from the generation and only cut from the text, so the model ran on to
    max_tokens and usage counted the tokens past it. The served build (`stop_on_decoded_text`) stops once the
    decoded new text holds it, as vLLM's detokenizer-side check does (the refusal is simulated: the tiny greedy
    model writes only "%", which its vocabulary can end)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving.local import stop_on_decoded_text

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))

    class Refusing(type(model)):  # as generate refuses a stop string it cannot match
        def _get_stopping_criteria(self, generation_config, *args, **kwargs):
            if generation_config.stop_strings is not None:
                raise ValueError("Stop string preprocessing was unable to identify tokens matching ...")
            return super()._get_stopping_criteria(generation_config, *args, **kwargs)

    stop_on_decoded_text(Refusing)
    model.__class__ = Refusing
    for prompt in ("hi", "%%%%"):  # the prompt's own "%%%" does not end the answer at once
        ids = tok(prompt, return_tensors="pt")
        plain = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:]
        assert tok.decode(plain, skip_special_tokens=True) == "%" * 12  # what the stop is then found in
        for stop in ("%%%", ["zz", "%%%"]):
            out = model.generate(**ids, max_new_tokens=12, do_sample=False, stop_strings=stop, tokenizer=tok)
            assert out.shape[1] - ids["input_ids"].shape[1] == 3, (prompt, stop, out.shape)
    ids = tok("hi", return_tensors="pt")  # a stop never written: max_tokens as before
    assert model.generate(**ids, max_new_tokens=5, do_sample=False, stop_strings="zz", tokenizer=tok).shape[1] == \
        ids["input_ids"].shape[1] + 5


def test_vllm_sampling_extensions_become_generation_settings():
    """vLLM's top_k / min_p / repetition_penalty / min_tokens / ignore_eos (sent by `serving.bench --ignore-eos` and
    by clients written for vLLM) were a 422 {"detail": "Unexpected fields"} from transformers serve: every request
    of `serving.bench --ignore-eos` failed. They now go into its generation_config (ignore_eos: no stop before
    max_tokens), merged with one the client sent, and bad values are a 400 naming the field."""
    body = check_chat_request({"messages": USER, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
                               "generation_config": json.dumps({"top_p": 0.5})}, 100, lambda b: 30)
    assert not set(body) & {"top_k", "min_p", "repetition_penalty", "ignore_eos"} and body["max_tokens"] == 70
    assert json.loads(body["generation_config"]) == {"top_p": 0.5, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
                                                     "min_new_tokens": 70, "do_sample": True}
    body = check_completion_request({"prompt": "x", "max_tokens": 4, "top_k": -1, "min_tokens": 2, "temperature": 0})
    assert json.loads(body["generation_config"]) == {"min_new_tokens": 2}  # greedy: no top_k to switch off
    assert "generation_config" not in check_chat_request({"messages": USER, "max_tokens": 3, "temperature": 0})
    for extra, param in (({"top_k": 1.5}, "top_k"), ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"ignore_eos": "yes"}, "ignore_eos"), ({"min_tokens": 9}, "min_tokens"),
                         # a top_k of another type was a TypeError deciding whether to sample: a 500
                         ({"top_k": "5"}, "top_k"), ({"top_k": [5]}, "top_k"), ({"top_k": {}}, "top_k")):
        with pytest.raises(RequestError) as e:
            check_chat_request({"messages": USER, "max_tokens": 3, **extra})
        assert e.value.param == param


def test_no_top_k_reaches_generate_as_off(tiny_dir):
    """vLLM's `top_k: -1` (or 0) says "no top-k". It became None in the generation_config, which transformers'
    generate fills from the model's generation_config, else its default top_k of 50: a request asking for the
    whole distribution sampled from the 50 likeliest tokens. Read as generate reads it (on the tiny model), no
    top-k (nor min-p) warper is left."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    for extra in ({"top_k": -1}, {"top_k": 0, "min_p": 0}, {"temperature": 0.7, "top_k": -1}):
        body = check_chat_request({"messages": USER, "max_tokens": 3, "temperature": 1.0, **extra})
        config, _ = model._prepare_generation_config(GenerationConfig(**json.loads(body["generation_config"])))
        assert config.do_sample and config.top_k == 0, (extra, config.top_k)
        warpers = model._get_logits_processor(config, input_ids_seq_length=3, encoder_input_ids=None,
                                              prefix_allowed_tokens_fn=None, logits_processor=None)
        assert not [w for w in warpers if type(w).__name__ in ("TopKLogitsWarper", "MinPLogitsWarper")]
    body = check_chat_request({"messages": USER, "max_tokens": 3, "top_k": 5})
    config, _ = model._prepare_generation_config(GenerationConfig(**json.loads(body["generation_config"])))
    assert config.top_k == 5  # a real top-k still applies
    body = check_chat_request({"messages": USER, "max_tokens": 3, "temperature": 0, "top_k": -1})
    assert "top_k" not in json.loads(body["generation_config"])  # greedy: transformers warned of an unread top_k


def test_seed_minus_one_is_no_seed_as_vllm_reads_it():
    """vLLM reads `seed: -1` as no seed (SamplingParams: -1 -> None), each answer sampled afresh; the local server
    seeded every such request with -1, so a client asking for fresh samples got the same text each time. A chat or
    text completion now goes on without it; any other seed is kept."""
    for check, base in ((check_chat_request, {"messages": USER}), (check_completion_request, {"prompt": "hi"})):
        assert "seed" not in check({**base, "max_tokens": 3, "temperature": 0.8, "seed": -1})
        assert "seed" not in check({**base, "max_tokens": 3, "temperature": 0.8, "seed": -1.0})
        assert check({**base, "max_tokens": 3, "temperature": 0.8, "seed": -2})["seed"] == -2


@pytest.mark.parametrize("temperature", [1e-300, 1e-6, 0.005])
def test_a_temperature_too_small_to_sample_with_samples_at_vllms_least(tiny_dir, temperature):
    """vLLM raises a temperature in (0, 0.01) to 0.01 and samples (SamplingParams' _MAX_TEMP); here 1e-300 divided
    the logits into infinities (a 500), and below 1e-5 was then read as greedy. Generated as transformers serve
    generates it, the answer is sampled at 0.01, repeatably with the seed."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    body = check_chat_request({"messages": USER, "max_tokens": 4, "temperature": temperature, "seed": 3})
    assert body["temperature"] == pytest.approx(0.01, abs=1e-12)
    config = GenerationConfig(**json.loads(body.get("generation_config") or "{}"))
    assert config.do_sample is True
    config.temperature = body["temperature"]  # transformers serve's reading of the request's temperature
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    ids = torch.tensor([[2, 5, 9, 14]])
    outs = []
    for _ in range(2):
        torch.manual_seed(body["seed"])
        outs.append(model.generate(ids, generation_config=config, max_new_tokens=4).tolist())
    assert outs[0] == outs[1] and len(outs[0][0]) == 8
    assert check_chat_request({"messages": USER, "temperature": 0})["temperature"] == 0  # 0 stays greedy
    assert check_chat_request({"messages": USER, "temperature": 0.5})["temperature"] == 0.5


def test_a_sampled_request_without_top_k_samples_the_whole_distribution(tiny_dir):
    """`temperature: 0.8` and no top_k: vLLM samples the whole distribution (or the model's generation_config
    top_k); transformers serve left top_k unset, which generate fills with its default of 50. The served build
    (`whole_distribution_by_default`) turns top-k off there, keeps a model's own top_k, and leaves greedy alone."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.cli.serving import utils

    from serving.local import whole_distribution_by_default

    class Handler(utils.BaseHandler):  # patched, not transformers' own class
        pass

    whole_distribution_by_default(SimpleNamespace(BaseHandler=Handler))
    handler = SimpleNamespace(generation_state=SimpleNamespace(_compile=False))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))

    def top_k(request: dict, model_config: GenerationConfig) -> tuple[bool, int]:
        body = check_chat_request({"messages": USER, "max_tokens": 3, **request})
        model.generation_config = model_config  # what generate fills unset values from
        config, _ = model._prepare_generation_config(Handler._build_generation_config(handler, body, model_config))
        return config.do_sample, config.top_k

    own = model.generation_config
    assert own.top_k is None  # the tiny model's generation_config.json names none
    assert top_k({"temperature": 0.8}, own) == (True, 0)
    assert top_k({"temperature": 0.8, "top_k": 7}, own) == (True, 7)
    assert top_k({"temperature": 0.8}, GenerationConfig(top_k=64, eos_token_id=1)) == (True, 64)
    assert top_k({"temperature": 0.8, "top_p": 0.9}, GenerationConfig(do_sample=True, eos_token_id=1)) == (True, 0)
    assert top_k({"temperature": 0}, own)[0] is False  # greedy: top_k is not read
    # no temperature: vLLM's default of 1 (or the model's generation_config's) samples, the whole distribution, where
    # this server answered greedily unless the model's generation_config said do_sample (the demo's merge does not)
    assert top_k({}, own) == (True, 0)
    assert top_k({}, GenerationConfig(top_k=64, eos_token_id=1)) == (True, 64)


def test_frequency_penalty_zero_keeps_the_repetition_penalty():
    """transformers serve applies frequency_penalty as repetition_penalty = 1 + value, after the generation_config:
    `frequency_penalty: 0` (OpenAI's "none", which clients send as a default) beside `repetition_penalty: 1.2`
    decoded with no penalty at all, and a non-zero one replaced it silently. Read as transformers serve's chat and
    text handlers build the config, the 1.2 is kept; both non-zero is a 400 naming frequency_penalty."""
    from types import SimpleNamespace

    from transformers import GenerationConfig
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler

    def penalty(handler_class, body: dict, model_config: GenerationConfig) -> float:
        handler = handler_class.__new__(handler_class)  # its config builder only reads generation_state
        handler.generation_state = SimpleNamespace(_compile=False)
        return handler._build_generation_config(body, model_config).repetition_penalty

    model_config = GenerationConfig(repetition_penalty=1.1, eos_token_id=1)  # a model's generation_config.json
    chat = {"messages": USER, "max_tokens": 3, "frequency_penalty": 0, "temperature": 0}
    assert penalty(ChatCompletionHandler, check_chat_request({**chat, "repetition_penalty": 1.2}), model_config) == 1.2
    assert penalty(ChatCompletionHandler, check_chat_request(chat), model_config) == 1.1
    text = {"prompt": "x", "max_tokens": 3, "frequency_penalty": 0.0, "repetition_penalty": 1.2}
    assert penalty(CompletionHandler, check_completion_request(text), model_config) == 1.2
    assert penalty(ChatCompletionHandler, check_chat_request({**chat, "frequency_penalty": 0.5}), model_config) == 1.5
    for body in ({**chat, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
                 {**chat, "frequency_penalty": 0.5, "generation_config": json.dumps({"repetition_penalty": 1.2})}):
        with pytest.raises(RequestError, match="send one of them") as e:
            check_chat_request(body)
        assert e.value.param == "frequency_penalty"


def test_inner_server_errors_come_back_in_openai_shape():
    """transformers serve refused a field it does not know (vLLM's skip_special_tokens, say) with 422
    {"detail": ...} and failed with a plain-text 500: OpenAI clients showed a bare status. Now both are
    {"error": {"message", ...}}, the 422 a 400 as OpenAI and vLLM answer; an error already in that shape is kept."""
    from serving.local import CheckedChatApp

    answers = [(422, b'{"detail":"Unexpected fields in the request: {\'skip_special_tokens\'}"}'),
               (500, b"Internal Server Error"), (400, b'{"error": {"message": "mine", "param": "x"}}')]

    async def inner(scope, receive, send):
        await receive()
        status, data = answers.pop(0)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data[:5], "more_body": True})
        await send({"type": "http.response.body", "body": data[5:]})

    app = CheckedChatApp(inner)
    code, resp = _asgi(app, {"messages": USER, "skip_special_tokens": True})
    assert code == 400 and "Unexpected field" in resp["error"]["message"] and "skip_special_tokens" in resp["error"]["message"]
    assert resp["error"]["param"] == "skip_special_tokens"  # the field a client reads (it was null)
    answers.insert(0, (422, b'{"detail":"Unexpected fields in the request: {\'zeta\', \'foo\'}"}'))
    code, resp = _asgi(app, {"messages": USER, "zeta": 1, "foo": 2})
    assert (code, resp["error"]["param"]) == (400, "foo") and "foo, zeta" in resp["error"]["message"], resp
    code, resp = _asgi(app, {"prompt": "x"}, "/v1/completions")
    assert code == 500 and resp["error"] == {"message": "Internal Server Error", "type": "InternalServerError",
                                             "param": None, "code": 500}
    assert _asgi(app, {"messages": USER}) == (400, {"error": {"message": "mine", "param": "x"}})
    # the other paths too (a 405, an unknown path); the audio endpoint, a bare 500 on a text model, is a 404
    answers[:] = [(405, b'{"detail":"Method Not Allowed"}'), (404, b'{"detail":"Not Found"}')]
    assert _asgi(app, {}, "/v1/chat/completions", method="GET") == (405, {"error": {
        "message": "Method Not Allowed", "type": "Method Not Allowed", "param": None, "code": 405}})
    assert _asgi(app, {}, "/v1/embeddings")[1]["error"]["message"] == "Not Found"
    code, resp = _asgi(CheckedChatApp(inner, model_name="tiny"), {}, "/v1/audio/transcriptions")
    assert code == 404 and "text model (`tiny`)" in resp["error"]["message"] and not answers


def test_errors_are_typed_as_vllm_types_them():
    """A request the checks refuse was typed OpenAI's "invalid_request_error" and a missing API key answered an
    OpenAI-shaped "authentication_error": vLLM (the container --local stands in for) types a 400 "BadRequestError"
    (create_error_response) and its AuthenticationMiddleware answers 401 with the body {"error": "Unauthorized"}, so
    a client matching on either met something else there. The key is still checked before the body is read."""
    from serving.local import CheckedChatApp

    async def inner(scope, receive, send):  # never reached
        raise AssertionError(scope["path"])

    app = CheckedChatApp(inner, api_key="s3cret")
    auth = [*JSON_HEADERS, (b"authorization", b"Bearer s3cret")]
    code, resp = _asgi(app, {"messages": USER, "temperature": 5}, headers=auth)
    assert code == 400 and resp["error"]["type"] == "BadRequestError" and resp["error"]["param"] == "temperature"
    code, resp = _asgi(app, {"input": "hi", "temperature": 5}, "/v1/responses", headers=auth)
    assert (code, resp["error"]["type"]) == (400, "BadRequestError"), resp
    # the scheme in any case, as vLLM's verify_token reads it (`bearer KEY` was a 401 here)
    for scheme in (b"bearer", b"BEARER"):
        code, resp = _asgi(app, {"messages": USER, "temperature": 5},
                           headers=[*JSON_HEADERS, (b"authorization", scheme + b" s3cret")])
        assert (code, resp["error"]["param"]) == (400, "temperature"), resp
    for headers in (JSON_HEADERS, [*JSON_HEADERS, (b"authorization", b"Bearer wrong")],
                    [*JSON_HEADERS, (b"authorization", b"Basic s3cret")],
                    [*JSON_HEADERS, (b"authorization", b"Bearer  s3cret")],
                    [*JSON_HEADERS, (b"authorization", b"s3cret")]):
        assert _asgi(app, {"messages": USER}, headers=headers) == (401, {"error": "Unauthorized"})
        assert _asgi(app, {}, "/v1/models", method="GET", headers=headers) == (401, {"error": "Unauthorized"})


def test_a_path_with_a_trailing_slash_is_redirected_unchecked_as_vllm_redirects_it():
    """`/v1/chat/completions/` was checked (a 400 for a malformed body, the prompt rendered and counted) and then
    answered 307 by transformers serve; vLLM (FastAPI) answers the 307 to the path without the slash before reading
    the body, and the request sent there is checked. `/v1/models/` and `/v1/responses/` were answered here directly
    (vLLM: 307). The redirected path is answered as before."""
    fastapi = pytest.importorskip("fastapi", reason="needs transformers[serving]")
    from serving.local import CheckedChatApp

    inner = fastapi.FastAPI()  # routes as transformers serve's (and vLLM's): no trailing slash

    @inner.post("/v1/chat/completions")
    @inner.post("/v1/completions")
    @inner.post("/v1/responses")
    async def answer():
        return {"served": True}

    @inner.get("/v1/models")
    async def models():
        return {"data": []}

    app = CheckedChatApp(inner, model_name="tiny")
    for path, method, body in [("/v1/chat/completions/", "POST", {"messages": []}),
                               ("/v1/completions/", "POST", {"prompt": "x", "max_tokens": -1}),
                               ("/v1/responses/", "POST", {"input": []}), ("/v1/models/", "GET", {})]:
        code, text = _asgi(app, body, path, raw=True, method=method)
        assert (code, text) == (307, ""), (path, code, text)
    assert _asgi(app, {"messages": []})[1]["error"]["param"] == "messages"
    assert _asgi(app, {}, "/v1/models", method="GET")[1]["data"][0]["id"] == "tiny"


def test_a_generation_failing_midway_streams_an_error_clients_read():
    """A generation that fails midway ends its stream with transformers serve's `{"error": "text"}`: the OpenAI SDK
    showed "An error occurred during streaming" (it reads error.message), and a streamed Response finished with
    `response.completed`, the answer cut short read as whole. Now the error is in OpenAI's shape, and the Response
    fails (`response.failed`, its error saying why)."""
    from serving.local import CheckedChatApp

    async def inner(scope, receive, send):
        await receive()
        chunk = {"id": "r1", "object": "chat.completion.chunk", "created": 1,
                 "choices": [{"index": 0, "delta": {"content": "Half an ans"}}]}
        data = b"data: " + json.dumps(chunk).encode() + b'\n\ndata: {"error": "out of memory"}\n\ndata: [DONE]\n\n'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": data})

    app = CheckedChatApp(inner)
    code, events = _stream_through(app, {"messages": USER, "stream": True})
    assert code == 200 and events[-1] == {"error": {"type": "InternalServerError", "param": None, "code": 500,
                                                    "message": "out of memory"}}, events
    code, text = _asgi(app, {"input": "hi", "stream": True}, "/v1/responses", raw=True)
    kinds = [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if "data: " in e]
    assert code == 200 and "response.completed" not in [k["type"] for k in kinds]
    assert kinds[-1]["type"] == "response.failed" and kinds[-1]["response"]["status"] == "failed"
    assert kinds[-1]["response"]["error"] == {"code": "server_error", "message": "out of memory"}


def test_tool_choice_opens_the_call_through_the_chat_template():
    """tool_choice naming a function, or "required", was checked but not enforced by the local server (transformers
    serve has no guided decoding): the model could answer in text. The tool chat template now opens the answer with
    the call (`forced_call` kwarg) and the model's text continues it, streamed or not; a template without the kwarg
    (forced_calls off) and tool_choice "auto" leave the request as it was."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from gemma_tpu.formats.function_calling import tool_chat_template
    from serving.local import CheckedChatApp

    token_map = {"<start_function_call>": "<unused2>", "<end_function_call>": "<unused3>", "<escape>": "<unused6>"}
    rendered = _compile_jinja_template(tool_chat_template(token_map)).render(
        messages=USER, tools=[TOOL], add_generation_prompt=True, bos_token="", forced_call="get_steps")
    assert rendered.endswith("<start_of_turn>model\n<unused2>call:get_steps{")
    seen: list[dict] = []

    async def inner(scope, receive, send):
        body = json.loads((await receive())["body"])
        seen.append(body)
        forced = (body.get("chat_template_kwargs") or {}).get("forced_call")
        text = {"get_steps": "date:<unused6>today<unused6>}<unused3>", True: "get_steps{}<unused3>"}.get(forced, "Hi.")
        finish = "length" if body.get("max_tokens") == 3 else "stop"
        text = text[:16] if finish == "length" else text
        if body.get("stream"):
            chunks = [{"id": "r", "choices": [{"index": 0, "delta": {"content": text[:7]}, "finish_reason": None}]},
                      {"id": "r", "choices": [{"index": 0, "delta": {"content": text[7:]}, "finish_reason": finish}]}]
            data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        else:
            data = json.dumps({"id": "r", "object": "chat.completion", "choices": [
                {"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}]}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    app = CheckedChatApp(inner, token_map=token_map, forced_calls=True)
    named = {"type": "function", "function": {"name": "get_steps"}}
    # finish_reason as vLLM (and OpenAI) gives it: "tool_calls" for a required call, the generation's own ("stop")
    # for a named one
    for choice, args, finish in ((named, {"date": "today"}, "stop"), ("required", {}, "tool_calls")):
        code, resp = _asgi(app, {"messages": USER, "tools": [TOOL], "tool_choice": choice})
        calls = resp["choices"][0]["message"]["tool_calls"]
        assert code == 200 and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_steps", args)] and resp["choices"][0]["finish_reason"] == finish, resp
        code, events = _stream_through(app, {"messages": USER, "tools": [TOOL], "tool_choice": choice, "stream": True})
        deltas = [t for e in events if e.get("choices") for t in e["choices"][0]["delta"].get("tool_calls") or []]
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in deltas] == [("get_steps", args)]
        assert not any(e["choices"][0]["delta"].get("content") for e in events if e.get("choices"))
        assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == finish, events
    # a forced call cut off by max_tokens is text, its opening included, streamed or not (unstreamed, the text
    # lacked the opening the template wrote: "date:<unused6>to", half a call)
    cut = {"messages": USER, "tools": [TOOL], "tool_choice": named, "max_tokens": 3}
    code, resp = _asgi(app, cut)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in _stream_through(app, {**cut, "stream": True})[1])
    assert resp["choices"][0]["message"]["content"] == streamed == "<unused2>call:get_steps{date:<unused6>to", streamed
    assert resp["choices"][0]["finish_reason"] == "length" and "tool_calls" not in resp["choices"][0]["message"]
    seen[:] = seen[:4]
    assert seen[0]["chat_template_kwargs"] == {"forced_call": "get_steps"}
    assert seen[2]["chat_template_kwargs"] == {"forced_call": True}
    # /v1/responses forces too (its flat tool and tool_choice shapes); before, it answered "Hi." in a message item
    flat = {"type": "function", "name": "get_steps", "parameters": {"type": "object", "properties": {}}}
    for choice, args in (({"type": "function", "name": "get_steps"}, {"date": "today"}), ("required", {})):
        code, resp = _asgi(app, {"input": "steps?", "tools": [flat], "tool_choice": choice}, "/v1/responses")
        assert code == 200 and [(o["type"], o.get("name"), json.loads(o.get("arguments") or "null"))
                                for o in resp["output"]] == [("function_call", "get_steps", args)], resp
    code, resp = _asgi(app, {"messages": USER, "tools": [TOOL], "tool_choice": "auto"})
    assert resp["choices"][0]["message"]["content"] == "Hi." and "chat_template_kwargs" not in seen[-1]
    code, resp = _asgi(CheckedChatApp(inner, token_map=token_map), {"messages": USER, "tools": [TOOL],
                                                                     "tool_choice": named})
    assert resp["choices"][0]["message"]["content"] == "Hi." and "chat_template_kwargs" not in seen[-1]
    # the server's own template argument, sent by a client: the template opened a call the server did not know of,
    # and the answer came back as the rest of it, in text
    n = len(seen)
    for body in ({"messages": USER, "tools": [TOOL], "chat_template_kwargs": {"forced_call": "get_steps"}},
                 {"messages": USER, "chat_template_kwargs": {"forced_call": True}}):
        code, resp = _asgi(app, body)
        assert code == 400 and resp["error"]["param"] == "chat_template_kwargs.forced_call", resp
        assert "send tool_choice instead" in resp["error"]["message"] and len(seen) == n


def test_fields_are_typed_as_vllm_types_them():
    """vLLM (and OpenAI) refuse a `user` or a message `name` that is not a string (400); both passed here. vLLM
    reads an integral float in an integer field as that integer (`"max_tokens": 5.0`); it was refused here."""
    for body, param in (({"messages": USER, "user": 5}, "user"),
                        ({"messages": [{"role": "user", "content": "hi", "name": ["x"]}]}, "messages[0].name")):
        with pytest.raises(RequestError, match="expected a string, got") as e:
            check_chat_request(body)
        assert e.value.param == param
    with pytest.raises(RequestError, match="expected a string, got a number") as e:
        check_completion_request({"prompt": "x", "user": 1})
    assert e.value.param == "user"
    ok = check_chat_request({"messages": [{"role": "user", "content": "hi", "name": "ann"}], "user": "u1",
                             "max_tokens": 5.0, "n": 1.0, "seed": 3.0, "top_k": 4.0, "min_tokens": 2.0}, 100,
                            lambda b: 10)
    assert ok["max_tokens"] == 5 and type(ok["max_tokens"]) is int and ok["seed"] == 3 and type(ok["seed"]) is int
    assert json.loads(ok["generation_config"]) == {"top_k": 4, "min_new_tokens": 2, "do_sample": True}
    assert type(check_chat_request({"messages": USER, "max_completion_tokens": 7.0})["max_tokens"]) is int
    assert type(check_completion_request({"prompt": "x", "max_tokens": 6.0}, 50, len)["max_tokens"]) is int
    for key in ("max_tokens", "n", "seed"):  # a fraction is still no whole number
        with pytest.raises(RequestError) as e:
            check_chat_request({"messages": USER, key: 5.5})
        assert e.value.param == key
    # the Responses API's user reaches the same check, and its max_output_tokens the same reading
    from serving.responses import chat_request
    with pytest.raises(RequestError, match="expected a string") as e:
        check_chat_request(chat_request({"input": "hi", "user": {"id": 1}}))
    assert e.value.param == "user"
    assert type(check_chat_request(chat_request({"input": "hi", "max_output_tokens": 8.0}))["max_tokens"]) is int


def test_stop_token_texts_only_a_missing_endpoint_turns_the_lookup_off(monkeypatch):
    """A transient /detokenize failure (503) leaves that stop unnamed and the next one is asked again; a 404 ends it."""
    from gemma_tpu.infer import openai_client as oc
    answers = [oc.HTTPStatusError("503", 503), {"prompt": "<x>"}, oc.HTTPStatusError("404", 404)]
    asked = []

    def fake(url, body, **kw):
        asked.append(body["tokens"][0])
        assert kw["retries"] == 2  # the requests' policy
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a
    monkeypatch.setattr(oc, "http_json", fake)
    texts = oc.StopTokenTexts("http://h/v1", "m", retries=2)
    assert texts(7) is None
    assert texts(7) == "<x>"
    assert texts(8) is None and texts(9) is None
    assert asked == [7, 7, 8]


def test_a_stop_name_lookup_is_retried_as_the_requests_are_and_its_failure_only_warns(monkeypatch, caplog):
    """evaluate --endpoint asked /detokenize once with no retry while its chat requests took --retries: one 503 of a
    server busy for a moment scored a reply that handed over to a tool as an answer in words. A lookup failing past
    the retries leaves that reply scored as without it, in one warning, and the run goes on."""
    import logging

    from gemma_tpu.evaluate import run
    from gemma_tpu.infer import openai_client as oc
    from tests.test_serving import ScriptedModel, http_server

    monkeypatch.setattr(oc.time, "sleep", lambda s: None)
    lookups, stops = [], [9, 8]  # each reply's stop token id, as vLLM gives it

    class Busy(ScriptedModel):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/detokenize":
                lookups.append(body["tokens"])
                if len(lookups) in (1, 3, 4):  # the first lookup once, the second one every time
                    return self._json(503, {"error": "busy"})
                return self._json(200, {"prompt": "<start_function_response>"})
            self._json(200, {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": stops.pop(0),
                                          "message": {"role": "assistant", "content": "Let me check."}}]})

    case = run.Case({"tools": None, "messages": [{"role": "user", "content": "hello"}]}, None, [], "hello", "Hi!")
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.infer.openai_client"), http_server(Busy) as url:
        preds, _ = run.predict_endpoint(url, "m", [case] * 2, 8, "fake", retries=1)
    assert lookups == [[9], [9], [8], [8]]
    assert [p.kind for p in preds] == ["format_error", "text"]  # handed over; the second's stop left unnamed
    unnamed = [r.getMessage() for r in caplog.records if "left unnamed" in r.getMessage()]
    assert len(unnamed) == 1 and "HTTP 503" in unnamed[0] and "stop token 8" in unnamed[0]


@pytest.mark.parametrize("choice, content, stop_texts", [
    ({"stop_reason": 50}, "Let me check.", {50: "<|tool_response>"}),  # vLLM: a merge's eos id, named by /detokenize
    ({"stop_reason": "<|tool_response>"}, "Let me check.", {}),  # a stop string, or serving.launch --local's cut
    ({}, "Let me check.<|tool_response>", {}),  # a server that keeps the stop text
    ({"stop_reason": 9}, "Let me check.", {9: "<start_function_response>"}),  # Gemma 3's FunctionGemma format
])
def test_a_gemma4_reply_handing_over_without_a_call_is_a_format_error(choice, content, stop_texts):
    """A merged Gemma 4 stops at <|tool_response> (id 50, its stop_token_ids in generation_config.json) to hand over
    to a tool; only FunctionGemma's marker was known, so a Gemma 4 reply that stopped there without a call scored as
    an answer in words. The markers are each family's (registry: Family.call_stop_token)."""
    from gemma_tpu.formats.function_calling import NO_CALL_AT_STOP
    from gemma_tpu.infer.openai_client import reply_from_answer
    from gemma_tpu.models.registry import families

    assert families()["gemma4"].call_stop_token == "<|tool_response>" and 50 in families()["gemma4"].stop_token_ids
    answer = {"choices": [{"index": 0, "finish_reason": "stop", **choice,
                           "message": {"role": "assistant", "content": content}}]}
    reply, _ = reply_from_answer(answer, "u", 64, stop_texts.get)
    assert (reply.kind, reply.error) == ("format_error", NO_CALL_AT_STOP)
    # the end of a turn is an answer in words, in either family
    for turn_end in ("<turn|>", "<end_of_turn>"):
        ended = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": 106,
                              "message": {"role": "assistant", "content": "Hi!"}}]}
        reply, _ = reply_from_answer(ended, "u", 64, {106: turn_end}.get)
        assert (reply.kind, reply.text, reply.error) == ("text", "Hi!", None)


def test_add_special_tokens_at_vllms_default_for_each_endpoint_is_served():
    """vLLM's `add_special_tokens` defaults to false for a chat completion (the template writes <bos>) and true for a
    text completion (the tokenizer adds it), as this server behaves; clients built for vLLM send it at that default,
    and this server answered 400 "Unexpected field". Served at each endpoint's default, the other value refused
    naming the field."""
    chat = check_chat_request({"messages": USER, "max_tokens": 2, "add_special_tokens": False})
    text = check_completion_request({"prompt": "hi", "max_tokens": 2, "add_special_tokens": True})
    assert "add_special_tokens" not in chat and "add_special_tokens" not in text
    for check, body in ((check_chat_request, {"messages": USER, "add_special_tokens": True}),
                        (check_completion_request, {"prompt": "hi", "add_special_tokens": False})):
        with pytest.raises(RequestError, match="this server serves only its default") as e:
            check({**body, "max_tokens": 2})
        assert e.value.param == "add_special_tokens"


def test_continue_final_message_continues_the_answer_as_vllm_renders_it(tiny_dir, tmp_path):
    """vLLM's `continue_final_message: true` with `add_generation_prompt: false` (how `gemma_tpu.evaluate --endpoint`
    sends TRL's continue rows, how clients prefill an answer) was a 400 here, "serves only its default": the prompt
    now ends inside the final message, as apply_chat_template(continue_final_message=True) renders it, and
    `add_generation_prompt: false` alone ends it closed. The pair both true is refused as vLLM refuses it, and so is
    a forced tool choice (this server forces a call at the generation prompt)."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving.local import LocalServer

    started = [*USER, {"role": "assistant", "content": "The answer is"}]
    with LocalServer(tiny_dir, name="tiny", log=tmp_path / "serve.log") as server:
        tok = AutoTokenizer.from_pretrained(str(server._workdir / "tiny"))  # the served dir: its chat template
        chat = server.base_url + "/chat/completions"
        got = {}
        for end, extra in (("continue", {"continue_final_message": True, "add_generation_prompt": False}),
                           ("closed", {"add_generation_prompt": False}), ("open", {})):
            code, body = _post(chat, json.dumps({"messages": started, "max_tokens": 6, "temperature": 0,
                                                 **extra}).encode())
            assert code == 200, (end, body)
            got[end] = body
        cfm = "continue_final_message"
        for odd, param in (({cfm: True}, cfm), ({cfm: True, "add_generation_prompt": True}, cfm),
                           ({cfm: "yes", "add_generation_prompt": False}, cfm),
                           ({"add_generation_prompt": False, "tool_choice": "required", "tools": [TOOL]},
                            "tool_choice")):
            code, body = _post(chat, json.dumps({"messages": started, "max_tokens": 2, **odd}).encode())
            assert code == 400 and body["error"]["param"] == param, (odd, body)
    prompts = {end: tok.apply_chat_template(started, tokenize=True, return_dict=True, **kw)["input_ids"]
               for end, kw in (("continue", {"continue_final_message": True, "add_generation_prompt": False}),
                               ("closed", {"add_generation_prompt": False}), ("open", {"add_generation_prompt": True}))}
    assert tok.decode(prompts["continue"]).endswith("The answer is")
    assert len({len(p) for p in prompts.values()}) == 3
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    for end, ids in prompts.items():
        assert got[end]["usage"]["prompt_tokens"] == len(ids), (end, got[end]["usage"], len(ids))
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
        assert got[end]["choices"][0]["message"]["content"] == tok.decode(out, skip_special_tokens=True), end


def test_vllm_extensions_at_their_defaults_are_served_and_other_values_named(tiny_dir, tmp_path):
    """Clients written for vLLM send its request extensions at their defaults (`skip_special_tokens: true`,
    `add_generation_prompt: true`, `echo: false`, `stop_token_ids: []`): vLLM takes them, and this server answered
    400 "Unexpected fields" (transformers serve reads none). At the value this server behaves as they are served;
    another value is refused naming the field, in chat and text completions alike."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    from serving.local import LocalServer

    defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "add_generation_prompt": True,
                "continue_final_message": False, "echo": False, "include_stop_str_in_output": False,
                "stop_token_ids": [], "bad_words": [], "use_beam_search": False, "length_penalty": 1,
                "priority": 0}
    with LocalServer(tiny_dir, name="tiny", log=tmp_path / "serve.log") as server:
        chat, text = server.base_url + "/chat/completions", server.base_url + "/completions"
        code, body = _post(chat, json.dumps({"messages": USER, "max_tokens": 2, **defaults, "request_id": "t1"}).encode())
        assert code == 200 and body["choices"][0]["message"]["role"] == "assistant", body
        assert body["id"] == "chatcmpl-t1", body  # vLLM's request_id: a 400 "Unexpected field" before
        code, body = _post(text, json.dumps({"prompt": "hi", "max_tokens": 2, "echo": False,
                                             "skip_special_tokens": True}).encode())
        assert code == 200 and body["choices"][0]["text"] is not None, body
        for odd in ({"skip_special_tokens": False}, {"stop_token_ids": [5]}, {"length_penalty": 2.0},
                    {"use_beam_search": 1}):
            code, body = _post(chat, json.dumps({"messages": USER, "max_tokens": 2, **odd}).encode())
            (key,) = odd
            assert code == 400 and body["error"]["param"] == key, (odd, body)
            assert "this server serves only its default" in body["error"]["message"], body


def test_request_id_names_the_completion_as_vllm_names_it():
    """vLLM's `request_id` field (chat and text completions, Responses) was refused as an unexpected field; vLLM
    takes it and answers with it as the id: `chatcmpl-ID`, `cmpl-ID` (its X-Request-Id header wins over the field),
    and the Response's id as given. Every chunk of a stream carries the one id; the served app never sees it."""
    from serving.local import CheckedChatApp

    seen: list[dict] = []

    async def inner(scope, receive, send):  # as transformers serve streams: its own request id on every chunk
        body = json.loads((await receive())["body"])
        seen.append(body)
        chat = scope["path"] == "/v1/chat/completions"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for piece, finish in (("a", None), ("b", "stop")):
            choice = {"index": 0, "finish_reason": finish,
                      **({"delta": {"content": piece}} if chat else {"text": piece})}
            chunk = {"id": "inner-uuid", "created": 5, "model": "tiny@main", "choices": [choice],
                     **({"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}} if finish else {})}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": finish is None})

    app = CheckedChatApp(inner, model_name="tiny")
    chat, text = {"messages": USER, "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2}
    for path, body, prefix in (("/v1/chat/completions", chat, "chatcmpl-"), ("/v1/completions", text, "cmpl-")):
        code, resp = _asgi(app, {**body, "request_id": "trace-7"}, path)
        assert code == 200 and resp["id"] == prefix + "trace-7", resp
        assert "request_id" not in seen[-1]
        code, raw = _asgi(app, {**body, "request_id": "trace-7", "stream": True}, path, raw=True)
        chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.strip() and "[DONE]" not in e]
        assert len(chunks) == 2 and {c["id"] for c in chunks} == {prefix + "trace-7"}, chunks
        code, resp = _asgi(app, {**body, "request_id": "trace-7"}, path,
                           headers=JSON_HEADERS + [(b"x-request-id", b"from-header")])
        assert resp["id"] == prefix + "from-header", resp
        # none named: vLLM's prefix before a fresh uuid's hex digits (`random_uuid`), whole and on every chunk; the
        # served app's own bare id was passed on
        code, resp = _asgi(app, body, path)
        assert re.fullmatch(prefix + "[0-9a-f]{32}", resp["id"]), resp
        code, raw = _asgi(app, {**body, "stream": True}, path, raw=True)
        chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.strip() and "[DONE]" not in e]
        assert len({c["id"] for c in chunks}) == 1 and re.fullmatch(prefix + "[0-9a-f]{32}", chunks[0]["id"]), chunks
        assert _asgi(app, body, path)[1]["id"] != resp["id"]
        code, resp = _asgi(app, {**body, "request_id": 7}, path)
        assert code == 400 and resp["error"]["param"] == "request_id", resp
        assert "expected a string, got a number" in resp["error"]["message"]
    code, resp = _asgi(app, {"input": "hi", "request_id": "resp_mine"}, "/v1/responses")
    assert code == 200 and resp["id"] == "resp_mine", resp
    code, raw = _asgi(app, {"input": "hi", "request_id": "resp_mine", "stream": True}, "/v1/responses", raw=True)
    events = [json.loads(e.split("data: ", 1)[1]) for e in raw.split("\n\n") if e.strip()]
    assert {e["response"]["id"] for e in events if "response" in e} == {"resp_mine"}
    code, resp = _asgi(app, {"input": "hi", "request_id": ["x"]}, "/v1/responses")
    assert code == 400 and resp["error"]["param"] == "request_id", resp
    code, resp = _asgi(app, {"input": "hi"}, "/v1/responses")  # none named: `resp_` and a fresh uuid's hex, as vLLM's
    assert code == 200 and re.fullmatch("resp_[0-9a-f]{32}", resp["id"]), resp
    code, raw = _asgi(app, {"input": "hi", "stream": True}, "/v1/responses", raw=True)
    events = [json.loads(e.split("data: ", 1)[1]) for e in raw.split("\n\n") if e.strip()]
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1 and re.fullmatch("resp_[0-9a-f]{32}", ids.pop()), events


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streamed_chunks_carry_the_null_fields_vllm_and_openai_send(path):
    """transformers serve writes its chunks without their null fields: a text completion's chunks came without
    `finish_reason` (and `logprobs`) until the last, a chat's too, and the chat's first chunk without `content` beside
    its role. vLLM and OpenAI send `"finish_reason": null` and `"logprobs": null` on every chunk before the last, and
    the role chunk's `"content": ""`; a client reading `choice["finish_reason"]` or `delta["content"]` failed here.
    vLLM's choices carry `stop_reason` too (a text completion's also `token_ids` and `prompt_token_ids`), null but for
    a stop string: they were left out but where a stop string was cut; and its whole chat message the null fields of
    its ChatMessage (`reasoning`, `refusal`, ...)."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler

    from serving.local import CheckedChatApp

    chat = path == "/v1/chat/completions"
    if chat:  # the served app's own chunks, as it writes them
        handler = ChatCompletionHandler.__new__(ChatCompletionHandler)
        sse = [handler._build_chunk_sse("r1", role="assistant", model="m"),
               *(handler._build_chunk_sse("r1", content=t, model="m") for t in ("a", "b")),
               handler._build_chunk_sse("r1", finish_reason="stop", model="m")]
    else:
        handler = CompletionHandler.__new__(CompletionHandler)
        sse = [*(handler._build_chunk_sse("r1", "m", text=t) for t in ("a", "b")),
               handler._build_chunk_sse("r1", "m", finish_reason="stop")]

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for k, event in enumerate(sse):
            await send({"type": "http.response.body", "body": event.encode(), "more_body": k < len(sse) - 1})

    body = {"messages": USER, "max_tokens": 2} if chat else {"prompt": "hi", "max_tokens": 2}
    code, raw = _asgi(CheckedChatApp(inner), {**body, "stream": True}, path, raw=True)
    chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.strip() and "[DONE]" not in e]
    assert code == 200 and len(chunks) == len(sse), chunks
    choices = [c["choices"][0] for c in chunks]
    assert [c["finish_reason"] for c in choices] == [None] * (len(sse) - 1) + ["stop"], choices
    assert all(c["logprobs"] is None for c in choices), choices
    # transformers serve's `"system_fingerprint": ""` on every chat chunk: a field vLLM's chunks leave out (unset)
    assert not any("system_fingerprint" in c for c in chunks), chunks
    # and vLLM's own: a text completion's `stop_reason`, `token_ids` and `prompt_token_ids` on every chunk, a chat's
    # `stop_reason` on its finishing chunk (null: no stop string ended it)
    if chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}, choices
        assert "".join(c["delta"].get("content") or "" for c in choices) == "ab"
        assert "stop_reason" in choices[-1] and choices[-1]["stop_reason"] is None, choices
    else:
        assert "".join(c["text"] for c in choices) == "ab"
        assert all({k: c.get(k, "missing") for k in ("stop_reason", "token_ids", "prompt_token_ids")} ==
                   dict.fromkeys(("stop_reason", "token_ids", "prompt_token_ids")) for c in choices), choices
    # the whole answer's choice too (transformers serve's chunks put together here)
    code, whole = _asgi(CheckedChatApp(inner), body, path)
    assert code == 200 and whole["choices"][0]["logprobs"] is None and whole["choices"][0]["finish_reason"] == "stop"
    nulls = ("stop_reason", "token_ids") if chat else ("stop_reason", "token_ids", "prompt_token_ids")
    assert {k: whole["choices"][0].get(k, "missing") for k in nulls} == dict.fromkeys(nulls), whole
    if chat:  # and vLLM's ChatMessage's: its `reasoning` null for a model without a thought
        message = whole["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "ab", "reasoning": None, "refusal": None,
                           "annotations": None, "audio": None, "function_call": None}, message
    # a stop string that ended the text is the stop_reason, whole and streamed, as vLLM names it
    code, whole = _asgi(CheckedChatApp(inner), {**body, "stop": "b"}, path)
    assert whole["choices"][0]["stop_reason"] == "b", whole
    code, raw = _asgi(CheckedChatApp(inner), {**body, "stop": "b", "stream": True}, path, raw=True)
    last = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.strip() and "[DONE]" not in e][-1]
    assert last["choices"][0]["stop_reason"] == "b", last


def test_a_response_echoes_the_request_settings_as_vllm_does(tmp_path):
    """vLLM's Response (ResponsesResponse.from_request) and OpenAI's echo the request's settings: `text` (its format),
    `truncation`, `reasoning`, `service_tier`, `user`, `max_tool_calls`, with `background` false and no
    `previous_response_id`; the local server's Response left them out (the SDK read them as None: `resp.text.format`
    an AttributeError), whole and in the stream's response events. Unset, they are vLLM's request defaults: `text`
    and `metadata` null, as vLLM echoes the request's own field (OpenAI's default format and {} were written). The
    sampling is echoed as the request gets it, as vLLM echoes its SamplingParams."""
    pytest.importorskip("openai")
    from openai.types.responses import Response

    from serving.local import CheckedChatApp

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for d, finish in (({"role": "assistant"}, None), ({"content": "ok"}, None), ({}, "stop")):
            chunk = {"id": "r1", "created": 5, "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": finish is None})

    app = CheckedChatApp(inner, model_name="tiny")
    given = {"text": {"format": {"type": "text"}}, "truncation": "auto", "reasoning": {"effort": "low"},
             "service_tier": "default", "user": "u1", "max_tool_calls": 3}
    defaults = {"text": None, "metadata": None, "truncation": "disabled", "reasoning": None,
                "service_tier": "auto", "user": None, "max_tool_calls": None}
    for request, expected in (({"input": "hi", **given}, given), ({"input": "hi"}, defaults)):
        code, whole = _asgi(app, request, "/v1/responses")
        assert code == 200 and {k: whole.get(k, "missing") for k in expected} == expected, whole
        assert (whole.get("background"), whole.get("previous_response_id", "missing")) == (False, None), whole
        valid = Response.model_validate(whole)  # the pinned SDK reads either
        assert (valid.text.format.type if "text" in request else valid.text) == (
            "text" if "text" in request else None)
        code, text = _asgi(app, {**request, "stream": True}, "/v1/responses", raw=True)
        events = [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if e.strip()]
        for e in (e for e in events if "response" in e):
            assert {k: e["response"].get(k, "missing") for k in expected} == expected, e
    # the sampling as the request gets it, as vLLM echoes its SamplingParams (numbers; they were null when left out):
    # the model's default temperature / top_p (generation_config.json), else 1, top_p 1 when greedy, and
    # max_output_tokens as resolved (what the context leaves after the prompt)
    app = CheckedChatApp(inner, model_name="tiny", context=100, count_prompt=lambda body: 10,
                         sampling_defaults={"top_p": 0.95})
    sampling = ("temperature", "top_p", "max_output_tokens")
    for request, expected in (({"input": "hi"}, (1.0, 0.95, 90)),
                              ({"input": "hi", "temperature": 0}, (0, 1.0, 90)),
                              ({"input": "hi", "temperature": 0.5, "top_p": 0.3, "max_output_tokens": 7},
                               (0.5, 0.3, 7)),
                              ({"input": "hi", "temperature": 1e-9}, (0.01, 0.95, 90))):
        code, whole = _asgi(app, request, "/v1/responses")
        assert code == 200 and tuple(whole[k] for k in sampling) == expected, (request, whole)
        code, text = _asgi(app, {**request, "stream": True}, "/v1/responses", raw=True)
        events = [json.loads(e.split("data: ", 1)[1]) for e in text.split("\n\n") if e.strip()]
        assert {tuple(e["response"][k] for k in sampling) for e in events if "response" in e} == {expected}, events
    from serving.local import sampling_defaults

    model = tmp_path / "m"
    model.mkdir()
    assert sampling_defaults(model) == {}
    (model / "generation_config.json").write_text(json.dumps({"top_p": 0.95, "top_k": 64, "temperature": True}))
    assert sampling_defaults(model) == {"top_p": 0.95}


def test_vllms_request_extensions_of_its_pinned_release_are_served():
    """vllm-tpu 0.27's chat completion takes `include_reasoning` (default true; its Responses API takes it as an extra
    field it does not read) and its Responses API the sampling extensions of a chat completion (`top_k`,
    `repetition_penalty`, `frequency_penalty`, `logit_bias`, `ignore_eos`, `chat_template_kwargs`,
    `skip_special_tokens`, ...): the local server refused them ("Unexpected field", "unknown parameter"). They are
    read as a chat completion reads them; a value this server cannot serve is refused naming the field, as before."""
    from serving.responses import chat_request, request_param

    assert "include_reasoning" not in check_chat_request({"messages": USER, "include_reasoning": True})
    assert check_chat_request({"messages": USER, "include_reasoning": False})["include_reasoning"] is False
    with pytest.raises(RequestError, match="expected true or false") as e:
        check_chat_request({"messages": USER, "include_reasoning": "no"})
    assert e.value.param == "include_reasoning"
    assert "include_reasoning" not in chat_request({"input": "hi", "include_reasoning": False})  # as vLLM: unread
    body = check_chat_request(chat_request({"input": "hi", "top_k": 5, "repetition_penalty": 1.1, "ignore_eos": False,
                                            "logit_bias": {"7": -100}, "frequency_penalty": 0,
                                            "skip_special_tokens": True, "include_reasoning": True, "priority": 0,
                                            "chat_template_kwargs": {"x": 1}}))
    assert json.loads(body["generation_config"]) == {"do_sample": True, "top_k": 5, "repetition_penalty": 1.1}
    assert body["logit_bias"] == {"7": -100.0} and body["chat_template_kwargs"] == {"x": 1}
    for request, param in (({"input": "hi", "presence_penalty": 0.5}, "presence_penalty"),
                           ({"input": "hi", "top_k": "5"}, "top_k"),
                           ({"input": "hi", "skip_special_tokens": False}, "skip_special_tokens")):
        with pytest.raises(RequestError) as e:
            check_chat_request(chat_request(request))
        assert request_param(e.value.param, request) == param
