"""Generate the fitness-coach tool-calling dataset: varied requests, real calls, grounded answers.

Each example is a whole exchange: the developer turn (who the model is; the same in every
example), a user request after today's date, the assistant's call with arguments, the simulated
device's response, and a short answer that uses the response's numbers. Requests are built from
templates (questions, commands, fragments, chatty and formal registers), date phrases (today, yesterday, weekday names, specific
dates in several spellings) and light noise (typos, lower case, no punctuation).

Generalisation is measured honestly: the request templates of each tool are split between
train, validation and test, so a test request is a phrasing the model never saw in training
(and `generate` asserts that no test request text occurs in train); train also draws on phrasings
of its own (`templates.EXTRA_TRAIN_TEMPLATES`), which leave the held-out splits unchanged. The
seven tools are balanced in every split. The output depends only on the seed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import random
import re
from pathlib import Path
from typing import Any

from gemma_tpu.core.config import DataConfig
from gemma_tpu.core.errors import UserError
from gemma_tpu.data import Renderer, load_conversations
from gemma_tpu.examples.fitness.providers import SimulatedDevice
from gemma_tpu.examples.fitness.templates import (EXTRA_TRAIN_TEMPLATES, HEART_DEFAULT, HEART_METRICS,
                                                  TEMPLATES)
from gemma_tpu.examples.fitness.tools import (WEEKDAYS, call_tool, request_of, system_prompt, tool_schemas,
                                              user_message)
from gemma_tpu.formats.function_calling import function_token_map
from gemma_tpu.infer.tool_loop import result_json

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
SPLITS = ("train", "validation", "test")
DEFAULT_SIZES = {"train": 1200, "validation": 150, "test": 200}


@dataclasses.dataclass
class DatePhrase:
    when: str  # adverbial, may be "" (implicit today)
    day: str  # nominal
    arg: str  # the argument the model should write
    date: dt.date


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def date_phrase(rng: random.Random, today: dt.date, tool: str, allow_empty: bool) -> DatePhrase:
    """A date as a user might say it, with the argument it maps to."""
    kind = rng.choices(["today", "yesterday", "weekday", "specific"], weights=[35, 25, 20, 20])[0]
    sleep = tool == "get_sleeping_minutes"
    if kind == "today":
        if sleep:
            when = rng.choice(["last night", "last night", "today", "this morning"] + ([""] if allow_empty else []))
            return DatePhrase(when, rng.choice(["last night", "today"]), "today", today)
        # "so far" fits running totals, not a goal: "step goal today so far?" reads as asking for progress
        so_far = ["today"] * 2 if tool == "get_daily_step_goal" else ["so far today", "today so far"]
        options = ["today", "today", so_far[0], "for today", so_far[1], "this morning" if
                   tool == "get_body_battery_level" else "today"]
        if allow_empty:
            options += ["", ""]
        when = rng.choice(options)
        return DatePhrase(when, "today", "today", today)
    if kind == "yesterday":
        day = today - dt.timedelta(days=1)
        forms = ["yesterday", "yesterday", "yday", "yesterday"] + (["the night before last"] if sleep else [])
        w = rng.choice(forms)
        return DatePhrase(w, "yesterday" if w == "the night before last" else w, "yesterday", day)
    if kind == "weekday":
        back = rng.randint(2, 7)  # never today's weekday, never ambiguous with yesterday
        day = today - dt.timedelta(days=back)
        name = WEEKDAYS[day.weekday()]
        shown = rng.choice([name.capitalize(), name.capitalize(), name, name[:3].capitalize()])
        when = rng.choice([f"on {shown}", f"on {shown}", f"last {shown}", shown])
        return DatePhrase(when, shown, name, day)
    back = rng.randint(2, 60)
    day = today - dt.timedelta(days=back)
    month = MONTHS[day.month - 1]
    forms = [f"{month} {day.day}", f"{month} {_ordinal(day.day)}", f"{day.day} {month}", f"{month[:3]} {day.day}",
             f"the {_ordinal(day.day)} of {month}", day.isoformat(), f"{month} {day.day}, {day.year}"]
    noun = rng.choice(forms)
    when = noun if noun.startswith("the ") and rng.random() < 0.3 else f"on {noun}"
    return DatePhrase(when, noun, day.isoformat(), day)


def _typo(word: str, rng: random.Random) -> str:
    if len(word) < 4 or not word.isalpha():
        return word
    i = rng.randrange(1, len(word) - 2)
    op = rng.choice(["swap", "drop", "double"])
    if op == "swap":
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if op == "drop":
        return word[:i] + word[i + 1:]
    return word[:i] + word[i] + word[i:]


def add_noise(text: str, protected: str, rng: random.Random) -> str:
    """Typos (never inside the date phrase), lower case, dropped punctuation - as people type."""
    r = rng.random()
    if r < 0.2:
        words = text.split(" ")
        keep = set(protected.split())
        cand = [i for i, w in enumerate(words) if w.isalpha() and w not in keep and len(w) >= 4]
        if cand:
            i = rng.choice(cand)
            words[i] = _typo(words[i], rng)
        text = " ".join(words)
    elif r < 0.3:
        text = text.lower()
    elif r < 0.38:
        text = text.rstrip("?.!")
    return text


def render_request(template: str, tool: str, rng: random.Random, today: dt.date) -> tuple[str, dict[str, Any], str]:
    """(user text, call arguments, the date phrase used) for one template."""
    allow_empty = "{when}" in template and not template.startswith("{") and "{day}" not in template
    dp = date_phrase(rng, today, tool, allow_empty)
    args: dict[str, Any] = {"date": dp.arg}
    fields = {"when": dp.when, "day": dp.day}
    if tool == "get_heart_rate":
        if rng.random() < 0.15:
            metric, phrase = "resting", rng.choice(HEART_DEFAULT)
        else:
            metric = rng.choice(list(HEART_METRICS))
            phrase = rng.choice(HEART_METRICS[metric])
        fields["metric"] = phrase
        args["metric"] = metric
    text = template.format(**fields)
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\s+([?.!,:;])", r"\1", text)
    if text[:1].islower() and template[:1] == "{":
        text = text[:1].upper() + text[1:]
    return add_noise(text, dp.when + " " + dp.day, rng), args, dp.when or dp.day


# ------------------------------------------------------------------------------------- answers


def _when_answer(result_date: str, today: dt.date, sleep: bool = False) -> str:
    day = dt.date.fromisoformat(result_date)
    if day == today:
        return "last night" if sleep else "today"
    if day == today - dt.timedelta(days=1):
        return "the night before yesterday" if sleep else "yesterday"
    label = f"{MONTHS[day.month - 1]} {day.day}"  # no weekday: the model cannot compute it reliably
    return f"the night before {label}" if sleep else f"on {label}"


def answer(tool: str, res: dict, today: dt.date, rng: random.Random) -> str:
    """A short coach-like answer that states the response's numbers."""
    w = _when_answer(res["date"], today, sleep=tool == "get_sleeping_minutes")
    is_today = res["date"] == today.isoformat()
    if tool == "get_steps":
        s = res["steps"]
        verb = "You've taken" if is_today else "You took"
        opts = [f"{verb} {s:,} steps {w}.", f"{s:,} steps {w}.", f"Your watch counted {s:,} steps {w}."]
        tail = (" Great job staying active!" if s >= 10000 else " A short walk would add a few more." if s < 5000
                else "")
        return rng.choice(opts) + (tail if rng.random() < 0.6 else "")
    if tool == "get_daily_step_goal":
        g = res["goal"]
        return rng.choice([f"Your daily step goal is {g:,} steps.", f"Your step goal {w} is {g:,} steps.",
                           f"You're aiming for {g:,} steps a day.", f"The goal is {g:,} steps per day."])
    if tool == "get_step_goal_progress":
        s, g, p, left = res["steps"], res["goal"], res["percent"], res["remaining"]
        if s >= g:
            return rng.choice([f"Yes! {s:,} of {g:,} steps {w} ({p}%).", f"Goal reached {w}: {s:,} of {g:,} steps.",
                               f"You hit {p}% of your goal {w}: {s:,} / {g:,} steps."])
        return rng.choice([f"Not yet: {s:,} of {g:,} steps {w} ({p}%).", f"{p}% {w}: {left:,} steps to go.",
                           f"{s:,} / {g:,} steps {w}, {left:,} to go."])
    if tool == "get_sleeping_minutes":
        m, d = res["minutes"], res["duration"]
        tail = (" That's a solid night." if m >= 450 else " Try to get to bed a bit earlier tonight." if m < 390
                else "")
        return rng.choice([f"You slept {d} ({m} minutes) {w}.", f"{m} minutes of sleep {w}, about {d}.",
                           f"Your watch recorded {d} of sleep {w} ({m} min)."]) + (tail if rng.random() < 0.6 else "")
    if tool == "get_active_minutes":
        mo, vi, t = res["moderate"], res["vigorous"], res["total"]
        return rng.choice([f"{t} active minutes {w}: {mo} moderate and {vi} vigorous.",
                           f"You had {mo} moderate and {vi} vigorous minutes {w}, {t} in total.",
                           f"Active time {w}: {t} minutes ({mo} moderate, {vi} vigorous)."])
    if tool == "get_heart_rate":
        m, b = res["metric"], res["bpm"]
        name = {"resting": "resting heart rate", "average": "average heart rate", "max": "maximum heart rate"}[m]
        return rng.choice([f"Your {name} {w} was {b} bpm.", f"{name.capitalize()} {w}: {b} bpm.",
                           f"Your watch measured a {name} of {b} bpm {w}."])
    if tool == "get_body_battery_level":
        lv, hi, lo = res["level"], res["highest"], res["lowest"]
        now = "is" if is_today else "ended at"
        tail = (" Take it easy and rest." if lv < 25 else " You've got energy to spare." if lv > 70 else "")
        return rng.choice([f"Your Body Battery {now} {lv} {w} (high {hi}, low {lo}).",
                           f"Body Battery {w}: {lv}, ranging from {lo} to {hi}.",
                           f"Energy level {w}: {lv}/100 (peak {hi}, lowest {lo})."]) + (tail if rng.random() < 0.5 else "")
    raise KeyError(tool)


