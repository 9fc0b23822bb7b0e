"""The data pipeline, checked by outcome: formats, exact rendering, loss masks, length policies,
pad/pack rows, grain order and resume, multi-process slices, chat-template equivalence, inspect.

Most tests use a small character-level tokenizer with Gemma's control-token ids (written in a
second); the ones marked by `any_tok` also run on the real Gemma 3 tokenizer when the embedded
270M has been prepared (skipped otherwise).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu.core.config import DataConfig
from gemma_tpu.core.errors import UserError
from gemma_tpu.data import (
    Renderer,
    TrainStream,
    batching,
    eval_batches,
    load_conversations,
    prepare_split,
    render_examples,
)
from gemma_tpu.data.records import normalise_messages, normalise_sharegpt
from gemma_tpu.data.render import template_messages
from gemma_tpu.formats.function_calling import function_token_map
from tests.conftest import REPO, assert_one_line_error, run_cli

# ----------------------------------------------------------------------------- fixtures, helpers

SOT, EOT = "<start_of_turn>", "<end_of_turn>"

STEPS_TOOL = {"type": "function", "function": {
    "name": "get_steps", "description": "Steps on a day.",
    "parameters": {"type": "object", "properties": {"date": {"type": "string"}}}}}
HR_TOOL = {"type": "function", "function": {
    "name": "get_heart_rate", "description": "Heart rate.",
    "parameters": {"type": "object", "properties": {"date": {"type": "string"},
                                                    "metric": {"type": "string", "enum": ["resting", "max"]}}}}}
STEPS_DECL = ("<start_function_declaration>declaration:get_steps{description:<escape>Steps on a day.<escape>,"
              "parameters:{type:<escape>object<escape>,properties:{date:{type:<escape>string<escape>}}}}"
              "<end_function_declaration>")
HR_DECL = ("<start_function_declaration>declaration:get_heart_rate{description:<escape>Heart rate.<escape>,"
           "parameters:{type:<escape>object<escape>,properties:{date:{type:<escape>string<escape>},"
           "metric:{type:<escape>string<escape>,enum:[<escape>resting<escape>,<escape>max<escape>]}}}}"
           "<end_function_declaration>")

CHAT = {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "It is 8."},
]}
CHAT_TEXT = (f"{SOT}user\nYou are terse.\n\nWhat is 2+2?{EOT}\n{SOT}model\n4.{EOT}\n"
             f"{SOT}user\nAnd doubled?{EOT}\n{SOT}model\nIt is 8.{EOT}\n")

TOOL_CHAT = {"tools": [STEPS_TOOL, HR_TOOL], "messages": [
    {"role": "developer", "content": "You are a coach."},
    {"role": "user", "content": "Steps today?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_steps", "arguments": {"date": "today"}}}]},
    {"role": "tool", "name": "get_steps", "content": "{\"steps\": 5, \"date\": \"2026-11-21\"}"},
    {"role": "assistant", "content": "You walked 5 steps."},
]}
TOOL_CALL = "<start_function_call>call:get_steps{date:<escape>today<escape>}<end_function_call>"
TOOL_TEXT = (f"{SOT}developer\nYou are a coach.{STEPS_DECL}{HR_DECL}{EOT}\n{SOT}user\nSteps today?{EOT}\n"
             f"{SOT}model\n{TOOL_CALL}<start_function_response>response:get_steps{{steps:5,date:<escape>2026-11-21"
             f"<escape>}}<end_function_response>You walked 5 steps.{EOT}\n")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from gemma_tpu.assets.tiny import _write_small_tokenizer

    out = tmp_path_factory.mktemp("small_tok")
    _write_small_tokenizer(out, 512)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def real_tok():
    from transformers import AutoTokenizer

    from gemma_tpu.assets import embedded as assets
    path = assets.target_dir("gemma3-270m")
    if not assets.is_complete(path):
        pytest.skip("the embedded Gemma 3 270M is not prepared (python -m gemma_tpu.assets prepare gemma3-270m)")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(params=["small", "gemma3"])
def any_tok(request, tok):
    return tok if request.param == "small" else request.getfixturevalue("real_tok")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def masked_runs(tokenizer, r) -> list[str]:
    """Decoded text of each contiguous run of loss-bearing tokens."""
    runs, cur = [], []
    for i, m in zip(r.ids.tolist(), r.loss_mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def norm(conv: dict) -> dict:
    return normalise_messages(conv, "test")


def chat_rows(n: int, seed: int = 0, long_every: int = 0) -> list[dict]:
    """n distinct small chats of varied lengths (every `long_every`-th one with a long answer)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        q = f"Question {i}: " + "x" * int(rng.integers(0, 40))
        a = f"Answer {i}. " + "y" * int(rng.integers(1, 60))
        if long_every and i % long_every == 0:
            a += "z" * 300
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if i % 3 == 0:
            msgs = [{"role": "system", "content": "Be brief."}] + msgs + [
                {"role": "user", "content": "More?"}, {"role": "assistant", "content": f"No more {i}."}]
        rows.append({"messages": msgs})
    return rows


# --------------------------------------------------------------------------------- rendering


def test_multiturn_chat_renders_exactly_with_system_folded(any_tok):
    r = Renderer(any_tok).render(norm(CHAT))
    assert r.text == CHAT_TEXT
    assert r.ids[0] == 2 and any_tok.decode(r.ids[1:].tolist(), skip_special_tokens=False) == CHAT_TEXT
    assert r.ids.dtype == np.int32 and r.loss_mask.dtype == bool and r.offsets.shape == (len(r.ids), 2)


def test_developer_turn_folds_like_system(tok):
    conv = {"messages": [{"role": "developer", "content": "Rules."}, *CHAT["messages"][1:3]]}
    assert Renderer(tok).render(norm(conv)).text == f"{SOT}user\nRules.\n\nWhat is 2+2?{EOT}\n{SOT}model\n4.{EOT}\n"


def test_loss_mask_is_every_assistant_turn_with_end_of_turn(any_tok):
    r = Renderer(any_tok).render(norm(CHAT))
    assert masked_runs(any_tok, r) == [f"4.{EOT}", f"It is 8.{EOT}"]
    assert not r.loss_mask[0]  # BOS is never a target


def test_loss_on_all_trains_every_token(any_tok):
    r = Renderer(any_tok, loss_on="all").render(norm(CHAT))
    assert r.loss_mask.all()
    ex, rep = batching.fit_length([batching.Example(r.ids, r.loss_mask)], 512, "truncate", "x")
    row = batching.build_row(ex, 512, 512)
    assert row["loss_weights"].sum() == len(r.ids) - 1  # every next token is a target
    np.testing.assert_array_equal(row["loss_targets"][: len(r.ids) - 1], r.ids[1:])


def test_unknown_loss_on_and_chat_format_are_refused(tok):
    with pytest.raises(UserError, match="data.loss_on"):
        Renderer(tok, loss_on="prompt")
    with pytest.raises(UserError, match="data.chat_format"):
        Renderer(tok, chat_format="llama")


def test_generation_prompt(tok):
    prompt = {"messages": CHAT["messages"][:2]}
    r = Renderer(tok).render(prompt, add_generation_prompt=True)
    assert r.text == f"{SOT}user\nYou are terse.\n\nWhat is 2+2?{EOT}\n{SOT}model\n"
    assert not r.loss_mask.any()


def test_tool_chat_renders_functiongemma_format_exactly(any_tok):
    r = Renderer(any_tok).render(norm(TOOL_CHAT))
    assert r.text == TOOL_TEXT
    # trained: the call and the marker that hands over to the tool, then the answer; not the tool's result
    assert masked_runs(any_tok, r) == [TOOL_CALL + "<start_function_response>", f"You walked 5 steps.{EOT}"]


def test_token_map_puts_markers_on_unused_tokens(any_tok):
    token_map = function_token_map(any_tok)
    vocab = any_tok.get_vocab()
    assert list(token_map) == ["<start_function_declaration>", "<end_function_declaration>", "<start_function_call>",
                               "<end_function_call>", "<start_function_response>", "<end_function_response>",
                               "<escape>"]
    assert all(v.startswith("<unused") and v in vocab for v in token_map.values())
    assert len(set(token_map.values())) == 7
    r = Renderer(any_tok, token_map=token_map).render(norm(TOOL_CHAT))
    mapped = TOOL_TEXT
    for marker, repl in token_map.items():
        mapped = mapped.replace(marker, repl)
    assert r.text == mapped and "<escape>" not in r.text
    from gemma_tpu.formats.function_calling import unmap_markers

    runs = [unmap_markers(t, token_map) for t in masked_runs(any_tok, r)]
    assert runs == [TOOL_CALL + "<start_function_response>", f"You walked 5 steps.{EOT}"]


def test_token_map_skips_markers_the_vocabulary_has(tok_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tok_dir))
    t.add_special_tokens({"additional_special_tokens": ["<start_function_call>", "<end_function_call>"]})
    m = function_token_map(t)
    assert "<start_function_call>" not in m and "<end_function_call>" not in m and len(m) == 5


def test_parallel_calls_each_result_opens_its_response(tok):
    conv = {"tools": [STEPS_TOOL, HR_TOOL], "messages": [
        {"role": "user", "content": "Steps and resting HR today?"},
        {"role": "assistant", "content": "Checking. ", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_steps", "arguments": {"date": "today"}}},
            {"id": "b", "type": "function",
             "function": {"name": "get_heart_rate", "arguments": '{"date": "today", "metric": "resting"}'}}]},
        {"role": "tool", "tool_call_id": "b", "content": "{\"bpm\": 51}"},  # names resolved from the call ids
        {"role": "tool", "tool_call_id": "a", "content": "{\"steps\": 5}"},
        {"role": "assistant", "content": "5 steps, 51 bpm."},
    ]}
    c = norm(conv)
    assert [m.get("name") for m in c["messages"] if m["role"] == "tool"] == ["get_heart_rate", "get_steps"]
    r = Renderer(tok).render(c)
    hr_call = "<start_function_call>call:get_heart_rate{date:<escape>today<escape>,metric:<escape>resting<escape>}" \
              "<end_function_call>"
    assert r.text == (f"{SOT}developer\n{STEPS_DECL}{HR_DECL}{EOT}\n"
                      f"{SOT}user\nSteps and resting HR today?{EOT}\n{SOT}model\nChecking. {TOOL_CALL}{hr_call}"
                      "<start_function_response>response:get_heart_rate{bpm:51}<end_function_response>"
                      "<start_function_response>response:get_steps{steps:5}<end_function_response>"
                      f"5 steps, 51 bpm.{EOT}\n")
    assert masked_runs(tok, r) == [f"Checking. {TOOL_CALL}{hr_call}<start_function_response>", f"5 steps, 51 bpm.{EOT}"]


def test_tool_results_given_as_json_values_are_their_json_text():
    """A tool result given as a JSON array is read as one given as an object or a number is, its JSON text (rendered
    as `{result:[...]}`): it was refused as "content[0]: expected a text part", read as OpenAI's content parts."""
    for content, text in (([1, 2], "[1, 2]"), ([{"steps": 5}], '[{"steps": 5}]'), ({"steps": 5}, '{"steps": 5}'),
                          (5, "5"), ([{"type": "text", "text": "5 steps"}], "5 steps")):
        conv = json.loads(json.dumps(TOOL_CHAT))
        conv["messages"][3]["content"] = content
        assert norm(conv)["messages"][3]["content"] == text, content
    conv["messages"][3]["content"] = [{"type": "text", "text": "x"}, 1]  # parts and something else: not a result
    with pytest.raises(UserError, match=r"messages\[3\]: content\[1\]: expected a text part"):
        norm(conv)


def test_nameless_tool_results_answer_calls_in_order(tok):
    conv = json.loads(json.dumps(TOOL_CHAT))
    del conv["messages"][3]["name"]
    assert norm(conv)["messages"][3]["name"] == "get_steps"
    conv["messages"][3]["name"] = "get_heart_rate"
    assert norm(conv)["messages"][3]["name"] == "get_heart_rate"
    conv["messages"][3]["name"] = "get_weather"
    with pytest.raises(UserError, match=r"messages\[3\].*'get_weather', which is not in 'tools'"):
        norm(conv)


def test_tool_call_ids_must_match_a_call_once():
    """A tool result whose tool_call_id matches no call used to be credited to the next call in order."""
    conv = json.loads(json.dumps(TOOL_CHAT))
    conv["messages"][2]["tool_calls"][0]["id"] = "call_1"
    del conv["messages"][3]["name"]
    conv["messages"][3]["tool_call_id"] = "call_1"
    assert norm(conv)["messages"][3]["name"] == "get_steps"
    conv["messages"][3]["tool_call_id"] = "call_9"
    with pytest.raises(UserError, match=r"messages\[3\]: tool_call_id 'call_9' matches no call of the preceding "
                                        r"assistant turn \(its call ids: 'call_1'\)"):
        norm(conv)
    conv["messages"][3].update(tool_call_id="call_1", name="get_heart_rate")
    with pytest.raises(UserError, match=r"named 'get_heart_rate' answers tool_call_id 'call_1', a call to 'get_steps'"):
        norm(conv)
    del conv["messages"][3]["name"]
    twice = {**conv, "messages": [*conv["messages"][:4], dict(conv["messages"][3]), *conv["messages"][4:]]}
    with pytest.raises(UserError, match=r"messages\[4\]: tool_call_id 'call_1' was already answered"):
        norm(twice)
    del conv["messages"][2]["tool_calls"][0]["id"]
    with pytest.raises(UserError, match=r"matches no call .*\(its calls have no ids\)"):
        norm(conv)
    # two calls of a turn with one id: refused at the call (was 'already answered' at the second result, or 'the
    # assistant continues before every tool call ... has a result' after one), as the local server refuses it
    call = TOOL_CHAT["messages"][2]["tool_calls"][0]
    conv["messages"][2]["tool_calls"] = [{**call, "id": "a"}, {**call, "id": "a"}]
    with pytest.raises(UserError, match=r"messages\[2\].tool_calls\[1\]: id 'a' is also the id of tool_calls\[0\]"):
        norm(conv)


SETS = {"type": "array", "items": {"type": "object", "properties": {"reps": {"type": "integer"}, "kind": {
    "enum": ["a", "b"]}}, "required": ["reps"]}}


