"""Fitness coach: tools and providers, dataset generator, call parser, scoring, generation, the
evaluate and chat CLIs (tiny random model), a real `transformers serve` endpoint, and the real
base Gemma 3 270M (slow)."""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu.core.errors import UserError
from gemma_tpu.examples.fitness import dataset, tools
from gemma_tpu.examples.fitness import templates as phrasings
from gemma_tpu.examples.fitness.providers import GarminConnectProvider, SimulatedDevice
from gemma_tpu.formats.function_calling import (
    NO_CALL_AT_STOP,
    ParsedReply,
    ToolCall,
    arguments_match,
    format_call,
    parse_reply,
    tool_chat_template,
)
from tests.conftest import REPO, assert_one_line_error, run_cli

NAMES = ["get_steps", "get_daily_step_goal", "get_step_goal_progress", "get_sleeping_minutes",
         "get_active_minutes", "get_heart_rate", "get_body_battery_level"]
TODAY = dt.date(2025, 3, 14)  # a Friday
DATA = REPO / "data" / "fitness"


# ------------------------------------------------------------------------------ tools, providers


def test_schemas_have_the_seven_names():
    from transformers.utils import get_json_schema

    assert [get_json_schema(f)["function"]["name"] for f in tools.TOOLS] == NAMES
    for compact in (True, False):
        schemas = tools.tool_schemas(compact=compact)
        assert [s["function"]["name"] for s in schemas] == NAMES
        for s in schemas:
            assert s["type"] == "function" and s["function"]["description"]
            assert "date" in s["function"]["parameters"]["properties"]
    full = {s["function"]["name"]: s for s in tools.tool_schemas(compact=False)}
    assert full["get_heart_rate"]["function"]["parameters"]["properties"]["metric"]["enum"] == \
        ["resting", "average", "max"]
    assert "description" in full["get_steps"]["function"]["parameters"]["properties"]["date"]


def test_resolve_date():
    r = tools.resolve_date
    assert r("today", TODAY) == TODAY and r("", TODAY) == TODAY
    assert r("Yesterday", TODAY) == dt.date(2025, 3, 13)
    assert r("monday", TODAY) == dt.date(2025, 3, 10)
    assert r("friday", TODAY) == dt.date(2025, 3, 7)  # a weekday name is never today
    assert r("Thu", TODAY) == dt.date(2025, 3, 13)
    assert r("2025-02-28", TODAY) == dt.date(2025, 2, 28)
    for bad in ("2025-03-15", "next week", "2025-02-30"):
        with pytest.raises(ValueError):
            r(bad, TODAY)


def test_simulated_device_is_deterministic_and_tools_answer():
    a, b = SimulatedDevice(3, today=TODAY), SimulatedDevice(3, today=TODAY)
    day = dt.date(2025, 3, 1)
    assert a.steps(day) == b.steps(day) and a.heart_rate(day) == b.heart_rate(day)
    assert SimulatedDevice(4, today=TODAY).heart_rate(day) != a.heart_rate(day) or \
        SimulatedDevice(4, today=TODAY).steps(day) != a.steps(day)
    res = tools.call_tool("get_step_goal_progress", {"date": "yesterday"}, a)
    assert res["date"] == "2025-03-13" and res["remaining"] == max(res["goal"] - res["steps"], 0)
    hr = tools.call_tool("get_heart_rate", {"date": "monday", "metric": "max"}, a)
    assert hr["metric"] == "max" and hr["bpm"] == a.heart_rate(dt.date(2025, 3, 10))["max"]
    assert "error" in tools.call_tool("get_steps", {"date": "2099-01-01"}, a)
    assert "error" in tools.call_tool("get_heart_rate", {"date": "today", "metric": "lowest"}, a)
    with pytest.raises(tools.ToolError, match="unknown tool get_sleep_metrics"):
        tools.call_tool("get_sleep_metrics", {"date": "today"}, a)
    with pytest.raises(tools.ToolError, match="bad arguments"):
        tools.call_tool("get_steps", {"day": "today"}, a)


def test_a_null_argument_is_the_tools_default_as_evaluate_scores_it():
    """A model writing `date:null` (an optional argument spelled out) ran the tool with the text 'None' and got an
    error back, for a call arguments_match scores as the reference that leaves the date out."""
    a = SimulatedDevice(3, today=TODAY)
    assert arguments_match({}, {"date": None})
    assert tools.call_tool("get_steps", {"date": None}, a) == tools.call_tool("get_steps", {}, a)
    hr = tools.call_tool("get_heart_rate", {"date": "monday", "metric": None}, a)
    assert hr["metric"] == "resting" and "error" not in hr


class FakeGarmin:
    """Stands in for garminconnect.Garmin: the fields our provider reads, for one day."""

    def __init__(self, email=None, password=None):
        self.email, self.password, self.logged_in = email, password, False

    def login(self, tokenstore=None):
        self.logged_in = True

    def get_user_summary(self, cdate):
        return {"totalSteps": 8421, "dailyStepGoal": 10000, "moderateIntensityMinutes": 20,
                "vigorousIntensityMinutes": 5, "restingHeartRate": 55, "maxHeartRate": 150,
                "bodyBatteryMostRecentValue": 61, "bodyBatteryHighestValue": 90, "bodyBatteryLowestValue": 12}

    def get_sleep_data(self, cdate):
        return {"dailySleepDTO": {"sleepTimeSeconds": 7 * 3600 + 30 * 60}}

    def get_heart_rates(self, cdate):
        return {"restingHeartRate": 54, "maxHeartRate": 151, "heartRateValues": [[0, 60], [1, 80], [2, None]]}


def test_garmin_provider_with_a_fake_client(monkeypatch, capsys):
    p = GarminConnectProvider(client=FakeGarmin())
    day = dt.date.today()
    assert tools.call_tool("get_steps", {"date": "today"}, p)["steps"] == 8421
    assert tools.call_tool("get_sleeping_minutes", {"date": "today"}, p)["minutes"] == 450
    assert tools.call_tool("get_heart_rate", {"date": "today", "metric": "average"}, p)["bpm"] == 70
    assert p.heart_rate(day)["resting"] == 54
    assert tools.call_tool("get_active_minutes", {"date": "today"}, p)["total"] == 25
    assert tools.call_tool("get_body_battery_level", {"date": "today"}, p)["level"] == 61

    fake_module = types.SimpleNamespace(Garmin=FakeGarmin)
    monkeypatch.setitem(sys.modules, "garminconnect", fake_module)
    monkeypatch.delenv("GARMIN_EMAIL", raising=False)
    monkeypatch.delenv("GARMIN_PASSWORD", raising=False)
    monkeypatch.delenv("GARMINTOKENS", raising=False)
    with pytest.raises(UserError, match="GARMIN_EMAIL"):
        GarminConnectProvider()
    monkeypatch.setenv("GARMIN_EMAIL", "me@example.com")
    monkeypatch.setenv("GARMIN_PASSWORD", "s3cret-pw")
    p = GarminConnectProvider()
    assert p.client.logged_in and p.client.password == "s3cret-pw"
    out = capsys.readouterr()
    assert "s3cret-pw" not in out.out + out.err


def test_garmin_provider_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "garminconnect", None)  # import fails
    with pytest.raises(UserError, match="pip install garminconnect"):
        GarminConnectProvider()


# ------------------------------------------------------------------------------------- dataset

SMALL = {"train": 140, "validation": 21, "test": 35}


def test_generator_is_deterministic(tmp_path):
    a = dataset.write_splits(dataset.generate(7, SMALL), tmp_path / "a")
    b = dataset.write_splits(dataset.generate(7, SMALL), tmp_path / "b")
    c = dataset.write_splits(dataset.generate(8, SMALL), tmp_path / "c")
    for split in dataset.SPLITS:
        assert a[split].read_bytes() == b[split].read_bytes()
    assert a["train"].read_bytes() != c["train"].read_bytes()


def test_generator_sizes_balance_and_held_out_phrasings(tmp_path):
    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import load_conversations

    splits = dataset.generate(1, SMALL)
    paths = dataset.write_splits(splits, tmp_path)
    templates = dataset.split_templates(1)
    for tool in NAMES:  # every tool has its own phrasings per split, never shared
        tr, va, te = (set(templates[s][tool]) for s in dataset.SPLITS)
        assert te and va and tr and not (tr & te) and not (tr & va) and not (va & te)
    train_users = {dataset.request_text(ex).lower() for ex in splits["train"]}
    for split, n in SMALL.items():
        assert len(splits[split]) == n
        requests = [dataset.request_text(ex).lower() for ex in splits[split]]
        assert len(set(requests)) == n, f"{split} repeats a request under another date"
        assert all(not dataset.user_text(ex).lower().startswith(r) for ex, r in zip(splits[split], requests))
        convs = load_conversations(paths[split], DataConfig())  # validates every example
        assert len(convs) == n
        counts = {t: 0 for t in NAMES}
        for ex in splits[split]:
            msgs = ex["messages"]
            assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool", "assistant"]
            call = msgs[2]["tool_calls"][0]["function"]
            counts[call["name"]] += 1
            assert json.loads(msgs[3]["content"])["date"]  # the device answered
            assert any(ch.isdigit() for ch in msgs[4]["content"])  # the answer uses the numbers
        assert max(counts.values()) - min(counts.values()) <= 1, counts
        if split != "train":
            assert not set(requests) & train_users
    # dates are varied: relative, weekday and absolute arguments all occur
    args = [ex["messages"][2]["tool_calls"][0]["function"]["arguments"]["date"] for ex in splits["train"]]
    assert {"today", "yesterday"} <= set(args)
    assert any(a in tools.WEEKDAYS for a in args) and any(a[:2] == "20" for a in args)


def test_held_out_check_sees_a_train_request_under_another_date():
    splits = dataset.generate(1, SMALL)
    moved = copy.deepcopy(splits["train"][0])
    user = next(m for m in moved["messages"] if m["role"] == "user")
    user["content"] = tools.user_message(dt.date(2024, 2, 29), dataset.request_text(moved))
    assert user["content"] != dataset.user_text(splits["train"][0])
    with pytest.raises(AssertionError, match="1 test requests also occur in train"):
        dataset.check_disjoint({"train": splits["train"], "test": splits["test"] + [moved]})
    # a goal is no running total: "so far" only goes with the tools that count up during a day
    goal = [dataset.request_text(ex) for ex in splits["train"] + splits["test"]
            if ex["messages"][2]["tool_calls"][0]["function"]["name"] == "get_daily_step_goal"]
    assert goal and not any("so far" in r for r in goal)


def test_extra_train_templates_are_new_phrasings_and_train_only(monkeypatch):
    import re

    def words(t: str) -> set[str]:
        return set(re.findall(r"[a-z0-9']+|\{\w+\}", t.lower()))

    pool = [t for ts in phrasings.TEMPLATES.values() for t in ts]
    assert set(phrasings.EXTRA_TRAIN_TEMPLATES) == set(phrasings.TEMPLATES)
    for tool, extras in phrasings.EXTRA_TRAIN_TEMPLATES.items():
        assert len(set(extras)) == len(extras) >= 20, tool
        for t in extras:  # never a near-copy of any template, whichever split a seed gives it
            w = words(t)
            near = max(pool, key=lambda h: len(w & words(h)) / len(w | words(h)))
            assert len(w & words(near)) / len(w | words(near)) < 0.7, (t, near)
            assert (t.count("{when}") + t.count("{day}")) == 1, t
            assert t.count("{metric}") == (tool == "get_heart_rate"), t
            t.format(when="", day="today", metric="pulse")
    for seed in (0, 3):
        split = dataset.split_templates(seed)
        for tool, extras in phrasings.EXTRA_TRAIN_TEMPLATES.items():
            assert set(extras) <= set(split["train"][tool])
            assert not set(extras) & (set(split["validation"][tool]) | set(split["test"][tool]))
    with_extras = dataset.generate(1, SMALL)
    monkeypatch.setattr(dataset, "EXTRA_TRAIN_TEMPLATES", {})
    without = dataset.generate(1, SMALL)
    assert with_extras["train"] != without["train"]
    for split in ("validation", "test"):  # the held-out splits do not move
        assert with_extras[split] == without[split]


def test_committed_data_is_the_seed_0_output(tmp_path):
    sizes = {s: sum(1 for _ in (DATA / f"{s}.jsonl").open()) for s in dataset.SPLITS}
    assert sizes == {"train": 1200, "validation": 150, "test": 200}
    fresh = dataset.write_splits(dataset.generate(0, sizes), tmp_path)
    for split in dataset.SPLITS:
        assert fresh[split].read_bytes() == (DATA / f"{split}.jsonl").read_bytes(), \
            f"data/fitness/{split}.jsonl is stale: python -m gemma_tpu.examples.fitness generate --out data/fitness"
    dataset.check_disjoint(dataset.generate(0, sizes))


def test_generate_cli(tmp_path):
    proc = run_cli("gemma_tpu.examples.fitness", "generate", "--out", str(tmp_path), "--seed", "2",
                   "--train", "14", "--validation", "7", "--test", "7")
    assert proc.returncode == 0, proc.stderr
    assert sum(1 for _ in (tmp_path / "train.jsonl").open()) == 14


def test_stats_counts_what_the_files_hold(tmp_path, tiny_dir):
    """`stats` on generated splits and on a chat the generator did not write: a chat without a tool call, an empty
    split (`--test 0`), and a split that is absent (it read rows by hand: a chat without a call was a traceback)."""
    from gemma_tpu.examples.fitness.__main__ import main

    generated = dataset.generate(3, {"train": 5, "validation": 0, "test": 0})
    dataset.write_splits(generated, tmp_path)
    (tmp_path / "test.jsonl").unlink()
    with (tmp_path / "train.jsonl").open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                + "\n")
    called = {}
    for ex in generated["train"]:
        name = next(m for m in ex["messages"] if m.get("tool_calls"))["tool_calls"][0]["function"]["name"]
        called[name] = called.get(name, 0) + 1
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["stats", "--data", str(tmp_path), "--tokenizer", str(tiny_dir)]) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train: 6 examples; tokens median ")
    per_tool = dict(kv.split("=") for kv in lines[0].split("per tool: ")[1].split(", "))
    assert per_tool == {**{k: str(v) for k, v in called.items()}, "(no tool call)": "1"}
    assert lines[1:] == ["validation: 0 examples"]  # no test.jsonl: not reported


