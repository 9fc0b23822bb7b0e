"""What every benchmark records about the CPU it ran on: timings are only comparable on the same kind of
machine, and the same cloud shape comes with or without AVX-512 (2-core AMD EPYC with AVX2 only runs our
CPU workloads ~2.8x slower than a 2-core Xeon with AVX-512)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_info() -> dict:
    """{"cpu_model": ..., "avx512": bool | None} from /proc/cpuinfo (None where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu_model": platform.processor() or "unknown", "avx512": None}
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return {"cpu_model": names[0] if names else platform.processor() or "unknown",
            "avx512": None if flags is None else "avx512f" in flags}


def cpu_label() -> str:
    """'AMD EPYC, no AVX-512' / 'Intel Xeon ..., AVX-512': the CPU as README and RESULTS.md name it."""
    info = cpu_info()
    kind = {True: "AVX-512", False: "no AVX-512", None: "AVX-512 unknown"}[info["avx512"]]
    return f"{info['cpu_model']}, {kind}"