@pytest.mark.parametrize("arguments, schema, message", [
    ({"day": "today"}, None, r"'day' is not a declared parameter \(parameters: date\)"),
    ({}, {"required": ["date"]}, r"the required parameter 'date' is missing"),
    ({"date": 3}, None, r"'date' is declared string, got a number 3"),
    ({"date": "today", "metric": "avg"}, {"properties": {"date": {"type": "string"}, "metric": {"enum": ["max"]}}},
     r"'metric' is \"avg\", not one of its enum \(\"max\"\)"),
    ({"n": True}, {"properties": {"n": {"type": "integer"}}}, r"'n' is declared integer, got a boolean true"),
    # nested schemas, checked as the top level is, the problem naming its path (only the top level was checked)
    ({"sets": [{"reps": 5}, {"reps": 3}, {"rep": 5}]}, {"properties": {"sets": SETS}},
     r"'sets\[2\].rep' is not a declared property \(properties: reps, kind\)"),
    ({"sets": [{"reps": 5}, {"kind": "a"}]}, {"properties": {"sets": SETS}},
     r"the required property 'sets\[1\].reps' is missing"),
    ({"sets": [{"reps": "5"}]}, {"properties": {"sets": SETS}}, r"'sets\[0\].reps' is declared integer, got a string"),
    ({"sets": [{"reps": 5, "kind": "c"}]}, {"properties": {"sets": SETS}}, r"'sets\[0\].kind' is \"c\", not one of"),
    ({"o": {"unit": 3}}, {"properties": {"o": {"type": "object", "properties": {"unit": {"type": "string"}}}}},
     r"'o.unit' is declared string, got a number 3"),
    # unions as pydantic writes them (Optional, Union, nested models): a value must pass a branch (were not walked)
    ({"unit": "kelvin"}, {"properties": {"unit": {"anyOf": [{"enum": ["c", "f"]}, {"type": "null"}]}}},
     r"'unit' matches none of the 2 schemas of its anyOf \(the first: 'unit' is \"kelvin\", not one of its enum"),
    ({"loc": {"town": "P"}}, {"properties": {"loc": {"oneOf": [{"type": "string"}, {"type": "object", "properties": {
        "city": {"type": "string"}}}]}}}, r"'loc' matches none of the 2 schemas of its oneOf \(the first: 'loc' is "
                                           r"declared string, got an object"),
    ({"tags": ["a", 1.5]}, {"properties": {"tags": {"items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}},
     r"'tags\[1\]' matches none of the 2 schemas of its anyOf"),
    ({"r": 3}, {"properties": {"r": {"allOf": [{"type": "integer"}, {"enum": [1, 2]}]}}},
     r"'r' is 3, not one of its enum \(1, 2\)"),
    # pydantic's nested models and enums, referred to in $defs (a $ref was a branch taking any value)
    ({"loc": {"town": "P"}}, {"properties": {"loc": {"$ref": "#/$defs/Loc"}}, "$defs": {"Loc": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
     r"'loc.town' is not a declared property \(properties: city\)"),
    ({"unit": "k"}, {"properties": {"unit": {"anyOf": [{"$ref": "#/$defs/Unit"}, {"type": "null"}]}}, "$defs": {
        "Unit": {"enum": ["c", "f"]}}}, r"'unit' matches none of the 2 schemas of its anyOf \(the first: 'unit' is "
                                         r"\"k\", not one of its enum"),
    # a const (pydantic's Literal["x"]; a discriminated union's tag) was not checked: {"kind": "b"} passed branch a
    ({"shape": {"kind": "b", "r": 1}}, {"properties": {"shape": {"oneOf": [
        {"properties": {"kind": {"const": "a"}, "r": {"type": "number"}}},
        {"properties": {"kind": {"const": "b"}, "w": {"type": "number"}}}]}}},
     r"'shape' matches none of the 2 schemas of its oneOf \(the first: 'shape.kind' is \"b\", not its const \"a\"\)"),
])
def test_call_arguments_are_checked_against_the_declared_schema(arguments, schema, message):
    """A call's arguments were never checked against the tool's declaration: a model trained on rows calling with a
    key the schema does not declare, without a required one, or with a value of another type. Checked where the
    schema declares properties and lets no others in; a schema without properties, additionalProperties and a null
    (an argument not given) are accepted."""
    conv = json.loads(json.dumps(TOOL_CHAT))
    conv["tools"][0]["function"]["parameters"].update(schema or {})
    conv["messages"][2]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(UserError, match=r"^test: messages\[2\].tool_calls\[0\]: calls get_steps with arguments its "
                                        r"declaration in 'tools' refuses: " + message):
        norm(conv)
    conv["tools"][0]["function"]["parameters"] = {"type": "object", "properties": {}}
    assert norm(conv)["messages"][2]["tool_calls"][0]["arguments"] == arguments  # nothing declared: accepted
    conv["tools"][0]["function"]["parameters"] = {**STEPS_TOOL["function"]["parameters"], "additionalProperties": True}
    conv["messages"][2]["tool_calls"][0]["function"]["arguments"] = {"date": None, "day": 1, "n": 3.0}
    assert norm(conv)["messages"][2]["tool_calls"][0]["arguments"]["day"] == 1


def test_tool_result_must_follow_a_call():
    conv = json.loads(json.dumps(TOOL_CHAT))
    # more results in a row than calls: the extra one answered nothing (openai_client gave it an id never issued)
    extra = {**conv, "messages": [*conv["messages"][:4], dict(conv["messages"][3]), *conv["messages"][4:]]}
    with pytest.raises(UserError, match=r"messages\[4\]: a tool result past the 1 call of the preceding assistant "
                                        r"turn \(each result answers one call\)"):
        norm(extra)
    del extra["messages"][4]["name"]
    with pytest.raises(UserError, match=r"messages\[4\]: a tool result past the 1 call"):
        norm(extra)
    del conv["messages"][2]  # the call is gone: its result now follows the user turn
    with pytest.raises(UserError, match=r"messages\[2\]: a tool result must follow an assistant turn with "
                                        r"tool_calls .*; it follows user"):
        norm(conv)


def test_normalisation_is_idempotent_and_accepts_openai_shapes():
    conv = json.loads(json.dumps(TOOL_CHAT))
    conv["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"date": "today"}'  # a JSON string
    conv["messages"][2]["content"] = None
    conv["messages"][4]["content"] = [{"type": "text", "text": "You walked "}, {"type": "text", "text": "5 steps."}]
    once = norm(conv)
    twice = normalise_messages({"messages": once["messages"], "tools": once["tools"]}, "test")
    assert once == twice
    assert once["messages"][2]["tool_calls"] == [{"name": "get_steps", "arguments": {"date": "today"}}]
    assert once["messages"][4]["content"] == "You walked 5 steps."
    model_role = {"messages": [{"role": "user", "content": "hi"}, {"role": "model", "content": "hello"}]}
    assert norm(model_role)["messages"][1]["role"] == "assistant"




@pytest.mark.parametrize("tail, line, hint", [
    (b"\x00" * 4096, 3, "the line holds 4096 NUL bytes, as a file cut short by a crash or a copy is padded"),
    (b"\x00\x00\n", 3, "the line holds 2 NUL bytes"),
    (None, 1, "lines end in CR alone (classic Mac line endings): convert them to LF"),
])
def test_a_line_of_nul_bytes_or_cr_line_endings_is_named_as_such(tmp_path, tail, line, hint):
    """A JSONL file zero-padded by a crash (the tail of a write that never landed) and one with CR-only line endings
    were "not valid JSON (Expecting value at column 1)" / "(Extra data at column 94)": true, and no help."""
    row = json.dumps(CHAT).encode()
    path = tmp_path / "d.jsonl"
    path.write_bytes(row + b"\r" + row + b"\r" if tail is None else row + b"\n" + row + b"\n" + tail)
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:{line}: not valid JSON \(.*; {re.escape(hint)}"):
        load_conversations(path, DataConfig())


@pytest.mark.parametrize("name, sep", [("d.csv", ""), ("d.tsv.gz", ", sep='\\t'")])
def test_a_csv_file_is_named_as_such(tmp_path, name, sep):
    """A CSV or TSV export (a spreadsheet's, pandas') was "not valid JSON (Expecting value at column 1)"."""
    text = "prompt,completion\nhi,yo\n".replace(",", "\t" if sep else ",").encode()
    (tmp_path / name).write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    with pytest.raises(UserError) as e:
        load_conversations(tmp_path / name, DataConfig())
    kind = "TSV" if sep else "CSV"
    assert str(e.value) == (f"{tmp_path / name}:1: not valid JSON (Expecting value at column 1; a {kind} file, which "
                            f"is not read: convert it to JSON Lines, e.g. pandas.read_csv(FILE{sep}).to_json("
                            f"'train.jsonl', orient='records', lines=True))")


def test_text_rows_among_chats_are_said_to_train_every_token(tmp_path, caplog):
    """A file of chats with some `{"text": ...}` rows (a pretraining shard concatenated to it, or chats that lost
    their messages) trained those rows on every token, without chat markup, and said nothing. Now one warning
    names the count and the first; files of one kind say nothing."""
    import logging

    text = {"text": "Plain prose with no turns."}
    path = write_jsonl(tmp_path / "mixed.jsonl", [CHAT, CHAT, text, text])
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        convs = load_conversations(path, DataConfig())
    assert sum("text" in c for c in convs) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 2 of 4 examples are language-modeling rows (a 'text' field and none of a chat's: the first is "
        f"{path}:3), trained on every token without chat markup, beside 2 chats; if that is not meant, fix those "
        f"rows or set data.format"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        load_conversations(write_jsonl(tmp_path / "t.jsonl", [text, text]), DataConfig())
        load_conversations(write_jsonl(tmp_path / "c.jsonl", [CHAT, {"prompt": "a", "completion": "b"}]),
                           DataConfig())
    assert not caplog.records

def test_reasoning_beside_an_answer_is_said_to_be_left_out(tmp_path, caplog):
    """R1-style exports put the model's reasoning in `reasoning_content` (or `reasoning`, `thinking`) beside the
    answer: it was dropped like any unknown key, without a word, and the run trained answers without it. It is
    still not rendered (the conversation is the same as without it), and one warning per file names it."""
    import logging

    plain = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}
    r1 = json.loads(json.dumps(plain))
    r1["messages"][1]["reasoning_content"] = "Two and two make four."
    empty = json.loads(json.dumps(plain))
    empty["messages"][1]["thinking"] = ""
    path = write_jsonl(tmp_path / "r1.jsonl", [plain, r1, empty, r1])
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        convs = load_conversations(path, DataConfig())
    assert [c["messages"] for c in convs] == [convs[0]["messages"]] * 4  # rendered as without it
    warned = [r.getMessage() for r in caplog.records if "reasoning" in r.getMessage()]
    assert warned == [f"{path}: 2 of 4 examples carry a model's reasoning beside an answer (first: {path}:2: "
                      f"messages[1].reasoning_content); it is left out of the rendered text, so not trained (a "
                      f"message renders its content and tool calls): to train on it, put it in the content"], caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        load_conversations(write_jsonl(tmp_path / "plain.jsonl", [plain, empty]), DataConfig())
    assert "reasoning" not in caplog.text


# ------------------------------------------------------------------------------ input formats


DOLLY = [
    {"instruction": "Name a colour.", "context": "", "response": "Blue.", "category": "open_qa"},
    {"instruction": "Summarise.", "context": "Cats sleep a lot.", "response": "Cats nap.", "category": "summarization"},
]


def test_dolly_rows_with_default_fields(tmp_path, tok):
    path = write_jsonl(tmp_path / "dolly.jsonl", DOLLY)
    convs = load_conversations(path, DataConfig())  # format auto
    r = Renderer(tok)
    assert r.render(convs[0]).text == f"{SOT}user\nName a colour.{EOT}\n{SOT}model\nBlue.{EOT}\n"
    assert r.render(convs[1]).text == f"{SOT}user\nSummarise.\n\nCats sleep a lot.{EOT}\n{SOT}model\nCats nap.{EOT}\n"
    assert masked_runs(tok, r.render(convs[1])) == [f"Cats nap.{EOT}"]
    assert [c["where"] for c in convs] == [f"{path}:1", f"{path}:2"]


def test_instruction_pairs_with_a_custom_field_mapping(tmp_path, tok):
    rows = [{"prompt": "Translate: chat", "source": "French", "answer": "cat"},
            {"prompt": "Say hi", "answer": "hi"}]  # the context column is optional per row
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    cfg = DataConfig(format="instruction", instruction_field="prompt", context_field="source", response_field="answer")
    convs = load_conversations(path, cfg)
    r = Renderer(tok)
    assert r.render(convs[0]).text == f"{SOT}user\nTranslate: chat\n\nFrench{EOT}\n{SOT}model\ncat{EOT}\n"
    assert r.render(convs[1]).text == f"{SOT}user\nSay hi{EOT}\n{SOT}model\nhi{EOT}\n"
    no_ctx = load_conversations(path, DataConfig(format="instruction", instruction_field="prompt", context_field=None,
                                                 response_field="answer"))
    assert r.render(no_ctx[0]).text == f"{SOT}user\nTranslate: chat{EOT}\n{SOT}model\ncat{EOT}\n"


def _untrained_first_answer(conv: dict) -> dict:
    out = json.loads(json.dumps(conv))
    next(m for m in out["messages"] if m["role"] == "assistant")["train"] = False
    return out


def test_prompt_completion_and_sharegpt_rows_render_as_their_messages(tmp_path, any_tok):
    """TRL's prompt-completion rows (text or messages, also as Parquet JSON strings) and ShareGPT rows are
    the same conversations as messages rows; a prompt-completion row trains its completion only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = CHAT["messages"]
    rows = [{"prompt": "What is 2+2?", "completion": "4."},
            {"prompt": msgs[:4], "completion": msgs[4:]},
            {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                "value": m["content"]} for m in msgs]}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    r = Renderer(any_tok)
    text_pair, conv_pair, sharegpt = (r.render(c) for c in load_conversations(path, DataConfig()))
    assert text_pair.text == f"{SOT}user\nWhat is 2+2?{EOT}\n{SOT}model\n4.{EOT}\n"
    assert masked_runs(any_tok, text_pair) == [f"4.{EOT}"]
    assert conv_pair.text == sharegpt.text == CHAT_TEXT
    assert masked_runs(any_tok, conv_pair) == [f"It is 8.{EOT}"]  # the prompt's answer is context
    assert masked_runs(any_tok, sharegpt) == [f"4.{EOT}", f"It is 8.{EOT}"]
    assert conv_pair.loss_mask.tolist() == r.render(norm(_untrained_first_answer(CHAT))).loss_mask.tolist()
    # Hub Parquet files keep message lists as JSON strings; text that only looks like JSON stays text
    pq.write_table(pa.Table.from_pylist([{"prompt": json.dumps(msgs[:4]), "completion": json.dumps(msgs[4:])},
                                         {"prompt": "[{not json", "completion": "ok"}]), tmp_path / "pc.parquet")
    from_parquet = load_conversations(tmp_path / "pc.parquet", DataConfig(format="prompt_completion"))
    assert r.render(from_parquet[0]).loss_mask.tolist() == conv_pair.loss_mask.tolist()
    assert from_parquet[1]["messages"][0]["content"] == "[{not json"


def test_a_prompt_ending_in_a_partial_answer_trains_its_continuation(tmp_path, gemma_template_tok, caplog):
    """TRL's "continue final message" rows: the prompt ends in the start of the assistant's answer and the completion
    continues it. The answer is one turn whose given start is context: the trained text is what a server generates
    after the prompt it renders with continue_final_message=True (they were refused as two assistant turns)."""
    t = gemma_template_tok
    prompt = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 6*7?"},
              {"role": "assistant", "content": "The answer is"}]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": " 42."}]}
    conv, = load_conversations(write_jsonl(tmp_path / "c.jsonl", [row]), DataConfig())
    served = t.apply_chat_template(prompt, tokenize=False, continue_final_message=True)
    whole = t.apply_chat_template(prompt[:2] + [{"role": "assistant", "content": "The answer is 42."}], tokenize=False)
    for fmt in ("gemma", "template"):
        r = Renderer(t, chat_format=fmt).render(conv)
        assert "<bos>" + r.text == whole
        assert masked_runs(t, r) == [f" 42.{EOT}"]
        first = int(np.flatnonzero(r.loss_mask)[0])
        assert r.ids[:first].tolist() == _ids(t.apply_chat_template(prompt, tokenize=True, continue_final_message=True))
        assert t.decode(r.ids[:first].tolist(), skip_special_tokens=False) == served
    if "answer" in t.get_vocab():  # Gemma's vocabulary (not the character-level one): a cut inside a word is said
        import logging

        cut = {"prompt": [*prompt[:2], {"role": "assistant", "content": "The ans"}],
               "completion": [{"role": "assistant", "content": "wer is 42."}]}
        with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
            render_examples(str(write_jsonl(tmp_path / "w.jsonl", [cut])), Renderer(t), DataConfig())
        assert [r.getMessage() for r in caplog.records] == [
            f"{tmp_path / 'w.jsonl'}: 1 of 1 examples have an answer whose first token also holds the end of the "
            f"prompt before it (the first: {tmp_path / 'w.jsonl'}:1, token ' answer'); a server tokenizes the prompt "
            f"apart from the answer, so the model is trained on a token it is never served there: end the start of "
            f"the answer a prompt gives where a word ends"]
    nothing = {"prompt": prompt, "completion": [{"role": "assistant", "content": " "}]}
    with pytest.raises(UserError, match=re.escape("c.jsonl:1: completion[0] continues the prompt's final assistant "
                                                  "message with nothing (only whitespace)")):
        load_conversations(write_jsonl(tmp_path / "c.jsonl", [nothing]), DataConfig())


@pytest.mark.parametrize("before, where, what", [
    ([{"role": "system", "content": "s"}], "prompt[1]", "the conversation must start with a user turn"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}], "prompt[2]", "two assistant turns"),
])
def test_a_given_start_out_of_turn_is_named_in_the_prompt(tmp_path, before, where, what):
    """The start of an answer a prompt gives, standing where the chat template refuses an assistant turn: the answer
    stands where its start stands, in the prompt. It was named completion[0], a message that is in its place."""
    row = {"prompt": [*before, {"role": "assistant", "content": "The answer is"}],
           "completion": [{"role": "assistant", "content": " 42."}]}
    with pytest.raises(UserError, match=re.escape(f"c.jsonl:1: {where}: {what}")):
        load_conversations(write_jsonl(tmp_path / "c.jsonl", [row]), DataConfig())
    # the completion's own faults are still named by it
    bad = {**row, "prompt": [{"role": "user", "content": "q"}, row["prompt"][-1]],
           "completion": [{"role": "assistant", "content": " 42.", "train": "yes"}]}
    with pytest.raises(UserError, match=re.escape("c.jsonl:1: completion[0]: 'train' must be true or false")):
        load_conversations(write_jsonl(tmp_path / "c.jsonl", [bad]), DataConfig())


@pytest.mark.parametrize("start, rest, error", [
    ("The answer", " is <end_of_turn> 42.", "completion[0]: the text holds '<end_of_turn>' at character 4,"),
    ("The answer <end_of", "_turn> 42.", "prompt[1]'s end and completion[0]'s start join into '<end_of_turn>' (from "
                                          "prompt[1]'s character 11),"),
])
def test_a_control_token_after_a_given_start_is_named_where_the_file_holds_it(tmp_path, start, rest, error):
    """The answer a prompt starts is checked for markup as one text: a control token in its continuation was said to
    be at its character in the joined answer (10 for the 4th of completion[0]'s text), one across the join to be in
    completion[0], which does not hold it."""
    row = {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": start}],
           "completion": [{"role": "assistant", "content": rest}]}
    with pytest.raises(UserError, match=re.escape(f"c.jsonl:1: {error}")):
        load_conversations(write_jsonl(tmp_path / "c.jsonl", [row]), DataConfig())


def test_chat_messages_under_the_sharegpt_column_read_as_messages(tmp_path, tok):
    """`conversations` holding role/content messages (Hub datasets and converters leave chats so) was refused as
    ShareGPT turns without 'from'/'value'."""
    path = write_jsonl(tmp_path / "c.jsonl", [CHAT, {"conversations": CHAT["messages"]},
                                              {"conversations": TOOL_CHAT["messages"], "tools": TOOL_CHAT["tools"]}])
    chat, conv, tools = load_conversations(path, DataConfig())
    assert conv["messages"] == chat["messages"]
    r = Renderer(tok)
    assert r.render(conv).text == CHAT_TEXT
    assert r.render(tools).ids.tolist() == r.render(norm(TOOL_CHAT)).ids.tolist()


def test_an_answer_marked_untrained_is_context_in_every_chat_format(any_tok):
    conv = norm(_untrained_first_answer(CHAT))
    ours = Renderer(any_tok).render(conv)
    assert ours.text == CHAT_TEXT and masked_runs(any_tok, ours) == [f"It is 8.{EOT}"]
    weight0 = json.loads(json.dumps(CHAT))
    weight0["messages"][2]["weight"] = 0
    weight0["messages"][1]["weight"] = 0  # as ShareGPT exports write it on every turn: a no-op off the assistant
    assert Renderer(any_tok).render(norm(weight0)).loss_mask.tolist() == ours.loss_mask.tolist()
    from gemma_tpu.assets.embedded import GEMMA3_CHAT_TEMPLATE

    own = Renderer(_with_template(any_tok, GEMMA3_CHAT_TEMPLATE), chat_format="template").render(conv)
    assert own.ids.tolist() == ours.ids.tolist() and own.loss_mask.tolist() == ours.loss_mask.tolist()


def test_a_null_weight_or_train_flag_is_no_flag(tmp_path, tok):
    """OpenHermes-2.5 style ShareGPT exports carry `"weight": null` on every turn (a column other rows fill): every
    row was refused as "'weight' must be 0 or 1, got None", though the same data as Parquet (nulls dropped) loaded.
    A null flag is no flag: the answer trains, as it does without one."""
    turns = [{"from": "system", "value": "Be brief.", "weight": None}, {"from": "human", "value": "hi", "weight": None},
             {"from": "gpt", "value": "yo", "weight": None}]
    chat = {"messages": [{"role": "user", "content": "hi", "train": None},
                         {"role": "assistant", "content": "yo", "train": None, "weight": None}]}
    pair = {"prompt": [chat["messages"][0], {"role": "assistant", "content": "yo", "weight": None},
                       {"role": "user", "content": "hi"}], "completion": chat["messages"][1:]}
    path = write_jsonl(tmp_path / "h.jsonl", [{"conversations": turns}, chat, pair])
    sharegpt, messages, context = load_conversations(path, DataConfig())
    assert [m.get("train", True) for m in context["messages"]] == [True, False, True, True]
    plain = norm({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "yo"}]})
    assert sharegpt["messages"] == plain["messages"] and messages["messages"] == plain["messages"][1:]
    assert masked_runs(tok, Renderer(tok).render(sharegpt)) == [f"yo{EOT}"]


def test_axolotls_training_flag_keeps_an_answer_as_context(tmp_path, tok):
    """Axolotl's chat datasets mark an answer not to train with `"training": false` (its message_field_training): the
    key was ignored as unknown and the answer trained. It is read as `"train"` is, in chats and ShareGPT turns alike;
    a non-boolean one, or one contradicting `train`, is refused naming the message."""
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bad", "training": False},
                         {"role": "user", "content": "again"}, {"role": "assistant", "content": "good",
                                                                "training": True}]}
    turns = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "bad", "training": False},
                               {"from": "human", "value": "again"}, {"from": "gpt", "value": "good"}]}
    path = write_jsonl(tmp_path / "ax.jsonl", [chat, turns])
    for conv in load_conversations(path, DataConfig()):
        assert [m.get("train", True) for m in conv["messages"]] == [True, False, True, True]
        assert masked_runs(tok, Renderer(tok).render(conv)) == [f"good{EOT}"]
    for flags, needle in (({"training": "no"}, r"'training' must be true or false"),
                          ({"training": False, "train": True}, r"'train' and 'training' disagree")):
        bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", **flags}]}
        with pytest.raises(UserError, match=needle):
            load_conversations(write_jsonl(tmp_path / "bad.jsonl", [bad]), DataConfig())


@pytest.mark.parametrize("row, message", [
    ({"prompt": "hi"}, r"missing field 'completion'"),
    ({"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]},
     r"'prompt' and 'completion' must both be strings or both be lists of messages"),
    ({"prompt": "hi", "completion": " "}, r"field 'completion' is empty"),
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", "content": "again"}]},
     r"'completion' has no assistant message to learn from"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "train": True},
                 {"role": "user", "content": "c"}], "completion": [{"role": "assistant", "content": "d"}]},
     r"an assistant turn in 'prompt' is marked trained"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{}"}]},
     r"conversations\[1\]\.tool_calls\[0\]: needs function.name"),
    ({"conversations": [{"from": "human", "text": "hi"}]}, r"conversations\[0\]: expected an object with 'from'"),
    ({"messages": [{"role": "user", "content": "hi", "weight": 1}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\]: weight can mark assistant messages only"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "weight": 0.5}]},
     r"messages\[1\]: 'weight' must be 0 or 1, got 0.5"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "train": "no"}]},
     r"messages\[1\]: 'train' must be true or false"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "train": False}]},
     r"no assistant message to learn from \(every one is marked train: false\)"),
    ({"messages": [{"role": "user", "text": "hi"}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\]: a user message needs 'content' \(it has role, text\)"),
    ({"messages": [{"role": "system"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\]: a system message needs 'content'"),
    # OpenAI arguments encoded twice (json.dumps of json.dumps, as some exporters write them): said so
    ({"tools": [STEPS_TOOL], "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_steps", "arguments": json.dumps(json.dumps({"date": "x"}))}}]}]},
     r"messages\[1\]\.tool_calls\[0\]: arguments must be an object, got a string holding JSON text \(encoded twice"),
    ({"tools": [STEPS_TOOL], "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_steps", "arguments": "[1]"}}]}]},
     r"messages\[1\]\.tool_calls\[0\]: arguments must be an object, got a list$"),
    # OpenAI's refusals: "neither content nor tool_calls", or a part "training here is text only (multimodal)"
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "refusal": "No."}]},
     r"messages\[1\]: the answer is in 'refusal' \(OpenAI's field for a declined request\) and its content is empty"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "refusal", "refusal": "No."}]}]}, r"messages\[1\]: content\[0\] is a 'refusal' part \(OpenAI's"),
    # Anthropic-style tool and thinking blocks were refused as pictures ("training here is text only")
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_steps", "input": {}}]}]},
     r"messages\[1\]: content\[0\] is a 'tool_use' part; give tool calls as the assistant's tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "yo"}]}]},
     r"messages\[1\]: content\[0\] is a 'thinking' part, a model's reasoning, which is not rendered"),
    # a null was worded as if the field were missing: "needs 'content' (it has role, content)"
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\]: a user message needs 'content' \(its 'content' is null\)$"),
    ({"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "yo"}]},
     r"conversations\[0\]: 'value' is null; a 'human' turn needs text$"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n "}]},
     r"messages\[1\]: assistant message has neither content nor tool_calls \(only whitespace\)"),
    ({"conversations": [{"role": "user", "content": "hi"}, {"role": "gpt", "content": "yo"}]},
     r"conversations\[1\]: unknown role 'gpt'"),
    # a declaration without its name was "tools[0].function.name: None is not a tool name"
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
      "tools": [{"type": "function", "function": {"description": "d", "parameters": {}}}]},
     r"tools\[0\].function.name: missing: a declaration needs its function's name \(it has description, "
     r"parameters\)$"),
    # a misspelt or missing role key was "unknown role None"
    ({"messages": [{"rol": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\]: a message needs 'role', one of system, developer, user, assistant, tool \(it has rol, "
     r"content\)$"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": None, "content": "yo"}]},
     r"messages\[1\]: a message needs 'role', .* \(its 'role' is null\)$"),
    # an empty prompt trains the model to answer nothing: refused as an empty answer is
    ({"messages": [{"role": "user", "content": " \n\t"}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\]: user message is empty \(only whitespace\)"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                   {"role": "user", "content": [{"type": "text", "text": " "}]}, {"role": "assistant", "content": "a"}]},
     r"messages\[2\]: user message is empty \(only whitespace\)"),
    ({"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "yo"}]},
     r"conversations\[0\]: user message is empty;"),
    ({"prompt": "  ", "completion": "yo"}, r"prompt\[0\]: user message is empty \(only whitespace\)"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]},
     r"conversations\[1\]: assistant message has neither content nor tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                {"type": "image_url", "image_url": {"url": "x.png"}}]},
                   {"role": "assistant", "content": "a cat"}]},
     r"messages\[0\]: content\[1\] is a 'image_url' part; training here is text only"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}, {"role": "assistant", "content": "a"}]},
     r"messages\[0\]: content\[0\]: expected a text part"),
    ({"prompt": "hi", "chosen": "yo", "rejected": "no"},
     r"missing field 'completion' \(.*\); this is a preference row \(chosen/rejected, for DPO-style training\): to "
     r"fine-tune on the preferred answers, write 'chosen' as 'completion'"),
    # TRL's unpaired preference rows (KTO): a completion marked undesirable was trained as a good answer
    ({"prompt": "hi", "completion": "go away", "label": False},
     r"'label': false marks an undesirable completion \(TRL's unpaired preference rows, for KTO\)"),
    ({"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "rejected": []},
     r"no 'messages'.*field \(the example has chosen, rejected; .*; this is a preference row"),
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": " "}]},
     r"completion\[0\]: assistant message has neither content nor tool_calls"),
    # a table written column by column (pandas' to_json() default, a to_dict() dump): named as such
    ({"prompt": {"0": "a", "1": "b"}, "completion": {"0": "c", "1": "d"}},
     r"'prompt' must be a string or a list of messages, got an object; this looks like a table of 2 rows written "
     r"column by column \(each field an object of row number -> value, as pandas' DataFrame.to_json\(\) writes by "
     r"default\): write one object per example, to_json\(orient='records'\)"),
    ({"prompt": ["a", "b", "c"], "completion": ["d", "e", "f"]},
     r"prompt\[0\]: expected an object .*; this looks like a table of 3 rows written column by column \(each field "
     r"a list of every row's value"),
    ({"prompt": [{"role": "system", "content": "s"}, {"role": "wizard", "content": "hi"}],
      "completion": [{"role": "assistant", "content": "yo"}]}, r"prompt\[1\]: unknown role 'wizard'"),
    ({"body": "plain text"}, r"no 'messages', 'prompt'/'completion', 'conversations', 'instruction' or 'text' "
                             r"field \(the example has body;"),
    ({"text": " \n"}, r"field 'text' is empty"),
    ({"text": ["a", "b"]}, r"field 'text' must be a string, got a list"),
    ({"text": None}, r"field 'text' must be a string, got null"),  # in JSON's words, not Python's NoneType
    ({"prompt": 3, "completion": "yo"}, r"'prompt' must be a string or a list of messages, got a number"),
    # text already rendered with the chat template (TRL's apply_chat_template, saved): was "prompt[0]: ... holds
    # '<bos>' ...; remove it", one token after another
    ({"prompt": f"<bos>{SOT}user\nWhat color is the sky?{EOT}\n{SOT}model\n", "completion": f"It is blue.{EOT}\n"},
     r"'prompt' holds '<bos>' at character 0, a control token of the chat markup: text prompt-completion rows are "
     r"rendered as a user turn and an assistant turn, so text already rendered with a chat template \(as TRL's "
     r"apply_chat_template writes it\) goes in as lists of messages"),
    ({"prompt": "What color is the sky?", "completion": f"It is blue.{EOT}\n"}, r"'completion' holds '<end_of_turn>'"),
])
def test_bad_rows_of_every_format_name_the_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "completion": "row"}, row])
    with pytest.raises(UserError, match=f"^{path}:2: {message}"):
        load_conversations(path, DataConfig())


def test_trl_text_rows_train_every_token_and_end_with_eos(tmp_path, any_tok):
    """TRL's language-modeling rows (`{"text": ...}`, its dataset_text_field): BOS, the text and EOS, every
    token but BOS a target, as TRL's SFTTrainer trains them; also beside chat rows and under another name."""
    rows = [{"text": "Plain prose, no chat."}, {"text": "<bos>Already ends.<eos>", "source": "web"}, CHAT]
    path = write_jsonl(tmp_path / "lm.jsonl", rows)
    r = Renderer(any_tok)
    prose, ended, chat = (r.render(c) for c in load_conversations(path, DataConfig()))
    want = [2] + any_tok("Plain prose, no chat.<eos>", add_special_tokens=False)["input_ids"]
    assert prose.ids.tolist() == want and want[-1] == any_tok.eos_token_id
    assert not prose.loss_mask[0] and prose.loss_mask[1:].all()
    assert ended.ids.tolist() == [2] + any_tok("Already ends.<eos>", add_special_tokens=False)["input_ids"]
    assert ended.loss_mask[1:].all()
    assert chat.text == CHAT_TEXT and masked_runs(any_tok, chat) == [f"4.{EOT}", f"It is 8.{EOT}"]
    # the chat format does not touch them
    assert Renderer(any_tok, chat_format="functiongemma").render(load_conversations(path, DataConfig())[0]).ids.tolist() \
        == want
    named = write_jsonl(tmp_path / "named.jsonl", [{"body": "Plain prose, no chat.", "text": 1}])
    conv, = load_conversations(named, DataConfig(format="text", text_field="body"))
    assert r.render(conv).ids.tolist() == want
    ex, = render_examples(str(path), r, DataConfig())[:1]
    row = batching.build_row(batching.fit_length([ex], 64, "truncate", "x")[0], 64, 64)
    assert row["loss_weights"].sum() == len(want) - 1
    np.testing.assert_array_equal(row["loss_targets"][: len(want) - 1], want[1:])


def test_inspect_says_every_token_is_trained_for_text_rows(tmp_path, tok_dir):
    """`inspect` said "loss on assistant" for TRL text rows, where every token is a target."""
    out = []
    for name, rows in (("lm", [{"text": "Plain prose."}] * 4), ("mixed", [{"text": "Plain prose."}, CHAT] * 4)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        proc = run_cli("gemma_tpu.data.inspect", "--config", str(_inspect_config(tmp_path, path)), "--tokenizer",
                       str(tok_dir), timeout=300)
        assert proc.returncode == 0, proc.stderr
        out.append(proc.stdout.splitlines()[0])
    assert out[0].endswith("loss on every token (text rows)") and out[1].endswith(
        "loss on assistant (chats), every token (text rows)"), out


def test_config_reads_text_format():
    from gemma_tpu.core.config import load_config

    cfg = load_config(None, ["data.format=text", "data.text_field=content"])
    assert (cfg.data.format, cfg.data.text_field) == ("text", "content")


def test_a_datasets_save_to_disk_directory_reads_as_its_rows(tmp_path):
    """A `datasets` save_to_disk directory (what a TRL recipe often keeps on disk) was refused as 'a directory';
    its rows now read as the same examples as JSONL, numbered across its Arrow shards; a DatasetDict names
    its splits."""
    import datasets

    rows = [CHAT, TOOL_CHAT, {"prompt": "What is 2+2?", "completion": "4."}, {"text": "Prose."}]
    plain = load_conversations(write_jsonl(tmp_path / "d.jsonl", rows), DataConfig())
    strip = lambda convs: [{k: v for k, v in c.items() if k != "where"} for c in convs]  # noqa: E731
    # one column per key across rows (nulls where a row lacks it), as datasets stores mixed rows
    keys = ("messages", "tools", "prompt", "completion", "text")
    ds = datasets.Dataset.from_list([{k: None if k not in r else json.dumps(r[k]) if k in ("messages", "tools") else r[k]
                                      for k in keys} for r in rows])
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    saved = load_conversations(tmp_path / "saved", DataConfig())
    assert strip(saved) == strip(plain)
    assert [c["where"] for c in saved] == [f"{tmp_path / 'saved'}:{i}" for i in (1, 2, 3, 4)]
    shard = sorted((tmp_path / "saved").glob("*.arrow"))[1]
    assert strip(load_conversations(shard, DataConfig())) == strip(plain)[2:]
    datasets.DatasetDict(train=ds, test=ds).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(UserError, match=rf"dict is a DatasetDict saved with save_to_disk; give one split's "
                                        rf"directory \({tmp_path / 'dict' / 'test'}, {tmp_path / 'dict' / 'train'}\)"):
        load_conversations(tmp_path / "dict", DataConfig())
    with pytest.raises(UserError, match=r"is a directory; give a .jsonl, .json or .parquet file or a "
                                        r"datasets.save_to_disk directory"):
        load_conversations(tmp_path, DataConfig())


def test_a_directory_of_data_files_names_them(tmp_path):
    """A directory of JSONL files (a hub download, a split's folder) was refused naming none of the files in it."""
    write_jsonl(tmp_path / "train.jsonl", [CHAT])
    with pytest.raises(UserError, match=rf"\(it has no state.json\); it holds {re.escape(str(tmp_path))}/train.jsonl$"):
        load_conversations(tmp_path, DataConfig())
    write_jsonl(tmp_path / "eval.jsonl", [CHAT])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match=rf"; it holds 2 data files \({re.escape(str(tmp_path))}/eval.jsonl, "
                                        rf"{re.escape(str(tmp_path))}/train.jsonl\): give one, or their examples "
                                        rf"concatenated into one file$"):
        load_conversations(tmp_path, DataConfig())


@pytest.mark.parametrize("fmt, column", [("messages", "messages"), ("sharegpt", "conversations")])
def test_a_forced_format_names_the_field_the_row_lacks(tmp_path, fmt, column):
    """data.format forced onto rows of another shape said "'messages' must be a non-empty list", as if the
    field were there and wrong."""
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "hi", "completion": "yo"}])
    with pytest.raises(UserError, match=rf"^{path}:1: no '{column}' field for data.format={fmt} \(the example "
                                        rf"has prompt, completion; data.format=auto"):
        load_conversations(path, DataConfig(format=fmt))


def test_utf16_files_and_wrapped_arrays_say_what_to_do(tmp_path):
    """A UTF-16 file (Windows PowerShell's `>`) was 'not UTF-8 text (byte 1 of the line)', and examples wrapped
    in an object ({"data": [...]}) were one example with no known field."""
    text = json.dumps({"prompt": "hi", "completion": "yo"}) + "\n"
    for enc in ("utf-16", "utf-16-be"):
        (tmp_path / "u.jsonl").write_bytes(("\ufeff" if enc.endswith("be") else "").encode(enc) + text.encode(enc))
        with pytest.raises(UserError, match=r"u.jsonl: UTF-16 text \(it starts with a UTF-16 byte-order mark\); "
                                            r"save it as UTF-8"):
            load_conversations(tmp_path / "u.jsonl", DataConfig())
    # gzipped, its text was refused as 'not UTF-8 text (byte 1 of the line)', naming no encoding
    (tmp_path / "u.jsonl.gz").write_bytes(gzip.compress(text.encode("utf-16")))
    with pytest.raises(UserError, match=r"u.jsonl.gz: gzip-compressed UTF-16 text \(it starts with a UTF-16 "
                                        r"byte-order mark\); save the text as UTF-8$"):
        load_conversations(tmp_path / "u.jsonl.gz", DataConfig())
    (tmp_path / "w.json").write_text(json.dumps({"version": 1, "data": [{"prompt": "a", "completion": "b"}] * 3}))
    with pytest.raises(UserError, match=r"w.json:1: no 'messages'.* field \(the example has version, data; .*; its "
                                        r"'data' holds a list of 3 objects: if those are the examples, give that list "
                                        r"itself \(a JSON array\) or JSON Lines\)$"):
        load_conversations(tmp_path / "w.json", DataConfig())


def test_a_chat_under_another_field_name_says_to_name_it_messages(tmp_path):
    """lmsys-chat-1m keeps its chats under 'conversation': the error said "set data.format and the field names" (no
    setting names a chat's field) and "if those are the examples, give that list itself", of a chat's messages."""
    rows = [{"conversation_id": "a", "conversation": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "yo"}], "turn": 1},
            {"dialog": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    for i, (field, name) in enumerate((("conversation", "messages"), ("dialog", "conversations"))):
        path = write_jsonl(tmp_path / f"c{i}.jsonl", [rows[i]])
        with pytest.raises(UserError, match=re.escape(
                f"c{i}.jsonl:1: no 'messages', 'prompt'/'completion', 'conversations', 'instruction' or 'text' field "
                f"(the example has {', '.join(rows[i])}; its '{field}' holds a chat's "
                f"{'messages' if i == 0 else 'ShareGPT turns'}: name that field '{name}', which no setting "
                f"renames)")):
            load_conversations(path, DataConfig())


def test_windows_files_concatenated_read_line_by_line(tmp_path):
    """A BOM, CRLF line ends and no final newline, in each file of a `cat a.jsonl b.jsonl` (the second file's
    BOM then starts line 3): that line was 'not valid JSON (Expecting value at column 1)', an invisible cause."""
    one = "\ufeff" + json.dumps(CHAT) + "\r\n" + json.dumps({"prompt": "hi", "completion": "yo"}) + "\r\n"
    two = "\ufeff" + json.dumps({"prompt": "a", "completion": "b"})
    path = tmp_path / "all.jsonl"
    path.write_bytes((one + two).encode())
    convs = load_conversations(path, DataConfig())
    assert [c["where"] for c in convs] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert convs[2]["messages"] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_gzip_compressed_files_read_as_their_text(tmp_path):
    import gzip

    rows = [CHAT, TOOL_CHAT]
    plain = load_conversations(write_jsonl(tmp_path / "d.jsonl", rows), DataConfig())
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "array.json.gz").write_bytes(gzip.compress(json.dumps(rows, indent=1).encode()))
    (tmp_path / "named_plain.jsonl").write_bytes(gzip.compress(body))  # told by its bytes, not its name
    strip = lambda convs: [{k: v for k, v in c.items() if k != "where"} for c in convs]  # noqa: E731
    for name in ("d.jsonl.gz", "array.json.gz", "named_plain.jsonl"):
        assert strip(load_conversations(tmp_path / name, DataConfig())) == strip(plain), name
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(body + b"{oops\n"))
    with pytest.raises(UserError, match=r"bad.jsonl.gz:3: not valid JSON"):
        load_conversations(tmp_path / "bad.jsonl.gz", DataConfig())
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(body * 50)[:200])
    with pytest.raises(UserError, match=r"cut.jsonl.gz:\d+: not a readable gzip file"):
        load_conversations(tmp_path / "cut.jsonl.gz", DataConfig())


def test_json_array_and_jsonl_and_parquet_read_the_same(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [CHAT, TOOL_CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps(rows, indent=2))
    # Parquet structs hold the union of all keys, null where a row lacks one (stripped when read)
    pq.write_table(pa.Table.from_pylist([{"tools": None, **r} for r in rows]), tmp_path / "d.parquet")
    cfg = DataConfig()
    r = Renderer(tok)
    texts = {}
    for p in (jsonl, arr, tmp_path / "d.parquet"):
        convs = load_conversations(p, cfg)
        texts[p.suffix] = [r.render(c).text for c in convs]
        assert [{k: v for k, v in c.items() if k != "where"} for c in convs] == \
            [{k: v for k, v in c.items() if k != "where"} for c in load_conversations(jsonl, cfg)]
    assert texts[".jsonl"] == texts[".json"] == texts[".parquet"] == [CHAT_TEXT, TOOL_TEXT,
                                                                     f"{SOT}user\nhi{EOT}\n{SOT}model\nyo{EOT}\n"]
    # each JSON array element is reported at the line it starts on
    lines = arr.read_text().splitlines()
    starts = [i + 1 for i, l in enumerate(lines) if l == "  {"]
    assert [c["where"] for c in load_conversations(arr, cfg)] == [f"{arr}:{n}" for n in starts]
    assert [c["where"] for c in load_conversations(tmp_path / "d.parquet", cfg)] == \
        [f"{tmp_path / 'd.parquet'}:{i}" for i in (1, 2, 3)]


PAIR = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])


@pytest.mark.parametrize("columns, null, row", [
    ({"messages": [PAIR, None]}, "messages", 2),
    ({"prompt": ["q", None], "completion": ["a", "b"]}, "prompt", 2),
    ({"text": ["some text", None]}, "text", 2),
    ({"conversations": [None], "text": [None]}, "conversations", 1),
    ({"instruction": ["a"], "context": [None], "response": [None]}, "response", 1),
])
def test_parquet_null_in_a_text_column_is_named_at_its_row(tmp_path, columns, null, row):
    """pandas writes a missing value (NaN, None) as null, and a row's nulls are dropped before it is read: a null
    'messages' or 'text' was "no 'messages' ... field (the example has no fields)", a null prompt a missing field,
    as if the file had no such column. The row and the null column are named now; a null optional column is not
    an error (the context above), nor is a mixed file's other shape (below)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "n.parquet"
    pq.write_table(pa.Table.from_pydict(columns), path)
    with pytest.raises(UserError) as e:
        load_conversations(path, DataConfig())
    assert str(e.value) == (f"{path}:{row}: '{null}' is null in this row (a missing value: pandas writes NaN and "
                            "None as null); fill it in or drop the row")
    mixed = {"messages": [PAIR, None], "text": [None, "a language-modeling row"]}
    pq.write_table(pa.Table.from_pydict(mixed), path)
    assert [("text" in c, c["where"]) for c in load_conversations(path, DataConfig())] == [(False, f"{path}:1"),
                                                                                          (True, f"{path}:2")]


def test_parquet_with_json_string_columns(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"messages": json.dumps(TOOL_CHAT["messages"]), "tools": json.dumps(TOOL_CHAT["tools"])}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "s.parquet")
    (conv,) = load_conversations(tmp_path / "s.parquet", DataConfig())
    assert Renderer(tok).render(conv).text == TOOL_TEXT
    # a declaration's parameters schema kept as a JSON string too (it was rendered as a string)
    tools = [{**t, "function": {**t["function"], "parameters": json.dumps(t["function"]["parameters"])}}
             for t in TOOL_CHAT["tools"]]
    write_jsonl(tmp_path / "p.jsonl", [{**TOOL_CHAT, "tools": tools}])
    (conv,) = load_conversations(tmp_path / "p.jsonl", DataConfig())
    assert Renderer(tok).render(conv).text == TOOL_TEXT


def test_openai_legacy_function_calling_renders_as_tool_calls(tmp_path, tok):
    """OpenAI's legacy fine-tuning rows (`functions`, an assistant `function_call`, a `function` result) were
    refused as "neither content nor tool_calls" or, with text beside the call, trained the text and dropped the
    call silently; they are the tools, tool call and tool result they stand for."""
    msgs = [dict(m) for m in TOOL_CHAT["messages"]]
    msgs[2] = {"role": "assistant", "content": None, "function_call": {"name": "get_steps",
                                                                       "arguments": json.dumps({"date": "today"})}}
    msgs[3] = {**msgs[3], "role": "function"}
    legacy = {"functions": [t["function"] for t in TOOL_CHAT["tools"]], "messages": msgs}
    write_jsonl(tmp_path / "l.jsonl", [legacy])
    (conv,) = load_conversations(tmp_path / "l.jsonl", DataConfig())
    assert Renderer(tok).render(conv).text == TOOL_TEXT
    both = [{**legacy, "tools": TOOL_CHAT["tools"]},
            {**legacy, "messages": [*msgs[:2], {**msgs[2], "tool_calls": TOOL_CHAT["messages"][2]["tool_calls"]},
                                    *msgs[3:]]}]
    write_jsonl(tmp_path / "b.jsonl", both[:1])
    with pytest.raises(UserError, match=r"b.jsonl:1: both 'tools' and 'functions' \(OpenAI's legacy name"):
        load_conversations(tmp_path / "b.jsonl", DataConfig())
    write_jsonl(tmp_path / "b.jsonl", both[1:])
    with pytest.raises(UserError, match=r"b.jsonl:1: messages\[2\]: both tool_calls and function_call"):
        load_conversations(tmp_path / "b.jsonl", DataConfig())


def test_single_object_json_and_jsonl_named_json(tmp_path):
    one = tmp_path / "one.json"
    one.write_text("\n" + json.dumps(CHAT, indent=2))
    (c,) = load_conversations(one, DataConfig())
    assert c["where"] == f"{one}:2"
    lines = tmp_path / "lines.json"
    write_jsonl(lines, [CHAT, CHAT])
    assert len(load_conversations(lines, DataConfig())) == 2


def test_pretty_printed_objects_one_after_another_under_a_json_name_are_read(tmp_path):
    """Objects pretty-printed one after another (`jq . rows.jsonl > rows.json`, json.dump(row, f, indent=2) for each
    row) were refused as JSON Lines whose first line ends inside its object, the error telling the user to name the
    file .json, which it was. Each is an example, named by the line it starts on; a bad one is refused at its line."""
    path = tmp_path / "rows.json"
    text = json.dumps(CHAT, indent=2)
    path.write_text("\ufeff" + text + "\n" + text.replace("\n", "\r\n") + "\n\n" + json.dumps(GOOD) + "\n",
                    encoding="utf-8")
    got = load_conversations(path, DataConfig())
    n = text.count("\n") + 1
    assert [c["where"] for c in got] == [f"{path}:1", f"{path}:{n + 1}", f"{path}:{2 * n + 2}"]
    assert [c["messages"] for c in got] == [norm(CHAT)["messages"]] * 2 + [norm(GOOD)["messages"]]
    path.write_text(text + "\n" + text.replace('"4."', "NaN") + "\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:{n + 1}: NaN is not JSON"):
        load_conversations(path, DataConfig())
    path.write_text(text + "\n" + text[:-3] + "\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:{2 * n}: not valid JSON \("):
        load_conversations(path, DataConfig())


def test_a_json_array_under_a_jsonl_name_is_read_as_an_array(tmp_path):
    """`json.dump(rows, open("train.jsonl", "w"))` (what HF's json loader reads whatever the name) was refused as
    "expected a JSON object per example, got a list", and indented as "not valid JSON"; the content decides."""
    import gzip

    for name, text in (("flat.jsonl", json.dumps([CHAT, CHAT])), ("indented.jsonl", json.dumps([CHAT, CHAT], indent=2)),
                       ("bom.txt", "\ufeff\n [" + json.dumps(CHAT) + "]")):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        convs = load_conversations(path, DataConfig())
        assert [c["messages"] for c in convs] == [load_conversations(write_jsonl(tmp_path / "one.jsonl", [CHAT]),
                                                                     DataConfig())[0]["messages"]] * len(convs)
        assert convs[0]["where"] == f"{path}:{2 if name != 'flat.jsonl' else 1}"
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(json.dumps([CHAT, CHAT, CHAT], indent=1))
    assert len(load_conversations(tmp_path / "a.jsonl.gz", DataConfig())) == 3


def test_a_pretty_printed_object_under_a_jsonl_name_says_why_it_fails(tmp_path):
    """One object indented over many lines in a .jsonl read "not valid JSON (Expecting property name enclosed in
    double quotes ...)" at line 1, with no word of lines; a line cut short later on (a truncated file) is unchanged."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(CHAT, indent=2))
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:1: not valid JSON \(.*; the line ends inside its "
                                        rf"object: JSON Lines holds one whole object a line, and a pretty-printed "
                                        rf"JSON file is read as such when named \.json\)$"):
        load_conversations(path, DataConfig())
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT)[:30])
    with pytest.raises(UserError) as e:
        load_conversations(path, DataConfig())
    assert str(e.value).startswith(f"{path}:2: not valid JSON (") and "JSON Lines holds" not in str(e.value)



