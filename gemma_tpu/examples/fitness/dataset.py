"""Generate the fitness-coach tool-calling dataset: varied requests, real calls, grounded answers.

Each example is a whole exchange: the developer turn (who the model is; the same in every
example), a user request after today's date, the assistant's call with arguments, the simulated
device's response, and a short answer that uses the response's numbers. Requests are built from
templates (questions, commands, fragments, chatty and formal registers), date phrases (today, yesterday, weekday names, specific
dates in several spellings) and light noise (typos, lower case, no punctuation).

Generalisation is measured honestly: the request templates of each tool are split between
train, validation and test, so a test request is a phrasing the model never saw in training
(and `generate` asserts that no test request text occurs in train). The seven tools are
balanced in every split. The output depends only on the seed.
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
from gemma_tpu.data import Renderer, load_conversations
from gemma_tpu.examples.fitness.providers import SimulatedDevice
from gemma_tpu.examples.fitness.tools import (WEEKDAYS, call_tool, request_of, system_prompt, tool_schemas,
                                              user_message)
from gemma_tpu.formats.function_calling import function_token_map
from gemma_tpu.infer.tool_loop import result_json

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
SPLITS = ("train", "validation", "test")
DEFAULT_SIZES = {"train": 1200, "validation": 150, "test": 200}

# ------------------------------------------------------------------------------------ requests
# {when}: an adverbial date phrase ("yesterday", "on Monday", "on March 3", "" for implicit today)
# {day}: a nominal one ("yesterday", "Monday", "March 3", "today"); {metric}: a heart-rate phrase.

TEMPLATES: dict[str, list[str]] = {
    "get_steps": [
        "How many steps did I take {when}?", "how many steps {when}", "steps {when}?",
        "What's my step count {when}?", "Show me my steps {when}.", "Tell me my step count {when}",
        "Did I walk much {when}? How many steps?", "number of steps {when}", "Give me the total steps {when}.",
        "Could you check how many steps I've done {when}?", "I'd like to know my step total {when}.",
        "yo how many steps did i get {when}", "Pull up my steps {when}", "what was my step total {when}",
        "Steps walked {when}?", "Can you tell me how many steps I logged {when}?", "step count for {day}",
        "{day} steps", "How many steps have I got {when}?", "Check my pedometer {when}.",
        "Please report my daily steps for {day}.", "how much did i walk {when}", "Total steps {when}, please.",
        "Count of steps {when}?", "I wonder how many steps I did {when}", "my steps {when}?",
        "What did my watch count for steps {when}?", "Kindly provide the step count for {day}.",
        "How active was I {when} in terms of steps?", "Let me see {day}'s step count",
        "how many steps did my watch record {when}", "Step tally for {day}?",
    ],
    "get_daily_step_goal": [
        "What is my daily step goal {when}?", "What's my step goal {when}?", "step goal {when}?",
        "How many steps am I supposed to do {when}?", "What target do I have for steps {when}?",
        "Remind me of my step target {when}.", "daily step target for {day}", "what's the goal for steps {when}",
        "How many steps should I aim for {when}?", "Tell me my daily goal for steps {when}.",
        "what step goal did i have {when}", "Show my step goal {when}", "Could you look up my step goal for {day}?",
        "Goal for steps {when}?", "How high is my step goal {when}?", "my daily steps goal {when}",
        "What number of steps is my goal {when}?", "Please state my daily step objective for {day}.",
        "what was i aiming for in steps {when}", "Step goal on my watch {when}?", "steps target {day}",
        "Is my step goal 10k {when}? What is it?", "Which step goal was set {when}?",
        "How many steps is my daily target {when}?", "Get my step goal {when}.", "goal steps {day}?",
        "What's the daily step count I'm meant to hit {when}?", "I forgot my step goal, what is it {when}?",
        "What's the target step number for {day}?", "how many steps do i need per day {when}",
    ],
    "get_step_goal_progress": [
        "Did I reach my step goal {when}?", "How close am I to my step goal {when}?",
        "Am I on track for my steps {when}?", "step goal progress {when}", "Did I hit 100% of my steps {when}?",
        "How much of my step goal did I do {when}?", "How many steps left to my goal {when}?",
        "progress toward step goal for {day}", "Did I make my step target {when}?", "Have I met my goal {when}?",
        "what percent of my step goal {when}", "Show my progress on steps {when}.",
        "Could you tell me whether I achieved my step goal {when}?", "steps vs goal {when}?",
        "Am I done with my steps {when}?", "how far from my step target am i {when}",
        "Did I beat my step goal {when}?", "Percentage of daily steps goal for {day}?",
        "How many more steps do I need {when}?", "Check if I hit my steps goal {when}.",
        "Please report progress against my step goal for {day}.", "goal progress {day}",
        "Was my step goal reached {when}?", "Did i get my steps in {when}?", "How am I doing on steps {when}?",
        "remaining steps for my goal {when}?", "Tell me if I completed my step goal {when}",
        "Step goal status for {day}?", "Am I behind on my step goal {when}?", "did i smash my step goal {when}",
    ],
    "get_sleeping_minutes": [
        "How long did I sleep {when}?", "How much sleep did I get {when}?", "sleep {when}?",
        "How many minutes did I sleep {when}?", "How many hours of sleep {when}?", "Show my sleep {when}.",
        "what was my sleep duration {when}", "Did I sleep well {when}? How long?", "sleep time {when}",
        "Tell me how long I slept {when}.", "Could you check my sleep {when}?", "minutes of sleep {when}?",
        "How long was I asleep {when}?", "my sleep {when}", "Total sleep {when}, please.",
        "Did I get enough sleep {when}?", "Please provide my sleep duration for {day}.",
        "sleep report for {day}", "how much did i sleep {when}", "How many hours did I snooze {when}?",
        "What did my watch record for sleep {when}?", "hours slept {when}?", "Let me see my sleep for {day}",
        "I feel tired, how long did I sleep {when}?", "Kindly report total sleeping time for {day}.",
        "sleep length {day}?", "Was my sleep long enough {when}?", "How much rest did I get {when}?",
        "check my sleep duration {when}", "Get my sleeping minutes {when}.",
    ],
    "get_active_minutes": [
        "How many active minutes did I get {when}?", "active minutes {when}?", "How active was I {when}?",
        "Show my active minutes {when}.", "How many minutes of exercise did I do {when}?",
        "intensity minutes {when}", "How much moderate and vigorous activity {when}?",
        "What were my activity minutes {when}?", "Tell me my active time {when}.",
        "Could you check my intensity minutes {when}?", "how long was i active {when}",
        "Minutes of activity {when}?", "How much did I work out {when}?", "my active minutes {when}",
        "Vigorous minutes {when}?", "Please report my activity minutes for {day}.", "active time for {day}",
        "How many minutes did I move {when}?", "Did I exercise {when}? How many minutes?",
        "exercise minutes {when}?", "What did my watch log as active minutes {when}?",
        "Get my activity minutes {when}.", "How much intense activity did I have {when}?",
        "Let me see my active minutes for {day}", "Kindly provide the active minutes for {day}.",
        "workout minutes {day}?", "How many minutes was I active {when}?", "Active minutes total {when}",
        "how much exercise did i get {when}", "Was I active enough {when}?",
    ],
    "get_heart_rate": [
        "What was my {metric} {when}?", "What's my {metric} {when}?", "{metric} {when}?",
        "Show me my {metric} {when}.", "Tell me my {metric} {when}", "Check my {metric} {when}.",
        "Could you look up my {metric} {when}?", "my {metric} {when}", "How high was my {metric} {when}?",
        "What did my watch record as my {metric} {when}?", "Please report my {metric} for {day}.",
        "{metric} for {day}", "I'd like to know my {metric} {when}.", "Get my {metric} {when}.",
        "what was the {metric} {when}", "How was my {metric} {when}?", "Can you give me my {metric} {when}?",
        "Let me see my {metric} for {day}", "Kindly provide my {metric} for {day}.",
        "any idea what my {metric} was {when}", "What number did my {metric} hit {when}?",
        "{day} {metric}?", "Was my {metric} normal {when}?", "Pull up my {metric} {when}",
        "What reading did I get for {metric} {when}?", "How fast was my {metric} {when}?",
        "whats my {metric} {when}", "Tell me the {metric} measured {when}.",
        "Need my {metric} {when}.", "What's the {metric} my watch saw {when}?",
    ],
    "get_body_battery_level": [
        "What's my body battery {when}?", "body battery {when}?", "How much energy do I have {when}?",
        "Show my body battery level {when}.", "What is my Body Battery {when}?", "Check my body battery {when}",
        "How charged am I {when}?", "energy level {when}", "What was my body battery {when}?",
        "Tell me my body battery level {when}.", "Could you look up my body battery for {day}?",
        "my body battery {when}", "How is my energy {when}?", "battery level {when}?",
        "Please report my Body Battery for {day}.", "body battery for {day}", "How drained am I {when}?",
        "What did my watch say my body battery was {when}?", "Get my body battery {when}.",
        "How much energy did I have left {when}?", "Let me see my body battery for {day}",
        "Kindly provide the Body Battery level for {day}.", "am i low on energy {when}",
        "What's my energy reserve {when}?", "How recharged am I {when}?", "BB level {when}?",
        "body battery reading {day}?", "Is my body battery low {when}?", "whats my body battery at {when}",
        "Energy score {when}?",
    ],
}

HEART_METRICS: dict[str, list[str]] = {
    "resting": ["resting heart rate", "resting HR", "RHR", "resting pulse", "heart rate at rest"],
    "average": ["average heart rate", "avg heart rate", "average HR", "mean heart rate", "average pulse"],
    "max": ["max heart rate", "maximum heart rate", "peak heart rate", "highest heart rate", "max HR"],
}
# a heart-rate request that names no metric means the resting rate (the declaration says so)
HEART_DEFAULT = ["heart rate", "pulse", "HR"]


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
    text = re.sub(r"\s+([?.!,])", r"\1", text)
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
        out["train"][tool] = order[n_test + n_val:]
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


def write_splits(splits: dict[str, list[dict]], out_dir: str | Path) -> dict[str, Path]:
    """One JSONL per split; stable key order and separators so equal data gives equal bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, examples in splits.items():
        p = out / f"{split}.jsonl"
        tmp = p.with_suffix(".jsonl.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for ex in examples:
                f.write(json.dumps(ex, ensure_ascii=False) + "\n")
        tmp.replace(p)
        paths[split] = p
    return paths


def token_lengths(path: str | Path, tokenizer) -> list[int]:
    """Rendered lengths (ids incl. BOS) of a split, with the renderer training uses."""

    renderer = Renderer(tokenizer, "gemma", token_map=function_token_map(tokenizer))
    return [len(renderer.render(c).ids) for c in load_conversations(path, DataConfig())]