# ---------------------------------------------------------------------------------- generation


def split_templates(seed: int) -> dict[str, dict[str, list[str]]]:
    """Per tool, the request templates of each split (about 70/10/20; never shared)."""
    out: dict[str, dict[str, list[str]]] = {s: {} for s in SPLITS}
    for tool, templates in TEMPLATES.items():
        order = list(templates)
        random.Random(f"{seed}:split:{tool}").shuffle(order)
        n_test = max(2, round(len(order) * 0.2))
        n_val = max(1, round(len(order) * 0.1))
        out["test"][tool] = order[:n_test]
        out["validation"][tool] = order[n_test:n_test + n_val]
        out["train"][tool] = order[n_test + n_val:] + EXTRA_TRAIN_TEMPLATES.get(tool, [])
    return out


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def make_example(tool: str, template: str, rng: random.Random, seed: int, schemas: list[dict]) -> dict:
    """One full conversation: developer turn, request, call, device response, answer."""
    today = dt.date(2025, 1, 1) + dt.timedelta(days=rng.randrange(0, 540))
    user, args, _ = render_request(template, tool, rng, today)
    device = SimulatedDevice(seed, today=today, hour=rng.randint(8, 21))
    result = call_tool(tool, args, device)
    return {
        "tools": schemas,
        "messages": [
            {"role": "developer", "content": system_prompt()},
            {"role": "user", "content": user_message(today, user)},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": tool, "arguments": args}}]},
            {"role": "tool", "name": tool, "content": result_json(result)},
            {"role": "assistant", "content": answer(tool, result, today, rng)},
        ],
    }