def test_a_comma_after_each_jsonl_object_is_named(tmp_path):
    """Rows copied out of a JSON array, one a line with their commas, read "not valid JSON (Extra data at column
    N)": now the comma is named."""
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CHAT) + ",\n" + json.dumps(CHAT) + "\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:1: not valid JSON \(Extra data at column \d+; a "
                                        rf"comma after the object: JSON Lines separates objects by line breaks alone\)$"):
        load_conversations(path, DataConfig())
    path.write_text(json.dumps(CHAT) + " x\n")  # other extra data: no comma hint
    with pytest.raises(UserError) as e:
        load_conversations(path, DataConfig())
    assert "Extra data" in str(e.value) and "a comma after" not in str(e.value)

# ----------------------------------------------------------------------------------- bad input

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
BAD_CASES = {
    "not_json": ([json.dumps(GOOD), "{oops"], 2, "not valid JSON"),
    "unknown_role": ([{"messages": [{"role": "robot", "content": "hi"}, GOOD["messages"][1]]}], 1,
                     "unknown role 'robot'"),
    "unknown_tool": ([{"tools": [STEPS_TOOL], "messages": [GOOD["messages"][0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {}}}]}]}], 1,
                     "'get_weather', which is not in 'tools'"),
    "no_tools_declared": ([{"messages": [GOOD["messages"][0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_steps", "arguments": {}}}]}]}], 1, "declares no 'tools'"),
    "empty_assistant": ([GOOD, {"messages": [GOOD["messages"][0], {"role": "assistant", "content": ""}]}], 2,
                        "neither content nor tool_calls"),
    "missing_instruction_field": ([{"instruction": "a", "response": "b"}, {"instruction": "c", "answer": "d"}], 2,
                                  "missing field 'response'"),
    "no_assistant": ([{"messages": [GOOD["messages"][0]]}], 1, "no assistant message"),
    "bad_arguments": ([{"tools": [STEPS_TOOL], "messages": [GOOD["messages"][0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_steps", "arguments": "{date"}}]}]}], 1,
                      "'tool_calls[0].function.arguments' is a string but not valid JSON"),
    # JSON kept in a string is read as strictly as the line itself: these were kept (the last key, a NaN trained
    # as `{x:NaN}`) or raised a traceback (a lone surrogate at the tokenizer, RecursionError)
    **{f"arguments_{k}": ([{"tools": [STEPS_TOOL], "messages": [GOOD["messages"][0], {"role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "get_steps", "arguments": a}}]}]}], 1, n)
       for k, a, n in (
        ("key_twice", '{"date": "a", "date": "b"}', "key 'date' appears twice"),
        ("nan", '{"date": NaN}', "NaN is not JSON"),
        ("overflow", '{"date": -1e400}', "-1e400 is beyond the range of a 64-bit float (it would be read as infinity)"),
        ("lone_surrogate", '{"date": "\\ud800"}', "arguments.date holds a lone UTF-16 surrogate"),
        ("too_deep", "[" * 5000, "'tool_calls[0].function.arguments': not valid JSON for this reader (nested"))},
    # a tool result the prompt renders as JSON, read as strictly: {"steps": 1e999} was rendered {steps:Infinity}
    **{f"tool_result_{k}": ([{"tools": [STEPS_TOOL], "messages": [GOOD["messages"][0], {"role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "get_steps", "arguments": {}}}]},
        {"role": "tool", "content": c}, {"role": "assistant", "content": "ok"}]}], 1, n)
       for k, c, n in (
        ("overflow", '{"steps": 1e999}', "messages[2]: the tool result's content, read as JSON to render it: 1e999 is "
                                         "beyond the range of a 64-bit float"),
        ("nan", '[{"steps": NaN}]', "messages[2]: the tool result's content, read as JSON to render it: NaN is not "
                                    "JSON (only finite numbers are)"),
        ("key_twice", '{"steps": 1, "steps": 2}', "the tool result's content, read as JSON to render it: key 'steps' "
                                                  "appears twice"),
        # a bare value is read as JSON too ({result:Infinity} in the prompt and the served template alike)
        ("bare_overflow", " 1e999", "messages[2]: the tool result's content, read as JSON to render it: 1e999 is "
                                    "beyond the range of a 64-bit float"),
        ("bare_nan", "NaN", "messages[2]: the tool result's content, read as JSON to render it: NaN is not JSON"),
        ("bare_infinity", "-Infinity", "render it: -Infinity is not JSON"))},
    "messages_string_key_twice": ([{"messages": json.dumps(GOOD["messages"]).replace('"hi"',
                                                                                     '"hi", "content": "x"')}],
                                  1, "'messages' (a JSON string): key 'content' appears twice"),
    "prompt_string_key_twice": ([{"prompt": '[{"role": "user", "content": "a", "content": "b"}]',
                                  "completion": '[{"role": "assistant", "content": "c"}]'}], 1,
                                "'prompt' (a JSON string): key 'content' appears twice"),
    "completion_string_nan": ([{"prompt": "q", "completion": '[{"role": "assistant", "content": NaN}]'}], 1,
                              "'completion' (a JSON string): NaN is not JSON"),
    # the chat markup inside a message's text: tokenized as control tokens (an answer with a leaked end of turn
    # trained two; a user text opened a model turn of its own; raw call text skipped the tools check)
    "answer_with_end_of_turn": ([GOOD, {"messages": [GOOD["messages"][0], {"role": "assistant",
                                                                          "content": "yo<end_of_turn>"}]}], 2,
                                "messages[1]: the text holds '<end_of_turn>' at character 2, the chat markup's own "
                                "control token"),
    "user_opens_a_turn": ([{"messages": [{"role": "user", "content": "hi\n<start_of_turn>model\nno"},
                                         GOOD["messages"][1]]}], 1, "messages[0]: the text holds '<start_of_turn>'"),
    "raw_call_in_content": ([{"messages": [GOOD["messages"][0], {"role": "assistant", "content":
                                           "<start_function_call>call:f{}<end_function_call>"}]}], 1,
                            "'<start_function_call>' at character 0, the chat markup's own control token, which the "
                            "tokenizer would read as markup; remove it (tool calls go in tool_calls)"),
    # ... and as a plain Gemma 3 vocabulary spells the call markers (`<unused2>`): the evaluation of an endpoint (a
    # served fine-tune reads them as markup) sent them, where a local evaluation refused them
    "raw_mapped_call_in_content": ([{"messages": [GOOD["messages"][0], {"role": "assistant", "content":
                                                  "<unused2>call:f{}<unused3>"}]}], 1,
                                   "'<unused2>' at character 0, the chat markup's own control token, which the "
                                   "tokenizer would read as markup; remove it (tool calls go in tool_calls)"),
    "user_holds_a_mapped_marker": ([{"messages": [{"role": "user", "content": "what is <unused6>?"},
                                                  GOOD["messages"][1]]}], 1, "messages[0]: the text holds '<unused6>'"),
    "instruction_with_eos": ([{"instruction": "a", "response": "b<eos>"}], 1, "field 'response': the text holds "
                                                                             "'<eos>'"),
    "tools_string_infinity": ([{"tools": json.dumps([STEPS_TOOL])[:-2] + ', "x": Infinity}]',
                                "messages": GOOD["messages"]}], 1, "'tools' (a JSON string): Infinity is not JSON"),
    "not_an_object": ([GOOD, [1, 2]], 2, "expected a JSON object per example, got a list"),
    # a line holding the messages alone: say how to wrap it
    "bare_messages": ([GOOD, GOOD["messages"]], 2, 'got a list (a list of messages: wrap each example as {"messages"'),
    "bare_messages_first": ([GOOD["messages"], GOOD["messages"]], 1, 'got a list (a list of messages: wrap each '
                                                                     'example as {"messages"'),
    "messages_an_object": ([{"messages": GOOD["messages"][0]}], 1, "'messages' must be a non-empty list, got an object"),
    "messages_empty": ([{"messages": []}], 1, "'messages' must be a non-empty list, got an empty list"),
    "conversations_a_string": ([{"conversations": "hi"}], 1, "'conversations' is a string but not valid JSON"),
    "conversations_null": ([{"conversations": None}], 1, "got null"),
    # instruction pairs whose text is not a string: an AttributeError traceback ('NoneType' has no 'strip')
    "instruction_null": ([{"instruction": None, "response": "b"}], 1, "field 'instruction' must be a string, got null"),
    "response_a_number": ([{"instruction": "a", "response": 3}], 1, "field 'response' must be a string, got a number"),
}



def test_a_number_past_a_float_is_refused_at_its_line(tmp_path):
    """1e400 in a JSONL line was read as infinity and trained as "Infinity" where the file said a number (NaN and
    Infinity themselves were refused)."""
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + '{"messages": [{"role": "user", "content": "a"}, '
                    '{"role": "assistant", "content": {"steps": 1e400}}]}\n')
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:2: 1e400 is beyond the range of a 64-bit float"):
        load_conversations(path, DataConfig())


def test_a_prompt_that_is_json_nested_past_the_stack_stays_text(tmp_path):
    """A prompt starting like a list of messages but nested deeper than the JSON reader recurses raised
    RecursionError (a traceback); text that is not a list of messages stays text."""
    text = '[{"a": ' + "[" * 5000
    path = _write_case(tmp_path, "deep", [{"prompt": text, "completion": "x"}])
    (conv,) = load_conversations(path, DataConfig())
    assert conv["messages"][0] == {"role": "user", "content": text}


def _write_case(tmp_path: Path, name: str, rows: list) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_input_names_file_and_line(tmp_path, name):
    rows, line, needle = BAD_CASES[name]
    path = _write_case(tmp_path, name, rows)
    with pytest.raises(UserError) as e:
        load_conversations(path, DataConfig())
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line}:") and needle in msg and "\n" not in msg, msg


def test_empty_file_and_missing_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match=r"empty\.jsonl: no examples \(empty file\)"):
        load_conversations(empty, DataConfig())
    empty.write_text("\n  \r\n\n")  # lines a user sees, all blank: was also "(empty file)"
    with pytest.raises(UserError, match=r"empty\.jsonl: no examples \(only blank lines\)"):
        load_conversations(empty, DataConfig())
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(UserError, match=r"empty\.json: no examples \(no rows in it\)"):
        load_conversations(tmp_path / "empty.json", DataConfig())
    with pytest.raises(UserError, match="data file not found"):
        load_conversations(tmp_path / "nope.jsonl", DataConfig())
    with pytest.raises(UserError, match=rf"data file {re.escape(str(tmp_path))} is a directory"):
        load_conversations(tmp_path, DataConfig())  # was 'data file not found' for a path that exists
    os.mkfifo(tmp_path / "fifo.jsonl")  # `data.train_path=<(zcat d.jsonl.gz)`: also 'not found'
    with pytest.raises(UserError, match=r"data file .*fifo.jsonl is not a regular file \(a pipe or device"):
        load_conversations(tmp_path / "fifo.jsonl", DataConfig())


def test_a_missing_relative_data_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """configs/tiny.yaml run from another directory: "data file not found: tests/data/chat_sample.jsonl", of a file
    the user can see; a relative path is read from the working directory, and the message says which that was."""
    from gemma_tpu.data.pipeline import prepare_splits

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        prepare_splits(None, DataConfig(train_path="tests/data/chat_sample.jsonl"), 0, 1)
    assert str(e.value) == (f"data file not found: tests/data/chat_sample.jsonl (data.train_path; a relative path is "
                            f"read from the working directory, {tmp_path})")


def test_bad_json_array_element_and_bad_bytes(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text(f'[\n  {json.dumps(GOOD)},\n  {{"messages": [}}\n]\n')
    with pytest.raises(UserError, match=r"a\.json:3: not valid JSON"):
        load_conversations(arr, DataConfig())
    arr.write_text(json.dumps([GOOD, GOOD], indent=1) + "\n[]")
    with pytest.raises(UserError, match="extra data after the array"):
        load_conversations(arr, DataConfig())
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes((json.dumps(GOOD) + "\n").encode() + b'{"messages": "\xe9"}\n')
    with pytest.raises(UserError, match=r"latin\.jsonl:2: not UTF-8 text \(byte 15 of the line: 0xe9, 'é' in "
                                        r"Latin-1/Windows-1252\); save it as UTF-8$"):
        load_conversations(latin, DataConfig())
    latin.rename(tmp_path / "latin.json")  # read whole, as a JSON document: its line counted from the bytes
    with pytest.raises(UserError, match=r"latin\.json:2: not UTF-8 text \(byte offset \d+: 0xe9, "):
        load_conversations(tmp_path / "latin.json", DataConfig())
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match="not a readable Parquet file"):
        load_conversations(tmp_path / "x.parquet", DataConfig())


# CLI: each bad input is one `error:` line naming the file and line, non-zero exit, no traceback.
CLI_CASES = ["not_json", "unknown_role", "unknown_tool", "empty_assistant", "missing_instruction_field"]


def _inspect_config(tmp_path: Path, train_path, **data) -> Path:
    import yaml

    cfg = {"data": {"train_path": str(train_path), "seq_len": 256, **data}, "train": {"batch_size": 4}}
    path = tmp_path / "inspect.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_inspect_json_written_as_option_equals_tilde_goes_home(tmp_path, tok_dir):
    """`--json=~/stats.json`: the shell expands no `~` after `--json=`, and the file went into a directory named `~`
    in the working directory, where the config's own paths (`checkpoint.dir=~/x`) expand it."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    path = write_jsonl(tmp_path / "i.jsonl", chat_rows(8, seed=1))
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(_inspect_config(tmp_path, path)), "--tokenizer",
                   str(tok_dir), "-n", "0", "--json=~/stats.json", cwd=work,
                   env={"HOME": str(home), "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((home / "stats.json").read_text())["examples_read"] == 8
    assert not (work / "~").exists()


@pytest.mark.parametrize("name", CLI_CASES + ["empty"])
def test_inspect_cli_bad_input_is_one_line(tmp_path, tok_dir, name):
    if name == "empty":
        path, line = tmp_path / "empty.jsonl", None
        path.write_text("")
    else:
        rows, line, _ = BAD_CASES[name]
        path = _write_case(tmp_path, name, rows)
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(_inspect_config(tmp_path, path)),
                   "--tokenizer", str(tok_dir), timeout=300)
    assert_one_line_error(proc, f"{path}:{line}" if line else str(path))
    assert proc.stdout == ""


def test_inspect_names_the_key_of_a_missing_data_file(tmp_path, monkeypatch):
    """inspect said 'data file not found: data/t.jsonl' alone, where training names the key and, for a relative
    path, the working directory it is read from (a config's paths are not read from the config's directory)."""
    from gemma_tpu.data.inspect import parse_args, run

    monkeypatch.chdir(tmp_path)
    config = _inspect_config(tmp_path, "data/t.jsonl")
    with pytest.raises(UserError) as e:
        run(parse_args(["--config", str(config), "--tokenizer", str(tmp_path / "no-tokenizer")]))
    assert str(e.value) == (f"data file not found: data/t.jsonl (data.train_path; a relative path is read from the "
                            f"working directory, {tmp_path})")


# ------------------------------------------------------------------------- over-length policies


def _examples(tok, tmp_path: Path, rows: list[dict]) -> tuple[Path, list[batching.Example]]:
    path = write_jsonl(tmp_path / "len.jsonl", rows)
    return path, render_examples(str(path), Renderer(tok), DataConfig())


def test_truncate_drop_error_policies_and_counts(tmp_path, tok):
    rows = chat_rows(30, seed=1, long_every=5)  # 6 examples with a 300-character tail
    # one more whose answer starts past the cut: truncation leaves it no target
    rows.append({"messages": [{"role": "user", "content": "q" * 400}, {"role": "assistant", "content": "late"}]})
    path, exs = _examples(tok, tmp_path, rows)
    seq_len = 200
    lengths = [len(e.ids) for e in exs]
    over = [i for i, n in enumerate(lengths) if n > seq_len]
    assert len(over) == 7 and over[-1] == 30

    kept, rep = batching.fit_length(exs, seq_len, "truncate", str(path))
    assert (rep.read, rep.overlength, rep.truncated, rep.no_loss, rep.dropped, rep.kept) == (31, 7, 6, 1, 1, 30)
    assert rep.read == rep.kept + rep.dropped and rep.lengths == lengths
    assert max(len(e.ids) for e in kept) == seq_len
    cut = [e for e in kept if len(e.ids) == seq_len]
    assert len(cut) >= 6 and all(e.loss_mask[1:].any() for e in kept)
    for e in kept:  # truncation keeps the front, ids and mask together
        orig = next(x for x in exs if x.where == e.where)
        np.testing.assert_array_equal(e.ids, orig.ids[:len(e.ids)])
        np.testing.assert_array_equal(e.loss_mask, orig.loss_mask[:len(e.ids)])

    kept, rep = batching.fit_length(exs, seq_len, "drop", str(path))
    assert (rep.overlength, rep.truncated, rep.dropped, rep.no_loss, rep.kept) == (7, 0, 7, 0, 24)
    assert sorted(e.where for e in kept) == sorted(exs[i].where for i in range(31) if i not in over)

    with pytest.raises(UserError) as e:
        batching.fit_length(exs, seq_len, "error", str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}:1:") and f"{lengths[0]} tokens" in msg and "data.seq_len=200" in msg


def test_overlength_error_through_prepare_split(tmp_path, tok):
    rows = chat_rows(4) + [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 300}]}]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    with pytest.raises(UserError, match=r"e\.jsonl:5: the example has \d+ tokens, more than data\.seq_len=160"):
        prepare_split(str(path), Renderer(tok), DataConfig(seq_len=160, overlength="error"), 0)


def test_nothing_left_is_an_error(tmp_path, tok):
    rows = [{"messages": [{"role": "user", "content": "q" * 300}, {"role": "assistant", "content": "a"}]}]
    path = write_jsonl(tmp_path / "n.jsonl", rows)
    with pytest.raises(UserError, match="no usable examples .* 1 with no loss-bearing token"):
        prepare_split(str(path), Renderer(tok), DataConfig(seq_len=64), 0)


@pytest.mark.parametrize("policy, counts", [("truncate", "0 over-length, 2 with no loss-bearing token left after "
                                                         "truncation"),
                                            ("drop", "2 over-length, 0 with no loss-bearing token left")])
def test_nothing_left_counts_each_example_once(tmp_path, tok, policy, counts):
    """Every example longer than seq_len under truncate said "dropped 2: 2 over-length, 2 with no loss-bearing
    token left" (4 reasons for 2 examples); each is counted once, with the length to raise seq_len to."""
    rows = [{"messages": [{"role": "user", "content": "q" * n}, {"role": "assistant", "content": "a"}]}
            for n in (300, 200)]
    path = write_jsonl(tmp_path / "n.jsonl", rows)
    renderer = Renderer(tok)
    rendered = [renderer.render(c) for c in load_conversations(path, DataConfig())]
    shortest = min(len(r.ids) for r in rendered)
    # under truncate, the seq_len that keeps the first loss-bearing token of one of them: what to raise it to
    need = min(int(np.flatnonzero(r.loss_mask)[0]) + 1 for r in rendered)
    with pytest.raises(UserError) as e:
        prepare_split(str(path), renderer, DataConfig(seq_len=64, overlength=policy), 0)
    assert str(e.value) == (f"{path}: no usable examples after applying data.seq_len=64 (read 2, dropped 2: {counts}; "
                            f"2 longer than data.seq_len, the shortest of them {shortest} tokens"
                            f"{f'; data.seq_len={need} or more trains some of them' if policy == 'truncate' else ''})")
    if policy == "truncate":  # and it does
        prepare_split(str(path), renderer, DataConfig(seq_len=need, overlength=policy), 0)


# --------------------------------------------------------------------------------- pad and pack


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", chat_rows(48, seed=2))


def _rows_as_examples(prepared) -> list[tuple[bytes, bytes]]:
    return sorted((e.ids.tobytes(), e.loss_mask.tobytes()) for row in prepared.rows for e in row)


def test_pad_and_pack_hold_the_same_examples_in_static_rows(chat_file, tok):
    r = Renderer(tok)
    pad = prepare_split(str(chat_file), r, DataConfig(seq_len=256, strategy="pad"), 0)
    pack = prepare_split(str(chat_file), r, DataConfig(seq_len=256, strategy="pack"), 0)
    assert len(pad.rows) == 48 and all(len(row) == 1 for row in pad.rows)
    assert len(pack.rows) < 48 / 2 and max(len(row) for row in pack.rows) > 2
    assert _rows_as_examples(pad) == _rows_as_examples(pack)  # nothing lost, nothing duplicated
    assert pack.nonpad_fraction() > pad.nonpad_fraction() * 2
    assert pack.useful_fraction() == pytest.approx(pad.useful_fraction() * len(pad.rows) / len(pack.rows))
    assert pack.loss_tokens() == pad.loss_tokens()
    for p in (pad, pack):
        assert all(sum(len(e.ids) for e in row) <= 256 for row in p.rows)
        shapes = {(k, v.shape, v.dtype) for i in range(len(p.rows)) for k, v in p.row_arrays(i).items()}
        assert len(shapes) == 7  # one shape per field over every row
        row_fields = ("tokens", "positions", "segment_ids", "prefix_segment_ids")
        assert {s for k, s, _ in shapes if k in row_fields} == {(256,)}


def test_packed_row_segments_positions_and_targets(chat_file, tok):
    pack = prepare_split(str(chat_file), Renderer(tok), DataConfig(seq_len=256, strategy="pack"), 0)
    for i, row in enumerate(pack.rows):
        a = pack.row_arrays(i)
        off = 0
        for s, ex in enumerate(row, start=1):
            n = len(ex.ids)
            np.testing.assert_array_equal(a["tokens"][off:off + n], ex.ids)
            np.testing.assert_array_equal(a["positions"][off:off + n], np.arange(n))  # restart per example
            assert (a["segment_ids"][off:off + n] == s).all()
            off += n
        assert (a["segment_ids"][off:] == 0).all() and (a["tokens"][off:] == 0).all()
        assert (a["positions"][off:] == 0).all()
        w = a["loss_weights"] > 0
        idx, tgt = a["loss_idx"][w], a["loss_targets"][w]
        assert w.sum() == sum(int(e.loss_mask[1:].sum()) for e in row)
        np.testing.assert_array_equal(a["tokens"][idx + 1], tgt)  # next-token targets
        np.testing.assert_array_equal(a["segment_ids"][idx], a["segment_ids"][idx + 1])  # never across examples
        assert (a["loss_idx"][~w] == 0).all() and (a["loss_targets"][~w] == 0).all()


def _naive_first_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        for r, free in enumerate(room):
            if free >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(seq_len - n)
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_pack_is_first_fit(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 200, size=int(rng.integers(1, 400))).tolist()
    exs = [batching.Example(np.full(n, i, np.int32), np.ones(n, bool)) for i, n in enumerate(lengths)]
    got = [[int(e.ids[0]) for e in row] for row in batching.pack_first_fit(exs, 256)]
    assert got == _naive_first_fit(lengths, 256)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_trees_are_first_fit(seed):
    """Each group's examples are cut into trees `[P | S1 | S2 ...]` by first fit of their suffixes (a scan of every
    open tree per example, quadratic in a group's size, was replaced by pack_first_fit's max-tree): the same trees,
    each in its first member's place, a tree of one member a plain example."""
    rng = np.random.default_rng(seed)
    n, seq_len = int(rng.integers(100, 300)), 256
    prefix = rng.integers(3, 500, 200).tolist()
    perm = rng.permutation(n).tolist()
    groups, at = [], 0
    while at < n * 3 // 4:  # groups of shuffled indices, the rest alone
        k, p = int(rng.integers(1, 60)), int(rng.integers(1, 120))
        groups.append((p, perm[at:at + k]))
        at += k
    plen = {i: p for p, idx in groups for i in idx}
    exs = [batching.Example(np.asarray(prefix[:plen.get(i, 0)] + [i] * int(rng.integers(1, seq_len - plen.get(i, 0))),
                                       np.int32), np.ones(1, bool)) for i in range(n)]
    got = [(type(it).__name__, [int(e.ids[-1]) for e in batching.members(it)]) for it in
           batching.make_trees(exs, groups, seq_len)]
    first, taken = {}, set()
    for p, idx in groups:
        for tree in _naive_first_fit([len(exs[i].ids) - p for i in idx], seq_len - p):
            first[idx[tree[0]]] = ("Tree" if len(tree) > 1 else "Example", [idx[k] for k in tree])
            taken.update(idx[k] for k in tree)
    assert got == [first.get(i, ("Example", [i])) for i in range(n) if i in first or i not in taken]
    assert sum(kind == "Tree" for kind, _ in got) > 2


def test_loss_buffer_is_static_and_counts_overflow(chat_file, tok):
    p = prepare_split(str(chat_file), Renderer(tok), DataConfig(seq_len=256, strategy="pack"), 0)
    most = max(batching.row_loss_count(r) for r in p.rows)
    assert p.max_loss % 8 == 0 and most <= p.max_loss < most + 8
    small = prepare_split(str(chat_file), Renderer(tok), DataConfig(seq_len=256, strategy="pack", max_loss_tokens=16), 0)
    assert small.max_loss == 16 and all(small.row_arrays(i)["loss_idx"].shape == (16,) for i in range(3))
    assert small.loss_tokens() == sum(min(batching.row_loss_count(r), 16) for r in small.rows)


def test_eval_batches_cover_every_row_once(chat_file, tok):
    p = prepare_split(str(chat_file), Renderer(tok), DataConfig(seq_len=256, strategy="pad"), 0)
    bs = eval_batches(p, 5)
    assert len(bs) == 10 and {b["tokens"].shape for b in bs} == {(5, 256)}
    seen = [t.tobytes() for b in bs for t, w in zip(b["tokens"], b["loss_weights"]) if w.sum()]
    assert sorted(seen) == sorted(p.row_arrays(i)["tokens"].tobytes() for i in range(48))
    assert bs[-1]["loss_weights"][3:].sum() == 0  # 48 = 9*5 + 3: two weightless filler rows
    # two processes: each has every batch, half of each, together the whole batch
    halves = [eval_batches(p, 6, process_index=i, process_count=2) for i in range(2)]
    whole = eval_batches(p, 6)
    assert len(halves[0]) == len(halves[1]) == len(whole) == 8
    for k in range(8):
        for key in whole[k]:
            np.testing.assert_array_equal(whole[k][key][0::2], halves[0][k][key])
            np.testing.assert_array_equal(whole[k][key][1::2], halves[1][k][key])



@pytest.mark.parametrize("strategy", ["pad", "pack"])
def test_token_weighted_eval_batches_mean_is_the_mean_over_tokens(chat_file, tok, strategy):
    """The trainer's eval loss is Tunix's plain mean of batch means; `loss_scale` makes that the mean over loss
    tokens (batches hold different numbers of them), as `gemma_tpu.evaluate` reports, for every process's share."""
    p = prepare_split(str(chat_file), Renderer(tok), DataConfig(seq_len=256, strategy=strategy), 0)
    rng = np.random.default_rng(0)
    nll = {i: rng.uniform(0, 5, p.row_arrays(i)["loss_weights"].shape) for i in range(len(p.rows))}
    bs = eval_batches(p, 4, token_weighted=True)
    w_all = np.concatenate([p.row_arrays(i)["loss_weights"] for i in range(len(p.rows))]).astype(float)
    per_token = sum((nll[i] * p.row_arrays(i)["loss_weights"]).sum() for i in range(len(p.rows))) / w_all.sum()
    batch_means, pos = [], 0
    for b in bs:
        rows = [nll[i] for i in range(pos, min(pos + 4, len(p.rows)))]
        pos += 4
        w = b["loss_weights"][:len(rows)].astype(float)
        batch_means.append((np.stack(rows) * w).sum() / max(w.sum(), 1.0) * float(b["loss_scale"][0]))
        assert b["loss_scale"].shape == (4,) and len(set(b["loss_scale"].tolist())) == 1
    assert len({round(float(b["loss_scale"][0]), 6) for b in bs}) > 1  # batches do differ in loss tokens
    assert np.mean(batch_means) == pytest.approx(per_token, rel=1e-5)
    # two processes: the same scale in both shares of a batch (the whole batch's share of the tokens)
    halves = [eval_batches(p, 4, process_index=i, process_count=2, token_weighted=True) for i in range(2)]
    for k, b in enumerate(bs):
        np.testing.assert_array_equal(halves[0][k]["loss_scale"], b["loss_scale"][:2])
        np.testing.assert_array_equal(halves[1][k]["loss_scale"], b["loss_scale"][:2])
    assert "loss_scale" not in eval_batches(p, 4)[0]

# -------------------------------------------------------------------------------------- grain


@pytest.fixture(scope="module")
def padded(chat_file, tok):
    return prepare_split(str(chat_file), Renderer(tok), DataConfig(seq_len=256, strategy="pad"), 0)


def _row_ids(prepared) -> dict[bytes, int]:
    key = {prepared.row_arrays(i)["tokens"].tobytes(): i for i in range(len(prepared.rows))}
    assert len(key) == len(prepared.rows)  # rows are distinct, so tokens identify them
    return key


def _read(stream, n: int, key: dict[bytes, int]) -> list[list[int]]:
    return [[key[t.tobytes()] for t in next(stream)["tokens"]] for _ in range(n)]


def test_same_seed_same_batches_other_seed_other_order(padded):
    key = _row_ids(padded)
    a = _read(TrainStream(padded, 8, seed=7), 12, key)
    b = _read(TrainStream(padded, 8, seed=7), 12, key)
    c = _read(TrainStream(padded, 8, seed=8), 12, key)
    assert a == b and a != c
    for run in (a, c):  # each epoch (6 batches) is a permutation of all rows; epochs differ in order
        e1, e2 = sum(run[:6], []), sum(run[6:], [])
        assert sorted(e1) == sorted(e2) == list(range(48)) and e1 != e2
    ordered = _read(TrainStream(padded, 8, seed=7, shuffle=False), 6, key)
    assert sum(ordered, []) == list(range(48))


def test_batches_have_one_shape(padded, chat_file, tok):
    pack = prepare_split(str(chat_file), Renderer(tok), DataConfig(seq_len=256, strategy="pack"), 0)
    for p in (padded, pack):
        sigs = {tuple((k, v.shape, str(v.dtype)) for k, v in sorted(b.items()))
                for b in TrainStream(p, 4, seed=0, num_epochs=3)}
        assert len(sigs) == 1
        assert dict((k, s) for k, s, _ in next(iter(sigs)))["tokens"] == (4, 256)


def test_finite_epochs_drop_the_last_partial_batch(padded):
    assert len(list(TrainStream(padded, 10, seed=0, num_epochs=1))) == 4  # 48 rows: 4 batches, 8 rows dropped
    assert len(list(TrainStream(padded, 10, seed=0, num_epochs=3))) == 14  # 144 rows over the epochs
    with pytest.raises(UserError, match="fewer than one batch"):
        TrainStream(padded, 64, seed=0)
    with pytest.raises(UserError, match="divisible by the 3 processes"):
        TrainStream(padded, 8, seed=0, process_count=3)


def test_restored_iterator_continues_exactly(padded):
    key = _row_ids(padded)
    whole = _read(TrainStream(padded, 8, seed=3), 15, key)
    first = TrainStream(padded, 8, seed=3)
    head = _read(first, 5, key)
    state = json.loads(json.dumps(first.get_state()))  # the checkpoint stores it as JSON
    resumed = TrainStream(padded, 8, seed=3)
    resumed.set_state(state)
    assert head + _read(resumed, 10, key) == whole  # crosses an epoch boundary too
    for p in range(2):  # per process as well
        s = TrainStream(padded, 8, seed=3, process_index=p, process_count=2)
        _read(s, 7, key)
        st = s.get_state()
        want = _read(s, 3, key)
        again = TrainStream(padded, 8, seed=3, process_index=p, process_count=2)
        again.set_state(st)
        assert _read(again, 3, key) == want


@pytest.mark.parametrize("processes", [2, 4])
def test_simulated_processes_read_disjoint_slices_covering_the_data(padded, processes):
    key = _row_ids(padded)
    single = _read(TrainStream(padded, 8, seed=5), 12, key)
    per = [_read(TrainStream(padded, 8, seed=5, process_index=i, process_count=processes), 12, key)
           for i in range(processes)]
    assert all(len(b) == 8 // processes for p in per for b in p)
    for epoch in range(2):
        rows = [sum(p[epoch * 6:(epoch + 1) * 6], []) for p in per]
        for i in range(processes):
            for j in range(i + 1, processes):
                assert not set(rows[i]) & set(rows[j])
        assert sorted(sum(rows, [])) == list(range(48))
    for k in range(12):  # global batch k is the one-process batch k
        assert sorted(sum((p[k] for p in per), [])) == sorted(single[k])
    # index view agrees with the batches
    s = TrainStream(padded, 8, seed=5, process_index=1, process_count=processes)
    assert [s.index_dataset[i] for i in range(8 // processes)] == per[1][0]


def test_uneven_rows_give_every_process_the_same_number_of_batches(tmp_path, tok):
    path = write_jsonl(tmp_path / "odd.jsonl", chat_rows(37, seed=4))
    p = prepare_split(str(path), Renderer(tok), DataConfig(seq_len=256), 0)
    counts = [len(list(TrainStream(p, 6, seed=0, num_epochs=2, process_index=i, process_count=3))) for i in range(3)]
    assert counts == [12, 12, 12]  # 74 rows -> 12 global batches of 6, 2 rows dropped


_TWO_PROCESS_SCRIPT = r'''
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port, data, tok_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from transformers import AutoTokenizer
from gemma_tpu.core.config import DataConfig
from gemma_tpu.data import Renderer, TrainStream, prepare_split

prepared = prepare_split(data, Renderer(AutoTokenizer.from_pretrained(tok_dir)), DataConfig(seq_len=256), seed=0)
key = {prepared.row_arrays(i)["tokens"].tobytes(): i for i in range(len(prepared.rows))}
stream = TrainStream(prepared, 8, seed=11, num_epochs=1, process_index=jax.process_index(),
                     process_count=jax.process_count())
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
total = jax.jit(lambda x: x.sum())
rows, sums = [], []
for batch in stream:
    rows.append([key[t.tobytes()] for t in batch["tokens"]])
    glob = jax.make_array_from_process_local_data(sharding, batch["tokens"])  # [8, 256] over both processes
    sums.append(int(total(glob)))
json.dump({"process_index": jax.process_index(), "process_count": jax.process_count(),
           "devices": jax.device_count(), "local_devices": jax.local_device_count(), "rows": rows, "sums": sums},
          open(out, "w"))
jax.distributed.shutdown()
'''


def test_two_jax_processes_read_disjoint_slices(tmp_path, tok_dir, padded, chat_file):
    """Two real JAX processes (gloo on loopback, 4 CPU devices each) through TrainStream."""
    script = tmp_path / "proc.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), str(chat_file), str(tok_dir),
                               str(tmp_path / f"p{i}.json")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two-process run did not finish in 240 s")
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    res = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    assert [r["process_index"] for r in res] == [0, 1]
    assert all(r["process_count"] == 2 and r["devices"] == 8 and r["local_devices"] == 4 for r in res)
    a, b = (sum(r["rows"], []) for r in res)
    assert len(res[0]["rows"]) == len(res[1]["rows"]) == 6 and all(len(x) == 4 for r in res for x in r["rows"])
    assert not set(a) & set(b) and sorted(a + b) == list(range(48))  # disjoint; together the dataset
    assert res[0]["sums"] == res[1]["sums"]  # both computed on the same global batch
    key = _row_ids(padded)
    single = _read(TrainStream(padded, 8, seed=11, num_epochs=1), 6, key)
    for k in range(6):  # global batch k is the one-process batch k
        assert sorted(res[0]["rows"][k] + res[1]["rows"][k]) == sorted(single[k])
        assert res[0]["sums"][k] == sum(int(padded.row_arrays(i)["tokens"].sum()) for i in single[k])


# ---------------------------------------------------------------- chat templates (apply_chat_template)

PLAIN_CONVS = [
    CHAT,
    {"messages": CHAT["messages"][1:]},  # no system
    {"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                  {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"},
                  {"role": "assistant", "content": "f"}]},
]


def _ids(out) -> list[int]:
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def _with_template(tokenizer_dir_or_tok, template: str):
    import copy

    t = copy.deepcopy(tokenizer_dir_or_tok)
    t.chat_template = template
    return t


@pytest.fixture(params=["small", "gemma3"])
def gemma_template_tok(request, tok):
    """A tokenizer that ships Gemma 3's chat template: the small one with it installed, or the real one."""
    from gemma_tpu.assets.embedded import GEMMA3_CHAT_TEMPLATE

    if request.param == "small":
        return _with_template(tok, GEMMA3_CHAT_TEMPLATE)
    return request.getfixturevalue("real_tok")


@pytest.mark.parametrize("i", range(len(PLAIN_CONVS)))
def test_rendering_equals_apply_chat_template(gemma_template_tok, i):
    t = gemma_template_tok
    conv = norm(PLAIN_CONVS[i])
    msgs = template_messages(conv["messages"])
    r = Renderer(t).render(conv)
    assert r.ids.tolist() == _ids(t.apply_chat_template(msgs, tokenize=True))
    assert "<bos>" + r.text == t.apply_chat_template(msgs, tokenize=False)
    k = max(j for j, m in enumerate(msgs) if m["role"] == "user")  # the prompt before the last answer
    prompt = Renderer(t).render({"messages": conv["messages"][:k + 1]}, add_generation_prompt=True)
    assert prompt.ids.tolist() == _ids(t.apply_chat_template(msgs[:k + 1], tokenize=True, add_generation_prompt=True))
    # the tokenizer's own template as the renderer: same ids, same loss mask
    own = Renderer(t, chat_format="template").render(conv)
    assert own.ids.tolist() == r.ids.tolist() and own.loss_mask.tolist() == r.loss_mask.tolist()


TOOL_CONVS = [TOOL_CHAT, {"tools": [STEPS_TOOL, HR_TOOL], "messages": [
    {"role": "system", "content": "Coach."}, {"role": "user", "content": "HR and steps?"},
    {"role": "assistant", "content": "Both. ", "tool_calls": [
        {"type": "function", "function": {"name": "get_heart_rate", "arguments": {"date": "today", "metric": "max"}}},
        {"type": "function", "function": {"name": "get_steps", "arguments": {"date": "today"}}}]},
    {"role": "tool", "name": "get_heart_rate", "content": "{\"bpm\": 170}"},
    {"role": "tool", "name": "get_steps", "content": "plain text result"},
    {"role": "assistant", "content": "170 bpm, some steps."},
    {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome."}]}]


@pytest.mark.parametrize("i", range(len(TOOL_CONVS)))
def test_tool_rendering_equals_tool_chat_template(any_tok, i):
    from gemma_tpu.formats.function_calling import tool_chat_template

    token_map = function_token_map(any_tok)
    t = _with_template(any_tok, tool_chat_template(token_map))
    conv = norm(TOOL_CONVS[i])
    msgs = template_messages(conv["messages"])
    ours = Renderer(t, token_map=token_map).render(conv)
    assert ours.ids.tolist() == _ids(t.apply_chat_template(msgs, tools=conv["tools"], tokenize=True))
    first = next(j for j, m in enumerate(msgs) if m["role"] == "assistant")
    prompt = Renderer(t, token_map=token_map).render({"tools": conv["tools"], "messages": conv["messages"][:first]},
                                                      add_generation_prompt=True)
    assert prompt.ids.tolist() == _ids(t.apply_chat_template(msgs[:first], tools=conv["tools"], tokenize=True,
                                                             add_generation_prompt=True))
    own = Renderer(t, chat_format="template", token_map=token_map).render(conv)
    assert own.ids.tolist() == ours.ids.tolist() and own.loss_mask.tolist() == ours.loss_mask.tolist()


def test_tool_template_reads_call_arguments_sent_as_json_text(tok):
    """OpenAI clients send a call's arguments as a JSON text: the template rendered every such call as `call:NAME{}`
    (a server that hands them on unparsed, `apply_chat_template` on an OpenAI history), the arguments lost. Read
    as the renderer reads them, they render as the object does; text that is not a JSON object stays `{}`."""
    from gemma_tpu.formats.function_calling import tool_chat_template

    t = _with_template(tok, tool_chat_template(function_token_map(tok)))
    odd = {"date": "to\"day{}:", "n": -3, "x": [1.5, 2e20, None, True], "o": {"k": "é😀"}}
    msgs = [{"role": "user", "content": "HR and steps?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_heart_rate", "arguments": {"date": "today", "metric": "max"}}},
        {"type": "function", "function": {"name": "get_steps", "arguments": odd}}]},
        {"role": "tool", "name": "get_heart_rate", "content": "1"},
        {"role": "tool", "name": "get_steps", "content": "2"}]
    as_text = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in msgs]
    rendered = t.apply_chat_template(msgs, tokenize=False)
    assert "call:get_steps{}" not in rendered and t.apply_chat_template(as_text, tokenize=False) == rendered
    for text in ("", "[1]", "{bad", "null"):
        as_text[1]["tool_calls"][1]["function"]["arguments"] = text
        assert "call:get_steps{}<" in t.apply_chat_template(as_text, tokenize=False)


def test_a_tool_without_a_description_renders_alike_as_vllm_hands_it_over(tok):
    """vLLM hands the chat template each declaration as its request model dumps it, a description left out as None
    (`FunctionDefinition.model_dump()`): the template wrote `description:null` where training wrote the empty
    description of the same tool (`description:<escape><escape>`). A null description is an empty one on both
    sides."""
    from gemma_tpu.formats.function_calling import tool_chat_template

    token_map = function_token_map(tok)
    t = _with_template(tok, tool_chat_template(token_map))
    bare = {"type": "function", "function": {"name": "ping"}}
    dumped = {"type": "function", "function": {"name": "ping", "description": None, "parameters": None}}
    msgs = [{"role": "user", "content": "q"}]
    conv = norm({"tools": [bare], "messages": msgs + [{"role": "assistant", "content": "a"}]})
    want = Renderer(t, token_map=token_map).render({"tools": conv["tools"], "messages": msgs},
                                                   add_generation_prompt=True).text
    for tools in ([bare], [dumped]):
        assert t.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True) == "<bos>" + want
        assert Renderer(t, token_map=token_map).render(
            {"tools": norm({"tools": tools, "messages": msgs + [{"role": "assistant", "content": "a"}]})["tools"],
             "messages": msgs}, add_generation_prompt=True).text == want


def test_tool_template_reads_content_parts_as_training_joins_them(any_tok):
    """vLLM hands the template content as parts (`serving.launch` passes --chat-template-content-format openai; its
    "string" form joins text parts with newlines first): split into parts, every message renders to the ids the
    same text as one string renders to, as the training reader joins parts."""
    from gemma_tpu.formats.function_calling import tool_chat_template

    t = _with_template(any_tok, tool_chat_template(function_token_map(any_tok)))
    conv = norm(TOOL_CONVS[1])
    msgs = template_messages(conv["messages"])
    parted = [{**m, "content": [{"type": "text", "text": m["content"][:len(m["content"]) // 2]},
                                {"type": "text", "text": m["content"][len(m["content"]) // 2:]}]}
              if isinstance(m.get("content"), str) and m["content"] else m for m in msgs]
    assert any(isinstance(m.get("content"), list) for m in parted if m["role"] == "tool")
    assert _ids(t.apply_chat_template(parted, tools=conv["tools"], tokenize=True)) == _ids(
        t.apply_chat_template(msgs, tools=conv["tools"], tokenize=True))


def test_nameless_parallel_results_render_as_the_renderer_reads_them(tok):
    """Results of parallel calls without a name or a tool_call_id (what transformers serve hands the template when a
    client sends names, or neither) answer the calls in order, as the renderer reads them; the template named every
    one after the turn's last call (`response:get_steps{bpm:170}` for the heart-rate result)."""
    from gemma_tpu.formats.function_calling import tool_chat_template

    token_map = function_token_map(tok)
    t = _with_template(tok, tool_chat_template(token_map))
    conv = norm(TOOL_CONVS[1])
    want = Renderer(t, token_map=token_map).render(conv).text
    msgs = [{k: v for k, v in m.items() if k != "name"} for m in template_messages(conv["messages"])]
    got = t.apply_chat_template(msgs, tools=conv["tools"], tokenize=False)
    assert "response:get_heart_rate{bpm:170}" in got and got == "<bos>" + want


def test_a_result_without_id_answers_the_call_results_by_id_left_open(tok):
    """Results of parallel calls answered by id out of order, then one with neither an id nor a name: it answers
    the call still open. It was credited to the call in its position (`response:get_steps` twice, the heart rate
    never answered) in training and in the served template alike."""
    from gemma_tpu.formats.function_calling import tool_chat_template

    conv = json.loads(json.dumps(TOOL_CONVS[1]))
    calls, results = conv["messages"][2]["tool_calls"], conv["messages"][3:5]
    calls[0]["id"], calls[1]["id"] = "hr", "st"
    results[0].update(name="get_steps", tool_call_id="st", content="plain text result")
    del results[1]["name"]
    results[1]["content"] = "{\"bpm\": 170}"
    got = norm(conv)["messages"]
    assert [m.get("name") for m in got[3:5]] == ["get_steps", "get_heart_rate"]
    # a named result answers the open call of its name: the one after it is the call left
    named = json.loads(json.dumps(conv))
    del named["messages"][3]["tool_call_id"]
    assert [m.get("name") for m in norm(named)["messages"][3:5]] == ["get_steps", "get_heart_rate"]
    token_map = function_token_map(tok)
    t = _with_template(tok, tool_chat_template(token_map))
    want = Renderer(t, token_map=token_map).render(norm(conv)).text
    assert "response:get_heart_rate{bpm:170}" in want
    for row in (conv, named):  # the client's messages as sent, the nameless result without a name
        msgs = template_messages(norm(row)["messages"])
        del msgs[4]["name"]
        assert t.apply_chat_template(msgs, tools=conv["tools"], tokenize=False) == "<bos>" + want

def _json_texts(n: int, seed: int = 0) -> list[str]:
    """Tool results as clients send them: JSON texts of random values (escapes, non-ASCII, surrogate pairs,
    numbers of every form, indentation) and some of them broken."""
    import random

    rng = random.Random(seed)

    def value(d=0):
        k = rng.random()
        if d > 3 or k < 0.45:
            return rng.choice([rng.randint(-10**6, 10**6), rng.random() * 10 ** rng.randint(-8, 8), True, False, None,
                               "".join(rng.choice('ab "\\/\n\té😀\x01<>{}[],:') for _ in range(rng.randint(0, 8))),
                               float("nan"), float("-inf"), -0.0, 10**25])
        if k < 0.75:
            return {"".join(rng.choice('kv_é" ') for _ in range(rng.randint(0, 4))) + str(i): value(d + 1)
                    for i in range(rng.randint(0, 4))}
        return [value(d + 1) for _ in range(rng.randint(0, 4))]

    out = []
    for _ in range(n):
        text = json.dumps(value(), ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2, "\t"]),
                          separators=rng.choice([None, (",", ":"), (" , ", " : ")]))
        if rng.random() < 0.2:
            k = rng.randrange(len(text) + 1)
            text = text[:k] + rng.choice(['"', ",", "}", "]", "x", "\\", ":", ""]) + text[k + 1:]
        out.append(text)
    return out


TOOL_RESULT_TEXTS = [
    '{"steps": 8123, "date": "2025-03-02"}', "{}", "[1, 2.5, -0, -0.0, 1e5, 1E+2, 2.5e-3, 12345678901234567890, 1.50]",
    '"text"', "5", "true", "null", "NaN", "-Infinity", '  {"a" : [ true , false , null ] }  ',
    '{"s": "q\\"uote \\\\ \\/ \\b\\f\\n\\r\\t \\u00e9 \\ud83d\\ude00 \\ud800x \\udc00"}', '{"\\u00e9": 2}',
    '{"a":1,}', "[1,]", "{a:1}", "{'a':1}", '{"a" 1}', "", "  ", "plain text", '{"a":1}}', "[1] x", "01", "1.", ".5",
    "+1", "1e", '"raw\nnewline"', '"\\x"', '"\\u12g4"', '{"a":' * 65 + "1" + "}" * 65,
    '{"a":' * 64 + "1" + "}" * 64, '{"n": -%s, "m": 1}' % ("9" * 4300), '{"n": %s}' % ("9" * 4301),
    json.dumps({"rows": ["x" * 40] * 180}), json.dumps({"rows": ["x" * 40] * 190}),
]


def test_tool_results_sent_as_json_text_render_as_in_training(tok):
    """OpenAI clients send a tool result as a JSON *string*. The served chat template rendered it as
    `{result:<escape>{"steps": 8123}<escape>}` where training rendered `{steps:8123}`, so a served model read its
    tool results in a format it was never trained on. The template now reads JSON as `format_response` does:
    objects field by field, other JSON values as `{result:...}`, anything else (broken JSON, nesting past 64,
    texts past 8,192 characters) as a string."""
    from gemma_tpu.formats.function_calling import JSON_RESULT_LIMIT, format_response, tool_chat_template

    token_map = function_token_map(tok)
    template = tool_chat_template(token_map)
    renderer = Renderer(tok, token_map=token_map)
    call = {"type": "function", "function": {"name": "get_steps", "arguments": {"date": "today"}}}
    texts = TOOL_RESULT_TEXTS + _json_texts(120)
    assert len(TOOL_RESULT_TEXTS[-2]) <= JSON_RESULT_LIMIT < len(TOOL_RESULT_TEXTS[-1])
    for text in texts:
        msgs = [{"role": "user", "content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "get_steps", "content": text}]
        got = tok.apply_chat_template(msgs, tools=[STEPS_TOOL], chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
        # the data reader refuses a result holding NaN/Infinity (or a key twice); a served one may hold them, so the
        # renderer gets the text as it is
        conv = norm({"tools": [STEPS_TOOL], "messages": [*msgs[:2], {**msgs[2], "content": "x"}]})
        conv["messages"][2]["content"] = text
        want = renderer.render(conv, add_generation_prompt=True).text
        assert got == "<bos>" + want, text
    unmapped = lambda text: format_response("get_steps", text)  # noqa: E731
    assert unmapped('{"steps": 8123}').endswith("response:get_steps{steps:8123}<end_function_response>")
    assert "{result:<escape>plain text<escape>}" in unmapped("plain text")
    assert "{result:5}" in unmapped("5") and "{result:<escape>{a:1}<escape>}" in unmapped("{a:1}")
    # an integer past Python's 4,300 digits: a ValueError traceback out of the renderer (json.loads), 0 in the template
    # (Jinja's int filter); both keep such a text as a string
    assert f"{{result:<escape>{TOOL_RESULT_TEXTS[-3]}<escape>}}" in unmapped(TOOL_RESULT_TEXTS[-3])
    # the GGUF's template (llama.cpp) keeps results as strings
    plain = tool_chat_template(token_map, parse_json=False)
    assert "json_value" not in plain
    msgs = [{"role": "user", "content": "steps?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "get_steps", "content": '{"steps": 5}'}]
    got = tok.apply_chat_template(msgs, tools=[STEPS_TOOL], chat_template=plain, tokenize=False)
    assert fc_unmap_text(got, token_map).endswith('response:get_steps{result:<escape>{"steps": 5}<escape>}'
                                                  '<end_function_response>')


def fc_unmap_text(text: str, token_map: dict) -> str:
    from gemma_tpu.formats.function_calling import unmap_markers

    return unmap_markers(text, token_map)


def test_template_format_with_a_foreign_template(tok):
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = _with_template(tok, chatml)
    r = Renderer(t, chat_format="template").render(norm(CHAT))
    assert r.text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert masked_runs(t, r) == ["4.<|im_end|>", "It is 8.<|im_end|>"]  # the newline after it is not trained
    assert r.ids[0] == 2 and (r.ids == 2).sum() == 1


def test_template_format_refuses_what_it_cannot_split(tok):
    with pytest.raises(UserError, match="has no chat template"):
        Renderer(_with_template(tok, None), chat_format="template")
    counting = "{{ messages | length }}{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    with pytest.raises(UserError, match="test: the tokenizer's chat template is not prefix-stable"):
        Renderer(_with_template(tok, counting), chat_format="template").render(norm(CHAT))
    from gemma_tpu.assets.embedded import GEMMA3_CHAT_TEMPLATE

    with pytest.raises(UserError, match="test: the tokenizer's chat template refused the conversation"):
        Renderer(_with_template(tok, GEMMA3_CHAT_TEMPLATE), chat_format="template").render(norm(TOOL_CHAT))


def test_config_accepts_template_chat_format():
    from gemma_tpu.core.config import load_config

    cfg = load_config(None, ["data.chat_format=template"])
    assert cfg.data.chat_format == "template"
    with pytest.raises(UserError, match="data.chat_format"):
        load_config(None, ["data.chat_format=chatml"])


# ------------------------------------------------------------------------------------- inspect


def test_inspect_prints_stats_and_marks_the_loss(tmp_path, tok_dir, tok):
    rows = [CHAT] + chat_rows(20, seed=3) + [
        {"messages": [{"role": "user", "content": "long"}, {"role": "assistant", "content": "w" * 400}]}]
    path = write_jsonl(tmp_path / "i.jsonl", rows)
    out_json = tmp_path / "stats.json"
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(_inspect_config(tmp_path, path)), "--tokenizer",
                   str(tok_dir), "-n", "2", "--json", str(out_json), "data.strategy=pack", timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    stats = json.loads(out_json.read_text())
    assert stats["examples_read"] == 22 and stats["examples_kept"] == 22 and stats["truncated"] == 1
    assert stats["strategy"] == "pack" and stats["distinct_batch_shapes"] == 1
    assert stats["other_strategy"]["pad"]["rows"] == 22 and stats["rows"] < 22
    assert stats["useful_fraction"] > stats["other_strategy"]["pad"]["useful_fraction"]
    lengths = [len(e.ids) for e in render_examples(str(path), Renderer(tok), DataConfig())]
    assert stats["p50"] == int(np.percentile(lengths, 50, method="higher")) and stats["length_max"] == max(lengths)
    assert "read 22, kept 22, truncated 1, dropped 0" in out
    assert f"p50 {stats['p50']}" in out and "batch shapes: 1 distinct" in out
    sp = stats["shared_prefixes"]
    assert f"shared prefixes (data.share_prefix_min_tokens=32): {sp['groups']} groups" in out
    assert f"{sp['computed_tokens_per_example']} one by one" in out and sp["examples"] == 22
    assert "pack *" in out and "\x1b[" not in out  # not a terminal: plain markers
    first = out.split("--- example 1")[1].split("--- example 2")[0]
    assert f"{SOT}model\n[[4.{EOT}]]\n{SOT}user\nAnd doubled?" in first
    assert f"[[It is 8.{EOT}]]" in first and "[[" not in first.split(f"{SOT}model")[0]
    colored = run_cli("gemma_tpu.data.inspect", "--config", str(_inspect_config(tmp_path, path)), "--tokenizer",
                      str(tok_dir), "--color", "always", "-n", "1", timeout=300)
    assert f"\x1b[1;32m4.{EOT}\x1b[0m" in colored.stdout


def test_inspect_warns_of_the_loss_buffer_once_for_the_configured_strategy(tmp_path, tok_dir, caplog):
    """`data.inspect` lays the rows out under both strategies to compare them; the loss-buffer warning came twice,
    the second time with the other strategy's row count, as if training would lose that much."""
    import logging

    from gemma_tpu.data import inspect

    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(8, seed=1))
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        inspect.run(inspect.parse_args(["--config", str(_inspect_config(tmp_path, path)), "--tokenizer", str(tok_dir),
                                        "-n", "0", "data.max_loss_tokens=1", "data.strategy=pad"]))
    said = [r.getMessage() for r in caplog.records if "data.max_loss_tokens" in r.getMessage()]
    assert said == [f"{path}: 8 rows have more than data.max_loss_tokens=1 targets; the excess is not trained"]


def test_inspect_shows_control_characters_of_the_text_as_escapes(tmp_path, tok_dir, capsys):
    """A carriage return or a terminal escape in a message was printed as it is: the terminal moved the cursor, hid
    the text before a '\\r' or changed its colours, and the example shown was not the text trained. They show as
    their escapes; newlines and tabs stay as they are."""
    from gemma_tpu.data import inspect

    row = {"messages": [{"role": "user", "content": "q\tr"},
                        {"role": "assistant", "content": "hidden\rshown \x1b[2Jcleared\x00end\x7f\u0085."}]}
    path = write_jsonl(tmp_path / "c.jsonl", [row] * 4)
    inspect.run(inspect.parse_args(["--config", str(_inspect_config(tmp_path, path)), "--tokenizer", str(tok_dir),
                                    "--color", "never", "-n", "1"]))
    out = capsys.readouterr().out
    assert f"{SOT}user\nq\tr{EOT}\n" in out
    assert f"[[hidden\\rshown \\x1b[2Jcleared\\x00end\\x7f\\x85.{EOT}]]" in out
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", out)


def test_over_length_examples_are_one_warning_naming_the_first(tmp_path, tok):
    """Training logged over-length examples only as counts inside an INFO line: a split whose answers were
    cut or dropped trained without a warning."""
    from gemma_tpu.data import overlength_warning

    late = {"messages": [{"role": "user", "content": "q" * 300}, {"role": "assistant", "content": "answer"}]}
    cut = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "w" * 300}]}
    path = write_jsonl(tmp_path / "o.jsonl", [CHAT, cut, late, cut])
    split = prepare_split(str(path), Renderer(tok), DataConfig(seq_len=128), seed=0)
    assert overlength_warning(split, "truncate") == (
        f"{path}: 3 of 4 examples are longer than data.seq_len=128 (the first: {path}:2); data.overlength=truncate: "
        f"2 truncated (trained up to the cut), 1 dropped (1 with no loss-bearing token before the cut); raise "
        f"data.seq_len or see `python -m gemma_tpu.data.inspect`")
    assert overlength_warning(prepare_split(str(path), Renderer(tok), DataConfig(seq_len=1024), seed=0),
                              "truncate") is None


def test_epochs_that_end_before_max_steps_are_one_warning(tmp_path, tok):
    """data.num_epochs=1 with train.max_steps past it: the run stopped at the end of the data ("done: steps 4"
    of 10) without a word, its learning-rate schedule sized for the 10 steps it never took."""
    from gemma_tpu.data import epochs_warning

    path = write_jsonl(tmp_path / "e.jsonl", chat_rows(10))
    split = prepare_split(str(path), Renderer(tok), DataConfig(seq_len=256), seed=0)
    assert len(split.rows) == 10 and len(list(TrainStream(split, 2, seed=0, num_epochs=3))) == 15
    assert epochs_warning(split, 2, 2, 3, 10) == (
        f"{path}: data.num_epochs=3 of 10 rows is 7 optimizer steps of train.batch_size=2 x 2 micro-batches, fewer "
        f"than train.max_steps=10: the run ends at step 7 with the learning-rate schedule sized for 10; set "
        f"train.max_steps=7 (or data.num_epochs=null)")
    assert epochs_warning(split, 2, 1, 3, 15) is None and epochs_warning(split, 2, 1, None, 10 ** 6) is None


def test_inspect_shows_truncation_and_eval_split(tmp_path, tok_dir):
    long = {"messages": [{"role": "user", "content": "long"}, {"role": "assistant", "content": "w" * 400}]}
    path = write_jsonl(tmp_path / "t.jsonl", [long] * 4)
    cfg = _inspect_config(tmp_path, path, eval_path=str(path))
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(cfg), "--tokenizer", str(tok_dir), "--split", "eval",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "truncated 4" in proc.stdout and "<<truncated at data.seq_len" in proc.stdout
    assert "(eval)" in proc.stdout and "batch shapes: 1 distinct (eval, batch 4, 1 batches)" in proc.stdout
    # the eval batches evaluation during training runs: each weighted by its tokens (loss_scale), at most
    # data.eval_max_batches of them (the listing showed every row, without loss_scale)
    assert re.search(r"loss_scale \[4\] float32", proc.stdout), proc.stdout
    cfg = _inspect_config(tmp_path, path, eval_path=str(write_jsonl(tmp_path / "e.jsonl", [long] * 9)),
                          eval_max_batches=2)
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(cfg), "--tokenizer", str(tok_dir), "--split", "eval",
                   "-n", "0", timeout=300)
    assert ("batch shapes: 1 distinct (eval, batch 4, 2 batches of 3 (data.eval_max_batches=2: evaluation uses the "
            "first 8 of 9 rows))") in proc.stdout, proc.stdout + proc.stderr
    # an example whose answer lies wholly past the cut is dropped, not trained truncated: say so
    late = {"messages": [{"role": "user", "content": "q" * 400}, {"role": "assistant", "content": "answer"}]}
    path = write_jsonl(tmp_path / "late.jsonl", [late] + [long] * 4)
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(_inspect_config(tmp_path, path)), "--tokenizer",
                   str(tok_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "read 5, kept 4, truncated 4, dropped 1" in proc.stdout
    assert re.search(r"--- example 1 \(\S+late.jsonl:1\): \d+ tokens, \d+ loss-bearing, dropped \(no loss-bearing "
                     r"token within data.seq_len\) ---", proc.stdout), proc.stdout
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(_inspect_config(tmp_path, path)), "--tokenizer",
                   str(tok_dir), "--split", "eval", timeout=300)
    assert_one_line_error(proc, "data.eval_path is not set")
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(_inspect_config(tmp_path, path, overlength="error")),
                   "--tokenizer", str(tok_dir), timeout=300)
    assert_one_line_error(proc, f"{path}:1", "data.seq_len=256")



def test_inspect_reports_evaluation_examples_that_are_training_examples(tmp_path, tok_dir, capsys):
    """Training warns when evaluation examples are also training examples (the validation loss then measures
    memorisation); `data.inspect`, there to see the data as training will, said nothing of it, on either split."""
    from gemma_tpu.data import inspect

    rows = chat_rows(12, seed=5)
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [CHAT, rows[7], rows[2]])
    cfg = str(_inspect_config(tmp_path, train, eval_path=str(evaluation)))
    for split in ("train", "eval"):
        stats = inspect.run(inspect.parse_args(["--config", cfg, "--tokenizer", str(tok_dir), "--split", split,
                                                "-n", "0"]))
        out = capsys.readouterr().out
        assert stats["eval_in_train"] == 2, out
        assert (f"eval/train 2 of 3 evaluation examples ({evaluation}) are also training examples (the first: "
                f"{evaluation}:2)") in out
    write_jsonl(evaluation, [CHAT])
    assert inspect.run(inspect.parse_args(["--config", cfg, "--tokenizer", str(tok_dir), "-n", "0"]))[
        "eval_in_train"] == 0
    assert "eval/train none of the 1 evaluation examples is a training example" in capsys.readouterr().out
    evaluation.write_text("{not json\n")  # the other split unreadable: the split asked for is still shown
    stats = inspect.run(inspect.parse_args(["--config", cfg, "--tokenizer", str(tok_dir), "-n", "0"]))
    assert stats["eval_in_train"] is None and f"eval/train not compared ({evaluation}:1" in capsys.readouterr().out

def test_inspect_reads_the_tokenizer_of_the_configured_model(tmp_path, tiny_dir):
    path = write_jsonl(tmp_path / "m.jsonl", [TOOL_CHAT, CHAT])
    cfg = _inspect_config(tmp_path, path, seq_len=1024)
    proc = run_cli("gemma_tpu.data.inspect", "--config", str(cfg), f"model.path={tiny_dir}", "train.batch_size=2",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"tokenizer  {tiny_dir}" in proc.stdout and "token map  <start_function_declaration> -> <unused" \
        in proc.stdout


def test_inspect_tokenizer_takes_what_model_path_takes(tmp_path, tiny_dir):
    """`--tokenizer` was handed to transformers as it came: `embedded:tiny-gemma3` and a missing directory
    were both read as hub ids ("Repo id must use alphanumeric chars ..."), though --help promises a hub id
    and model.path takes all three."""
    from gemma_tpu.data.inspect import tokenizer_for

    tok, where, _, _ = tokenizer_for("embedded:tiny-gemma3", None)
    assert Path(where).is_dir() and tok.convert_tokens_to_ids("<start_of_turn>") is not None
    assert tokenizer_for(str(tiny_dir), None)[1] == str(tiny_dir)
    with pytest.raises(UserError, match=r"^--tokenizer \S+/nope: no such directory$"):
        tokenizer_for(str(tmp_path / "nope"), None)
    with pytest.raises(UserError, match=r"^--tokenizer \S+config.json: not a directory \(a file of a model directory: "
                                        r"give the directory, \S+\)$"):
        tokenizer_for(str(tiny_dir / "config.json"), None)


# Roles in odd places: refused by the normaliser exactly where Gemma's own chat template refuses; what both accept
# renders to the template's text.
_U, _A = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
_ODD_ROLES = {
    "assistant first": ([_A], "must start with a user turn"),
    "two user turns": ([_U, _U, _A], "two user turns in a row"),
    "two assistant turns": ([_U, _A, _A], "two assistant turns in a row"),
    "late system": ([_U, {"role": "system", "content": "late"}, _A], "allowed only as the first message"),
    "two system messages": ([{"role": "system", "content": "s"}, {"role": "system", "content": "t"}, _U, _A],
                            "allowed only as the first message"),
    "system then assistant": ([{"role": "system", "content": "s"}, _A], "must start with a user turn"),
}


@pytest.mark.parametrize("name", list(_ODD_ROLES))
def test_odd_roles_refused_as_the_chat_template_refuses(name):
    from jinja2.exceptions import TemplateError

    from tests.test_assets import _render

    messages, message = _ODD_ROLES[name]
    with pytest.raises(UserError, match=rf"^f\.jsonl:3: messages\[\d\]: .*{message}"):
        normalise_messages({"messages": messages}, "f.jsonl:3")
    with pytest.raises(TemplateError):
        _render(messages)


@pytest.mark.parametrize("messages", [
    [_U, _A],
    [{"role": "system", "content": "Be brief."}, _U, _A, {"role": "user", "content": "more?"}, _A],
    [_U, _A, {"role": "user", "content": "and a trailing question"}],
])
def test_accepted_roles_render_as_the_chat_template(messages):
    from gemma_tpu.data.render import gemma_segments
    from tests.test_assets import _render

    conv = normalise_messages({"messages": messages}, "f.jsonl:1")
    assert "<bos>" + "".join(text for text, _ in gemma_segments(conv)) == _render(messages)


def test_tool_turn_order():
    calls = json.loads(json.dumps(TOOL_CHAT))
    i = next(k for k, m in enumerate(calls["messages"]) if m.get("tool_calls"))
    unanswered = {**calls, "messages": calls["messages"][:i + 1] + [{"role": "user", "content": "hello?"}]}
    with pytest.raises(UserError, match=rf"messages\[{i + 1}\]: a user turn follows unanswered tool calls"):
        norm(unanswered)
    skipped = {**calls, "messages": calls["messages"][:i + 1] + [{"role": "assistant", "content": "done"}]}
    with pytest.raises(UserError, match=rf"messages\[{i + 1}\]: the assistant continues before every tool call"):
        norm(skipped)


def test_a_template_refusal_names_the_line_once(tmp_path, tok):
    """A chat template's refusal read 'FILE:1: FILE:1: the tokenizer's chat template refused ...' (the renderer
    and the pipeline each named the example)."""
    path = write_jsonl(tmp_path / "t.jsonl", [CHAT])
    refusing = _with_template(tok, "{{ raise_exception('no tools here') }}")
    with pytest.raises(UserError) as e:
        render_examples(str(path), Renderer(refusing, chat_format="template"), DataConfig())
    assert str(e.value).startswith(f"{path}:1: the tokenizer's chat template refused the conversation "
                                   f"(TemplateError: no tools here)"), str(e.value)
    assert str(e.value).count(str(path)) == 1


def test_an_empty_system_turn_is_left_out():
    """ShareGPT exports often carry an empty system turn: it says nothing, so it is dropped rather than refused,
    and the row renders as it would without it."""
    from gemma_tpu.data.records import normalise_sharegpt

    plain = normalise_messages({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                               "t")
    for empty in ("", " \n"):
        got = normalise_sharegpt({"conversations": [{"from": "system", "value": empty}, {"from": "human", "value": "hi"},
                                                    {"from": "gpt", "value": "yo"}]}, "t")
        assert got["messages"] == plain["messages"]


def test_user_turns_of_content_parts_and_empty_tool_results_still_load(tmp_path):
    """The empty-turn refusal is about text: a user turn of text parts loads joined, and a tool result may be
    empty (a tool that printed nothing), as before."""
    tools = [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "ok"}]},
            {"tools": tools, "messages": [{"role": "user", "content": "run it"},
                                          {"role": "assistant", "tool_calls": [{"function": {"name": "noop"}}]},
                                          {"role": "tool", "name": "noop", "content": ""},
                                          {"role": "assistant", "content": "done"}]}]
    # tool results the strict JSON check lets by: text (a lowercase nan is no JSON: rendered as the word it is), JSON
    # of finite numbers, and text that only starts like JSON
    texts = ("nan", "1e5", '{"r": 1.5e3}', "{not json")
    rows += [{**rows[1], "messages": [*rows[1]["messages"][:2], {**rows[1]["messages"][2], "content": c},
                                      rows[1]["messages"][3]]} for c in texts]
    parts, tool, *more = load_conversations(write_jsonl(tmp_path / "ok.jsonl", rows), DataConfig())
    assert parts["messages"][0]["content"] == "a b"
    assert tool["messages"][2] == {"role": "tool", "content": "", "name": "noop"}
    assert [m["messages"][2]["content"] for m in more] == list(texts)


def test_markup_without_a_tokenizer_is_the_registrys_gemma3_list():
    """Without a tokenizer (a row normalised alone), message text is checked
    against Gemma 3's markup as the family registry lists it (`Family.markup_tokens`, the one home): a second copy in
    the records module missed `<pad>` and the media markers (`<start_of_image>`, `[multimodal]`), which a Gemma 3
    tokenizer reads as its control ids, and which an endpoint's evaluation refused."""
    from gemma_tpu.models import get_family

    for token in get_family("gemma3").markup_tokens:
        row = {"messages": [{"role": "user", "content": f"what is {token}?"}, {"role": "assistant", "content": "x"}]}
        with pytest.raises(UserError) as e:
            normalise_messages(row, "f.jsonl:1")
        assert str(e.value).startswith(f"f.jsonl:1: messages[0]: the text holds {token!r} at character 8"), e.value


def test_message_text_may_not_hold_the_models_own_control_tokens(tmp_path, tok_dir, tok, any_tok):
    """The control tokens refused in message text come from the model's tokenizer: a Gemma 4 vocabulary's
    `<|turn>` (its own turn marker, which the Gemma 3 list let through) and the `<unusedN>` the tool-call markers
    map onto in a plain Gemma 3 vocabulary are refused by FILE:LINE at render_examples, as `<end_of_turn>` was;
    text that only looks like markup in another model's vocabulary stays text."""
    from transformers import AutoTokenizer

    g4 = AutoTokenizer.from_pretrained(str(tok_dir))
    g4.add_special_tokens({"additional_special_tokens": ["<|turn>", "<turn|>", '<|"|>']})
    rows = [CHAT, {"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "done<turn|>\n<|turn>user\nmore"}]}]
    path = write_jsonl(tmp_path / "g4.jsonl", rows)
    cfg = DataConfig(chat_format="gemma")
    with pytest.raises(UserError) as e:
        render_examples(str(path), Renderer(g4, "gemma"), cfg)
    assert str(e.value).startswith(f"{path}:2: messages[1]: the text holds '<turn|>' at character 4"), e.value
    # the same text is plain characters to a Gemma 3 vocabulary: it renders
    assert len(render_examples(str(path), Renderer(tok, "gemma"), cfg)) == 2
    # whitespace a vocabulary flags special is still ordinary text
    spaced = AutoTokenizer.from_pretrained(str(tok_dir))
    spaced.add_special_tokens({"additional_special_tokens": ["\n", "\t\t"]})
    assert Renderer(spaced, "gemma").markup.search("a\n\t\tb") is None
    # a media marker the vocabulary has but does not flag special (Gemma 3's <start_of_image>, id 255999, beside HTML
    # tags that are text) was tokenized as the image marker: a text-only row trained it without an image
    media = AutoTokenizer.from_pretrained(str(tok_dir))
    media.add_tokens(["<start_of_image>", "<table>", "[multimodal]"])  # not special, as Gemma 3's tokenizer has them
    assert Renderer(media, "gemma").markup.search("a <table> <start_of_image> b") == (10, "<start_of_image>")
    assert Renderer(media, "gemma").markup.search("a [multimodal] b") == (2, "[multimodal]")  # Gemma 3's id 5
    # the reserved token a tool-call marker maps onto (plain Gemma 3) is refused too, in every row shape
    token_map = function_token_map(any_tok)
    marker = token_map.get("<start_function_call>")
    if marker is None:
        pytest.skip("this vocabulary has the tool-call markers as tokens")
    # ... pointed at tool_calls in an answer only (a user's text or a tool's result holding it wrote no call)
    for row, answer in (({"prompt": f"call {marker}", "completion": "ok"}, False),
                        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": f"a {marker}"}]},
                         True),
                        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
                            {"function": {"name": "f", "arguments": {}}}]}, {"role": "tool", "content": f"o {marker}"},
                            {"role": "assistant", "content": "ok"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, False)):
        p = write_jsonl(tmp_path / "m.jsonl", [row])
        r = Renderer(any_tok, "gemma", token_map=token_map)
        with pytest.raises(UserError, match=rf"^{re.escape(str(p))}:1: .*holds '{marker}'") as e:
            render_examples(str(p), r, cfg)
        assert ("tool calls go in tool_calls" in str(e.value)) == answer, e.value


def test_turns_after_the_last_trained_one_are_left_out_of_the_row(tmp_path, tok_dir, tok, capsys):
    """A chat ending in a user turn (or an untrained answer) kept those tokens in its row though nothing after
    them is trained: they took row space and made the example over-length (truncated, or dropped under
    data.overlength=drop). They are left out, the loss unchanged; data.inspect counts them."""
    from gemma_tpu.data import inspect

    ended = {"messages": CHAT["messages"] + [{"role": "user", "content": "And tripled? " + "q" * 200}]}
    untrained = {"messages": CHAT["messages"] + [{"role": "user", "content": "More?"},
                                                {"role": "assistant", "content": "no", "train": False}]}
    r = Renderer(tok)
    full = r.render(norm(CHAT))
    for conv in (ended, untrained):
        got = r.render(norm(conv))
        assert got.text == CHAT_TEXT and got.untrained_tail
        assert got.ids.tolist() == full.ids.tolist() and got.loss_mask.tolist() == full.loss_mask.tolist()
    assert not full.untrained_tail
    # a prompt for generation keeps every turn
    assert r.render(norm(ended), add_generation_prompt=True).text.endswith(f"{'q' * 200}{EOT}\n{SOT}model\n")
    path = write_jsonl(tmp_path / "t.jsonl", [CHAT, ended] * 2)
    result = inspect.run(inspect.parse_args(["--config", str(_inspect_config(tmp_path, path, overlength="drop",
                                                                           share_prefix="off")),
                                             "--tokenizer", str(tok_dir), "-n", "0"]))
    assert result["examples_kept"] == 4 and result["dropped"] == 0 and result["untrained_tails"] == 2
    assert "2 end in turns that train nothing, left out of their rows" in capsys.readouterr().out


def test_exact_duplicate_examples_are_reported_not_removed(tmp_path, tok_dir, tok, capsys):
    """Rows exported twice (a common export bug) trained twice without a word: the split counts examples that
    train exactly what an earlier one trains, across row shapes; training, its dry run and data.inspect say so
    naming the first; the examples are kept."""
    from gemma_tpu.data import duplicates_warning, inspect

    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in CHAT["messages"]]}
    rows = chat_rows(6) + [CHAT, chat_rows(6)[2], sharegpt]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    split = prepare_split(str(path), Renderer(tok), DataConfig(seq_len=256), seed=0)
    assert split.report.kept == 9 and split.stats()["duplicates"] == 2
    assert duplicates_warning(split) == (
        f"{path}: 2 of 9 examples train exactly what an earlier one trains (the first: {path}:8 repeats {path}:3); "
        f"they are trained as often as they appear - remove them unless that is meant")
    unique = prepare_split(str(write_jsonl(tmp_path / "u.jsonl", chat_rows(6))), Renderer(tok), DataConfig(), seed=0)
    assert duplicates_warning(unique) is None
    result = inspect.run(inspect.parse_args(["--config", str(_inspect_config(tmp_path, path, share_prefix="off")),
                                             "--tokenizer",
                                             str(tok_dir), "-n", "0"]))
    assert result["duplicates"] == 2
    assert f"duplicates 2 examples train exactly what an earlier one trains, as often as they appear (the first: " \
           f"{path}:8 repeats {path}:3)" in capsys.readouterr().out


def test_sharegpt_model_speakers_and_capitalised_roles_are_read(tmp_path, tok):
    """ShareGPT's own export names the answering model (chatgpt, bing, bard) and many exports capitalise roles
    (Human, GPT, System, User, Assistant): they were refused as unknown; each has one meaning, so it is read."""
    plain = Renderer(tok).render(norm(CHAT)).ids.tolist()
    speakers = ["System", "Human", "chatgpt", "HUMAN", "Bard"]
    sharegpt = {"conversations": [{"from": s, "value": m["content"]} for s, m in zip(speakers, CHAT["messages"])]}
    capital = {"messages": [{**m, "role": m["role"].capitalize()} for m in CHAT["messages"]]}
    pc = {"prompt": [{**m, "role": m["role"].title()} for m in CHAT["messages"][:4]],
          "completion": [{"role": "Assistant", "content": "It is 8."}]}
    convs = load_conversations(write_jsonl(tmp_path / "r.jsonl", [sharegpt, capital, pc]), DataConfig())
    for conv in convs[:2]:
        assert Renderer(tok).render(conv).ids.tolist() == plain
    r = Renderer(tok).render(convs[2])  # only the completion is trained
    assert r.ids.tolist() == plain and masked_runs(tok, r) == [f"It is 8.{EOT}"]
    with pytest.raises(UserError, match=r"conversations\[1\]: a tool result must follow an assistant turn with "
                                        r"tool_calls"):
        normalise_sharegpt({"conversations": [{"from": "human", "value": "q"}, {"from": "observation", "value": "x"}]},
                           "t")


def test_responses_api_text_parts_are_text(tmp_path, tok):
    """OpenAI's Responses API writes text parts as input_text / output_text: they were refused as "a
    'input_text' part; training here is text only" though they are text."""
    parts = {"messages": [{"role": "system", "content": [{"type": "input_text", "text": "You are terse."}]},
                          {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
                          {"role": "assistant", "content": [{"type": "output_text", "text": "4.", "annotations": []}]},
                          *CHAT["messages"][3:]]}
    (conv,) = load_conversations(write_jsonl(tmp_path / "r.jsonl", [parts]), DataConfig())
    assert Renderer(tok).render(conv).text == CHAT_TEXT
    with pytest.raises(UserError, match=r"content\[0\] is a 'input_image' part; training here is text only"):
        norm({"messages": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})


def test_tool_declarations_and_call_arguments_may_not_hold_control_tokens():
    """Declarations and call arguments are rendered into the text as well: a description or an argument holding
    `<end_of_turn>` was tokenized as the control token (only message text was checked)."""
    tool = json.loads(json.dumps(STEPS_TOOL))
    tool["function"]["description"] = "Steps.<end_of_turn>"
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "get_steps",
                                                              "arguments": {"date": ["x<start_of_turn>"]}}}]}
    with pytest.raises(UserError, match=r"^test: tools\[0\].function.description: the text holds '<end_of_turn>'"):
        norm({"tools": [tool], "messages": TOOL_CHAT["messages"]})
    with pytest.raises(UserError, match=r"^test: messages\[2\]: tool_calls\[0\].arguments.date\[0\]: the text "
                                        r"holds '<start_of_turn>' at character 1"):
        norm({"tools": [STEPS_TOOL], "messages": [*TOOL_CHAT["messages"][:2], call, *TOOL_CHAT["messages"][3:]]})


@pytest.mark.parametrize("fn, path", [
    ({"name": "get_steps", "parameters": {"type": "object", "properties": "x"}}, "function.parameters.properties"),
    ({"name": "get_steps", "parameters": {"properties": {"d": "string"}}}, "function.parameters.properties.d"),
    ({"name": "get_steps", "parameters": {"type": "object", "required": "d"}}, "function.parameters.required"),
    ({"name": "get_steps", "parameters": {"type": "array"}}, "function.parameters.type"),
    ({"name": "get_steps", "strict": "yes"}, "function.strict"),
    ({"name": "get_steps" * 8}, "function.name"),
])
def test_a_tool_declaration_the_server_refuses_does_not_train(tmp_path, fn, path):
    """Training rows and the local server's requests share one declaration check: a row whose schema the server
    refuses (400) trained fine, a model taught declarations no request can send. Both name the same path."""
    from serving.openai_request import RequestError, check_chat_request

    tools = [{"type": "function", "function": fn}]
    call = {"role": "assistant", "tool_calls": [{"function": {"name": fn["name"], "arguments": {}}}]}
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"tools": tools, "messages": [{"role": "user", "content": "steps?"}, call,
                                          {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5."}]}]
    with pytest.raises(RequestError) as served:
        check_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert served.value.param == f"tools[0].{path}"
    with pytest.raises(UserError) as trained:
        load_conversations(write_jsonl(tmp_path / "t.jsonl", rows), DataConfig())
    assert str(trained.value) == f"{tmp_path / 't.jsonl'}:2: {served.value}"


@pytest.mark.parametrize("tool", [{"type": "code_interpreter"}, {"type": "file_search", "file_search": {}},
                                  {"type": "web_search", "function": {"name": "f"}}])
def test_another_apis_built_in_tool_is_refused_by_its_type(tool):
    """An Assistants/Responses export's built-in tool was read as a bare function: "tools[0].name: None is not a tool
    name", of a field the row does not have."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(UserError) as e:
        normalise_messages({"tools": [tool], "messages": chat}, "f.jsonl:3")
    assert str(e.value) == f'f.jsonl:3: tools[0].type: "{tool["type"]}" is not supported (only "function" tools)'


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "BIG", "content": "user"}, {"role": "assistant", "content": "x"}]},  # columns swapped
    {"conversations": [{"from": "BIG", "value": "x"}, {"from": "gpt", "value": "y"}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "BIG"}}]},
    {"messages": [{"role": "user", "content": [{"type": "BIG"}]}, {"role": "assistant", "content": "x"}]},
])
def test_a_long_text_in_a_names_place_is_quoted_cut_to_a_line(row):
    """A message's text given as its role (or a speaker, a tool name, a part type) was quoted whole: a 10 KB error
    line for a 10 KB text."""
    big = "word " * 2000
    with pytest.raises(UserError) as e:
        normalise_messages(json.loads(json.dumps(row).replace("BIG", big)), "f.jsonl:3") if "messages" in row else \
            normalise_sharegpt(json.loads(json.dumps(row).replace("BIG", big)), "f.jsonl:3")
    assert str(e.value).startswith("f.jsonl:3: ") and "'word word" in str(e.value) and len(str(e.value)) < 300, \
        str(e.value)[:300]


def test_a_legacy_functions_declaration_is_refused_by_the_field_the_row_has():
    """OpenAI's legacy `functions` are checked as the tools they become; the error named `tools[0].function.strict`,
    a field the row does not have."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(UserError, match=r'^f.jsonl:3: functions\[0\].strict: expected true or false, got "yes"$'):
        normalise_messages({"functions": [{"name": "f", "strict": "yes"}], "messages": chat}, "f.jsonl:3")


def test_alpaca_rows_say_which_fields_to_set_and_never_drop_their_input(tmp_path):
    """Alpaca rows (instruction, input, output) failed on the Dolly default with "missing field 'response'"; with
    data.response_field=output alone, each row's input was left out of its prompt without a word."""
    row = {"instruction": "Translate.", "input": "Bonjour", "output": "Hello"}
    path = write_jsonl(tmp_path / "a.jsonl", [row])
    with pytest.raises(UserError, match=r":1: missing field 'response' .*Alpaca rows: data.response_field=output "
                                        r"data.context_field=input\)$"):
        load_conversations(path, DataConfig())
    with pytest.raises(UserError, match=r":1: the row has an 'input' field but no 'context' \(data.context_field\)"):
        load_conversations(path, DataConfig(response_field="output"))
    (conv,) = load_conversations(path, DataConfig(response_field="output", context_field="input"))
    assert conv["messages"][0]["content"] == "Translate.\n\nBonjour"
    (conv,) = load_conversations(path, DataConfig(response_field="output", context_field=None))
    assert conv["messages"][0]["content"] == "Translate."
    empty = write_jsonl(tmp_path / "e.jsonl", [{**row, "input": ""}])
    assert load_conversations(empty, DataConfig(response_field="output"))[0]["messages"][0]["content"] == "Translate."


def test_evaluation_examples_that_are_training_examples_are_one_warning(tmp_path, tok):
    """An eval split sampled from the training file (or the same file) trained and evaluated on the same
    examples without a word: the validation loss measured memorisation."""
    from gemma_tpu.data import overlap_warning

    rows = chat_rows(12)
    train_path = write_jsonl(tmp_path / "train.jsonl", rows[:10])
    eval_path = write_jsonl(tmp_path / "eval.jsonl", [rows[11], rows[7], rows[10], rows[3]])
    cfg = DataConfig(seq_len=256, strategy="pack")
    train = prepare_split(str(train_path), Renderer(tok), cfg, seed=0)
    ev = prepare_split(str(eval_path), Renderer(tok), cfg, seed=0)
    assert overlap_warning(train, ev) == (
        f"{eval_path}: 2 of 4 evaluation examples are also training examples in {train_path} (the first: "
        f"{eval_path}:2); the validation loss measures how well they were memorised")
    fresh = prepare_split(str(write_jsonl(tmp_path / "fresh.jsonl", rows[10:])), Renderer(tok), cfg, seed=0)
    assert overlap_warning(train, fresh) is None and overlap_warning(train, None) is None


def test_a_huge_example_is_tokenized_only_as_far_as_seq_len_can_reach(tmp_path, any_tok, capsys):
    """A 10 MB single-line example took 23 s and 1.5 GB in data.inspect (and at training start): the whole text was
    tokenized, then cut to data.seq_len. Only the part the first seq_len tokens can reach is tokenized now; what is
    trained is the same as from the whole text."""
    answer = " ".join(f"word{i % 97}" for i in range(30_000))  # ~200 KB
    path = write_jsonl(tmp_path / "big.jsonl", [CHAT, {"messages": [{"role": "user", "content": "q"},
                                                                    {"role": "assistant", "content": answer}]}])
    seen = []

    class Counting:  # the tokenizer, recording how much text it is given
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __call__(self, text, **kw):
            seen.append(len(text))
            return self.tok(text, **kw)

    cfg = DataConfig(seq_len=256)
    full = render_examples(str(path), Renderer(any_tok), DataConfig(seq_len=10 ** 9))
    examples = render_examples(str(path), Renderer(Counting(any_tok)), cfg)
    assert max(seen) < 40_000 and examples[1].partial and not examples[0].partial
    assert examples[0].ids.tolist() == full[0].ids.tolist()
    assert examples[1].ids[:256].tolist() == full[1].ids[:256].tolist()
    assert examples[1].loss_mask[:256].tolist() == full[1].loss_mask[:256].tolist()
    split = prepare_split(str(path), Renderer(any_tok), cfg, seed=0)
    assert (split.report.overlength, split.report.truncated, split.report.kept) == (1, 1, 2)
    with pytest.raises(UserError, match=r"big.jsonl:2: the example has at least \d+ tokens, more than data.seq_len"):
        prepare_split(str(path), Renderer(any_tok), DataConfig(seq_len=256, overlength="error"), seed=0)
    # nothing left: the length it names is a lower bound too (a 50 MB line said "the shortest of them 1626 tokens")
    alone = write_jsonl(tmp_path / "alone.jsonl", [{"messages": [{"role": "user", "content": answer},
                                                                 {"role": "assistant", "content": "a"}]}])
    with pytest.raises(UserError, match=r"1 longer than data.seq_len, the shortest of them at least \d+ tokens\)$"):
        prepare_split(str(alone), Renderer(any_tok), cfg, seed=0)
    # data.inspect says which lengths are lower bounds
    from gemma_tpu.data import inspect

    path = write_jsonl(tmp_path / "big4.jsonl", [CHAT, json.loads(path.read_text().splitlines()[1])] * 2)
    result = inspect.run(inspect.parse_args(["--config", str(_inspect_config(tmp_path, path, share_prefix="off")),
                                             "--tokenizer", any_tok.name_or_path, "-n", "2"]))
    assert result["tokenized_in_part"] == 2, result
    out = capsys.readouterr().out
    assert "; 2 tokenized only as far as data.seq_len reaches (their lengths are lower bounds)" in out, out
    assert re.search(r"--- example 2 \(\S+big4.jsonl:2\): at least \d+ tokens", out), out


def test_our_gemma_format_refuses_a_vocabulary_without_its_turn_tokens(tok_dir):
    """A Gemma 4 tokenizer (turns <|turn>...<turn|>) under data.chat_format=auto/gemma: Gemma 3's <start_of_turn>
    was tokenized as plain text pieces and the run trained on markup the model had never seen, without a word."""
    import shutil

    from transformers import AutoTokenizer

    g4_dir = tok_dir.parent / "g4_tok"
    shutil.copytree(tok_dir, g4_dir, dirs_exist_ok=True)
    spec = json.loads((g4_dir / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:  # Gemma 4 spells ids 105 and 106 <|turn> and <turn|>
        t["content"] = {"<start_of_turn>": "<|turn>", "<end_of_turn>": "<turn|>"}.get(t["content"], t["content"])
    spec["model"]["vocab"] = {{"<start_of_turn>": "<|turn>", "<end_of_turn>": "<turn|>"}.get(k, k): v
                              for k, v in spec["model"]["vocab"].items()}
    (g4_dir / "tokenizer.json").write_text(json.dumps(spec))
    g4 = AutoTokenizer.from_pretrained(str(g4_dir))
    assert g4.convert_tokens_to_ids("<|turn>") == 105
    from gemma_tpu.data import make_renderer

    with pytest.raises(UserError, match="has no '<start_of_turn>' token .*it has no chat template either"):
        make_renderer(g4, DataConfig(), "gemma")  # auto, and no template to fall back on
    g4.chat_template = ("{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
                        "{{ m.content }}<turn|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|turn>model\n{% endif %}")
    for fmt in ("gemma", "functiongemma"):  # asked for by name: refused, not replaced
        with pytest.raises(UserError, match=rf"^data.chat_format={fmt} writes Gemma 3's turn markup, but the tokenizer "
                                            rf".*has no '<start_of_turn>' token .*set data.chat_format=template"):
            make_renderer(g4, DataConfig(chat_format=fmt), "gemma")
    # data.chat_format=auto reads a vocabulary with turn tokens of its own as its template's (README: real Gemma 4
    # checkpoints train with the template); a Gemma 3 vocabulary keeps our format
    r = make_renderer(g4, DataConfig(), "gemma")
    assert r.chat_format == "template"
    out = r.render({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    assert list(out.ids).count(105) == 2 and out.loss_mask.sum() > 0
    assert make_renderer(AutoTokenizer.from_pretrained(str(tok_dir)), DataConfig(), "gemma").chat_format == "gemma"


def test_a_resume_without_shuffling_may_change_the_seed_but_not_the_rows():
    """With data.shuffle=false the seed orders nothing: a resume with another train.seed was refused as one whose
    data position names other rows. It still is when shuffling (either side), and whatever the seed when the rows
    differ (the seed chooses which examples share a row: that is in the rows' digest)."""
    from gemma_tpu.data import check_layout

    def layout(seed, shuffle, digest="d"):
        return {"rows": 56, "rows_digest": digest, "train.batch_size": 4, "train.seed": seed, "data.shuffle": shuffle,
                "data.num_epochs": None}

    check_layout(layout(0, False), layout(1, False), "ck/8")
    for saved, now, named in [(layout(0, True), layout(1, True), "train.seed 0 -> 1"),
                              (layout(0, True), layout(1, False), "train.seed 0 -> 1; data.shuffle True -> False"),
                              (layout(0, False, "d"), layout(0, False, "e"), "the rows' contents: the data file"),
                              (layout(0, False, "d"), layout(1, False, "e"), "train.seed 0 -> 1, which orders nothing "
                               "unshuffled but chooses which examples share a row; the rows' contents)")]:
        with pytest.raises(UserError, match=rf"^ck/8: its data position is for other training rows \({re.escape(named)}"):
            check_layout(saved, now, "ck/8")


def test_a_developer_chat_the_served_template_refuses_is_a_warning(tmp_path, tok, caplog):
    """A plain chat led by a `developer` message trained folded like a system prompt, without a word, while the
    tokenizer's own template (what vLLM serves with; Gemma 3's take only `system`) refuses that role: no client
    could send the prompt as trained. Training now says so, naming the refusal; as `system` nothing is said."""
    import logging

    from gemma_tpu.assets.embedded import GEMMA3_CHAT_TEMPLATE

    t = _with_template(tok, GEMMA3_CHAT_TEMPLATE)
    qa = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"messages": [{"role": "developer", "content": "Be brief."}, *qa]}])
    sys_ = write_jsonl(tmp_path / "sys.jsonl", [{"messages": [{"role": "system", "content": "Be brief."}, *qa]}])
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        prepare_split(str(sys_), Renderer(t), DataConfig(seq_len=256), seed=0)
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        prepare_split(str(dev), Renderer(t), DataConfig(seq_len=256), seed=0)
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"{dev}: 1 of the first 1 chats render otherwise than the tokenizer's own chat "
                              f"template, which a server renders them with (the first: {dev}:1: the template "
                              f"refuses it (TemplateError: unsupported role developer"), message


def test_a_resume_may_change_data_num_epochs_but_not_past_its_end(padded, tmp_path):
    """A run that used up data.num_epochs=1 was refused another epoch (its position was "for other training
    rows"), though the stream's first batches are the same whatever the number of epochs: it continues exactly
    where the longer stream is. A position past the new end is refused, by the run before anything loads too."""
    import types

    from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS
    from gemma_tpu.train.resume import check_data_position

    one = TrainStream(padded, 10, seed=0, num_epochs=1)
    assert len(list(one)) == 4  # 48 rows: the epoch used up
    for epochs in (2, None):
        more, again = TrainStream(padded, 10, seed=0, num_epochs=epochs), TrainStream(padded, 10, 0, num_epochs=epochs)
        more.set_state(one.get_state(), one.layout, "ck/4")
        for _ in range(4):
            next(again)
        np.testing.assert_array_equal(next(more)["tokens"], next(again)["tokens"])
    three = TrainStream(padded, 10, seed=0, num_epochs=3)
    for _ in range(5):
        next(three)
    with pytest.raises(UserError, match=r"^ck/5: its data position is past the end of data.num_epochs=1 \(batch 5 of "
                                        r"4\); resume with more epochs or data.num_epochs=null$"):
        TrainStream(padded, 10, seed=0, num_epochs=1).set_state(three.get_state(), three.layout, "ck/5")
    with pytest.raises(UserError, match=r"train.batch_size 10 -> 8"):  # what else shapes the position still counts
        TrainStream(padded, 8, seed=0, num_epochs=3).set_state(three.get_state(), three.layout, "ck/5")

    step = tmp_path / "ck" / "5"  # the run's check, before the model loads, reads the step's stored position
    (step / "model_params").mkdir(parents=True)
    (step / COMMIT_MARKERS[1]).write_text("")
    (step / COMMIT_MARKERS[0]).write_text(json.dumps(
        {"custom_metadata": {"data_state": three.get_state(), "data_layout": three.layout}}))

    def cfg(epochs):
        return types.SimpleNamespace(checkpoint=types.SimpleNamespace(dir=str(tmp_path / "ck")),
                                     train=types.SimpleNamespace(batch_size=10, seed=0),
                                     data=types.SimpleNamespace(shuffle=True, num_epochs=epochs))

    check_data_position(cfg(2), padded)
    with pytest.raises(UserError, match=rf"^{re.escape(str(step))}: its data position is past the end of "
                                        r"data.num_epochs=1 \(batch 5 of 4\)"):
        check_data_position(cfg(1), padded)


@pytest.mark.parametrize("state", [{"next_index": 3.0}, {}, "x", {"next_index": -2}, {"next_index": True}])
def test_a_damaged_data_position_is_refused_naming_the_step(padded, tmp_path, state):
    """A step whose stored data position is not what the trainer writes (a hand-edited or rewritten
    _CHECKPOINT_METADATA: `{"next_index": 3.0}` from a tool that writes numbers as floats, `{}`, a negative index):
    grain took 3.0 and the run died at its first batch in a traceback; the others failed only once the model had
    loaded, as a KeyError or IndexError of grain's. Refused in one line naming the step, before the model loads."""
    import types

    from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS
    from gemma_tpu.train.resume import check_data_position

    stream = TrainStream(padded, 10, seed=0)
    with pytest.raises(UserError, match=r"^ck/5: its data position .* is not one the trainer writes"):
        TrainStream(padded, 10, seed=0).set_state(state, stream.layout, "ck/5")
    step = tmp_path / "ck" / "5"
    (step / "model_params").mkdir(parents=True)
    (step / COMMIT_MARKERS[1]).write_text("")
    (step / COMMIT_MARKERS[0]).write_text(json.dumps(
        {"custom_metadata": {"data_state": state, "data_layout": stream.layout}}))
    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(dir=str(tmp_path / "ck")),
                                train=types.SimpleNamespace(batch_size=10, seed=0),
                                data=types.SimpleNamespace(shuffle=True, num_epochs=None))
    with pytest.raises(UserError, match=rf"^{re.escape(str(step))}: its data position .* is not one the trainer "
                                        r"writes .*move the step aside to resume from the one before"):
        check_data_position(cfg, padded)


@pytest.mark.parametrize("layout", ["x", [1, 2], 3])
def test_a_damaged_data_layout_is_refused_naming_the_step(padded, layout):
    """A step whose stored data layout is not a mapping (its _CHECKPOINT_METADATA edited or damaged) ended the resume
    in an AttributeError traceback ('str' object has no attribute 'get'). One line naming the step."""
    stream = TrainStream(padded, 10, seed=0)
    with pytest.raises(UserError, match=r"^ck/5: its data layout .* is not one the trainer writes .*move the step "
                                        r"aside to resume from the one before$"):
        TrainStream(padded, 10, seed=0).set_state(stream.get_state(), layout, "ck/5")


# a chat template that trims each message's text (as some shipped Gemma templates do): written for this test
TRIMMING_TEMPLATE = ("{{- bos_token -}}{%- for m in messages -%}{{- '<start_of_turn>' ~ ('model' if m['role'] == "
                     "'assistant' else 'user') ~ '\\n' ~ (m['content'] | trim) ~ '<end_of_turn>\\n' -}}{%- endfor -%}"
                     "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")


def test_a_given_start_a_trimming_template_continues_otherwise_is_warned(tmp_path, tok, caplog):
    """A prompt ending in the start of the answer with trailing whitespace ("The answer is "), continued by the
    completion: a template that trims message text continues it after "The answer is" (apply_chat_template with
    continue_final_message=True), so the served model generates " 42." where our Gemma rendering trained "42." after
    the space. The whole conversation renders alike, so nothing was said; the prompt before the continuation is
    compared too now. With the template as the renderer, the trained text is what it serves."""
    import logging

    trimming = _with_template(tok, TRIMMING_TEMPLATE)
    prompt = [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": "The answer is "}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": prompt,
                                               "completion": [{"role": "assistant", "content": "42."}]}])
    conv, = load_conversations(path, DataConfig())
    served = trimming.apply_chat_template(prompt, tokenize=False, continue_final_message=True)
    assert served.endswith("<start_of_turn>model\nThe answer is")
    own = Renderer(trimming, chat_format="template").render(conv)
    first = int(np.flatnonzero(own.loss_mask)[0])
    assert trimming.decode(own.ids[:first].tolist(), skip_special_tokens=False) == served
    assert masked_runs(trimming, own) == [f" 42.{EOT}"]
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        prepare_split(str(path), Renderer(trimming), DataConfig(seq_len=256), seed=0)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 1 of the first 1 chats render otherwise than the tokenizer's own chat template, which a server "
        f"renders them with (the first: {path}:1: messages[1]'s given start, continued (continue_final_message): ours "
        f"ends 'model\\nThe answer is ', the template's '>model\\nThe answer is'); the model would be "
        f"trained on text it is not served: set data.chat_format=template to train on the template's rendering, or "
        f"fix the data"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):  # a start the template keeps as it is
        prepare_split(str(write_jsonl(tmp_path / "d.jsonl", [{"prompt": [prompt[0], {
            "role": "assistant", "content": "The answer is"}], "completion": [{"role": "assistant", "content": " 42."}]}
        ])), Renderer(trimming), DataConfig(seq_len=256), seed=0)
    assert caplog.records == []


# a chat template that trims each text part of a message's content (as Google's Gemma 3 template does), text as it is
PART_TRIMMING_TEMPLATE = (
    "{{- bos_token -}}{%- for m in messages -%}{{- '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else "
    "'user') ~ '\\n' -}}{%- if m['content'] is string -%}{{- m['content'] -}}{%- else -%}{%- for item in m['content'] "
    "-%}{{- item['text'] | trim -}}{%- endfor -%}{%- endif -%}{{- '<end_of_turn>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")


def test_content_parts_go_to_the_template_as_parts_as_vllm_hands_them(tmp_path, tok, caplog):
    """vLLM hands a message's text parts to the chat template as a list (content format `openai`, serving's default),
    and Google's Gemma 3 template trims each part: a user turn of ["How many ", " steps?"] is served as "How
    manysteps?". The template was handed the parts joined ("How many  steps?"): training with the template trained
    text the served model is not shown, and our Gemma rendering's difference from it was not seen."""
    import logging

    trimming = _with_template(tok, PART_TRIMMING_TEMPLATE)
    parts = [{"type": "text", "text": "How many "}, {"type": "text", "text": " steps?"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": parts},
                                                            {"role": "assistant", "content": "Ten."}]}])
    served = trimming.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                          add_generation_prompt=True)
    assert served.endswith("user\nHow manysteps?<end_of_turn>\n<start_of_turn>model\n")
    conv, = load_conversations(path, DataConfig())
    assert conv["messages"][0]["content"] == "How many  steps?"  # our Gemma rendering's text, joined as it was
    own = Renderer(trimming, chat_format="template").render(conv)
    first = int(np.flatnonzero(own.loss_mask)[0])
    assert trimming.decode(own.ids[:first].tolist(), skip_special_tokens=False) == served
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        prepare_split(str(path), Renderer(trimming), DataConfig(seq_len=256), seed=0)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 1 of the first 1 chats render otherwise than the tokenizer's own chat template, which a server "
        f"renders them with (the first: {path}:1: at character 28, ours 'f_turn>user\\nHow many  steps?"
        f"<end_of_turn', the template's 'f_turn>user\\nHow manysteps?<end_of_turn>\\n'); the model would be trained "
        f"on text it is not served: set data.chat_format=template to train on the template's rendering, or fix the "
        f"data"]
    assert normalise_messages(conv, "again")["messages"] == conv["messages"]  # normalised again: the parts kept


def test_a_chat_template_without_tools_is_refused_for_tool_chats(tmp_path, tok):
    """data.chat_format=template with a template that renders no tools (Gemma 3's, which raises only on a tool
    message): a chat whose answer is a tool call trained '<end_of_turn>' alone as that answer (the call was not in
    the text), and declared tools were left out of the prompt, without a word. Both are refused by FILE:LINE."""
    from gemma_tpu.assets.embedded import GEMMA3_CHAT_TEMPLATE

    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_steps", "arguments": {"date": "today"}}}]}
    path = write_jsonl(tmp_path / "c.jsonl", [{"tools": [STEPS_TOOL], "messages": [
        {"role": "user", "content": "Steps today?"}, call]}])
    conv, = load_conversations(path, DataConfig())
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}:1: the tokenizer's chat template does not render "
                                        f"the tool declarations \\(the conversation renders the same without them\\)"):
        Renderer(_with_template(tok, GEMMA3_CHAT_TEMPLATE), chat_format="template").render(conv)
    # a template that writes the declarations but not the calls
    declares = ("{{- bos_token -}}{%- if tools -%}{{- '<start_of_turn>user\\n' ~ (tools | tojson) ~ "
                "'<end_of_turn>\\n' -}}{%- endif -%}" + GEMMA3_CHAT_TEMPLATE.replace("{{- bos_token -}}", ""))
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}:1: the tokenizer's chat template does not render "
                                        f"messages\\[1\\]'s tool call 'get_steps' \\(the answer it renders, "
                                        f"'<end_of_turn>', does not name it\\)"):
        Renderer(_with_template(tok, declares), chat_format="template").render(conv)