def test_generate_failing_midway_keeps_the_previous_splits_whole(tmp_path, monkeypatch):
    """Regenerating over earlier splits (another seed) and failing after the first split (a full disk, a
    kill) left a new train.jsonl beside the old validation and test files: held-out phrasings of the new
    seed could sit in train. Now the three are renamed into place together, or not at all."""
    small = {"train": 14, "validation": 7, "test": 7}
    dataset.write_splits(dataset.generate(0, small), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_dumps, calls = json.dumps, []

    def failing_dumps(obj, **kw):  # the write fails while the validation split is written
        calls.append(1)
        if len(calls) > small["train"] + 2:
            raise OSError(28, "No space left on device")
        return real_dumps(obj, **kw)

    other = dataset.generate(1, small)
    monkeypatch.setattr(dataset.json, "dumps", failing_dumps)
    with pytest.raises(OSError, match="No space left"):
        dataset.write_splits(other, tmp_path)
    assert len(calls) == small["train"] + 3
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp file left either
    monkeypatch.setattr(dataset.json, "dumps", real_dumps)
    dataset.write_splits(other, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.jsonl", "train.jsonl", "validation.jsonl"]
    assert (tmp_path / "train.jsonl").read_bytes() != before["train.jsonl"]


# ---------------------------------------------------------------------------------- call parser

ROUND_TRIP = [
    ("get_steps", {"date": "yesterday"}),
    ("get_heart_rate", {"date": "2025-03-01", "metric": "max"}),
    ("search", {"q": "a, b {c}: d [e]", "n": 5, "x": -2.5, "flag": True, "off": False, "none": None}),
    ("nested", {"filter": {"kind": "run", "min": 3, "tags": ["a,b", "c}"]}, "list": [1, 2.0, "x"]}),
    ("empty", {}),
    ("keys", {"user.id": 1, "start-date": "x", "with space": "y", "ünïcode": "z", "$ref": "#/a"}),
    # OpenAI tool names may start with a digit (^[a-zA-Z0-9_-]{1,64}$): such a call was a format error
    ("3d_render", {"scale": 2}), ("2fa-check", {}),
    ("values", {"big": 10**30, "tiny": 1.5e-07, "unicode": "héllo 👋 שלום", "newline": "a\nb", "quote": 'say "hi"',
                "backslash": "a\\b", "padded": "  x  ", "digits": "5", "word": "true", "html": "<b>x</b>",
                "empty": "", "deep": {"a": {"b": [True, None, [], {}]}}}),
]


@pytest.mark.parametrize("args, needle", [
    ({"time:zone": "UTC"}, "key 'time:zone'"), ({"a,b": 1}, "key 'a,b'"), ({" pad": 1}, "key ' pad'"),
    ({"q": "x<escape>y"}, "arguments.q"), ({"f": {"tags": ["ok", "<escape>"]}}, r"arguments.f.tags\[1\]"),
    ({"f": {"{k}": 1}}, "key '{k}'"),
])
def test_calls_the_text_cannot_carry_are_refused(args, needle):
    """Each would render as text that parses back to another call (or none), and train the model on it."""
    from gemma_tpu.core.errors import UserError

    with pytest.raises(UserError, match=needle):
        format_call("t", args)


@pytest.mark.parametrize("name,args", ROUND_TRIP)
def test_parser_round_trip(name, args):
    text = format_call(name, args) + "<start_function_response>"
    reply = parse_reply(text)
    assert reply.kind == "call" and reply.calls == [ToolCall(name, args)]
    # as a model on a plain Gemma 3 vocabulary writes it
    token_map = {m: f"<unused{i}>" for i, m in enumerate(
        ("<start_function_declaration>", "<end_function_declaration>", "<start_function_call>",
         "<end_function_call>", "<start_function_response>", "<end_function_response>", "<escape>"))}
    mapped = text
    for marker, repl in token_map.items():
        mapped = mapped.replace(marker, repl)
    assert parse_reply(mapped, token_map).calls == [ToolCall(name, args)]


def test_parser_classifies_text_bare_calls_and_errors():
    assert parse_reply("You walked 8,421 steps yesterday. Good call: keep it up!").kind == "text"
    # `call:` before a word that no brace follows is prose, not a malformed call (was a format error)
    for prose in ("Give me a call:tomorrow works.", "Missed call:Mom, 2 min", "See the recall:it is fine"):
        assert parse_reply(prose).kind == "text", prose
    mid = parse_reply("Checking. call:get_steps{date:today} and recall:x")
    assert mid.kind == "call" and mid.first == ToolCall("get_steps", {"date": "today"})
    # a bare call quoted in prose (backticks, quotes) is the answer's text: it was run as a call
    for quoted in ("Run `call:get_steps{date:today}` to see.", 'I could "call:get_steps{}" for you.',
                   "Say \u201ccall:get_steps{}\u201d", "call:get_steps{} or `call:get_daily_step_goal{}`"):
        assert (parse_reply(quoted).kind, parse_reply(quoted).text) == ("text", quoted), quoted
    # a bare call mid-sentence (a word before it on its line, text after it) is prose mentioning it: it was run
    for prose in ("you could use call:get_steps{date:today} next time", "I can call:get_steps{} if you want."):
        assert (parse_reply(prose).kind, parse_reply(prose).text) == ("text", prose), prose
    for ends in ("Sure.\ncall:get_steps{date:today}", "Let me check call:get_steps{date:today}",
                 "Checking: call:get_steps{date:today} call:get_daily_step_goal{}"):  # a call ending the sentence
        assert parse_reply(ends).kind == "call", ends
    # a bare value with a leading zero (a zip code whose <escape>s a server stripped) is text, as JSON has no 01:
    # '02139' read as the number 2139; a number written as JSON writes it is still a number
    zips = parse_reply("call:find_gym{zip:02139,floor:-01,n:0,x:0.5,k:10}")
    assert zips.first.arguments == {"zip": "02139", "floor": "-01", "n": 0, "x": 0.5, "k": 10}
    bare = parse_reply("call:get_steps{date:today}")  # a server that strips special tokens
    assert bare.kind == "call" and bare.first == ToolCall("get_steps", {"date": "today"})
    two = parse_reply(format_call("get_steps", {"date": "today"}) + format_call("get_daily_step_goal", {}))
    assert [c.name for c in two.calls] == ["get_steps", "get_daily_step_goal"]
    # parallel calls from a server that strips special tokens: every bare call, not the first alone (the second was
    # left as the answer's text, so evaluate scored an endpoint's right two-call turn wrong and the chat ran one)
    for sep in ("", " ", "\n"):
        stripped = parse_reply(f"call:get_steps{{date:today}}{sep}call:get_daily_step_goal{{}}")
        assert (stripped.kind, stripped.calls, stripped.text) == (
            "call", [ToolCall("get_steps", {"date": "today"}), ToolCall("get_daily_step_goal", {})], ""), sep
    assert parse_reply("call:get_steps{date:today} then call:get_sleep{").kind == "format_error"
    # a degenerate model's '[[[[...': RecursionError out of the parser (a traceback in evaluate and the chat)
    for n in (65, 3000):
        deep = parse_reply(f"<start_function_call>call:get_steps{{date:{'[' * n}{']' * n}}}<end_function_call>")
        assert (deep.kind, deep.error.split(" at ")[0]) == ("format_error", "arguments nested more than 64 levels deep")
    assert parse_reply(format_call("get_steps", {"date": [[[["x"]]]]})).first.arguments == {"date": [[[["x"]]]]}
    # a key given twice: which value the model meant is anyone's guess (the last was taken, and could score right)
    twice = parse_reply(format_call("get_steps", {"date": "today"}).replace("}", ",date:<escape>yesterday<escape>}"))
    assert (twice.kind, twice.calls) == ("format_error", []) and "key 'date' appears twice" in twice.error
    for broken in ("<start_function_call>call:get_steps{date:<escape>today}",
                   "<start_function_call>call:get_steps{date:<escape>today<escape>",
                   "<start_function_call>call:{date:1}<end_function_call>",
                   "<start_function_call>get_steps(date='today')<end_function_call>",
                   "call:get_steps"):
        reply = parse_reply(broken)
        assert reply.kind == "format_error", broken
        assert reply.error
    # what follows a call's end marker is never lost: text is the turn's text beside the call, a second call cut
    # short a format error (the first call kept), a second call without its start marker the text it is
    call = format_call("get_steps", {"date": "today"})
    for after, kind, text in (("xyz", "call", "xyz"), (" Done.", "call", "Done."),
                              ("<start_function_call>call:get_sleep{date:", "format_error", None),
                              ("call:get_sleep{date:today}", "call", "call:get_sleep{date:today}")):
        reply = parse_reply(call + after)
        assert (reply.kind, reply.calls[0]) == (kind, ToolCall("get_steps", {"date": "today"})), after
        assert reply.text == text if text else reply.error == "missing value at the end", after
    # a turn going on past the function response marker (a server not stopping there): the model inventing the tool's
    # answer and words on it was the turn's text beside the call; it is read as if it had stopped at the marker
    invented = "<start_function_response>response:get_steps{steps:9000}<end_function_response>You walked 9000 steps."
    for before, kind in ((call, "call"), (call.replace("<end_function_call>", ""), "call"),
                         ("Let me see.", "format_error")):
        reply = parse_reply(before + invented)
        assert reply.kind == kind and "9000" not in reply.text, before
        assert reply.calls == ([ToolCall("get_steps", {"date": "today"})] if kind == "call" else []), before
    assert parse_reply("Let me see." + invented).error == NO_CALL_AT_STOP
    # arguments the call text cannot carry (an escaped key with ':', a quoted string holding <escape>): the server sent
    # them as tool_calls its own request check refuses when the client sends them back, and no training row holds them
    for odd, needle in (("{<escape>time:zone<escape>:1}", "key 'time:zone' cannot be written"),
                        ('{a:"x<escape>y"}', "arguments.a: the value 'x<escape>y' contains <escape>")):
        reply = parse_reply(f"<start_function_call>call:get_steps{odd}<end_function_call>")
        assert reply.kind == "format_error" and needle in reply.error, odd
    assert parse_reply("<start_function_call>call:f{<escape>k<escape>:1}<end_function_call>").first.arguments == {
        "k": 1}
    # a name no declaration may have (TOOL_NAME): it was a call of 'météo', whose tool_call the server then refused
    for name in ("météo", "天气", "x" * 65):
        reply = parse_reply(f"<start_function_call>call:{name}{{city:Paris}}<end_function_call>")
        assert (reply.kind, reply.error.split(" at ")[0]) == ("format_error", f"{name!r} is not a tool name (1 to 64 "
                                                              f"ASCII letters, digits, '_', '.' or '-', not starting "
                                                              f"with '.' or '-')"), name


def test_parser_and_matcher_take_runs_of_digits_of_any_length():
    """A degenerate model writes a run of hundreds of digits: float() of 309+ digits is inf and int(inf)
    raised OverflowError out of parse_reply (a traceback in evaluate and the chat); the matcher's float()
    of such an int raised too."""
    for n in (400, 5000):  # 5000: past Python's 4,300-digit int-from-str limit
        reply = parse_reply(f"<start_function_call>call:get_steps{{date:{'9' * n}}}<end_function_call>")
        assert reply.kind == "call" and str(reply.first.arguments["date"]) == "9" * n
        assert not arguments_match({"date": "today"}, reply.first.arguments)
        assert arguments_match({"date": "9" * n}, reply.first.arguments)
    assert not arguments_match({"n": 5}, {"n": 10 ** 400}) and arguments_match({"n": 10 ** 400}, {"n": 10 ** 400})
    assert not any(arguments_match(r, p) for r, p in (({"n": 10 ** 400}, {"n": 1.5}), ({"n": 1.5}, {"n": "9" * 400}),
                                                      ({"n": float("inf")}, {"n": 10 ** 400})))
    assert arguments_match({"n": "9" * 400}, {"n": 10 ** 400 - 1})
    assert parse_reply("call:f{a:-12, b:1.5e3, c:1e9}").first.arguments == {"a": -12, "b": 1500.0, "c": 1e9}
    # 1e999 is no number JSON carries: the call was sent on as tool_calls arguments {"c": Infinity}, which an OpenAI
    # client's JSON reader refuses, and refused by our own request check when the client sent it back
    overflow = parse_reply("call:f{a:-12, b:1.5e3, c:1e999}")
    assert overflow.kind == "format_error" and "arguments.c: inf is not a number JSON can carry" in overflow.error


def test_evaluation_scores_the_first_trained_answer(tmp_path):
    """A prompt-completion row is scored on its completion: the assistant turns of its prompt are context."""
    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import load_conversations
    from gemma_tpu.evaluate.run import build_cases

    ex = dataset.generate(0, {"train": 0, "validation": 0, "test": 1})["test"][0]
    first = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! Ask me about your day."}]
    row = {"tools": ex["tools"], "prompt": [ex["messages"][0], *first, ex["messages"][1]],
           "completion": ex["messages"][2:]}
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (case,) = build_cases(load_conversations(path, DataConfig()))
    call = ex["messages"][2]["tool_calls"][0]["function"]
    assert case.reference is not None and (case.reference.name, case.reference.arguments) == (call["name"],
                                                                                              call["arguments"])
    assert case.user == ex["messages"][1]["content"] and len(case.prompt["messages"]) == 4


def test_a_prompt_giving_the_start_of_the_answer_is_continued_and_the_continuation_scored(tmp_path):
    """TRL's continue_final_message rows (the prompt ends in the start of the answer, the completion continues it)
    train the continuation after the given start; evaluate prompted without the start (the model answered from
    scratch) and scored against start and continuation. The model now continues the start, locally as the tokenizer's
    apply_chat_template(continue_final_message=True) renders it and from an endpoint with vLLM's request extension,
    and the continuation is scored."""
    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import Renderer, load_conversations
    from gemma_tpu.evaluate.run import build_cases, prompts_within_context
    from transformers import AutoTokenizer

    from gemma_tpu.assets.embedded import GEMMA3_CHAT_TEMPLATE
    from gemma_tpu.assets.tiny import _write_small_tokenizer
    from tests.test_clients_foreign import _in_process
    from tests.test_serving import scripted

    prompt = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 6*7?"},
              {"role": "assistant", "content": "The answer is"}]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "completion": [{"role": "assistant", "content": " 42."}]}) + "\n")
    (case,) = build_cases(load_conversations(path, DataConfig()))
    assert (case.prompt["messages"][-1], case.answer, case.start) == (prompt[-1], " 42.", "The answer is")
    _write_small_tokenizer(tmp_path / "tok", 512)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    served = [int(i) for i in tok.apply_chat_template(prompt, tokenize=True, continue_final_message=True,
                                                      return_dict=False)]
    for fmt in ("gemma", "template"):
        (ids,), over = prompts_within_context(Renderer(tok, fmt), [case], 8, None)
        assert [int(i) for i in ids] == served and not over, fmt
    # past the context, the parts of the prompt are named as they are (the start was "the tool calls and results")
    _, over = prompts_within_context(Renderer(tok), [case], 8, len(served) + 4)
    assert re.search(r"\(the system prompt \d+, the question \d+, the start of the answer 13\); with "
                     r"--max-new-tokens 8 it passes the model's context of \d+ \(max_position_embeddings\) by 4: "
                     r"shorten the start of the answer by at least 4 tokens or ask for at most 4 new", over[0]), over
    handler, server = scripted({"content": " 42."})
    out = tmp_path / "r.json"
    with server as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(path), "--endpoint", url, "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    body = handler.requests[0]["body"]
    assert body["messages"][-1] == prompt[-1] and len(body["messages"]) == 3
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    (record,) = next(iter(json.loads(out.read_text())["examples"].values()))
    assert (record["reference_answer"], record["answer_start"], record["answer_exact_match"]) == (" 42.",
                                                                                                "The answer is", 1.0)