def generate(seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """All splits; deterministic in `seed`; tools balanced; no test request text in train."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    schemas = tool_schemas()
    tools = list(TEMPLATES)
    templates = split_templates(seed)
    out: dict[str, list[dict]] = {}
    seen: dict[str, set[str]] = {}
    for split in SPLITS:
        rng = random.Random(f"{seed}:examples:{split}")
        n = sizes[split]
        order = [tools[i % len(tools)] for i in range(n)]
        rng.shuffle(order)
        examples, texts = [], set()
        for tool in order:
            for attempt in range(20):  # avoid exact repeats and any text seen in an earlier split
                ex = make_example(tool, rng.choice(templates[split][tool]), rng, seed, schemas)
                key = _norm(request_text(ex))  # the request, not the dated turn: a new date is no new phrasing
                clash = any(key in s for s in seen.values())
                if not clash and (key not in texts or attempt == 19 and split == "train"):
                    break
            else:
                raise RuntimeError(f"could not make a new {split} request for {tool}")
            texts.add(key)
            examples.append(ex)
        out[split] = examples
        seen[split] = texts
    check_disjoint(out)
    return out


def check_disjoint(splits: dict[str, list[dict]]) -> None:
    """No user request of validation/test occurs (case- and space-insensitively, whatever the date
    before it) in train."""
    train = {_norm(request_text(ex)) for ex in splits.get("train", [])}
    for split in ("validation", "test"):
        shared = [request_text(ex) for ex in splits.get(split, []) if _norm(request_text(ex)) in train]
        if shared:
            raise AssertionError(f"{len(shared)} {split} requests also occur in train, e.g. {shared[0]!r}")


def user_text(example: dict) -> str:
    return next(m["content"] for m in example["messages"] if m["role"] == "user")


def request_text(example: dict) -> str:
    """The user's request without the date the coach is told first."""
    return request_of(user_text(example))


def written_here(path: Path) -> bool:
    """Whether `path` is absent, empty, or a split this generator wrote (its first row declares the coach's tools),
    so that writing the splits may replace it."""
    try:
        with path.open("rb") as f:
            first = f.readline()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not first.strip():
        return True
    try:
        row = json.loads(first)
        names = {t["function"]["name"] for t in row["tools"]}
    except (ValueError, TypeError, KeyError):
        return False
    return names == {t["function"]["name"] for t in tool_schemas()}


def write_splits(splits: dict[str, list[dict]], out_dir: str | Path) -> dict[str, Path]:
    """One JSONL per split; stable key order and separators so equal data gives equal bytes. Every split
    is written to a hidden temp file first and the files are renamed into place only once all are
    written: a failure or a kill midway leaves the previous set whole, never a train split of one seed
    beside a test split of another (whose held-out phrasings the new train split may then contain).
    Earlier splits of this generator are replaced; a file of other data under a split's name is refused
    (`--out` a directory of the user's own data: its train.jsonl was replaced without a word)."""
    import os

    from gemma_tpu.core.atomic import clean_stale

    out = Path(out_dir)
    paths = {split: out / f"{split}.jsonl" for split in splits}
    other = next((p for p in paths.values() if not written_here(p)), None)
    if other is not None:
        raise UserError(f"--out {out_dir}: {other} holds data this command did not write (not a fitness split); give "
                        f"another --out, or move the file")
    out.mkdir(parents=True, exist_ok=True)
    tmps: dict[str, Path] = {}
    try:
        for split, examples in splits.items():
            clean_stale(paths[split])  # temp files of a run that was killed
            tmps[split] = out / f".{paths[split].name}.tmp-{os.getpid()}"
            with tmps[split].open("w", encoding="utf-8") as f:
                for ex in examples:
                    f.write(json.dumps(ex, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
        for split, tmp in tmps.items():
            tmp.replace(paths[split])
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
    return paths


def read_split(path: str | Path) -> list[dict]:
    """A split's conversations, read as training reads them (a bad row named by FILE:LINE); an empty file has none
    (`generate --test 0` writes one)."""
    return load_conversations(path, DataConfig()) if Path(path).stat().st_size else []


def split_stats(conversations: list[dict], tokenizer) -> tuple[list[int], dict[str, int]]:
    """Rendered lengths (ids incl. BOS, with the renderer training uses) and examples per called tool (the first
    call's name; `(no tool call)` for a chat without one)."""
    renderer = Renderer(tokenizer, "gemma", token_map=function_token_map(tokenizer))
    tools: dict[str, int] = {}
    for c in conversations:
        calls = [call for m in c.get("messages", ()) for call in m.get("tool_calls") or ()]
        name = calls[0]["name"] if calls else "(no tool call)"
        tools[name] = tools.get(name, 0) + 1
    return [len(renderer.render(c).ids) for c in conversations], tools