def _results_template(tool_turn: str) -> str:
    """A chat template writing declarations, user turns, answers and calls; a tool message as `tool_turn`."""
    return ("{{- bos_token -}}{%- if tools -%}{{- '<start_of_turn>developer\\n' ~ (tools | tojson) ~ "
            "'<end_of_turn>\\n' -}}{%- endif -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
            "{{- '<start_of_turn>user\\n' ~ m.content ~ '<end_of_turn>\\n' -}}{%- elif m.role == 'assistant' -%}"
            "{{- '<start_of_turn>model\\n' ~ m.content -}}{%- for c in m.tool_calls or [] -%}"
            "{{- 'call:' ~ c.function.name ~ (c.function.arguments | tojson) -}}{%- endfor -%}"
            "{{- '<end_of_turn>\\n' -}}{%- elif m.role == 'tool' -%}" + tool_turn + "{%- endif -%}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")


def test_a_chat_template_dropping_tool_results_is_refused(tmp_path, tok):
    """data.chat_format=template with a template that renders a tool message as nothing, or without its content: the
    answers after the results were trained on prompts without them, as the model is then served, so it learns to
    answer results it is never shown (the numbers of its answers made up), without a word. Refused by FILE:LINE,
    naming the result; a template that writes the result (a JSON object or text) renders as before."""
    path = write_jsonl(tmp_path / "c.jsonl", [TOOL_CHAT])
    conv, = load_conversations(path, DataConfig())
    for tool_turn in ("", "{{- '<start_of_turn>tool\\n' ~ m.name ~ '<end_of_turn>\\n' -}}"):
        with pytest.raises(UserError, match=f"^{re.escape(str(path))}:1: the tokenizer's chat template does not "
                                            f"render messages\\[3\\]'s tool result \\(the conversation renders the "
                                            f"same whatever it holds\\)"):
            Renderer(_with_template(tok, _results_template(tool_turn)), chat_format="template").render(conv)
    writes = _with_template(tok, _results_template("{{- '<start_of_turn>tool\\n' ~ m.content ~ '<end_of_turn>\\n' -}}"))
    for result in ("{\"steps\": 5}", "5 steps"):
        conv["messages"][3]["content"] = result
        r = Renderer(writes, chat_format="template").render(conv)
        assert masked_runs(tok, r) == [f'call:get_steps{{"date": "today"}}{EOT}', f"You walked 5 steps.{EOT}"]