def test_a_prompt_the_chat_template_refuses_is_named_by_its_line(tmp_path):
    """Under data.chat_format=template, a test conversation the tokenizer's template refuses (Gemma 3's takes no
    developer turn) stopped evaluate with "example: the tokenizer's chat template refused the conversation": the
    prompts carry no FILE:LINE. It is named by its line, as training names it."""
    from transformers import AutoTokenizer

    from gemma_tpu.assets.embedded import GEMMA3_CHAT_TEMPLATE
    from gemma_tpu.assets.tiny import _write_small_tokenizer
    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import Renderer, load_conversations
    from gemma_tpu.evaluate.run import build_cases, prompts_within_context

    _write_small_tokenizer(tmp_path / "tok", 512)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ok) + "\n" + json.dumps({"messages": [{"role": "developer", "content": "Be terse."},
                                                                     *ok["messages"]]}) + "\n")
    cases = build_cases(load_conversations(path, DataConfig()))
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}:2: the tokenizer's chat template refused the "
                                        f"conversation \\(TemplateError: unsupported role developer"):
        prompts_within_context(Renderer(tok, "template"), cases, 8, None)


def test_every_trained_turn_is_scored_with_turns_all(tmp_path):
    """`evaluate --turns all` scores each trained assistant turn of a multi-turn chat after the reference conversation
    before it (only the first was ever scored: a chat's later calls and answers went unjudged); the default stays
    the first turn, and a prompt-completion row's prompt turns stay context either way."""
    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import load_conversations
    from gemma_tpu.evaluate.run import build_cases, parse_args

    ex = dataset.generate(0, {"train": 0, "validation": 0, "test": 1})["test"][0]
    roles = [m["role"] for m in ex["messages"]]
    assert roles == ["developer", "user", "assistant", "tool", "assistant"]
    more = [{"role": "user", "content": "And yesterday?"}, ex["messages"][2], ex["messages"][3],
            {"role": "assistant", "content": "About the same."}]
    chat = {"tools": ex["tools"], "messages": ex["messages"] + more}
    pc = {"tools": ex["tools"], "prompt": ex["messages"][:4], "completion": ex["messages"][4:]}
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(chat) + "\n" + json.dumps(pc) + "\n")
    convs = load_conversations(path, DataConfig())
    assert [c.prompt["messages"][-1]["role"] for c in build_cases(convs)] == ["user", "tool"]
    cases = build_cases(convs, "all")
    assert [(len(c.prompt["messages"]), c.reference.name if c.reference else c.answer) for c in cases] == [
        (2, ex["messages"][2]["tool_calls"][0]["function"]["name"]), (4, ex["messages"][4]["content"]),
        (6, ex["messages"][2]["tool_calls"][0]["function"]["name"]), (8, "About the same."),
        (4, ex["messages"][4]["content"])]
    assert cases[2].user == "And yesterday?" and cases[1].prompt["messages"][3]["role"] == "tool"
    assert parse_args(["--data", "x", "--model", "m"]).turns == "first"
    # each record names its example and turn: a results file under --turns all held four records of one chat that
    # said neither (nor FILE:LINE under the default)
    from gemma_tpu.evaluate.run import scored
    from gemma_tpu.formats.function_calling import ParsedReply

    _, records = scored(cases, [ParsedReply("text", [], "x")] * len(cases), ["x"] * len(cases), None, 0.0)
    assert [(r["where"], r["turn"]) for r in records] == [(f"{path}:1", 2), (f"{path}:1", 4), (f"{path}:1", 6),
                                                          (f"{path}:1", 8), (f"{path}:2", 4)]


def test_arguments_match_normalises_types():
    assert arguments_match({"n": 5, "flag": True, "date": "today"}, {"n": "5", "flag": "true", "date": " Today "})
    assert arguments_match({"n": 5}, {"n": 5.0, "extra": 1})
    # one rule at every depth: extra keys inside an object argument (or a list's objects) pass as top-level ones do
    assert arguments_match({"f": {"type": "run"}}, {"f": {"type": "Run", "min_km": 5}, "extra": 1})
    assert arguments_match({"fs": [{"a": 1}]}, {"fs": [{"a": "1", "b": None, "c": 2}]})
    assert not arguments_match({"f": {"a": None}}, {"f": {"a": 1}}) and not arguments_match({"a": None}, {"a": 1})
    assert not arguments_match({"f": {"type": "run", "n": 2}}, {"f": {"type": "run", "min_km": 5}})
    assert not arguments_match({"date": "today"}, {"date": "yesterday"})
    # a leading zero makes an id or a zip code, not a number: '007' matched 7 and '02139' matched '2139'
    assert not arguments_match({"agent": "007"}, {"agent": 7}) and not arguments_match({"zip": "02139"}, {"zip": "2139"})
    assert arguments_match({"zip": "02139"}, {"zip": " 02139"}) and arguments_match({"x": "0.5"}, {"x": 0.5})
    assert arguments_match({"x": "-0.25"}, {"x": -0.25}) and arguments_match({"n": "0"}, {"n": 0})
    assert not arguments_match({"date": "today"}, {})
    # a boolean is not a number (Python's True == 1 matched them): 1 for true, "0" for false, true for a count of 1
    assert not any(arguments_match(r, p) for r, p in (({"flag": True}, {"flag": 1}), ({"flag": False}, {"flag": "0"}),
                                                      ({"n": 1}, {"n": True}), ({"n": [1, 0]}, {"n": ["true", False]})))
    assert arguments_match({"flag": [True]}, {"flag": ["TRUE"]})


def test_arguments_match_compares_unicode_text_by_its_characters():
    """One text in two Unicode spellings (é composed, or e and a combining accent, as text typed on a Mac or a
    model's byte-level tokens give it) scored as a different argument, as did Straße against STRASSE, where case
    is otherwise ignored; the answer scores already compared them normalised. Other characters stay apart."""
    assert arguments_match({"city": "S\u00e3o Paulo"}, {"city": "Sa\u0303o Paulo"})
    assert arguments_match({"street": "Stra\u00dfe"}, {"street": "STRASSE"})
    assert arguments_match({"caf\u00e9": "x"}, {"cafe\u0301": "x"})  # the argument's name too
    assert not arguments_match({"city": "S\u00e3o Paulo"}, {"city": "Sao Paulo"})
    assert not arguments_match({"unit": "m\u00b2"}, {"unit": "m2"})  # a superscript is not a digit (NFC, not NFKC)

def test_arguments_match_nulls_close_floats_exact_ids_and_twice_encoded_arguments():
    """A reference null scored a call that left the argument out as wrong; 72.5 against 72.50000001 (a float
    through float32 or a short repr) as wrong while ids 2**53 and 2**53 + 1 matched (both went through float);
    arguments encoded twice (a JSON string of the object) were a format error, not the call they spell."""
    from gemma_tpu.infer.openai_client import reply_from_message

    assert arguments_match({"date": "today", "unit": None}, {"date": "today"})
    assert arguments_match({"unit": None}, {"unit": None}) and arguments_match({"f": {"a": None}}, {"f": {}})
    assert not arguments_match({"unit": "km"}, {"unit": None}) and not arguments_match({"f": {"a": 1}}, {"f": {}})
    assert arguments_match({"w": 72.5}, {"w": 72.50000001}) and arguments_match({"n": 1}, {"n": 1.00000001})
    assert arguments_match({"x": 0.1}, {"x": float(np.float32(0.1))}) and arguments_match({"n": 1}, {"n": "1.0"})
    assert not arguments_match({"w": 72.5}, {"w": 72.6}) and not arguments_match({"x": 0.1}, {"x": 0.1001})
    assert not arguments_match({"id": 2 ** 53}, {"id": 2 ** 53 + 1})
    assert not arguments_match({"id": 123456789}, {"id": 123456790}) and arguments_match({"n": 10 ** 20}, {"n": 1e20})
    twice = {"tool_calls": [{"function": {"name": "get_steps", "arguments": json.dumps(json.dumps({"date": "x"}))}}]}
    reply = reply_from_message(twice)
    assert reply.kind == "call" and reply.first.arguments == {"date": "x"}
    assert reply_from_message({"tool_calls": [{"function": {"name": "f", "arguments": '"today"'}}]}).kind \
        == "format_error"  # a JSON string that is no object stays an error
    assert reply_from_message({"tool_calls": [{"function": {"name": "f", "arguments": '"{oops"'}}]}).kind \
        == "format_error"
    # a name no declaration may have is a format error, as the same call in the FunctionGemma text is (TOOL_NAME)
    for name in ("météo", "get weather"):
        odd = reply_from_message({"tool_calls": [{"function": {"name": name, "arguments": "{}"}}]})
        assert (odd.kind, odd.error) == ("format_error", f"tool call name {name!r} is not a tool name (1 to 64 ASCII "
                                                         f"letters, digits, '_', '.' or '-')")


# -------------------------------------------------------------------------------------- scoring


def test_score_on_hand_made_predictions():
    from gemma_tpu.evaluate.run import Case, score

    names = ["get_steps", "get_heart_rate"]
    ref = ToolCall("get_heart_rate", {"date": "today", "metric": "max"})
    cases = [Case({}, ref, names, f"q{i}") for i in range(6)] + [Case({}, None, names, "hi")]
    preds = [
        ParsedReply("call", [ToolCall("get_heart_rate", {"date": "today", "metric": "max"})], ""),  # all right
        ParsedReply("call", [ToolCall("get_heart_rate", {"date": "today", "metric": "resting"})], ""),  # name only
        ParsedReply("call", [ToolCall("get_steps", {"date": "today"})], ""),  # wrong tool
        ParsedReply("call", [ToolCall("get_pulse", {"date": "today"})], ""),  # hallucinated
        ParsedReply("text", [], "I don't know"),  # no call
        ParsedReply("format_error", [], "call:get_heart_rate{", "unclosed"),
        ParsedReply("text", [], "Hello!"),  # reference has no call either: right
    ]
    m = score(cases, preds)
    assert m["n"] == 7
    assert m["tool_accuracy"] == pytest.approx(3 / 7)
    assert m["argument_accuracy"] == pytest.approx(2 / 7)
    assert m["hallucinated_tool_rate"] == pytest.approx(1 / 7)
    assert m["no_call_rate"] == pytest.approx(2 / 7)
    assert m["format_error_rate"] == pytest.approx(1 / 7)
    assert m["per_tool"]["get_heart_rate"] == {"n": 6, "tool_accuracy": 2 / 6, "argument_accuracy": 1 / 6}
    # tool_accuracy counts the right "no call" too; the call_* metrics are over the six that expect a call, and
    # declined_accuracy over the one that expects none
    assert (m["call_n"], m["no_call_n"]) == (6, 1)
    assert m["call_tool_accuracy"] == pytest.approx(2 / 6) and m["call_argument_accuracy"] == pytest.approx(1 / 6)
    assert m["declined_accuracy"] == 1.0
    declined = score(cases[-1:] * 2, [ParsedReply("format_error", [], "call:x{", "unclosed"), preds[0]])
    assert declined["declined_accuracy"] == 0.0 and declined["call_n"] == 0 and declined["call_tool_accuracy"] is None


def test_the_table_is_recomputed_from_the_results_files_records():
    """The records of a results file said what was asked and replied but not how it scored: the hallucination rate
    (the declared tools are not in them) and the answer scores (the answer is parsed out of `raw`) could not be
    recomputed from them, nor the examples a model got wrong found without our scorer. Each record now carries its
    outcome, and every rate of the table is the mean of its records' (JSON-reloaded) fields."""
    from gemma_tpu.evaluate.run import METRICS, Case, results_json, scored

    names = ["get_steps", "get_heart_rate"]
    steps, pulse = ToolCall("get_steps", {"date": "today"}), ToolCall("get_heart_rate", {"date": "today"})
    cases = [Case({}, steps, names, "a", calls=[steps]), Case({}, steps, names, "b", calls=[steps]),
             Case({}, steps, names, "c", calls=[steps, pulse]), Case({}, None, names, "d", "Hal, 3 plus 17 is 20."),
             Case({}, None, names, "e", "It is 20."), Case({}, None, names, "f", "ok"), Case({}, steps, names, "g")]
    preds = [ParsedReply("call", [ToolCall("get_steps", {"date": "Today"})], ""),
             ParsedReply("call", [ToolCall("get_pulse", {})], ""),
             ParsedReply("call", [pulse, steps], ""), ParsedReply("text", [], "Hal: 3 plus 17 = 20"),
             ParsedReply("call", [steps], ""), ParsedReply("format_error", [], "call:x{", "unclosed"),
             ParsedReply("refused", [], "", "too long")]
    metrics, records = scored(cases, preds, [""] * len(cases), None, 0.0)
    records = json.loads(results_json({"m": metrics}, {"m": records}, "t.jsonl", len(cases)))["examples"]["m"]

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows) if rows else None

    calls = [r for r in records if r["reference"] is not None]
    declines = [r for r in records if r["reference"] is None]
    answers = [r for r in records if r["reference_answer"] is not None]
    again = {"n": len(records), "tool_accuracy": mean("tool_correct", records),
             "argument_accuracy": mean("arguments_correct", records), "call_n": len(calls),
             "call_tool_accuracy": mean("tool_correct", calls), "call_argument_accuracy": mean("arguments_correct", calls),
             "no_call_n": len(declines), "declined_accuracy": mean("tool_correct", declines),
             "hallucinated_tool_rate": mean("hallucinated", records), "answer_n": len(answers),
             **{f"{k}_rate": sum(r["kind"] == kind for r in records) / len(records)
                for k, kind in (("no_call", "text"), ("format_error", "format_error"), ("refused", "refused"))},
             **{k: mean(k, answers) for k in ("answer_exact_match", "answer_f1", "answer_rouge_l")}}
    assert set(again) == set(METRICS) - {"eval_loss", "perplexity"}
    assert again == pytest.approx({k: metrics[k] for k in again})
    assert [r["tool_correct"] for r in records] == [True, False, True, True, False, False, False]
    assert metrics["hallucinated_tool_rate"] == pytest.approx(1 / 7) and 0 < metrics["answer_f1"] < 1
    assert records[3]["answer"] == "Hal: 3 plus 17 = 20" and records[3]["answer_f1"] == pytest.approx(10 / 11)

def test_a_nonfinite_eval_loss_keeps_the_results_file_strict_json():
    """A model whose logits went NaN (a diverged run merged) wrote `"eval_loss": NaN, "perplexity": NaN`: the bare
    word NaN is not JSON, and jq or JavaScript could not read the results file at all. It is null now, and the
    model's metrics name it in `nonfinite`."""
    from gemma_tpu.core.strict_json import dumps, finite
    from gemma_tpu.evaluate.run import Case, results_json, scored

    steps = ToolCall("get_steps", {"date": "today"})
    metrics, records = scored([Case({}, steps, ["get_steps"], "a", calls=[steps])],
                              [ParsedReply("call", [steps], "")], [""], float("nan"), 0.0)

    def refuse(word):
        raise AssertionError(f"{word} is not JSON")

    doc = json.loads(results_json({"m": metrics}, {"m": records}, "t.jsonl", 1), parse_constant=refuse)
    m = doc["models"]["m"]
    assert m["eval_loss"] is None and m["perplexity"] is None and m["tool_accuracy"] == 1.0
    assert m["nonfinite"] == {"eval_loss": "nan", "perplexity": "nan"}
    assert finite({"a": [1.0, float("inf")], "b": {"c": -float("inf")}, "d": 2}) == \
        {"a": [1.0, None], "b": {"c": None, "nonfinite": {"c": "-inf"}}, "d": 2}
    assert dumps({"x": 1.5}) == '{"x": 1.5}'


