"""The reduced kill harness in CI: 4 kills of the tiny run, resumed to the end bit-identical
(benchmarks/kill_harness.py; the full 100-kill run and its tally are in benchmarks/RESULTS.md). Seed 7 draws
SIGKILL mid-step, at start-up and right after a step (inside its save), and SIGTERM inside a save; 4 kills, not
6, keep the suite inside CI's time budget (6 took 247 s on the AVX2 EPYC). SIGTERM mid-step and at an eval are
tests/test_sigterm.py's, SIGKILL mid-step tests/test_resume.py's as well."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def test_random_kills_resume_bit_identical(tmp_path):
    out = tmp_path / "kills.json"
    proc = subprocess.run([sys.executable, "benchmarks/kill_harness.py", "--kills", "4", "--per-chain", "4",
                           "--seed", "7", "--work", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kills"] == 4 and doc["killed_while_alive"] == 4, doc["by_signal_and_phase"]
    assert doc["chains_bit_identical"] == doc["chains"] >= 1  # a chain near its end stops; the next makes up the rest
    signals = {k.split()[0] for k in doc["by_signal_and_phase"]}
    assert signals == {"SIGKILL", "SIGTERM"}, doc["by_signal_and_phase"]
    phases = {k.split(" ", 1)[1] for k in doc["by_signal_and_phase"]}
    assert {"start-up", "mid-step", "after a step (saving)"} <= phases, doc["by_signal_and_phase"]
    assert f"chains resumed bit-identical: {doc['chains']}/{doc['chains']}" in proc.stdout


def test_a_failed_reference_run_leaves_no_temp_dir_and_no_json(tmp_path):
    """A reference run that fails (here: a model directory without config.json) returned 1 and left the harness's
    temp dir (the tiny model, the JAX cache) behind; so did Ctrl-C. The temp dir goes whatever ends the run."""
    temp, model = tmp_path / "tmp", tmp_path / "not-a-model"
    temp.mkdir()
    model.mkdir()
    proc = subprocess.run([sys.executable, "benchmarks/kill_harness.py", "--model", str(model), "--json",
                           str(tmp_path / "kills.json")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == 1 and f"{model}/config.json: missing" in proc.stderr, proc.stderr[-2000:]
    assert list(temp.iterdir()) == [] and not (tmp_path / "kills.json").exists()
