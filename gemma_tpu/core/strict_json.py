"""JSON that every reader takes. Python's json writes a NaN or infinite float as the bare words NaN/Infinity,
which jq, JavaScript's JSON.parse and other strict parsers refuse: one diverged step made a whole metrics.jsonl line
(or an evaluation's results file) unreadable to them. Here such a float is written as null, and the object that
held it names it in `nonfinite` (`{"loss": "nan"}`), so the fact is kept."""

from __future__ import annotations

import json
import math
from typing import Any


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


def dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps of `finite(obj)`; NaN/Infinity can no longer reach the text."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