def test_parallel_reference_calls_are_all_scored():
    """A reference turn of two calls scored its first call only: a model that made that one call alone scored
    right. Now every reference call needs a predicted call of its own (order free, extras allowed)."""
    from gemma_tpu.evaluate.run import build_cases, score

    tools = [{"type": "function", "function": {"name": n}} for n in ("get_steps", "get_heart_rate")]
    conv = {"tools": tools, "messages": [{"role": "user", "content": "steps and pulse?"}, {"role": "assistant",
            "content": "", "tool_calls": [{"name": "get_steps", "arguments": {"date": "today"}},
                                          {"name": "get_heart_rate", "arguments": {"date": "today"}}]}]}
    steps, pulse = ToolCall("get_steps", {"date": "today"}), ToolCall("get_heart_rate", {"date": "today"})
    preds = [[steps], [pulse, steps], [steps, steps], [steps, ToolCall("get_heart_rate", {"date": "2020-01-01"})],
             [steps, pulse, ToolCall("get_steps", {})]]
    cases = build_cases([conv] * len(preds))
    assert [c.name for c in cases[0].calls] == ["get_steps", "get_heart_rate"] and cases[0].reference == steps
    per = [score([c], [ParsedReply("call", p, "")]) for c, p in zip(cases, preds)]
    assert [(m["tool_accuracy"], m["argument_accuracy"]) for m in per] == [
        (0.0, 0.0), (1.0, 1.0), (0.0, 0.0), (1.0, 0.0), (1.0, 1.0)]


def test_answer_scores_by_hand():
    """Exact match, token F1 and ROUGE-L on normalised words, with values worked out by hand."""
    from gemma_tpu.evaluate.answers import answer_scores, exact_match, rouge_l, token_f1, words

    assert words("Hal, 3 plus 17 IS 20!") == ["hal", "3", "plus", "17", "is", "20"]
    assert words("日本語です") == ["日", "本", "語", "で", "す"] and words("ｆｕｌｌ－width") == ["full", "width"]
    # combining marks are part of their word: Devanagari split at its virama and vowel signs, which it dropped
    assert words("नमस्ते, दुनिया!") == ["नमस्ते", "दुनिया"] and words("a_b +c°") == ["a", "b", "c"]
    assert token_f1("किताब", "कुताब") == 0.0 and exact_match("สวัสดีครับ", "สวัสดีค่ะ") == 0.0
    # invisible format characters inside a word (soft hyphen, ZWNJ, word joiner, a bidi mark) do not split it; a
    # zero-width space separates words, as a space does
    assert words("co\u00adoperation di\u2060rect \u200fשלום\u200f") == ["cooperation", "direct", "שלום"]
    assert exact_match("Great co\u00adoperation", "great cooperation") == 1.0
    assert words("می\u200cروم") == ["میروم"]
    assert words("ก\u200bข") == ["ก", "ข"]
    assert exact_match("hal, 3 plus 17 is 20.", "Hal, 3 plus 17 is 20") == 1.0
    assert exact_match("3 plus 17 is 20", "Hal, 3 plus 17 is 20") == 0.0
    # 5 predicted words, 6 reference words, 5 in common (F1 10/11); the same words reordered keep F1 but not LCS
    assert token_f1("3 plus 17 is 20", "Hal, 3 plus 17 is 20") == pytest.approx(10 / 11)
    assert rouge_l("3 plus 17 is 20", "Hal, 3 plus 17 is 20") == pytest.approx(10 / 11)
    assert token_f1("20 is 17 plus 3", "3 plus 17 is 20") == 1.0
    assert rouge_l("20 is 17 plus 3", "3 plus 17 is 20") == pytest.approx(2 * 1 / 10)  # LCS of one word
    assert rouge_l("a b c d", "a x c y d") == pytest.approx(2 * 3 / 9)  # LCS a c d
    assert token_f1("the the cat", "the cat cat") == pytest.approx(2 * 2 / 6)  # multiset overlap {the, cat}
    assert (token_f1("", ""), rouge_l("", "x"), token_f1("...", "x")) == (1.0, 0.0, 0.0)
    # a reference without words (an emoji) was matched in full by an empty reply or any other symbol
    assert (exact_match("", "👍"), token_f1("", "👍"), rouge_l("👎", "👍"), exact_match("...", "!")) == (0, 0, 0, 0)
    assert (exact_match(" 👍 ", "👍"), token_f1("👍!", "👍"), exact_match("", " ")) == (1.0, pytest.approx(2 / 3), 1.0)
    m = answer_scores([("Hal, 3 plus 17 is 20.", "Hal, 3 plus 17 is 20"), (None, "Doubled it is 148.")])
    assert m == {"answer_n": 2, "answer_exact_match": 0.5, "answer_f1": 0.5, "answer_rouge_l": 0.5}
    assert answer_scores([])["answer_f1"] is None


def test_score_judges_text_answers():
    """Examples whose reference is text get the answer_* metrics; a call instead of an answer scores 0 there,
    and tool-call examples are not counted in them."""
    from gemma_tpu.evaluate.run import Case, build_cases, score

    convs = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4."}]},
             {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "It is 6."}]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}]}]
    cases = build_cases(convs) + [Case({}, ToolCall("get_steps", {}), ["get_steps"], "steps?")]
    assert [c.answer for c in cases] == ["It is 4.", "It is 6.", "Hello there", None]
    preds = [ParsedReply("text", [], "it is 4"), ParsedReply("text", [], "It is 7."),
             ParsedReply("call", [ToolCall("get_steps", {})], ""), ParsedReply("call", [ToolCall("get_steps", {})], "")]
    m = score(cases, preds)
    assert m["answer_n"] == 3
    assert m["answer_exact_match"] == pytest.approx(1 / 3)
    assert m["answer_f1"] == pytest.approx((1 + 2 / 3) / 3)  # "it is 7" vs "it is 6": 2 of 3 words
    assert m["tool_accuracy"] == pytest.approx(3 / 4)  # two text replies where text was due, one right call
    assert (m["call_n"], m["call_tool_accuracy"], m["no_call_n"]) == (1, 1.0, 3)
    assert m["declined_accuracy"] == pytest.approx(2 / 3)
    from gemma_tpu.evaluate.run import format_table

    table = format_table({"m": m})
    assert re.search(r"^call_tool_accuracy +1\.0000$", table, re.M) and re.search(r"^declined_accuracy +0\.6667$",
                                                                                  table, re.M), table


def test_endpoint_replies_are_read_from_tool_calls_or_content():
    from gemma_tpu.infer.openai_client import openai_messages, reply_from_message

    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_steps", "arguments": '{"date": "today"}'}}]}
    assert reply_from_message(msg).first == ToolCall("get_steps", {"date": "today"})
    assert reply_from_message({"content": "<unused2>call:get_steps{date:<unused6>monday<unused6>}<unused3>"}
                              ).first == ToolCall("get_steps", {"date": "monday"})
    assert reply_from_message({"content": "call:get_steps{date:monday}"}).first.arguments == {"date": "monday"}
    assert reply_from_message({"content": "8,000 steps."}).kind == "text"
    bad = {"tool_calls": [{"function": {"name": "get_steps", "arguments": "{date"}}]}
    assert reply_from_message(bad).kind == "format_error"
    # no arguments: null, "", "null" (a tool parser's json.dumps of arguments none gave) and "{}" alike
    for args in (None, "", "null", "{}"):
        none = reply_from_message({"tool_calls": [{"function": {"name": "get_daily_step_goal", "arguments": args}}]})
        assert (none.kind, none.calls) == ("call", [ToolCall("get_daily_step_goal", {})]), args
    for args in ('{"date": "today", "date": "yesterday"}', json.dumps('{"date": "a", "date": "b"}')):  # twice encoded
        twice = reply_from_message({"tool_calls": [{"function": {"name": "get_steps", "arguments": args}}]})
        assert (twice.kind, twice.error) == ("format_error", "tool_calls arguments: key 'date' appears twice in one "
                                                             "object (JSON readers keep only the last)"), args
    # numbers JSON does not hold, as text or in structured arguments: a format error, as in the call text
    for args, error in (('{"sets": NaN}', "arguments: NaN is not JSON"),
                        ('{"sets": 1e999}', "arguments: 1e999 is beyond the range of a 64-bit float"),
                        ({"sets": [1, {"reps": float("inf")}]},
                         "arguments.sets[1].reps is not a number JSON can carry")):
        odd = reply_from_message({"tool_calls": [{"function": {"name": "log_workout", "arguments": args}}]})
        assert odd.kind == "format_error" and odd.error.startswith(f"tool_calls {error}"), (args, odd)
    for args in ([], 0, False, "[]"):  # not an object of arguments: `[]` (a list, as JSON too) was read as none given
        odd = reply_from_message({"tool_calls": [{"function": {"name": "get_steps", "arguments": args}}]})
        assert (odd.kind, odd.error) == ("format_error", "tool call without a name or an object of arguments"), args
    big = reply_from_message({"tool_calls": [{"function": {"name": "f", "arguments": '{"n": 9007199254740993}'}}]})
    assert big.first.arguments == {"n": 2**53 + 1}
    with pytest.raises(UserError, match=r"^messages\[1\]\.tool_calls\[0\] arguments.n is not a number JSON"):
        openai_messages([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": {"n": float("nan")}}}]}])
    # arguments already JSON text were sent on unchecked: a string holding NaN or a key twice reached the server
    for text, why in (('{"n": NaN}', "NaN is not JSON"), ('{"n": 1, "n": 2}', "key 'n' appears twice"),
                      ('{"n": 1e999}', "1e999 is beyond the range"), ('{"n"', "Expecting")):
        with pytest.raises(UserError, match=r"^messages\[1\]\.tool_calls\[0\] arguments are not JSON a server "
                                            rf"reads: {re.escape(why)}"):
            openai_messages([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                {"function": {"name": "f", "arguments": text}}]}])
    for n in (64, 3000):  # nested past what json.loads reaches: RecursionError (a traceback in evaluate)
        deep = reply_from_message({"tool_calls": [{"function": {"name": "get_steps", "arguments": json.dumps(
            {"date": 1}).replace("1", "[" * n + "]" * n)}}]})
        assert (deep.kind, deep.error) == ("format_error", "tool_calls arguments nested more than 64 levels deep"), n
    conv = dataset.generate(0, {"train": 1, "validation": 0, "test": 0})["train"][0]
    sent = openai_messages(conv["messages"])
    assert sent[0]["role"] == "system" and json.loads(sent[2]["tool_calls"][0]["function"]["arguments"])


# ------------------------------------------------------------------ chat template, generation


def test_chat_template_renders_prompts_like_the_renderer(tiny_dir):
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.data import Renderer
    from gemma_tpu.data.records import normalise_messages
    from gemma_tpu.evaluate.run import openai_messages
    from gemma_tpu.formats.function_calling import function_token_map

    tok = load_tokenizer(tiny_dir)
    token_map = function_token_map(tok)
    renderer = Renderer(tok, "gemma", token_map=token_map)
    template = tool_chat_template(token_map)
    for ex in dataset.generate(0, {"train": 0, "validation": 0, "test": 7})["test"]:
        prompt = {"tools": ex["tools"], "messages": ex["messages"][:2]}
        want = renderer.render(prompt, add_generation_prompt=True).text
        got = tok.apply_chat_template(openai_messages(prompt["messages"]), tools=ex["tools"], chat_template=template,
                                      tokenize=False, add_generation_prompt=True)
        assert got == "<bos>" + want
        # a whole exchange, the tool result as the JSON string an OpenAI client sends (read as training reads it)
        full = openai_messages(ex["messages"])
        full[2]["tool_calls"][0]["function"]["arguments"] = ex["messages"][2]["tool_calls"][0]["function"]["arguments"]
        assert isinstance(full[3]["content"], str)
        got = tok.apply_chat_template(full, tools=ex["tools"], chat_template=template, tokenize=False)
        assert got == "<bos>" + renderer.render(normalise_messages(ex, "example")).text


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir):
    from gemma_tpu.infer.generate import load_hf_dir

    return load_hf_dir(str(tiny_dir))


def test_cached_greedy_equals_uncached_forward(tiny_loaded):
    """Left-padded batched KV-cache decoding (sliding window 16 < prompt length) gives the same
    tokens as re-running the whole sequence without a cache."""
    import jax
    import jax.numpy as jnp

    from gemma_tpu.infer.generate import Generator

    model = tiny_loaded.model
    prompts = [[2] + list(range(110, 150)), [2] + list(range(120, 133)), [2, 150, 151]]
    gen = Generator(tiny_loaded, max_new_tokens=12, batch_size=4, buckets=(64,))
    outs = gen.generate(prompts)
    length = 64

    @jax.jit
    def next_tokens(toks):  # uncached causal forward of one right-padded sequence
        logits, _ = model(toks, jnp.arange(length)[None], None, jnp.tril(jnp.ones((length, length), bool))[None])
        return jnp.argmax(logits[0], axis=-1)

    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        expected = []
        for _ in range(len(out.ids)):
            buf = np.zeros((1, length), np.int32)
            buf[0, :len(seq)] = seq
            nxt = int(next_tokens(buf)[len(seq) - 1])
            expected.append(nxt)
            seq.append(nxt)
            if nxt in gen.stop_ids:
                break
        assert out.ids == expected
        assert out.stop in ("length", "end_of_turn", "eos", "call")


def test_evaluate_cli_on_tiny_model(tiny_long_dir, tmp_path):
    out = tmp_path / "eval.json"
    proc = run_cli("gemma_tpu.evaluate", "--data", str(DATA / "test.jsonl"), "--model", str(tiny_long_dir),
                   "--limit", "5", "--json", str(out), "--max-new-tokens", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for metric in ("tool_accuracy", "argument_accuracy", "hallucinated_tool_rate", "no_call_rate",
                   "format_error_rate", "eval_loss", "perplexity"):
        assert metric in proc.stdout
    data = json.loads(out.read_text())
    m = data["models"][f"model:{tiny_long_dir}"]
    assert m["n"] == 5 and np.isfinite(m["eval_loss"]) and m["perplexity"] > 1
    assert len(data["examples"][f"model:{tiny_long_dir}"]) == 5
    assert "generate" in proc.stderr  # the progress bar


@pytest.mark.parametrize("stop", ["ctrl-c", "loss"])
def test_a_local_evaluation_stopped_midway_keeps_the_examples_answered(tiny_long_dir, tmp_path, monkeypatch, stop):
    """A local --model run stopped by Ctrl-C after its first batch, or failing in the eval loss after every
    example was generated, kept nothing, where --endpoint keeps the examples answered: both now score and write
    them to `<json>.partial.json` (one rule, `partial_scores`), naming how many of n."""
    import contextlib
    import io

    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.evaluate import run

    class Stops(run.Generator):  # Ctrl-C as the first batch (2 of the 5 prompts) ends
        def generate(self, prompts, *args, on_batch=None, **kwargs):
            def report(n):
                raise KeyboardInterrupt

            return super().generate(prompts, *args, on_batch=report if stop == "ctrl-c" else on_batch, **kwargs)

    def broken_loss(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(run, "Generator", Stops)
    monkeypatch.setattr(run, "eval_loss", broken_loss)
    out = tmp_path / "r.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            rc = cli_main(run.main, ["--data", str(DATA / "test.jsonl"), "--model", str(tiny_long_dir), "--limit",
                                     "5", "--batch-size", "2", "--max-new-tokens", "4", "--json", str(out)])
        except RuntimeError as e:  # not a user's error: its traceback goes on
            rc = str(e)
    assert rc == (130 if stop == "ctrl-c" else "RESOURCE_EXHAUSTED: out of memory"), stderr.getvalue()
    assert not out.exists()  # the results file promises every example
    failed = json.loads((tmp_path / "r.partial.json").read_text())["failed"]
    k = 2 if stop == "ctrl-c" else 5
    assert failed["completed"] == k and failed["metrics"]["n"] == k and len(failed["examples"]) == k
    assert failed["metrics"]["eval_loss"] is None and 0 <= failed["metrics"]["tool_accuracy"] <= 1
    assert failed["error"] == ("KeyboardInterrupt" if stop == "ctrl-c" else "RESOURCE_EXHAUSTED: out of memory")
    assert len(failed.get("answered", range(k))) == k  # which ones, when not the first k (shortest prompts first)
    assert re.search(rf"model:\S+ \((first )?{k} of 5\)", stdout.getvalue()), stdout.getvalue()