def test_a_json_tool_result_reaches_the_chat_template_as_the_text_a_server_hands_it(tmp_path, tok):
    """data.chat_format=template: a tool result holding a JSON object was handed to the template as a Python dict, so a
    template writing the content as it is trained `{'steps': 5, ...}` (Python's repr), where vLLM hands the template
    the client's text and the served model is shown `{"steps": 5, ...}`. The trained text is the served one."""
    path = write_jsonl(tmp_path / "c.jsonl", [TOOL_CHAT])
    conv, = load_conversations(path, DataConfig())
    t = _with_template(tok, _results_template("{{- '<start_of_turn>tool\\n' ~ m.content ~ '<end_of_turn>\\n' -}}"))
    served = t.apply_chat_template(TOOL_CHAT["messages"], tools=TOOL_CHAT["tools"], tokenize=False)
    r = Renderer(t, chat_format="template").render(conv)
    assert '<start_of_turn>tool\n{"steps": 5, "date": "2026-11-21"}<end_of_turn>' in served
    assert t.bos_token + r.text == served
    assert masked_runs(tok, r) == [f'call:get_steps{{"date": "today"}}{EOT}', f"You walked 5 steps.{EOT}"]


def test_tool_chats_are_compared_with_the_template_a_marked_vocabulary_is_served_with(tmp_path, tok, caplog):
    """A vocabulary with the FunctionGemma markers as tokens (FunctionGemma, a merged tool-calling fine-tune) is served
    with its own chat template, but tool chats were never compared with it: a template that writes a JSON tool result
    as its text (a merge before the template's JSON reader, the GGUF's) served `{result:<escape>{"steps": 5, ...}`
    where training rendered `{steps:5,...}`, without a word. Tool chats are compared now; the merge's own template
    renders them as training does, and a vocabulary without the markers (served with the template the merge writes)
    is not compared."""
    import copy
    import logging

    from gemma_tpu.formats.function_calling import FUNCTION_MARKERS, tool_chat_template

    marked = copy.deepcopy(tok)
    marked.add_special_tokens({"additional_special_tokens": list(FUNCTION_MARKERS)})
    assert function_token_map(marked) == {} and function_token_map(tok) != {}
    path = write_jsonl(tmp_path / "t.jsonl", [TOOL_CHAT])
    said = {}
    for vocab, template, warned in ((marked, tool_chat_template(None), False),
                                    (marked, tool_chat_template(None, parse_json=False), True),
                                    (tok, tool_chat_template(None, parse_json=False), False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
            prepare_split(str(path), Renderer(_with_template(vocab, template), token_map=function_token_map(vocab)),
                          DataConfig(seq_len=1024), seed=0)
        said[warned] = skew = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
        assert len(skew) == warned, skew
    skew = said[True]
    assert skew[0].startswith(f"{path}: 1 of the first 1 chats render otherwise than the tokenizer's own chat "
                              f"template, which a server renders them with (the first: {path}:1: at character "), skew
    assert "ours '>response:get_steps{steps:5,date:<escape', the template's '>response:get_steps{result:<escape>{\"" \
        in skew[0], skew


def test_flat_tool_declarations_reach_the_chat_template_as_a_server_hands_them(tmp_path, tok):
    """data.chat_format=template: flat declarations (`{"name", "parameters"}`, as LLaMA-Factory rows and many datasets
    keep them) were handed to the template as the file held them, where a client must send `{"type": "function",
    "function": {...}}` and vLLM hands the template that, a description or parameters left out as null: a template
    writing `tools | tojson` trained text no server writes, and one reading `tool.function.name` refused the row."""
    flat = {"name": "get_steps", "parameters": STEPS_TOOL["function"]["parameters"]}
    served_tools = [{"type": "function", "function": {**flat, "description": None}}]
    served_tools[0]["function"] = {k: served_tools[0]["function"][k] for k in ("name", "description", "parameters")}
    row = {"tools": [flat], "messages": TOOL_CHAT["messages"][1:]}
    conv, = load_conversations(write_jsonl(tmp_path / "c.jsonl", [row]), DataConfig())
    t = _with_template(tok, _results_template("{{- '<start_of_turn>tool\\n' ~ m.content ~ '<end_of_turn>\\n' -}}"))
    served = t.apply_chat_template(row["messages"], tools=served_tools, tokenize=False)
    assert '[{"type": "function", "function": {"name": "get_steps", "description": null, "parameters"' in served
    assert t.bos_token + Renderer(t, chat_format="template").render(conv).text == served
    named = _with_template(tok, t.chat_template.replace("(tools | tojson)", "tools[0].function.name ~ tools[0].type"))
    assert "get_stepsfunction" in Renderer(named, chat_format="template").render(conv).text


def test_chats_the_tokenizer_template_renders_otherwise_are_one_warning(tmp_path, tok, tok_dir, caplog, capsys):
    """Our Gemma rendering kept an answer's trailing newline that the tokenizer's own template (what vLLM serves
    the model with) trims: the model was trained on text it is never shown, without a word. Training and inspect
    now say so, naming the first such chat; with the tokenizer's own template as the renderer nothing is said."""
    import logging
    import shutil

    from gemma_tpu.assets.embedded import GEMMA3_CHAT_TEMPLATE
    from gemma_tpu.data import inspect

    plain = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    padded = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a.\n"}]}
    path = write_jsonl(tmp_path / "s.jsonl", [plain, padded, TOOL_CHAT, padded])
    trimming = _with_template(tok, TRIMMING_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        prepare_split(str(path), Renderer(trimming), DataConfig(seq_len=256), seed=0)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 2 of the first 3 chats render otherwise than the tokenizer's own chat template, which a server "
        f"renders them with (the first: {path}:2: at character 58, ours 'art_of_turn>model\\na.\\n<end_of_turn>\\n',"
        f" the template's 'art_of_turn>model\\na.<end_of_turn>\\n'); the model would be trained on text it is not "
        f"served: set data.chat_format=template to train on the template's rendering, or fix the data"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):  # (that template writes no tool calls: refused)
        prepare_split(str(write_jsonl(tmp_path / "p.jsonl", [plain, padded])),
                      Renderer(trimming, chat_format="template"), DataConfig(seq_len=256), seed=0)
        prepare_split(str(path), Renderer(_with_template(tok, GEMMA3_CHAT_TEMPLATE)), DataConfig(seq_len=256), 0)
    assert caplog.records == []
    # inspect shows it as training warns it
    tdir = tmp_path / "tok"
    shutil.copytree(tok_dir, tdir)
    (tdir / "chat_template.jinja").write_text(TRIMMING_TEMPLATE)
    result = inspect.run(inspect.parse_args(["--config", str(_inspect_config(tmp_path, path)), "--tokenizer",
                                             str(tdir), "-n", "0", "train.batch_size=1"]))
    assert result["template_skew"].startswith(f"{path}: 2 of the first 3 chats render otherwise")
    assert f"template   {result['template_skew']}" in capsys.readouterr().out


def test_a_long_chat_masks_each_token_touching_trained_text(any_tok):
    """The loss mask and the joined token of a 2,000-turn chat (answers opening with newlines, tool calls twice in a
    row, a given start) against their definitions, character by character: a token is a target when one of its
    characters (an empty token: its first) is trained text; the joined token is the first to hold the start of
    trained text after untrained text, at the first such start. (Each was a pass over every token for each trained
    span, quadratic in the turns: 0.9 s for a 4,000-turn chat; now one search a token.)"""
    msgs = []
    for i in range(1000):
        msgs.append({"role": "user", "content": f"Question {i}: steps on day {i}?"})
        if i % 7 == 3:  # calls twice in a row, then the answer
            for d in (i, i + 1):
                msgs += [{"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_steps", "arguments": {"date": str(d)}}}]},
                    {"role": "tool", "name": "get_steps", "content": json.dumps({"steps": d})}]
        msgs.append({"role": "assistant", "content": ("\n\n" if i % 3 else "") + f"You walked {i} steps.",
                     **({"train": False} if i % 11 == 5 else {})})
    conv = norm({"tools": [STEPS_TOOL], "messages": msgs})
    conv["messages"][-1]["given"] = 4
    r = Renderer(any_tok, token_map=function_token_map(any_tok))
    rendered = r.render(conv)
    segs = [(r.map_markers(t), tr) for t, tr in r.segments(conv)]
    assert "".join(t for t, _ in segs) == rendered.text
    trained = np.zeros(len(rendered.text) + 1, bool)
    pos, opens = 0, []
    for t, tr in segs:
        trained[pos:pos + len(t)] = tr
        if tr and t and pos and not trained[pos - 1]:
            opens.append(pos)
        pos += len(t)
    offsets = rendered.offsets[1:]
    want = [bool(trained[a:max(b, a + 1)].any()) for a, b in offsets.tolist()]
    assert rendered.loss_mask.tolist() == [False] + want and sum(want) > 9000
    inside = np.full(len(trained), -1)  # the first token holding each character past its own first
    for k, (a, b) in reversed(list(enumerate(offsets.tolist()))):
        inside[a + 1:b] = k
    joined = next((rendered.text[slice(*offsets[inside[p]])] for p in opens if inside[p] >= 0), None)
    assert rendered.joined == joined and (joined == "\n\n\n" or any_tok.vocab_size < 1000), joined


