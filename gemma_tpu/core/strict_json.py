"""JSON that every reader takes, written and read. Python's json writes a NaN or infinite float as the bare words
NaN/Infinity, which jq, JavaScript's JSON.parse and other strict parsers refuse: one diverged step made a whole
metrics.jsonl line (or an evaluation's results file) unreadable to them. Here such a float is written as null, and the
object that held it names it in `nonfinite` (`{"loss": "nan"}`), so the fact is kept.

Reading, Python's json takes what is not JSON (NaN, Infinity) or not what the text says (1e400 as infinity, the last
of a key given twice): `DECODER` refuses these with `NotJSON`, for data files, JSON kept in their strings and the
server's requests alike (one reader: a call argument the data refused was rendered `Infinity` when a client sent it)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any


class NotJSON(ValueError):
    """What Python's JSON reader accepts but JSON does not hold, or holds otherwise (raised by `DECODER`'s hooks)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a key given twice is refused (the reader kept the last and dropped the first silently,
    e.g. one of two "content" fields)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise NotJSON(f"key {k!r} appears twice in one object (JSON readers keep only the last)")
        out[k] = v
    return out


def _constant(name: str) -> Any:
    raise NotJSON(f"{name} is not JSON (only finite numbers are)")


def _float(text: str) -> float:
    """A JSON number with a fraction or exponent; past a 64-bit float (1e400) Python read it as infinity, and the
    example was trained on "Infinity" where the file said a number."""
    value = float(text)
    if not math.isfinite(value):
        raise NotJSON(f"{text} is beyond the range of a 64-bit float (it would be read as infinity)")
    return value


def _int(text: str) -> int:
    """A JSON integer; one longer than Python converts from text (4,300 digits, `sys.get_int_max_str_digits`) was a
    ValueError traceback out of the reader."""
    digits = len(text.lstrip("-"))
    limit = sys.get_int_max_str_digits()
    if limit and digits > limit:
        raise NotJSON(f"a number of {digits} digits (Python reads integers of at most {limit})")
    return int(text)


def loads_finite(text: str | bytes) -> Any:
    """json.loads refusing NaN, Infinity and numbers past a 64-bit float (`NotJSON`), for a server's requests: a call
    argument of 1e999 was rendered `Infinity` into the prompt. A key given twice keeps the last, as OpenAI's and
    vLLM's servers read a request. An integer past Python's 4,300 digits is `NotJSON` too (it was a bare ValueError,
    which neither the server's body reader nor its arguments check caught: a traceback and HTTP 500)."""
    return json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)


# `DECODER.decode(text)` raises json.JSONDecodeError (not JSON at all), NotJSON, or RecursionError (nested past the
# stack: Python's reader recurses once a level)
DECODER = json.JSONDecoder(object_pairs_hook=unique_keys, parse_constant=_constant, parse_float=_float, parse_int=_int)


def lenient_only(text: str) -> NotJSON | None:
    """Why `DECODER` refuses a text Python's json reads (NaN, Infinity, 1e999, a key given twice), bare or nested;
    None where both read it, where Python's does not (a text that is no JSON) or where it nests past the stack. The
    one rule for a tool result, which the chat templates read as JSON: the data reader refuses such a row, the
    server such a request."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return None
    try:
        DECODER.decode(text)
    except NotJSON as e:
        return e
    except RecursionError:
        return None
    return None


def _word(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def finite(obj: Any) -> Any:
    """`obj` with each non-finite float as None; a dict holding one gains `nonfinite` naming its keys."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        out, bad = {}, {}
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v):
                bad[str(k)] = _word(v)
            out[k] = finite(v)
        if bad:
            out["nonfinite"] = {**(out.get("nonfinite") or {}), **bad}
        return out
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def nonfinite_path(obj: Any, path: str = "arguments") -> str | None:
    """Where `obj` (parsed JSON, or a structure a client built) holds a NaN or infinite float, as `arguments.a[2]`;
    None when nowhere."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = nonfinite_path(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}")
        if found:
            return found
    return None


def dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps of `finite(obj)`; NaN/Infinity can no longer reach the text."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