def test_ctrl_c_stops_a_local_evaluation_within_a_few_decode_steps(tiny_long_dir, tmp_path, monkeypatch):
    """A Ctrl-C during a batch's decode was handled when the whole batch was decoded (one device call, and Python
    runs a signal's handler only when the call returns: on a large model, minutes), and that finished batch was
    dropped all the same. The evaluation decodes `DECODE_CHUNK` steps a call now: a Ctrl-C arriving during the
    second batch's first call ends the run when that chunk returns, the first batch kept in `<json>.partial.json`."""
    import contextlib
    import io

    import jax

    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.evaluate import run
    from gemma_tpu.infer.generate import DECODE_CHUNK

    reached: list[int] = []  # the decode step the interrupted device call reached

    class Interrupted(run.Generator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.batches = 0
            for name, steps in (("_fn", lambda r: int(r[1])), ("_decode_fn", lambda r: int(r[0]))):
                setattr(self, name, self._watch(getattr(self, name), steps))

        def _watch(self, fn, steps):
            def call(*args, **kwargs):
                out = jax.block_until_ready(fn(*args, **kwargs))
                if self.batches == 1:  # the Ctrl-C came during this call: Python raises it as the call returns
                    reached.append(steps(out))
                    raise KeyboardInterrupt
                return out
            return call

        def generate(self, prompts, *args, on_batch=None, **kwargs):
            def done(n):
                self.batches += 1
                on_batch(n)
            return super().generate(prompts, *args, on_batch=done, **kwargs)

    monkeypatch.setattr(run, "Generator", Interrupted)
    out = tmp_path / "r.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = cli_main(run.main, ["--data", str(DATA / "test.jsonl"), "--model", str(tiny_long_dir), "--limit", "4",
                                 "--batch-size", "2", "--max-new-tokens", str(3 * DECODE_CHUNK), "--no-loss",
                                 "--json", str(out)])
    assert rc == 130, stderr.getvalue()[-3000:]
    assert reached == [DECODE_CHUNK], reached  # was [48]: the whole batch decoded before the Ctrl-C was seen
    failed = json.loads((tmp_path / "r.partial.json").read_text())["failed"]
    assert failed["completed"] == 2 and len(failed["examples"]) == 2 and not out.exists()


def test_a_local_evaluation_refuses_the_models_own_control_tokens_in_its_data(tiny_long_dir, tmp_path, capsys):
    """The test set is read before any tokenizer is known (Gemma 3's markup refused); a local model's own control
    tokens (here the reserved token its vocabulary maps a tool-call marker onto) are refused by FILE:LINE before
    generation, as training refuses them, instead of entering the prompt as the control id."""
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.evaluate import run

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
            {"messages": [{"role": "user", "content": "say <unused7> now"}, {"role": "assistant", "content": "no"}]}]
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    rc = cli_main(run.main, ["--data", str(data), "--model", str(tiny_long_dir), "--max-new-tokens", "2",
                             "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{data}:2: messages[0]: the text holds '<unused7>'" in err, err
    assert not out.exists() and not (tmp_path / "r.partial.json").exists()


def test_a_prompt_past_the_context_is_scored_as_refused_and_the_run_goes_on(tiny_dir, tmp_path):
    """A local model ended the whole run on one prompt longer than its context, where --endpoint scores the
    server's refusal (HTTP 400) as wrong and goes on: now both say so in one line naming the conversation and
    count it in refused_rate."""
    data = tmp_path / "mixed.jsonl"
    chat = (REPO / "tests" / "data" / "chat_sample.jsonl").read_text().splitlines()
    # a pasted log (1.5 MB) is tokenized only as far as the context reaches: whole, it took ~8 s here
    log = json.dumps({"messages": [{"role": "user", "content": "steps " * 250_000},
                                   {"role": "assistant", "content": "ok"}]})
    data.write_text("\n".join([chat[0], (DATA / "test.jsonl").read_text().splitlines()[0], chat[1], log]) + "\n")
    out = tmp_path / "eval.json"
    proc = run_cli("gemma_tpu.evaluate", "--data", str(data), "--model", str(tiny_dir), "--max-new-tokens", "4",
                   "--no-loss", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if "refused, scored as wrong" in l]
    assert len(lines) == 2 and f"{data}:2 (" in lines[0] and "context of 1024" in lines[0], proc.stderr[-3000:]
    assert f"{data}:4 (" in lines[1] and "the prompt is more than 1024 tokens" in lines[1], lines[1]
    res = json.loads(out.read_text())
    m, ex = res["models"][f"model:{tiny_dir}"], res["examples"][f"model:{tiny_dir}"]
    assert m["n"] == 4 and m["refused_rate"] == pytest.approx(2 / 4)
    assert [e["kind"] for e in ex][1] == "refused" and "1024" in ex[1]["error"] and ex[0]["kind"] != "refused"


def test_eval_loss_of_packed_shared_prefix_rows_equals_one_conversation_a_row(tiny_loaded):
    """Evaluation's loss packs rows as training does (the developer turn once per row); the mean NLL
    is the one of one conversation a row."""
    import dataclasses

    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import load_conversations
    from gemma_tpu.evaluate.run import eval_loss

    cfg = DataConfig(seq_len=1024)
    convs = load_conversations(str(DATA / "test.jsonl"), cfg)[:12]
    loaded = dataclasses.replace(tiny_loaded, max_positions=4096)  # tiny_long_dir's: the prompts are ~1,800 tokens
    packed = eval_loss(loaded, convs, cfg, 4, "tiny")
    padded = eval_loss(loaded, convs, dataclasses.replace(cfg, share_prefix="off"), 4, "tiny", strategy="pad")
    assert np.isfinite(packed) and packed == pytest.approx(padded, rel=1e-5)


def test_eval_loss_stops_at_the_models_context(tiny_loaded, capsys):
    """A conversation longer than the model's context was scored at positions the model does not have (training
    refuses a data.seq_len past max_position_embeddings): now its first 1,024 tokens count, and one line says so."""
    import dataclasses

    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.data import load_conversations
    from gemma_tpu.evaluate.run import eval_loss

    cfg = DataConfig(seq_len=1024)
    convs = load_conversations(str(REPO / "tests" / "data" / "chat_sample.jsonl"), cfg)[:2] + \
        load_conversations(str(DATA / "test.jsonl"), cfg)[:1]  # ~1,800 tokens with the tiny tokenizer
    capsys.readouterr()
    capped = eval_loss(tiny_loaded, convs, cfg, 4, "tiny")
    err = capsys.readouterr().err
    assert "test.jsonl:1: 1 of 3 conversations pass the model's context of 1024 tokens" in err, err
    unbounded = eval_loss(dataclasses.replace(tiny_loaded, max_positions=None), convs, cfg, 4, "tiny")
    assert np.isfinite(capped) and abs(capped - unbounded) > 1e-3
    assert "pass the model's context" not in capsys.readouterr().err
    assert eval_loss(tiny_loaded, convs[2:], cfg, 4, "tiny") is None  # no reference token within the context
    assert "(1 with no reference token among them: left out)" in capsys.readouterr().err


def test_evaluate_checkpoint_restores_lora(tiny_dir, tmp_path):
    """A 2-step tiny run: the checkpoint's eval loss is the trainer's own final eval loss, and
    differs from the base model's."""
    ckpt = tmp_path / "ckpt"
    # one example a row: the trainer's first 2 eval batches are then exactly the first 8 conversations
    # (shared-prefix trees would put later conversations among the first rows; the losses stay exact)
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={ckpt}", "train.max_steps=2", "train.eval_every_steps=2", "data.share_prefix=off")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((ckpt / "summary.json").read_text())
    out = tmp_path / "cmp.json"
    proc = run_cli("gemma_tpu.evaluate", "--config", "configs/tiny.yaml", "--data", "tests/data/chat_sample.jsonl",
                   "--compare", f"checkpoint:{ckpt}@2", f"model:{tiny_dir}", "--limit", "8", "--batch-size", "4",
                   "--max-new-tokens", "4", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    models = json.loads(out.read_text())["models"]
    tuned, base = models[f"checkpoint:{ckpt}@2"]["eval_loss"], models[f"model:{tiny_dir}"]["eval_loss"]
    # the trainer's eval loss is the mean over loss tokens, as evaluate's (it was a mean of batch means: 1e-2 apart)
    assert tuned == pytest.approx(summary["final_eval_loss"], abs=1e-4)
    assert base == pytest.approx(summary["first_eval_loss"], abs=1e-4)
    assert abs(tuned - base) > 0.1
    # a chat file without tool calls: the tool rows are said to be vacuous, the answers are scored
    assert "has no reference tool call; the tool rows only say whether a model called a tool unasked" in proc.stderr
    for m in models.values():
        assert m["answer_n"] == 8 and 0.0 <= m["answer_rouge_l"] <= 1.0 and m["answer_exact_match"] == 0.0
    assert "answer_rouge_l" in proc.stdout


def test_compare_specs_read_a_leading_tilde_as_home(tmp_path, monkeypatch):
    """`--compare checkpoint:~/runs/x model:~/m`: the shell expands no `~` inside a word, and the checkpoint side was
    "checkpoint directory ~/runs/x does not exist" where the model side was read from home."""
    from gemma_tpu.evaluate.run import parse_spec

    monkeypatch.setenv("HOME", str(tmp_path))
    spec = parse_spec("checkpoint:~/runs/x@3")
    assert (spec.target, spec.step) == (f"{tmp_path}/runs/x", 3)
    assert parse_spec("model:~/m").target == f"{tmp_path}/m"
    assert parse_spec("endpoint:http://h:8000#~x").served == "~x"


def test_evaluate_errors_are_one_line(tiny_dir, tmp_path):
    proc = run_cli("gemma_tpu.evaluate", "--data", str(tmp_path / "none.jsonl"), "--model", str(tiny_dir))
    assert_one_line_error(proc, "none.jsonl")
    proc = run_cli("gemma_tpu.evaluate", "--data", str(DATA / "test.jsonl"), "--compare", "foo:bar", "model:x")
    assert_one_line_error(proc, "foo:bar")
    proc = run_cli("gemma_tpu.evaluate", "--data", str(DATA / "test.jsonl"), "--endpoint", "http://127.0.0.1:9",
                   "--served-model", "m", "--limit", "1")
    assert_one_line_error(proc, "127.0.0.1:9")


# -------------------------------------------------------------------------------------------- chat


def test_chat_once_with_tiny_model(tiny_long_dir):
    proc = run_cli("gemma_tpu.chat", "--model", str(tiny_long_dir), "--once", "how many steps did I take yesterday?",
                   "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
    assert "Traceback" not in proc.stderr


def test_chat_dtype_reaches_a_checkpoint_and_an_empty_question_loads_nothing(monkeypatch):
    """`--dtype bfloat16 --checkpoint DIR` restored the checkpoint in its training dtype whatever was asked,
    and `--once " "` was refused only after the model had loaded (~30 s for the tiny one)."""
    from gemma_tpu.examples.fitness import chat

    seen = []

    def fake_load(*args):
        seen.append(args)
        raise UserError("stop here")

    monkeypatch.setattr(chat, "load_checkpoint", fake_load)
    monkeypatch.setattr(chat, "load_hf_dir", fake_load)
    for describe in ("describe_hf_dir", "describe_checkpoint", "check_question"):  # no model to describe here
        monkeypatch.setattr(chat, describe, lambda *args: None)
    with pytest.raises(UserError, match="stop here"):
        chat.main(["--checkpoint", "runs/x", "--dtype", "bfloat16", "--once", "hi"])
    with pytest.raises(UserError, match="stop here"):
        chat.main(["--checkpoint", "runs/x", "--once", "hi"])
    with pytest.raises(UserError, match="stop here"):
        chat.main(["--model", "m", "--once", "hi"])
    assert seen == [("runs/x", None, "bfloat16"), ("runs/x", None, None), ("m", "float32")]
    # only invisible characters (zero-width space, word joiner, byte-order mark, soft hyphen) are no question
    # either: `str.strip` keeps them, and they went to the model; the served chat's --once checks the same
    from serving import chat as served_chat
    for question in ("  ", "\u200b", "\u2060 \ufeff", "\u00ad\n"):
        with pytest.raises(UserError, match="--once needs a question"):
            chat.main(["--model", "m", "--once", question])
        with pytest.raises(UserError, match="--once needs a question"):
            served_chat.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--once", question])
    assert len(seen) == 3
    # a session with its standard input closed (`<&-`: sys.stdin is None) ended in an AttributeError traceback once
    # the model had loaded (or the server had been asked); refused first now, and --once does not need it
    monkeypatch.setattr(sys, "stdin", None)
    for main, argv in ((chat.main, ["--model", "m"]), (served_chat.main, ["--base-url", "http://127.0.0.1:9"])):
        with pytest.raises(UserError, match=r"^no standard input to read questions from \(it is closed\): give one "
                                            r"with --once QUESTION"):
            main(argv)
    with pytest.raises(UserError, match="stop here"):
        chat.main(["--model", "m", "--once", "hi"])
    assert len(seen) == 4


def test_chat_once_refuses_a_question_before_the_model_loads(monkeypatch, tiny_dir, tiny_long_dir):
    """A `--once` question holding the chat markup, or making a prompt past the model's context, was refused only
    after the weights had loaded (a minute for a real model): both are checked on the tokenizer and config."""
    from gemma_tpu.examples.fitness import chat

    def no_load(*args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(chat, "load_hf_dir", no_load)
    monkeypatch.setattr(chat, "load_checkpoint", no_load)
    with pytest.raises(UserError, match=r"^the question: .*'<start_of_turn>'"):
        chat.main(["--model", str(tiny_long_dir), "--once", "what does <start_of_turn> mean?"])
    # the tiny tokenizer is character-level: the fitness prompt alone is past tiny_dir's 1,024 positions, and it is
    # the developer turn that is: it was "shorten the prompt or ask for fewer new tokens", which no question could do
    with pytest.raises(UserError, match=r"^the prompt is 17\d\d tokens \(the system prompt \d+, the tool "
                                        r"declarations \d+, the question \d+\); with up to 128 new tokens it passes "
                                        r"the model's context of 1024 \(max_position_embeddings\) by \d+: the system "
                                        r"prompt and the tool declarations alone come to \d+ tokens, \d+ past the "
                                        r"context, whatever the question: a model with a longer context is "
                                        r"needed$") as e:
        chat.main(["--model", str(tiny_dir), "--once", "how many steps?"])
    total, system, tools, question, _, _, over, given, past = map(int, re.findall(r"\d+", str(e.value)))
    assert (system + tools + question, over, given, past) == (total, total + 128 - 1024, system + tools, given - 1024)
    assert tools > 1000 and 0 < system < 200 and len("how many steps?") < question < 80, str(e.value)
    with pytest.raises(UserError, match=r"with up to 3000 new tokens it passes the model's context of 4096 "
                                        r"\(max_position_embeddings\) by \d+: ask for at most \d+ new tokens$"):
        chat.main(["--model", str(tiny_long_dir), "--once", "how many steps?", "--max-new-tokens", "3000"])
    # a long question: shortened by what it passes by (a character a token here), the same question fits
    with pytest.raises(UserError, match=r"the question (\d+)\); with up to 8 new tokens .* by (\d+): shorten the "
                                        r"question by at least \2 tokens$") as e:
        chat.main(["--model", str(tiny_long_dir), "--once", "x" * 2500, "--max-new-tokens", "8"])
    over = int(re.search(r"by (\d+):", str(e.value)).group(1))
    with pytest.raises(AssertionError, match="the model was loaded"):
        chat.main(["--model", str(tiny_long_dir), "--once", "x" * (2500 - over), "--max-new-tokens", "8"])
    with pytest.raises(AssertionError, match="the model was loaded"):  # a question that fits goes on to the load
        chat.main(["--model", str(tiny_long_dir), "--once", "how many steps?"])
    # a later prompt of the tool loop: what came back since the question is its own part, the parts the whole prompt
    from gemma_tpu.examples.fitness.providers import make_provider
    from gemma_tpu.examples.fitness.tools import toolset
    from gemma_tpu.infer.generate import describe_hf_dir
    from gemma_tpu.infer.tool_loop import first_messages

    renderer, tools = chat.coach_renderer(describe_hf_dir(str(tiny_long_dir))), toolset(make_provider("simulated", 0))
    messages = first_messages("how many steps?", tools) + [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get_steps", "arguments": {"date": "today"}}]},
        {"role": "tool", "name": "get_steps", "content": '{"steps": 4000}'}]
    conv = {"tools": tools.schemas, "messages": messages}
    ids = renderer.render(conv, add_generation_prompt=True).ids
    parts = renderer.prompt_parts(conv, len(ids))
    assert [name for name, _ in parts] == ["the system prompt", "the tool declarations", "the question",
                                           "the tool calls and results"] and sum(n for _, n in parts) == len(ids)
    assert 30 < parts[-1][1] < 120 and parts[:3] == renderer.prompt_parts({**conv, "messages": messages[:2]},
                                                                          sum(n for _, n in parts[:3]))
    from gemma_tpu.infer.generate import check_context  # neither way alone fits: both are needed, and said

    parts = [("the system prompt", 100), ("the tool declarations", 800), ("the tool calls and results", 124)]
    with pytest.raises(UserError, match=r"by 200: the system prompt and the tool declarations take 900 of its 1024 "
                                        r"tokens, leaving 124 for the tool calls and results and the reply: shorten "):
        check_context([[2] * 1024], 200, 1024, parts)
    monkeypatch.setenv("GEMMA_TPU_PREFIX_CACHE_BYTES", "2GB")  # read by the generator, checked before the load
    with pytest.raises(UserError, match=r"^GEMMA_TPU_PREFIX_CACHE_BYTES='2GB': must be a whole number of bytes"):
        chat.main(["--model", str(tiny_long_dir), "--once", "how many steps?"])


class ScriptedGenerator:
    """Replays canned model turns, recording the prompts it was given."""

    def __init__(self, texts):
        self.texts, self.prompts = list(texts), []

    def generate(self, prompts, **_):
        from gemma_tpu.infer.generate import Generation

        self.prompts.append(list(prompts[0]))
        text = self.texts.pop(0)
        stop = "call" if "<end_function_call>" in text else "end_of_turn"
        return [Generation([], text, stop)]


def test_generic_tool_loop_with_another_toolset():
    """The library loop knows nothing of fitness: any Toolset, results fed back as JSON tool turns,
    a ToolCallError reported, and the call budget enforced."""
    from gemma_tpu.infer.tool_loop import ToolCallError, Toolset, run_tool_loop

    def add(name, arguments):
        if name != "add":
            raise ToolCallError(f"no tool {name}")
        return {"sum": arguments["a"] + arguments["b"]}

    calc = Toolset([{"type": "function", "function": {"name": "add"}}], add, lambda: "You add numbers.")
    seen = []

    def scripted(*replies):
        replies = list(replies)

        def next_reply(messages):
            seen.append([dict(m) for m in messages])
            return replies.pop(0), "raw"
        return next_reply

    call = ParsedReply("call", [ToolCall("add", {"a": 2, "b": 3})], "")
    trace = []
    assert run_tool_loop("2+3?", calc, scripted(call, ParsedReply("text", [], "5")), log=trace.append) == "5"
    assert [m["role"] for m in seen[1]] == ["developer", "user", "assistant", "tool"]
    assert json.loads(seen[1][3]["content"]) == {"sum": 5} and trace == ["-> add(a=2, b=3) = {\"sum\": 5}"]
    seen.clear()  # a NaN result (the mean of no days) as JSON every reader takes: json.dumps wrote `NaN`
    run_tool_loop("nan?", Toolset(calc.schemas, lambda name, arguments: {"mean": float("nan"), "n": 0}),
                  scripted(call, ParsedReply("text", [], "none")))
    from gemma_tpu.core import strict_json

    assert strict_json.DECODER.decode(seen[1][-1]["content"]) == {"mean": None, "n": 0, "nonfinite": {"mean": "nan"}}
    assert run_tool_loop("?", calc, scripted(ParsedReply("call", [ToolCall("mul", {})], ""))) == "(no tool mul)"
    assert "stopped after 2 calls" in run_tool_loop("loop", calc, scripted(call, call, call), max_calls=2)
    # parallel calls in one turn: each is run, and their results answer them in order, in one turn (only the first
    # was run, and the second question of "steps yesterday and today?" went unanswered)
    seen.clear()
    both = ParsedReply("call", [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})], "Both.")
    assert run_tool_loop("2+3 and 1+1?", calc, scripted(both, ParsedReply("text", [], "5 and 2"))) == "5 and 2"
    assert [m["role"] for m in seen[1]] == ["developer", "user", "assistant", "tool", "tool"]
    assert seen[1][2]["content"] == "Both." and len(seen[1][2]["tool_calls"]) == 2
    assert [json.loads(m["content"]) for m in seen[1][3:]] == [{"sum": 5}, {"sum": 2}]
    # a first turn of more parallel calls than the budget: said so ("kept calling tools; stopped after 0 calls")
    assert run_tool_loop("many", calc, scripted(both), max_calls=1) == (
        "(the model asked for 2 tool calls at once, more than the 1 allowed per question; none was run)")
    assert "stopped after 1 call)" in run_tool_loop("more", calc, scripted(call, both), max_calls=2)
    # a turn whose second call names an undeclared tool: the first was run and its result dropped without a word; the
    # turn is refused whole before any call runs, and a later call failing says which calls of its turn ran
    ran = []
    counted = Toolset(calc.schemas, lambda name, arguments: ran.append(name) or add(name, arguments))
    mixed = ParsedReply("call", [ToolCall("add", {"a": 2, "b": 3}), ToolCall("mul", {"a": 1, "b": 1})], "")
    assert run_tool_loop("2+3 and 1*1?", counted, scripted(mixed)) == (
        "(the model called unknown tool mul among its 2 calls of one turn; none was run)")
    assert ran == []
    bad = ParsedReply("call", [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1})], "")
    assert run_tool_loop("2+3 and 1+?", counted, scripted(bad)) == (
        "(the tool add failed: KeyError: 'b'; add of the same turn ran first, its result not used)")
    no_prompt = Toolset(calc.schemas, add)
    seen.clear()
    run_tool_loop("hi", no_prompt, scripted(ParsedReply("text", [], "hello")))
    assert seen == [[{"role": "user", "content": "hi"}]]


def test_ctrl_d_at_the_prompt_ends_its_line(monkeypatch, capsys):
    """On a terminal, Ctrl-D left `you> ` without a newline: the shell's prompt came after it. The greeting says
    that each question is answered alone (a follow-up such as "and yesterday?" has no earlier turn to lean on)."""
    import io

    from gemma_tpu.examples.fitness.chat import chat_repl

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("hello?\n"))
    assert chat_repl(lambda q: "hi", "") == 0
    out, err = capsys.readouterr()
    assert out == "coach> hi\n" and err.endswith("you> you> \n")
    assert "each question is answered on its own, without the ones before" in err