def test_an_answer_opening_with_newlines_is_one_warning(tmp_path, real_tok, caplog):
    """An answer opening with newlines shares one token with its turn's newline ('\\n\\n\\n', trained from
    'model'), as the whole conversation tokenizes; a server tokenizes the prompt apart (ending in its own '\\n') and
    the model generates from there, so that token was trained where it is never served, without a word. Said once
    per file, naming the first such example; an answer opening with a space or a word is not."""
    import logging

    def chat(answer):
        return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}

    path = write_jsonl(tmp_path / "n.jsonl", [chat("Hello"), chat(" Hi"), chat("\n\nHello"), chat("\nOk")])
    renderer = Renderer(real_tok)
    served = renderer.render({"messages": [{"role": "user", "content": "q"}]}, add_generation_prompt=True)
    trained = renderer.render(norm(chat("\n\nHello")))
    assert trained.ids[:len(served.ids)].tolist() != served.ids.tolist() and trained.joined == "\n\n\n"
    with caplog.at_level(logging.WARNING, logger="gemma_tpu.data"):
        prepare_split(str(path), renderer, DataConfig(seq_len=64), seed=0)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 2 of 4 examples have an answer whose first token also holds the end of the prompt before it (the "
        f"first: {path}:3, token '\\n\\n\\n'); a server tokenizes the prompt apart from the answer, so the model "
        f"is trained on a token it is never served there: strip the answers' leading whitespace"]


