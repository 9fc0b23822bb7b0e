"""The fitness coach's seven tools, declared by their signatures and Google-style docstrings.

`transformers.utils.get_json_schema` turns each function into the JSON schema that goes into the
`tools` field of every example and every request. The docstrings are deliberately terse: all
seven declarations are rendered into the prompt of every example, and they dominate its length.

Every tool takes a `date` the way a user says it and the model can copy it: "today",
"yesterday", a weekday name (the most recent past one) or an ISO date; the system prompt states
this convention once instead of every declaration repeating it. The data comes from the
active provider (providers.py); `call_tool` runs one call against a given provider.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from typing import Any, Callable, Iterator

from gemma_tpu.examples.fitness.providers import Provider, SimulatedDevice
from gemma_tpu.infer.tool_loop import ToolCallError, Toolset

WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
HEART_RATE_METRICS = ("resting", "average", "max")

_provider: Provider | None = None


class ToolError(ToolCallError, ValueError):
    """A call the tools cannot run: unknown name, or arguments of the wrong shape."""


@contextlib.contextmanager
def use_provider(provider: Provider) -> Iterator[Provider]:
    """Run tools against `provider` inside the block."""
    global _provider
    previous, _provider = _provider, provider
    try:
        yield provider
    finally:
        _provider = previous


def _current() -> Provider:
    global _provider
    if _provider is None:
        _provider = SimulatedDevice(0)
    return _provider


def resolve_date(text: str, today: dt.date) -> dt.date:
    """'today' | 'yesterday' | weekday name (most recent past one) | YYYY-MM-DD -> a past or current day."""
    t = str(text).strip().lower().rstrip(".")
    if t in ("", "today", "now"):
        return today
    if t == "yesterday":
        return today - dt.timedelta(days=1)
    for i, name in enumerate(WEEKDAYS):
        if t in (name, name[:3]):
            back = (today.weekday() - i) % 7 or 7
            return today - dt.timedelta(days=back)
    m = re.fullmatch(r"(\d{4})-(\d{1,2})-(\d{1,2})", t)
    if not m:
        raise ValueError(f"unrecognised date {text!r}; use today, yesterday, a weekday or YYYY-MM-DD")
    try:
        day = dt.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    except ValueError:
        raise ValueError(f"{text!r} is not a valid date") from None
    if day > today:
        raise ValueError(f"{day.isoformat()} is in the future")
    return day


def _day(date: str) -> dt.date:
    return resolve_date(date, _current().today())


def _hours(minutes: int) -> str:
    return f"{minutes // 60}h {minutes % 60:02d}m"


def get_steps(date: str = "today") -> dict:
    """Steps walked in a day.

    Args:
        date: Day.
    """
    day = _day(date)
    return {"date": day.isoformat(), "steps": _current().steps(day)}


def get_daily_step_goal(date: str = "today") -> dict:
    """Daily step goal.

    Args:
        date: Day.
    """
    day = _day(date)
    return {"date": day.isoformat(), "goal": _current().step_goal(day)}


def get_step_goal_progress(date: str = "today") -> dict:
    """Steps versus the step goal.

    Args:
        date: Day.
    """
    day = _day(date)
    p = _current()
    steps, goal = p.steps(day), p.step_goal(day)
    return {"date": day.isoformat(), "steps": steps, "goal": goal,
            "percent": round(100 * steps / goal) if goal else 0, "remaining": max(goal - steps, 0)}


def get_sleeping_minutes(date: str = "today") -> dict:
    """Minutes slept in the night before a day.

    Args:
        date: Day the sleep ended.
    """
    day = _day(date)
    minutes = _current().sleep_minutes(day)
    if minutes is None:
        return {"date": day.isoformat(), "error": "no sleep recorded"}
    return {"date": day.isoformat(), "minutes": minutes, "duration": _hours(minutes)}


def get_active_minutes(date: str = "today") -> dict:
    """Moderate and vigorous active minutes.

    Args:
        date: Day.
    """
    day = _day(date)
    a = _current().active_minutes(day)
    return {"date": day.isoformat(), "moderate": a["moderate"], "vigorous": a["vigorous"],
            "total": a["moderate"] + a["vigorous"]}


def get_heart_rate(date: str = "today", metric: str = "resting") -> dict:
    """Heart rate in bpm.

    Args:
        date: Day.
        metric: Which rate. (choices: ["resting", "average", "max"])
    """
    day = _day(date)
    m = str(metric).strip().lower()
    m = {"avg": "average", "mean": "average", "maximum": "max", "peak": "max", "rest": "resting"}.get(m, m)
    if m not in HEART_RATE_METRICS:
        raise ValueError(f"metric must be one of {', '.join(HEART_RATE_METRICS)}, got {metric!r}")
    bpm = _current().heart_rate(day)[m]
    if bpm is None:
        return {"date": day.isoformat(), "metric": m, "error": "no heart rate recorded"}
    return {"date": day.isoformat(), "metric": m, "bpm": bpm}


def get_body_battery_level(date: str = "today") -> dict:
    """Body Battery energy level (0-100).

    Args:
        date: Day.
    """
    day = _day(date)
    b = _current().body_battery(day)
    return {"date": day.isoformat(), **b}


TOOLS: list[Callable[..., dict]] = [
    get_steps, get_daily_step_goal, get_step_goal_progress, get_sleeping_minutes, get_active_minutes,
    get_heart_rate, get_body_battery_level,
]
TOOLS_BY_NAME = {f.__name__: f for f in TOOLS}


def tool_schemas(compact: bool = True) -> list[dict]:
    """The seven declarations as `get_json_schema` writes them, minus the return type.

    `compact` (the default, used for the dataset and chat) also drops the per-parameter
    descriptions: the system prompt states the date convention once and `metric` keeps its
    enum, which saves about 55 tokens per example and keeps every example within 512 tokens.
    """
    from transformers.utils import get_json_schema

    out = []
    for f in TOOLS:
        schema = get_json_schema(f)
        schema["function"].pop("return", None)
        if compact:
            for prop in schema["function"].get("parameters", {}).get("properties", {}).values():
                prop.pop("description", None)
        out.append(schema)
    return out


def call_tool(name: str, arguments: dict[str, Any], provider: Provider) -> dict:
    """Run one call; unknown names and wrong argument sets raise ToolError, bad values return
    `{"error": ...}` (which the model then reports, as it would a real API's refusal)."""
    fn = TOOLS_BY_NAME.get(name)
    if fn is None:
        raise ToolError(f"model called unknown tool {name}")
    import inspect

    # a null argument is one not given (as evaluate's arguments_match reads it): the tool's default, where it ran
    # with the text 'None' ("unrecognised date 'None'") for a call evaluate scored right
    arguments = {k: v for k, v in arguments.items() if v is not None}
    params = inspect.signature(fn).parameters
    missing = [p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in arguments]
    extra = [a for a in arguments if a not in params]
    if missing or extra:
        what = "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                     f"unexpected {', '.join(extra)}" if extra else "") if x)
        raise ToolError(f"model called {name} with bad arguments ({what})")
    with use_provider(provider):
        try:
            return fn(**{k: str(v) if not isinstance(v, str) else v for k, v in arguments.items()})
        except ValueError as e:
            return {"error": str(e)}


SYSTEM_PROMPT = "You are a fitness coach. Dates: today, yesterday, weekday or YYYY-MM-DD."


def system_prompt() -> str:
    """The developer turn: who the model is and how to write a date argument (said once here rather
    than in all seven declarations). It is the same every day: with the tool declarations it forms
    a prompt prefix every conversation shares, computed once per training row and once per
    evaluation or chat (a date in it would make each day's prefix different)."""
    return SYSTEM_PROMPT


def user_message(today: dt.date, text: str) -> str:
    """A user turn as the coach sees it: today's date first (for dates like 'March 3'), then the request."""
    return f"Today is {today.isoformat()}. {text}"


def request_of(user_turn: str) -> str:
    """The request in a user turn made by `user_message` (the turn itself if it has no date)."""
    return re.sub(r"^Today is \d{4}-\d{2}-\d{2}\. ", "", user_turn, count=1)


def toolset(provider: Provider) -> Toolset:
    """The seven tools run against `provider`, with the coach's system prompt, for the generic tool loop
    (`gemma_tpu.infer.tool_loop`) of the local chat and of `serving.chat`."""
    return Toolset(tool_schemas(), lambda name, arguments: call_tool(name, arguments, provider),
                   system_prompt, lambda question: user_message(provider.today(), question))