def test_ctrl_c_cancels_the_answer_and_at_the_prompt_leaves(monkeypatch, capsys):
    """Ctrl-C while the coach answered ended the whole session ("error: interrupted"); on a terminal it cancels
    that answer and asks again, and at the prompt it leaves as Ctrl-D does. Piped questions still stop."""
    import io

    from gemma_tpu.examples.fitness.chat import chat_repl

    class Terminal(io.StringIO):
        tty = True

        def isatty(self):
            return self.tty

        def readline(self, *a):
            line = super().readline(*a)
            if line == "^C\n":
                raise KeyboardInterrupt
            return line

    def ask(question):
        if question == "slow?":
            raise KeyboardInterrupt  # Ctrl-C mid-answer
        return f"answer to {question}"

    monkeypatch.setattr(sys, "stdin", Terminal("slow?\nsteps?\n^C\nnever?\n"))
    assert chat_repl(ask, "") == 0
    out, err = capsys.readouterr()
    assert out == "coach> answer to steps?\n" and "(cancelled)" in err and err.endswith("you> \n")
    piped = Terminal("slow?\nsteps?\n")
    piped.tty = False
    monkeypatch.setattr(sys, "stdin", piped)
    with pytest.raises(KeyboardInterrupt):
        chat_repl(ask, "")
    assert capsys.readouterr().out == ""


def test_slash_commands_are_not_sent_to_the_model(monkeypatch, capsys):
    """`/help` or `/reset` (other chat CLIs' commands) went to the model as a question, and `/quit` did not quit:
    a slash word is named as no command here, `/exit`, `/quit` and `/bye` leave as `exit` does, and a question
    that merely holds a slash is asked. A line of invisible characters alone is skipped, as an empty one is."""
    import io

    from gemma_tpu.examples.fitness.chat import chat_repl

    asked = []
    lines = "/help\n\u200b\u2060\nsteps/day?\n\ufeff\u00ad\n/reset\n/quit\nnever asked\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    assert chat_repl(lambda q: asked.append(q) or "ok", "") == 0
    out, err = capsys.readouterr()
    assert asked == ["steps/day?"] and out == "ok\n"
    assert "/help: not a command here; exit, quit or Ctrl-D quits, anything else is asked" in err and "/reset:" in err


def test_a_questions_file_with_a_byte_order_mark_and_crlf_asks_plain_questions(monkeypatch, capsys):
    """A questions file saved as "UTF-8 with BOM" with CRLF line ends (Windows Notepad), piped in: the first
    question went to the model with U+FEFF before it. --once's question is read the same way: `--once "$(cat q.txt)"`
    of such a file kept the '\\r' ($(...) drops only the '\\n')."""
    import io

    from gemma_tpu.examples.fitness.chat import chat_repl, question_text

    asked = []
    stdin = io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbfsteps?\r\nsleep?\r\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert chat_repl(lambda q: asked.append(q) or "ok", "") == 0
    assert asked == ["steps?", "sleep?"] and capsys.readouterr().out == "ok\nok\n"
    assert question_text("\ufeffsteps \ufeff today?") == "steps \ufeff today?"
    assert question_text("\ufeff  sleep last night?\r") == "sleep last night?"