def test_inspect_names_answers_whose_first_token_holds_the_prompts_end(tmp_path, real_tok, capsys):
    """Training warns of answers opening with newlines (their first token, '\\n\\n\\n', also holds the prompt's end);
    `data.inspect`, which the README says shows it as training warns it, said nothing."""
    from gemma_tpu.data import inspect

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": answer}]}
            for i, answer in enumerate(["Hello", "\n\nHello", "\nOk", "Hi"])]
    path = write_jsonl(tmp_path / "n.jsonl", rows)
    result = inspect.run(inspect.parse_args(["--config", str(_inspect_config(tmp_path, path)), "--tokenizer",
                                             real_tok.name_or_path, "-n", "0", "train.batch_size=1"]))
    line = (f"{path}: 2 of 4 examples have an answer whose first token also holds the end of the prompt before it "
            f"(the first: {path}:2, token '\\n\\n\\n')")
    assert result["joined_answers"].startswith(line)
    assert f"joined     {result['joined_answers']}\n" in capsys.readouterr().out


def test_mixed_schema_json_lines_from_a_table_read_each_row_by_its_shape(tmp_path):
    """pandas' to_json of sets of several shapes gives every row every column, null where the row is of another
    shape: the ShareGPT row was refused as "'messages' must be a non-empty list, got null". Each row is read by the
    fields that hold something, as Parquet rows are; a row whose only shape is null is still refused by its field."""
    import pandas as pd

    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
            {"instruction": "i", "context": "", "response": "r"}, {"prompt": "p", "completion": "c"}]
    path = tmp_path / "mixed.jsonl"
    pd.DataFrame(rows).to_json(path, orient="records", lines=True)
    assert '"messages":null,"conversations":[' in path.read_text()
    convs = load_conversations(path, DataConfig())
    assert [[m["content"] for m in c["messages"]] for c in convs] == [["q", "a"], ["q2", "a2"], ["i", "r"], ["p", "c"]]
    write_jsonl(path, [rows[0], {"messages": None, "conversations": None}])
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:2: 'messages' must be a non-empty list, got null"):
        load_conversations(path, DataConfig())


