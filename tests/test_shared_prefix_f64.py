"""Issue 15, point 3, in float64: shared-prefix rows give the loss and LoRA gradients of one example a row
to float64 rounding. In fp32 (tests/test_shared_prefix.py) the Gemma 4 per-layer-embedding variant differs by
up to 2.2e-5 on an AVX2-only CPU, the size of fp32 summation noise there; here the same comparison, with
nothing rounded to fp32, must agree to 1e-11 (measured 2026-11-25: 1.9e-14 at max |grad| 0.88; a layout error
would be ~1e-2)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_shared_prefix_rows_are_exact_in_float64():
    proc = subprocess.run([sys.executable, "-m", "tests.shared_prefix_f64", "ple"], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert [r["variant"] for r in rows] == ["ple"]
    for r in rows:
        assert r["dtypes"] == ["float64"] and r["trees"] >= 1, r
        assert r["grad_max"] > 0.1, r  # gradients that could differ
        assert r["loss_diff"] < 1e-12 and r["grad_diff"] < 1e-11, r