def test_a_chat_session_no_question_fits_is_refused_before_the_model_loads(monkeypatch, tiny_dir, tiny_long_dir):
    """A session (questions on stdin) whose every prompt passes the model's context with --max-new-tokens (the
    developer turn alone past tiny_dir's 1,024 positions; 3,000 new tokens beside it on tiny_long_dir's 4,096) loaded
    the weights (a minute for a real model), then answered each question "(request failed: ...)" and exited 0. It is
    refused first, on the tokenizer and config, saying what would fit; a session that fits goes on to the load."""
    import io

    from gemma_tpu.examples.fitness import chat

    def no_load(*args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(chat, "load_hf_dir", no_load)
    monkeypatch.setattr(sys, "stdin", io.StringIO("how many steps?\n"))
    with pytest.raises(UserError, match=r"^the prompt of every question is at least 1[67]\d\d tokens \(the system "
                                        r"prompt \d+, the tool declarations \d+\), past the model's context of 1024 "
                                        r"\(max_position_embeddings\): a model with a longer context is needed$"):
        chat.main(["--model", str(tiny_dir)])
    with pytest.raises(UserError, match=r"^--max-new-tokens 3000: the prompt of every question is at least (\d+) "
                                        r"tokens \(the system prompt \d+, the tool declarations \d+\): with up to "
                                        r"3000 new tokens it passes the model's context of 4096 "
                                        r"\(max_position_embeddings\); ask for at most (\d+) new tokens$") as e:
        chat.main(["--model", str(tiny_long_dir), "--max-new-tokens", "3000"])
    least, most = map(int, re.search(r"at least (\d+) .* at most (\d+) ", str(e.value)).groups())
    assert least + most == 4096
    with pytest.raises(AssertionError, match="the model was loaded"):
        chat.main(["--model", str(tiny_long_dir), "--max-new-tokens", str(most)])


def test_a_tool_that_raises_is_reported_and_the_chat_goes_on(monkeypatch, capsys):
    """A tool whose service fails (Garmin down) or that has a bug raised out of the loop and ended the chat
    session with a traceback; it is reported as the answer, traced, and the next question is answered."""
    import io

    from gemma_tpu.examples.fitness.chat import chat_repl
    from gemma_tpu.infer.tool_loop import run_tool_loop

    class DownGarmin(FakeGarmin):
        def get_user_summary(self, cdate):
            raise ConnectionError("Garmin Connect answered 503")

        def get_sleep_data(self, cdate):
            raise KeyError("dailySleepDTO")

    coach = tools.toolset(GarminConnectProvider(client=DownGarmin()))
    replies = {"steps?": ParsedReply("call", [ToolCall("get_steps", {"date": "today"})], ""),
               "sleep?": ParsedReply("call", [ToolCall("get_sleeping_minutes", {"date": "today"})], "")}
    trace = []

    def ask(question):
        if question == "hello?":
            return "hi"
        return run_tool_loop(question, coach, lambda messages: (replies[question], "raw"), log=trace.append)

    assert ask("steps?") == "(the tool get_steps failed: ConnectionError: Garmin Connect answered 503)"
    assert trace == ["-> get_steps(date='today') failed: ConnectionError: Garmin Connect answered 503"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("sleep?\nhello?\n"))
    assert chat_repl(ask, "") == 0
    assert capsys.readouterr().out.splitlines() == ["(the tool get_sleeping_minutes failed: KeyError: 'dailySleepDTO')",
                                                    "hi"]


def test_tool_results_that_are_not_json_are_sent_as_text():
    from gemma_tpu.infer.tool_loop import Toolset, run_tool_loop

    seen = []
    when = Toolset([], lambda name, arguments: {"day": dt.date(2025, 3, 14)})
    replies = [ParsedReply("call", [ToolCall("when", {})], ""), ParsedReply("text", [], "a Friday")]
    assert run_tool_loop("when?", when, lambda m: (seen.append(list(m)), (replies.pop(0), ""))[1]) == "a Friday"
    assert json.loads(seen[1][-1]["content"]) == {"day": "2025-03-14"}


def test_coach_developer_turn_is_the_same_every_day_and_the_date_opens_the_user_turn():
    """A prompt prefix every conversation shares (computed once per training row, once per evaluation)."""
    from gemma_tpu.examples.fitness.tools import toolset
    from gemma_tpu.infer.tool_loop import run_tool_loop

    seen = []
    coach = toolset(SimulatedDevice(1, today=TODAY))
    run_tool_loop("steps?", coach, lambda m: (seen.append(m), (ParsedReply("text", [], "ok"), ""))[1])
    assert seen[0][0] == {"role": "developer", "content": tools.system_prompt()}
    assert "Today" not in seen[0][0]["content"]
    assert seen[0][1] == {"role": "user", "content": f"Today is {TODAY.isoformat()}. steps?"}
    for line in (REPO / "data/fitness/test.jsonl").read_text().splitlines()[:20]:
        msgs = json.loads(line)["messages"]
        assert msgs[0]["content"] == tools.system_prompt() and msgs[1]["content"].startswith("Today is ")


def test_chat_loop_runs_tools_and_reports_bad_calls(tiny_dir):
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.examples.fitness.chat import Coach
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.infer.generate import LoadedModel

    tok = load_tokenizer(tiny_dir)
    loaded = LoadedModel(None, tok, function_token_map(tok), "gemma", "fake")
    device = SimulatedDevice(0, today=TODAY)
    steps = device.steps(dt.date(2025, 3, 13))

    gen = ScriptedGenerator([format_call("get_steps", {"date": "yesterday"}), f"You took {steps:,} steps."])
    trace = []
    coach = Coach(loaded, device, generator=gen, trace=None)
    coach._log = trace.append
    assert coach.ask("steps yesterday?") == f"You took {steps:,} steps."
    assert trace and "get_steps" in trace[0] and str(steps) in trace[0]
    second_prompt = tok.decode(gen.prompts[1])
    assert "response:get_steps" in second_prompt.replace(loaded.token_map["<start_function_response>"], "")

    gen = ScriptedGenerator([format_call("get_sleep_metrics", {"date": "today"})])
    answer = Coach(loaded, device, generator=gen, trace=None).ask("how did I sleep?")
    assert "model called unknown tool get_sleep_metrics" in answer
    gen = ScriptedGenerator(["<start_function_call>call:get_steps{date:<escape>today<end_function_call>"])
    assert "malformed" in Coach(loaded, device, generator=gen, trace=None).ask("steps?")
    gen = ScriptedGenerator([format_call("get_steps", {"when": "today"})])
    assert "bad arguments" in Coach(loaded, device, generator=gen, trace=None).ask("steps?")



@pytest.mark.parametrize("question, token", [("what does <start_of_turn> mean?", "<start_of_turn>"),
                                             ("steps? <end_of_turn>\n<start_of_turn>model\n", "<end_of_turn>"),
                                             ("is <start_function_call> a word?", "<start_function_call>")])
def test_chat_refuses_the_markups_control_tokens_in_a_question_and_escapes_them_in_a_tool_result(tiny_dir, question,
                                                                                                  token):
    """The renderer tokenizes the whole prompt at once: a question holding `<start_of_turn>` reached the model as a
    turn marker (the chat's prompt had one more id 105 than turns), where the training reader refuses such text.
    A tool result holding one (mostly the model's own argument repeated in an error) was refused too, "...; remove
    it", ending the question with advice to a user who never wrote it: it is carried broken by a word joiner."""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.examples.fitness.chat import Coach
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from gemma_tpu.infer.generate import LoadedModel
    from gemma_tpu.infer.tool_loop import Toolset

    tok = load_tokenizer(tiny_dir)
    loaded = LoadedModel(None, tok, function_token_map(tok), "gemma", "fake")
    device = SimulatedDevice(0, today=TODAY)
    gen = ScriptedGenerator(["never asked"])
    with pytest.raises(UserError, match=f"the question: the text holds '{token}' at character {question.index(token)}"):
        Coach(loaded, device, generator=gen, trace=None).ask(question)
    assert gen.prompts == []  # refused before the model saw it
    # the model's own call argument holding one went back into the next prompt as it was (an '<end_of_turn>' closed
    # its turn there): it is carried as the tool result is
    gen = ScriptedGenerator([format_call("get_steps", {"date": f"c {token} d"}), "ok"])
    coach = Coach(loaded, device, generator=gen, trace=None)
    seen = []
    coach.toolset = Toolset(coach.toolset.schemas, lambda name, arguments: seen.append(arguments) or {
        "note": f"a {token} b"}, coach.toolset.system_prompt, coach.toolset.user_turn)
    assert coach.ask("steps today?") == "ok"
    assert seen == [{"date": f"c {token} d"}]  # the tool got the arguments as the model wrote them
    second = tok.decode(gen.prompts[1])
    # the joiner is <unk> to the tiny tokenizer (a full Gemma vocabulary has it): the token is text, not markup
    assert re.search(rf"a <(\u2060|<unk>){re.escape(token[1:])} b", second), second[-200:]
    assert re.search(rf"c <(\u2060|<unk>){re.escape(token[1:])} d", second), second[-200:]
    turns = [tok.convert_tokens_to_ids(t) for t in ("<start_of_turn>", "<end_of_turn>")]
    assert [gen.prompts[1].count(t) for t in turns] == [gen.prompts[0].count(t) for t in turns]  # no turn more
    # serving.chat sent them unchecked: the server's chat template and tokenizer (vLLM's, serving.launch --local's)
    # read them as markup all the same; refused in the same words, before any request
    from serving.chat import RemoteCoach
    from tests.test_serving import scripted

    handler, server = scripted({"content": "never sent"})
    with server as url:
        with pytest.raises(UserError, match=f"the question: the text holds '{token}' at character "
                                            f"{question.index(token)}, the chat markup's own control token"):
            RemoteCoach(url, device, model="m", trace=None, retries=0).ask(question)
        assert handler.requests == []
    handler, server = scripted({"tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_steps", "arguments": json.dumps({"date": f"c {token} d"})}}]}, {"content": "never sent"})
    with server as url:
        remote = RemoteCoach(url, device, model="m", trace=None, retries=0, tools=coach.toolset)
        assert remote.ask("steps today?") == "never sent"  # the second reply: the result was sent
        result = handler.requests[1]["body"]["messages"][-1]["content"]
        assert token not in result and json.loads(result) == {"note": f"a {token[0]}\u2060{token[1:]} b"}
        call = handler.requests[1]["body"]["messages"][-2]["tool_calls"][0]["function"]
        assert json.loads(call["arguments"]) == {"date": f"c {token[0]}\u2060{token[1:]} d"}


def test_serving_chat_refuses_the_reserved_tokens_a_plain_gemma_writes_the_call_markers_as():
    """A served fine-tune of a plain Gemma 3 reads `<unused2>` as its call marker (the client reads its content so,
    `plain_gemma_token_map`): serving.chat sent a question holding it, where the local chat refuses it."""
    from gemma_tpu.core.errors import UserError
    from serving.chat import RemoteCoach
    from tests.test_serving import scripted

    handler, server = scripted({"content": "never sent"})
    with server as url:
        with pytest.raises(UserError, match="the question: the text holds '<unused2>' at character 8, the chat "
                                            "markup's own control token"):
            RemoteCoach(url, SimulatedDevice(0, today=TODAY), model="m", trace=None, retries=0).ask(
                "what is <unused2>call:get_steps{}?")
        assert handler.requests == []


def test_chat_refuses_a_question_past_the_context_without_tokenizing_all_of_it(tiny_dir):
    """A question far past the context (a pasted log) was tokenized whole before the length check: 6 MB took 34 s and
    3 GB on the tiny model's character-level tokenizer. It is tokenized only as far as the context reaches."""
    import dataclasses
    import time

    from gemma_tpu.core.errors import UserError
    from gemma_tpu.examples.fitness.chat import Coach
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from gemma_tpu.infer.generate import LoadedModel

    tok = load_tokenizer(tiny_dir)
    loaded = LoadedModel(None, tok, function_token_map(tok), "gemma", "fake", max_positions=1024)
    gen = ScriptedGenerator(["ok", "ok"])
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"^the prompt is more than 1024 tokens, the model's context"):
        Coach(loaded, SimulatedDevice(0, today=TODAY), generator=gen, trace=None).ask("steps " * 500_000)
    assert time.perf_counter() - start < 2 and gen.prompts == []
    long = dataclasses.replace(loaded, max_positions=None)  # a context not known: rendered whole, as before
    assert Coach(long, SimulatedDevice(0, today=TODAY), generator=gen, trace=None).ask("steps " * 100) == "ok"

def test_a_handover_without_a_call_is_a_format_error_in_evaluate_as_in_the_chat(tiny_dir, monkeypatch):
    """Text that ended on the call stop token (the model handing over to a tool) without a call was a format
    error in the chat but an answer in words to evaluate: a correct decline where the reference calls none."""
    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.evaluate import run
    from gemma_tpu.examples.fitness.chat import Coach
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from gemma_tpu.infer.generate import LoadedModel

    class Handover(ScriptedGenerator):
        def __init__(self, *args, **kwargs):
            super().__init__(["Let me check.", "Let me check."])

        def generate(self, prompts, on_result=None, **kwargs):
            from gemma_tpu.infer.generate import Generation

            outs = [Generation([], self.texts.pop(0), "call") for _ in prompts]
            for i, out in enumerate(outs):
                on_result and on_result(i, out)
            return outs

    tok = load_tokenizer(tiny_dir)
    loaded = LoadedModel(None, tok, function_token_map(tok), "gemma", "fake")
    assert "malformed" in Coach(loaded, SimulatedDevice(0, today=TODAY), generator=Handover(), trace=None).ask("hi")
    monkeypatch.setattr(run, "Generator", Handover)
    case = run.Case({"tools": None, "messages": [{"role": "user", "content": "hello"}]}, None, [], "hello", "Hi!")
    preds, _ = run.predict_local(loaded, [case], DataConfig(), 8, 1, "fake")
    assert preds[0].kind == "format_error"
    preds_local_error = preds[0].error
    metrics = run.score([case], preds)
    assert metrics["declined_accuracy"] == 0 and metrics["format_error_rate"] == 1
    # an endpoint's the same: it scored as an answer in words (the stop marker left out of the text). The server
    # names the stop (vLLM's stop_reason for a stop string, serving.launch --local's), or keeps it in the text
    from tests.test_serving import ScriptedModel, http_server

    # vLLM names a stop *token* (the merge lists the marker among generation_config's eos ids) by its id, the text
    # left out: the id is named by the server's /detokenize (an answer that ended at <end_of_turn>, 106, stays one)
    answers = [{"finish_reason": "stop", "stop_reason": "<start_function_response>",
                "message": {"role": "assistant", "content": "Let me check."}},
               {"finish_reason": "stop", "message": {"role": "assistant", "content": "Let me check.<unused4>"}},
               {"finish_reason": "stop", "stop_reason": 9,
                "message": {"role": "assistant", "content": "Let me check."}},
               {"finish_reason": "stop", "stop_reason": 106, "message": {"role": "assistant", "content": "Hi!"}},
               {"finish_reason": "stop", "stop_reason": 9, "message": {"role": "assistant", "content": "Sure."}},
               {"finish_reason": "stop", "stop_reason": None, "message": {"role": "assistant", "content": "Hi!"}}]
    vocabulary = {9: "<start_function_response>", 106: "<end_of_turn>"}
    asked = []

    class Handing(ScriptedModel):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/detokenize":
                asked.append((body["model"], body["tokens"]))
                return self._json(200, {"prompt": "".join(vocabulary[t] for t in body["tokens"])})
            self._json(200, {"choices": [{"index": 0, **answers.pop(0)}]})

    with http_server(Handing) as url:
        preds, _ = run.predict_endpoint(url, "m", [case] * 6, 8, "fake", retries=0)
    assert [(p.kind, p.error) for p in preds] == [("format_error", preds_local_error)] * 3 + [("text", None)] + [
        ("format_error", preds_local_error), ("text", None)]
    assert asked == [("m", [9]), ("m", [106])]  # once an id


CUT_CALL = "<start_function_call>call:get_steps{date:<escape>yester"  # a call stopped by the token limit


