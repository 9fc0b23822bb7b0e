"""Where the fitness tools get their numbers: a simulated watch, or a Garmin Connect account.

A provider answers per-day questions with plain numbers; the tools (tools.py) turn dates the
model writes ("yesterday", "monday", "2025-03-03") into days and shape the answers. The
simulated device is a pure function of (seed, day, quantity), so generated datasets are
byte-for-byte reproducible and a chat session gives stable answers.
"""

from __future__ import annotations

import datetime as dt
import os
import random
from typing import Any, Protocol

from gemma_tpu.core.errors import UserError


class Provider(Protocol):
    """Per-day watch data. `today()` anchors relative dates."""

    def today(self) -> dt.date: ...

    def steps(self, day: dt.date) -> int: ...

    def step_goal(self, day: dt.date) -> int: ...

    def sleep_minutes(self, day: dt.date) -> int | None: ...

    def active_minutes(self, day: dt.date) -> dict[str, int]: ...  # moderate, vigorous

    def heart_rate(self, day: dt.date) -> dict[str, int | None]: ...  # resting, average, max

    def body_battery(self, day: dt.date) -> dict[str, int | None]: ...  # level, highest, lowest


class SimulatedDevice:
    """A deterministic fake watch: the same seed and day always give the same numbers.

    Values are drawn from plausible ranges for an adult who is moderately active; today's
    counters (steps, active minutes) are scaled by how far the day has progressed at `hour`.
    """

    def __init__(self, seed: int = 0, today: dt.date | None = None, hour: int = 18):
        self.seed = seed
        self._today = today or dt.date.today()
        self.hour = hour

    def today(self) -> dt.date:
        return self._today

    def _rng(self, day: dt.date, what: str) -> random.Random:
        return random.Random(f"{self.seed}:{day.isoformat()}:{what}")

    def _progress(self, day: dt.date) -> float:
        return min(1.0, max(0.1, self.hour / 22)) if day == self._today else 1.0

    def steps(self, day: dt.date) -> int:
        r = self._rng(day, "steps")
        base = r.choice([r.randint(1500, 6000), r.randint(5000, 12000), r.randint(9000, 19000)])
        return int(base * self._progress(day))

    def step_goal(self, day: dt.date) -> int:
        # goals change rarely: one goal per (seed, month)
        r = random.Random(f"{self.seed}:{day.year}-{day.month}:goal")
        return r.choice([6000, 7000, 7500, 8000, 10000, 10000, 12000])

    def sleep_minutes(self, day: dt.date) -> int | None:
        return self._rng(day, "sleep").randint(290, 560)

    def active_minutes(self, day: dt.date) -> dict[str, int]:
        r = self._rng(day, "active")
        p = self._progress(day)
        return {"moderate": int(r.randint(0, 75) * p), "vigorous": int(r.choice([0, 0, r.randint(5, 50)]) * p)}

    def heart_rate(self, day: dt.date) -> dict[str, int | None]:
        r = self._rng(day, "hr")
        resting = r.randint(46, 72)
        return {"resting": resting, "average": resting + r.randint(10, 28), "max": r.randint(118, 188)}

    def body_battery(self, day: dt.date) -> dict[str, int | None]:
        r = self._rng(day, "battery")
        highest = r.randint(55, 100)
        lowest = r.randint(5, min(45, highest - 10))
        level = r.randint(lowest, highest) if day == self._today else lowest + r.randint(0, 8)
        return {"level": level, "highest": highest, "lowest": lowest}


class GarminConnectProvider:
    """Garmin Connect through the `garminconnect` package (pip install garminconnect).

    Credentials come from GARMIN_EMAIL / GARMIN_PASSWORD (or saved tokens in GARMINTOKENS); they
    are passed to the client and never printed or logged. `client` lets tests inject a fake.
    """

    def __init__(self, client: Any = None):
        if client is None:
            client = self._login()
        self.client = client
        self._summaries: dict[str, dict] = {}

    @staticmethod
    def _login():
        try:
            import garminconnect
        except ImportError:
            raise UserError("--provider garmin needs the garminconnect package: pip install garminconnect") from None
        email, password = os.environ.get("GARMIN_EMAIL"), os.environ.get("GARMIN_PASSWORD")
        tokens = os.environ.get("GARMINTOKENS")
        if not tokens and not (email and password):
            raise UserError("--provider garmin needs GARMIN_EMAIL and GARMIN_PASSWORD in the environment "
                            "(or GARMINTOKENS pointing at saved login tokens)")
        client = garminconnect.Garmin(email, password)
        try:
            client.login(tokens) if tokens else client.login()
        except Exception as e:  # the message may echo the account name, not the password
            raise UserError(f"Garmin Connect login failed ({type(e).__name__})") from None
        return client

    def today(self) -> dt.date:
        return dt.date.today()

    def _summary(self, day: dt.date) -> dict:
        key = day.isoformat()
        if key not in self._summaries:
            self._summaries[key] = self.client.get_user_summary(key) or {}
        return self._summaries[key]

    @staticmethod
    def _int(v: Any) -> int | None:
        return None if v is None else int(round(float(v)))

    def steps(self, day: dt.date) -> int:
        return self._int(self._summary(day).get("totalSteps")) or 0

    def step_goal(self, day: dt.date) -> int:
        return self._int(self._summary(day).get("dailyStepGoal")) or 0

    def sleep_minutes(self, day: dt.date) -> int | None:
        data = self.client.get_sleep_data(day.isoformat()) or {}
        secs = (data.get("dailySleepDTO") or {}).get("sleepTimeSeconds")
        return None if secs is None else int(secs) // 60

    def active_minutes(self, day: dt.date) -> dict[str, int]:
        s = self._summary(day)
        return {"moderate": self._int(s.get("moderateIntensityMinutes")) or 0,
                "vigorous": self._int(s.get("vigorousIntensityMinutes")) or 0}

    def heart_rate(self, day: dt.date) -> dict[str, int | None]:
        s = self._summary(day)
        data = self.client.get_heart_rates(day.isoformat()) or {}
        values = [v[1] for v in data.get("heartRateValues") or [] if v and len(v) > 1 and v[1]]
        average = round(sum(values) / len(values)) if values else None
        return {"resting": self._int(data.get("restingHeartRate") or s.get("restingHeartRate")),
                "average": average,
                "max": self._int(data.get("maxHeartRate") or s.get("maxHeartRate"))}

    def body_battery(self, day: dt.date) -> dict[str, int | None]:
        s = self._summary(day)
        return {"level": self._int(s.get("bodyBatteryMostRecentValue")),
                "highest": self._int(s.get("bodyBatteryHighestValue")),
                "lowest": self._int(s.get("bodyBatteryLowestValue"))}


def make_provider(name: str, seed: int = 0) -> Provider:
    """`simulated` (default) or `garmin`."""
    if name == "simulated":
        return SimulatedDevice(seed)
    if name == "garmin":
        return GarminConnectProvider()
    raise UserError(f"unknown provider {name!r} (simulated, garmin)")