def test_sharegpt_turns_under_the_messages_column_are_read_as_sharegpt(tmp_path):
    """Converters leave ShareGPT turns (`from`/`value`) under 'messages' (as they leave chat messages under
    'conversations', which was already read): each row was refused as "messages[0]: unknown role None"."""
    turns = [{"from": "system", "value": "S."}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": turns}, {"conversations": turns},
                                              {"messages": [turns[1], {"from": "wizard", "value": "a"}]}])
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:3: messages\[1\]: unknown speaker 'wizard'"):
        load_conversations(path, DataConfig())
    write_jsonl(path, [{"messages": turns}, {"conversations": turns}])
    first, second = load_conversations(path, DataConfig())
    assert first["messages"] == second["messages"] == [
        {"role": "system", "content": "S."}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_a_system_prompt_in_a_field_of_its_own_leads_the_conversation(tmp_path, tok):
    """LLaMA-Factory's ShareGPT and Alpaca rows, and Anthropic-style exports, keep the system prompt in a 'system'
    field beside the turns: it was dropped without a word, and the model trained without the prompt it is served
    with. It renders as a first system message does; given twice (a field and a system turn), it is refused."""
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows = [{"conversations": turns, "system": "Be brief.", "tools": ""},
            {"system": [{"type": "text", "text": "Be brief."}], "messages": chat},
            {"instruction": "q", "input": "", "output": "a", "system": "Be brief."},
            {"prompt": "q", "completion": "a", "system": "Be brief."},
            {"messages": [{"role": "system", "content": "Be brief."}, *chat]}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    convs = load_conversations(path, DataConfig(response_field="output", context_field="input"))
    want = Renderer(tok).render(norm(rows[-1])).ids.tolist()
    assert [Renderer(tok).render(c).ids.tolist() == want for c in convs] == [True] * 5
    assert "Be brief.\n\nq" in Renderer(tok).render(convs[0]).text
    write_jsonl(path, [{"conversations": [{"from": "system", "value": "Other."}, *turns], "system": "Be brief."}])
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:1: both a 'system' field and a system message "
                                        rf"opening the conversation; give the system prompt once$"):
        load_conversations(path, DataConfig())


def test_an_alpaca_rows_history_is_its_earlier_turns(tmp_path, tok):
    """LLaMA-Factory's Alpaca rows carry earlier turns as `history` ([[instruction, response], ...]): they were dropped
    without a word. They render as the chat's earlier turns, trained as every assistant turn is; a malformed pair is
    refused naming it."""
    row = {"instruction": "c", "input": "", "output": "d", "system": "S.", "history": [["a", "b"]]}
    chat = {"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": "a"},
                         {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                         {"role": "assistant", "content": "d"}]}
    cfg = DataConfig(response_field="output", context_field="input")
    path = write_jsonl(tmp_path / "h.jsonl", [row, {**row, "history": []}])
    full, alone = load_conversations(path, cfg)
    ours, want = Renderer(tok).render(full), Renderer(tok).render(norm(chat))
    assert ours.ids.tolist() == want.ids.tolist() and ours.loss_mask.tolist() == want.loss_mask.tolist()
    assert [m["content"] for m in alone["messages"]] == ["S.", "c", "d"]
    write_jsonl(path, [{**row, "history": [["a"]]}])
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:1: history\[0\] must be an \[instruction, "
                                        rf"response\] pair of non-empty strings, got \['a'\]$"):
        load_conversations(path, cfg)


def test_llama_factory_sharegpt_tool_turns_train_as_openai_tool_calls(tmp_path, tok):
    """LLaMA-Factory's ShareGPT tool rows (`function_call` turns holding a call or a list of calls as JSON text,
    `observation` turns holding the result, `tools` as a JSON string of bare functions) were refused as unknown
    speakers; they train exactly as the same chat in OpenAI messages does (ids and loss mask)."""
    tools = [STEPS_TOOL["function"], HR_TOOL["function"]]
    calls = [{"name": "get_steps", "arguments": {"date": "today"}}, {"name": "get_heart_rate", "arguments": {}}]
    row = {"system": "Coach.", "tools": json.dumps(tools), "conversations": [
        {"from": "human", "value": "Steps and HR?"}, {"from": "function_call", "value": json.dumps(calls)},
        {"from": "observation", "value": "{\"steps\": 5}"}, {"from": "observation", "value": "60"},
        {"from": "gpt", "value": "5 steps, 60 bpm."}]}
    chat = {"tools": [STEPS_TOOL, HR_TOOL], "messages": [
        {"role": "system", "content": "Coach."}, {"role": "user", "content": "Steps and HR?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": c} for c in calls]},
        {"role": "tool", "content": "{\"steps\": 5}"}, {"role": "tool", "content": "60"},
        {"role": "assistant", "content": "5 steps, 60 bpm."}]}
    token_map = function_token_map(tok)
    ours, want = (Renderer(tok, token_map=token_map).render(c)
                  for c in load_conversations(write_jsonl(tmp_path / "lf.jsonl", [row, chat]), DataConfig()))
    assert ours.ids.tolist() == want.ids.tolist() and ours.loss_mask.tolist() == want.loss_mask.tolist()
    assert "call:get_steps{date:" in ours.text and "call:get_heart_rate{}" in ours.text
    row["conversations"][1]["value"] = "get_steps(today)"
    with pytest.raises(UserError, match=r":1: conversations\[1\]: 'value' is a string but not valid JSON"):
        load_conversations(write_jsonl(tmp_path / "lf.jsonl", [row]), DataConfig())


def test_llama_factory_parallel_calls_answered_by_one_observation(tmp_path, tok):
    """LLaMA-Factory's ShareGPT rows alternate strictly (human/observation, gpt/function_call), so a function_call
    turn of several calls is answered by one observation: a JSON list of the results in the calls' order, or the
    results joined as its converter of OpenAI chats joins them. Such rows were refused at the answer after them (the
    assistant continuing with 1 of 2 calls answered); each result now answers its call, and the row trains as the
    same chat in OpenAI messages does. One observation that cannot be split into one result a call is refused
    naming it."""
    from gemma_tpu.data.records import LLAMA_FACTORY_RESULTS_JOIN

    tools = [STEPS_TOOL["function"], HR_TOOL["function"]]
    calls = [{"name": "get_steps", "arguments": {"date": "today"}}, {"name": "get_heart_rate", "arguments": {}}]
    chat = {"tools": [STEPS_TOOL, HR_TOOL], "messages": [
        {"role": "user", "content": "Steps and HR?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": c} for c in calls]},
        {"role": "tool", "content": "{\"steps\": 5}"}, {"role": "tool", "content": "60 bpm"},
        {"role": "assistant", "content": "5 steps, 60 bpm."}, {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Welcome."}]}

    def row(observation) -> dict:
        return {"tools": json.dumps(tools), "conversations": [
            {"from": "human", "value": "Steps and HR?"}, {"from": "function_call", "value": json.dumps(calls)},
            {"from": "observation", "value": observation}, {"from": "gpt", "value": "5 steps, 60 bpm."},
            {"from": "human", "value": "Thanks"}, {"from": "gpt", "value": "Welcome."}]}

    token_map = function_token_map(tok)
    observations = ['[{"steps": 5}, "60 bpm"]', [{"steps": 5}, "60 bpm"],
                    LLAMA_FACTORY_RESULTS_JOIN.join(['{"steps": 5}', "60 bpm"])]
    want, *got = load_conversations(write_jsonl(tmp_path / "lf.jsonl", [chat, *map(row, observations)]), DataConfig())
    for conv in got:
        assert [m.get("name") for m in conv["messages"]] == [None, None, "get_steps", "get_heart_rate", None, None,
                                                             None]
        ours, theirs = Renderer(tok, token_map=token_map).render(conv), Renderer(tok, token_map=token_map).render(want)
        assert ours.ids.tolist() == theirs.ids.tolist() and ours.loss_mask.tolist() == theirs.loss_mask.tolist()
    assert "response:get_steps{steps:5}" in ours.text and "response:get_heart_rate{result:" in ours.text
    for bad, holds in (("5 steps and 60 bpm", "one result"), ("[1, 2, 3]", "a list of 3")):
        path = write_jsonl(tmp_path / "bad.jsonl", [row(bad)])
        with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:1: conversations\[2\]: one observation answers "
                                            rf"the 2 parallel calls of the function_call turn before it, but holds "
                                            rf"{holds}: give a JSON list of 2 results in the calls' order \(or one "
                                            rf"observation per call\)$"):
            load_conversations(path, DataConfig())
    # a turn after the split one is named by its own index in the row
    late = row('[1, 2]')
    late["conversations"][4]["value"] = "<end_of_turn>"
    path = write_jsonl(tmp_path / "late.jsonl", [late])
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:1: conversations\[4\]: the text holds"):
        load_conversations(path, DataConfig())


def test_an_openorca_system_prompt_column_leads_the_conversation(tmp_path, tok):
    """OpenOrca's rows (system_prompt, question, response; read with data.instruction_field=question) lost their
    system prompt without a word. It leads the conversation; a row giving both 'system' and 'system_prompt' is
    refused."""
    row = {"id": "x.1", "system_prompt": "Be brief.", "question": "q", "response": "a"}
    cfg = DataConfig(instruction_field="question", context_field=None)
    path = write_jsonl(tmp_path / "orca.jsonl", [row, {**row, "system_prompt": ""}])
    with_prompt, without = load_conversations(path, cfg)
    assert [m["content"] for m in with_prompt["messages"]] == ["Be brief.", "q", "a"]
    assert Renderer(tok).render(with_prompt).text.startswith(f"{SOT}user\nBe brief.\n\nq{EOT}")
    assert [m["role"] for m in without["messages"]] == ["user", "assistant"]
    write_jsonl(path, [{**row, "system": "Other."}])
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:1: both 'system' and 'system_prompt' hold a "
                                        rf"system prompt; give one$"):
        load_conversations(path, cfg)


def test_call_arguments_passing_a_union_branch_are_accepted():
    """A value some branch of an anyOf/oneOf takes (every branch of an allOf) is accepted; a `$ref` branch takes any."""
    from gemma_tpu.formats.function_calling import arguments_problem

    params = {"properties": {"unit": {"anyOf": [{"enum": ["c", "f"]}, {"type": "null"}]}, "loc": {"oneOf": [
        {"type": "string"}, {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}]},
        "r": {"allOf": [{"type": "integer"}, {"enum": [1, 2]}]}, "x": {"anyOf": [{"$ref": "other.json#/X"}]},
        "tree": {"$ref": "#/$defs/Node"}}, "$defs": {"Node": {"properties": {"v": {"type": "integer"}, "kids": {
            "items": {"$ref": "#/$defs/Node"}}}},
        "Loop": {"anyOf": [{"$ref": "#/$defs/Loop"}, {"$ref": "#/$defs/Loop"}]}}}
    for args in ({"unit": "c"}, {"unit": None}, {"loc": "Paris"}, {"loc": {"city": "Paris"}}, {"r": 2.0},
                 {"x": {"any": [1]}}, {"tree": {"v": 1, "kids": [{"v": 2, "kids": []}]}}):
        assert arguments_problem(params, args) is None, args
    # a recursive $ref is followed as deep as the value goes; refs that only refer to each other end (a budget)
    assert arguments_problem(params, {"tree": {"kids": [{"kids": [{"v": "x"}]}]}}) == (
        "'tree.kids[0].kids[0].v' is declared integer, got a string \"x\"")
    params["properties"]["loop"] = {"$ref": "#/$defs/Loop"}
    assert arguments_problem(params, {"loop": 5}) is None


def test_a_blank_system_message_is_left_out_by_the_tool_template_as_in_training(tok):
    """Training leaves out a system message of only whitespace (ShareGPT exports carry them), anywhere in the chat;
    the served tool template put `" \\n"` before the first user turn (or in the developer turn) and rendered a later
    one as an empty user turn: a prompt the model never saw. Both now render what training renders."""
    from gemma_tpu.formats.function_calling import tool_chat_template

    token_map = function_token_map(tok)
    t = _with_template(tok, tool_chat_template(token_map))
    tool = {"type": "function", "function": {"name": "ping", "description": "d"}}
    blank = {"role": "system", "content": " \n"}
    q, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    for tools in ([], [tool]):
        for msgs in ([blank, q], [q, a, blank, q], [{"role": "developer", "content": "  "}, q]):
            conv = norm({"tools": tools, "messages": msgs + [a]} if tools else {"messages": msgs + [a]})
            want = Renderer(t, token_map=token_map).render({**conv, "messages": conv["messages"][:-1]},
                                                           add_generation_prompt=True).text
            got = t.apply_chat_template(msgs, tools=tools or None, tokenize=False, add_generation_prompt=True)
            assert got == "<bos>" + want, (msgs, tools)