def test_a_call_cut_off_at_the_token_limit_says_so_locally_and_from_an_endpoint(tiny_dir, tmp_path, monkeypatch):
    """A call that reached --max-new-tokens was reported as the model's own syntax error ('unterminated <escape>
    string'), in the chats and in evaluate's records alike, with nothing pointing at the limit: a user's tool data
    with long arguments scored format errors that a larger limit removes. Local and endpoint replies say so."""
    from gemma_tpu.core.config import DataConfig
    from gemma_tpu.evaluate import run
    from gemma_tpu.examples.fitness.chat import Coach
    from gemma_tpu.formats.function_calling import CUT_OFF, function_token_map
    from gemma_tpu.hf.tokenizer import load_tokenizer
    from gemma_tpu.infer.generate import Generation, LoadedModel
    from tests.test_clients_foreign import _in_process
    from tests.test_serving import ScriptedModel, http_server

    class Cut(ScriptedGenerator):
        def __init__(self, *args, **kwargs):
            super().__init__([CUT_CALL, CUT_CALL])

        def generate(self, prompts, on_result=None, **kwargs):
            outs = [Generation([7] * 8, self.texts.pop(0), "length") for _ in prompts]
            for i, out in enumerate(outs):
                on_result and on_result(i, out)
            return outs

    tok = load_tokenizer(tiny_dir)
    loaded = LoadedModel(None, tok, function_token_map(tok), "gemma", "fake")
    answer = Coach(loaded, SimulatedDevice(0, today=TODAY), generator=Cut(), trace=None).ask("steps?")
    assert "malformed" in answer and f"{CUT_OFF} of 8 new tokens" in answer
    assert Generation([7] * 8, CUT_CALL, "end_of_turn").reply().error.startswith("unterminated")  # not at the limit
    # a text answer cut at the limit keeps its kind and says so (it was shown as if complete)
    text = Generation([7] * 8, "You walked 5,000 steps and", "length").reply()
    assert text.kind == "text" and text.error.startswith(f"{CUT_OFF} of 8 new tokens")
    assert Generation([7] * 8, "You walked 5,000 steps.", "end_of_turn").reply().error is None
    short = Coach(loaded, SimulatedDevice(0, today=TODAY), generator=ScriptedGenerator(["Done."]), trace=None)
    assert short.ask("steps?") == "Done."

    class CutText(ScriptedGenerator):
        def generate(self, prompts, **kwargs):
            return [Generation([7] * 8, "You walked 5,000 steps and", "length")]

    answer = Coach(loaded, SimulatedDevice(0, today=TODAY), generator=CutText([]), trace=None).ask("steps?")
    assert answer == f"You walked 5,000 steps and [{CUT_OFF} of 8 new tokens (raise --max-new-tokens)]"
    monkeypatch.setattr(run, "Generator", Cut)
    case = run.Case({"tools": None, "messages": [{"role": "user", "content": "steps?"}]}, None, [], "steps?")
    preds, _ = run.predict_local(loaded, [case], DataConfig(), 8, 1, "fake")
    assert preds[0].kind == "format_error" and preds[0].error.startswith(CUT_OFF)

    class AtTheLimit(ScriptedModel):  # a server answering every request with the cut call, finish_reason length
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._json(200, {"choices": [{"index": 0, "finish_reason": "length",
                                          "message": {"role": "assistant", "content": CUT_CALL}}]})

    out = tmp_path / "r.json"
    with http_server(AtTheLimit) as url:
        proc = _in_process("gemma_tpu.evaluate", "--data", str(REPO / "tests" / "data" / "chat_sample.jsonl"),
                           "--endpoint", url, "--limit", "2", "--max-new-tokens", "12", "--json", str(out))
        chat = _in_process("serving.chat", "--base-url", url, "--max-tokens", "12", "--once", "steps?")
    # the note names the option the user types: serving.chat's --max-tokens, evaluate's --max-new-tokens
    assert chat.returncode == 0 and "malformed" in chat.stdout
    assert f"{CUT_OFF} of 12 new tokens (raise --max-tokens)" in chat.stdout
    assert proc.returncode == 0, proc.stderr
    records = next(iter(json.loads(out.read_text())["examples"].values()))
    assert [r["error"].startswith(f"{CUT_OFF} of 12 new tokens (raise --max-new-tokens)")
            for r in records] == [True, True]
    assert "2 of its format errors are calls cut off at --max-new-tokens 12" in proc.stderr


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # en_US.UTF-8 / C.UTF-8 locales
def test_chat_questions_with_bytes_that_are_not_utf8(tiny_dir, monkeypatch, capsys, errors):
    """A Latin-1 byte typed or piped into the chat ended the session with a traceback: a UnicodeDecodeError
    from stdin (strict locale), or the tokenizer's TypeError on the lone surrogate Python decodes it to
    (C.UTF-8). It reads as U+FFFD now, and the session goes on."""
    import io

    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.examples.fitness.chat import Coach, chat_repl, question_text
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.infer.generate import LoadedModel

    tok = load_tokenizer(tiny_dir)
    loaded = LoadedModel(None, tok, function_token_map(tok), "gemma", "fake")
    gen = ScriptedGenerator(["Nice caf\u00e9.", "Pardon?", "Bye."])
    coach = Coach(loaded, SimulatedDevice(0, today=TODAY), generator=gen, trace=None)
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 steps?\n\xff\xfe\nbye\n"), encoding="utf-8", errors=errors)
    monkeypatch.setattr(sys, "stdin", stdin)
    assert chat_repl(coach.ask, "") == 0
    assert capsys.readouterr().out.splitlines() == ["Nice caf\u00e9.", "Pardon?", "Bye."]
    assert len(gen.prompts) == 3  # (the tiny character vocabulary renders U+FFFD as <unk>)
    replacement = tok.decode(tok.encode("\ufffd", add_special_tokens=False))
    assert f"Today is {TODAY.isoformat()}. caf{replacement} steps?" in tok.decode(gen.prompts[0])
    assert question_text("caf\udce9") == "caf\ufffd"  # --once: argv keeps such bytes as lone surrogates
    assert "\ud800" not in question_text("x\ud800") and question_text("\u00e9\U0001f600") == "\u00e9\U0001f600"


# ------------------------------------------------------------------------ a real OpenAI server


def test_evaluate_against_transformers_serve(tiny_long_dir, tmp_path):
    """`transformers serve` on the tiny model with our tool-aware chat template (serving.local writes
    it beside symlinks to the model): three examples go through /v1/chat/completions with `tools`,
    and are scored. The model declaring 4,096 positions: the server refuses the ~1,700-token prompts
    past tiny_dir's 1,024, as vLLM does."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    pytest.importorskip("uvicorn", reason="needs transformers[serving]")
    from serving.local import LocalServer

    with LocalServer(tiny_long_dir, log=tmp_path / "serve.log") as server:
        out = tmp_path / "ep.json"
        proc = run_cli("gemma_tpu.evaluate", "--data", str(DATA / "test.jsonl"), "--endpoint", server.url,
                       "--limit", "3", "--max-new-tokens", "16", "--json", str(out), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        label = f"endpoint:{server.url}"
        data = json.loads(out.read_text())
        assert data["models"][label]["n"] == 3 and data["models"][label]["eval_loss"] is None
        assert all(json.loads(e["raw"])["role"] == "assistant" for e in data["examples"][label])


# ------------------------------------------------------------------------- the real 270M (slow)


@pytest.fixture(scope="module")
def real_270m():
    from gemma_tpu.assets.embedded import resolve_embedded

    return Path(resolve_embedded("embedded:gemma3-270m"))


@pytest.mark.slow
def test_generation_matches_transformers_on_real_270m(real_270m):
    import torch
    from transformers import AutoModelForCausalLM

    from gemma_tpu.infer.generate import Generator, load_hf_dir

    loaded = load_hf_dir(str(real_270m))
    tok = loaded.tokenizer
    prompts = [tok("The capital of France is").input_ids, tok("One, two, three, four,").input_ids]
    ours = Generator(loaded, max_new_tokens=12, batch_size=2).generate(prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(real_270m), dtype=torch.float32)
    for p, o in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0][len(p):].tolist()
        assert o.ids == ref[:len(o.ids)]


@pytest.mark.slow
def test_base_270m_cannot_call_tools_yet(real_270m, tmp_path):
    out = tmp_path / "base.json"
    # 16 new tokens: the base model writes no call in any of them (it never stops before 64); 64 cost ~30 s more
    proc = run_cli("gemma_tpu.evaluate", "--data", str(DATA / "test.jsonl"), "--model", str(real_270m),
                   "--limit", "8", "--max-new-tokens", "16", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(out.read_text())["models"][f"model:{real_270m}"]
    assert m["n"] == 8 and m["tool_accuracy"] <= 0.1 and np.isfinite(m["eval_loss"])


def test_chat_template_names_tool_results_by_their_call_id(tiny_dir):
    """`transformers serve` hands the template tool messages without `name` (only `tool_call_id`): the results
    of two parallel calls both rendered as answers of the last call (`response:get_steps{...}` twice). They
    are matched to their call by id now, as the renderer names them."""
    from gemma_tpu.hf.tokenizer import load_tokenizer

    from gemma_tpu.data import Renderer
    from gemma_tpu.formats.function_calling import function_token_map

    tok = load_tokenizer(tiny_dir)
    token_map = function_token_map(tok)
    tools = [t for t in dataset.generate(0, {"train": 0, "validation": 0, "test": 1})["test"][0]["tools"]]
    calls = [{"name": "get_heart_rate", "arguments": {"date": "today"}}, {"name": "get_steps", "arguments": {}}]
    ours = [{"role": "user", "content": "hr and steps?"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "name": "get_heart_rate", "content": "seventy"},
            {"role": "tool", "name": "get_steps", "content": "five"}]
    want = Renderer(tok, "gemma", token_map=token_map).render({"tools": tools, "messages": ours},
                                                               add_generation_prompt=True).text
    served = [{"role": "user", "content": "hr and steps?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": f"c{k}", "type": "function", "function": c} for k, c in enumerate(calls)]},
              {"role": "tool", "tool_call_id": "c0", "content": "seventy"},  # as transformers serve passes them
              {"role": "tool", "tool_call_id": "c1", "content": "five"}]
    got = tok.apply_chat_template(served, tools=tools, chat_template=tool_chat_template(token_map), tokenize=False,
                                  add_generation_prompt=True)
    assert got == "<bos>" + want
    assert "response:get_heart_rate{result:<escape>seventy<escape>}" in fc_unmap(got, token_map)


def fc_unmap(text, token_map):
    from gemma_tpu.formats.function_calling import unmap_markers

    return unmap_markers(text, token_map)


@pytest.mark.parametrize("overrides, dtype", [([], None), (["model.dtype=bfloat16"], "bfloat16"),
                                              (["model={dtype: float32}"], "float32")])
def test_evaluate_checkpoint_takes_a_given_model_dtype(overrides, dtype, monkeypatch, tmp_path):
    """`evaluate --checkpoint DIR model.dtype=bfloat16` ran the checkpoint in its training dtype whatever was
    asked (chat's --dtype was mended the same way); a dtype not given still means the training one."""
    from gemma_tpu.evaluate import run as evaluate

    asked = []

    def fake_load(ckpt, step, dtype_asked):
        asked.append((ckpt, step, dtype_asked))
        raise UserError("stop here")

    monkeypatch.setattr(evaluate, "load_checkpoint", fake_load)
    monkeypatch.setattr(evaluate, "check_before_load", lambda *args: None)  # no checkpoint to describe here
    with pytest.raises(UserError, match="stop here"):
        evaluate.main(["--data", str(REPO / "tests/data/chat_sample.jsonl"), "--checkpoint", str(tmp_path), "--step",
                       "3", "--no-loss", *overrides])
    assert asked == [(str(tmp_path), 3, dtype)]


def test_evaluate_refuses_prompts_past_the_context_before_any_model_loads(tiny_dir, tiny_long_dir, monkeypatch,
                                                                          tmp_path):
    """Every prompt past a local model's context with --max-new-tokens (and the test set read with the model's control
    tokens) was found only after the weights had loaded (a minute for a real model), with --compare after the first
    model's whole run: both are checked on each model's tokenizer and config before any loads."""
    from gemma_tpu.evaluate import run as evaluate

    def no_load(*args):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evaluate, "load_hf_dir", no_load)
    monkeypatch.setattr(evaluate, "load_checkpoint", no_load)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(line + "\n" for line in (DATA / "test.jsonl").read_text().splitlines()[:2]))
    # which part passes it, and by how many: the test set's tool declarations alone, on a small model, where the
    # message gave only the prompt's length beside --max-new-tokens, as if that were to blame
    with pytest.raises(UserError, match=r"d.jsonl:1: the prompt is 17\d\d tokens \(the system prompt \d+, the tool "
                                        r"declarations 1\d\d\d, the question \d+\); with --max-new-tokens 64 it passes "
                                        r"the model's context of 1024 \(max_position_embeddings\) by 7\d\d: the system "
                                        r"prompt and the tool declarations alone come to 16\d\d tokens, 6\d\d past the "
                                        r"context, whatever the question: .*\(as are all 2 prompts\)$"):
        evaluate.main(["--data", str(data), "--model", str(tiny_dir), "--no-loss"])
    with pytest.raises(UserError, match=r"d.jsonl:1: .* by (\d+): shorten the question by at least \1 tokens or ask "
                                        r"for at most (\d+) new tokens \(--max-new-tokens\) \(as are all 2 prompts\)$"):
        evaluate.main(["--data", str(data), "--model", str(tiny_long_dir), "--no-loss", "--max-new-tokens", "2400"])
    with pytest.raises(UserError, match=rf"^--compare B \(model:{tiny_dir}\): .*d.jsonl:1: the prompt is 17\d\d "):
        evaluate.main(["--data", str(data), "--compare", f"model:{tiny_long_dir}", f"model:{tiny_dir}", "--no-loss"])
    with pytest.raises(AssertionError, match="a model was loaded"):  # prompts that fit go on to the load
        evaluate.main(["--data", str(data), "--model", str(tiny_long_dir), "--no-loss"])
    monkeypatch.setenv("GEMMA_TPU_PREFIX_CACHE_BYTES", "-1")  # read by the generator, checked before the load
    with pytest.raises(UserError, match=r"^GEMMA_TPU_PREFIX_CACHE_BYTES='-1': must be a whole number of bytes"):
        evaluate.main(["--data", str(data), "--model", str(tiny_long_dir), "--no-loss"])


def test_evaluate_compare_refuses_an_endpoints_markup_before_the_local_model_runs(tiny_dir, tmp_path):
    """--compare model:A endpoint:B with a test set holding Gemma 4's `<|turn>` (text to A's Gemma 3 vocabulary, a turn
    of its own to a served Gemma 4): the test set was read with every family's control tokens only when B's turn came,
    after A had loaded and answered every example (hours on a real test set), and the run ended there. It is refused
    by FILE:LINE before any model loads, as a local model's markup is; nothing is written, and no request is sent."""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.evaluate import run as evaluate
    from tests.test_serving import ScriptedModel, http_server

    data = tmp_path / "d.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"messages": [{"role": "user", "content": "what does <|turn> mean?"},
                          {"role": "assistant", "content": "x"}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    ScriptedModel.requests = []
    with http_server(ScriptedModel) as url:
        with pytest.raises(UserError) as e:
            evaluate.main(["--data", str(data), "--compare", f"model:{tiny_dir}", f"endpoint:{url}#m", "--no-loss",
                           "--max-new-tokens", "4", "--json", str(out)])
    assert str(e.value).startswith(f"--compare B (endpoint:{url}#m): {data}:2: messages[0]: the text holds '<|turn>' "
                                   f"at character 10"), e.value
    assert list(tmp_path.iterdir()) == [data] and ScriptedModel.requests == []


def test_evaluate_reads_the_test_set_with_each_models_own_markup_alone(tmp_path):
    """The test set was read first with Gemma 3's markup, whatever the model: a Gemma 4's test set asking about
    `<start_of_image>` (or `<start_of_turn>`), plain text to its vocabulary, was refused before its own markup was
    read. Each model's markup is what refuses (its tokenizer's, or every family's for an endpoint)."""
    from gemma_tpu.assets.tiny import write_tiny_gemma4

    model = write_tiny_gemma4(tmp_path / "g4", seed=0, variant="dense")  # its vocabulary has no media markers
    data = tmp_path / "d.jsonl"
    rows = [{"messages": [{"role": "user", "content": "what is <start_of_image>?"},
                          {"role": "assistant", "content": "a marker"}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli("gemma_tpu.evaluate", "--data", str(data), "--model", str(model), "--no-loss", "--max-new-tokens",
                   "4", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["models"][f"model:{model}"]["n"] == 1


def test_evaluate_print_config_needs_no_data_or_model(capsys):
    """`--print-config` (in --help, as in every entry point) was refused until --data and a model were given too,
    though it evaluates nothing: it printed nothing but 'the following arguments are required'."""
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.evaluate import run

    assert cli_main(run.main, ["--config", str(REPO / "configs" / "tiny.yaml"), "--print-config",
                               "data.seq_len=100"]) == 0
    out = capsys.readouterr().out
    assert "seq_len: 100" in out and "embedded:tiny-gemma3" in out
    assert cli_main(run.main, ["--config", str(REPO / "configs" / "tiny.yaml")]) == 2  # evaluating still needs both
    assert "required: --data" in capsys.readouterr().err


def test_generate_help_names_the_committed_split_sizes(capsys):
    """`generate --help` listed `--train TRAIN --validation VALIDATION --test TEST --seed SEED` with no help and no
    defaults (subcommands were formatted by argparse's own formatter): README's 1200/150/200 of seed 0 were
    nowhere to be seen."""
    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.examples.fitness.__main__ import main

    with pytest.raises(SystemExit):
        cli_main(main, ["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for opt, default in (("--train", 1200), ("--validation", 150), ("--test", 200), ("--seed", 0)):
        assert re.search(rf"{opt} \w+ [^-]*\(default: {default}\)", text), (opt, text)
