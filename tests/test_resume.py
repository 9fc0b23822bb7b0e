"""Exact resume under preemption: SIGKILL at 10 seeded-random moments, then bit-identical LoRA params.

One uninterrupted reference run, and one run of the same command that is killed 10 times (during
start-up and restore, mid-step, mid-checkpoint) and restarted each time; after the last restart it
runs to the end. Every loss the killed run ever logged must equal the reference's for that step,
and the final LoRA params must be bit-identical. A step directory left half-written (no Orbax
commit markers) and an Orbax temp dir must be ignored on resume.

Cost: about a dozen process starts of the tiny model; a shared JAX compilation cache keeps each one
to imports + restore.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO

MAX_STEPS = 12
STEP_DELAY = 0.3  # GEMMA_TPU_STEP_DELAY: seconds slept per batch, so kills land mid-run
TRIALS = 10
SEED = 20261121


def command(tiny_dir: Path, ckpt: Path) -> list[str]:
    return [sys.executable, "-m", "gemma_tpu.train", "--config", str(REPO / "configs" / "tiny.yaml"),
            f"model.path={tiny_dir}", f"checkpoint.dir={ckpt}", f"train.max_steps={MAX_STEPS}",
            "checkpoint.every_steps=1", "checkpoint.max_to_keep=3", "checkpoint.async_save=true",
            "data.eval_path=null"]


def environment(cache: Path, delay: float = 0.0) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "GEMMA_TPU_STEP_DELAY": str(delay),
            # the same executables for every start, compiled once
            "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def train_rows(ckpt: Path, offset: int = 0) -> list[dict]:
    path = ckpt / "metrics.jsonl"
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode()
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if row.get("mode") == "train":
            rows.append(row)
    return rows


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """The uninterrupted run (which also fills the compilation cache): its checkpoint dir and losses."""
    root = tmp_path_factory.mktemp("resume")
    ckpt, cache, log = root / "reference", root / "jax-cache", root / "reference.log"
    with log.open("w") as err:
        proc = subprocess.run(command(tiny_dir, ckpt), cwd=REPO, env=environment(cache), stdout=subprocess.DEVNULL,
                              stderr=err, timeout=600)
    assert proc.returncode == 0, tail(log)
    losses = {r["step"]: r["loss"] for r in train_rows(ckpt)}
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    return {"ckpt": ckpt, "cache": cache, "losses": losses, "root": root}


def assert_same_params(a_dir: Path, b_dir: Path, step: int) -> None:
    from gemma_tpu.checkpoint.metadata import read_params

    a, b = read_params(a_dir, step), read_params(b_dir, step)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"step {step}: {k} differs"


def test_sigkill_at_random_moments_then_resume_is_bit_identical(tiny_dir, reference):
    rng = random.Random(SEED)
    root = reference["root"]
    ckpt = root / "killed"
    cmd, env = command(tiny_dir, ckpt), environment(reference["cache"], STEP_DELAY)
    from gemma_tpu.checkpoint.metadata import list_steps

    start_s = None  # seconds from a restart to its first step, measured on the first trial
    trials = []
    for i in range(TRIALS):
        resume_at = (list_steps(ckpt) or [0])[-1]
        k = 1 if start_s is None else rng.choice([0, 1, 1, 2])  # steps to run before the kill (0: during start-up)
        if resume_at + k > MAX_STEPS - 2:  # never let a segment finish
            k = 0
        log = root / f"trial-{i}.log"
        offset = size(ckpt / "metrics.jsonl")
        t0 = time.monotonic()
        with log.open("w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
            try:
                if k == 0:
                    time.sleep(rng.uniform(0.1, 1.0) * start_s)  # loading, restoring, compiling
                else:
                    deadline = t0 + 300
                    while (not any(r["step"] >= resume_at + k for r in train_rows(ckpt, offset))
                           and proc.poll() is None and time.monotonic() < deadline):
                        time.sleep(0.05)
                    if start_s is None:
                        start_s = time.monotonic() - t0
                    time.sleep(rng.uniform(0.0, STEP_DELAY + 0.1))  # mid-step or mid-checkpoint
                alive = proc.poll() is None
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
        assert alive, f"trial {i} (k={k}) ended before it was killed (rc {proc.returncode}): {tail(log)}"
        assert not (ckpt / "summary.json").exists(), f"trial {i}: the run finished before it was killed"
        trials.append({"resumed_at": resume_at, "k": k, "s": round(time.monotonic() - t0, 1),
                       "complete_after": (list_steps(ckpt) or [0])[-1]})
    # the last restart runs to the end
    log = root / "final.log"
    with log.open("w") as err:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, timeout=600)
    assert proc.returncode == 0, tail(log)
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS
    assert summary["resumed_from"] > 0, trials

    # every loss the killed run ever logged (re-run steps included) is the reference's for that step.
    # (Tunix writes a step's metrics after the next step, so a step checkpointed just before a kill
    # may have no row: not every step need appear.)
    ref = reference["losses"]
    rows = train_rows(ckpt)
    assert {r["step"] for r in rows} <= set(ref), trials
    assert sum(t["complete_after"] > t["resumed_at"] for t in trials) >= 3, trials  # kills after progress
    wrong = [(r["step"], r["loss"], ref[r["step"]]) for r in rows if r["loss"] != ref[r["step"]]]
    assert not wrong, f"losses differ from the uninterrupted run (step, got, want): {wrong}; trials {trials}"
    resumed = summary["resumed_from"]
    after = {r["step"]: r["loss"] for r in rows[-(MAX_STEPS - resumed):]}
    assert after == {s: ref[s] for s in range(resumed + 1, MAX_STEPS + 1)}

    kept = list_steps(ckpt)
    assert kept[-1] == MAX_STEPS and kept == list_steps(reference["ckpt"])
    for step in kept:
        assert_same_params(ckpt, reference["ckpt"], step)


def test_half_written_latest_step_is_ignored_on_resume(tiny_dir, reference, tmp_path):
    """The latest step dir lacks Orbax's commit markers (a non-atomic save or a copy cut short) and an
    Orbax temp dir lies beside it: the run resumes from the step before and ends identical."""
    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt = tmp_path / "half"
    shutil.copytree(reference["ckpt"], ckpt)
    last = ckpt / str(MAX_STEPS)
    for marker in ("_CHECKPOINT_METADATA", "commit_success.txt"):
        (last / marker).unlink()
    biggest = max((p for p in (last / "model_params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with biggest.open("r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    tmp_dir = ckpt / f"{MAX_STEPS}.orbax-checkpoint-tmp-1763700000"
    shutil.copytree(ckpt / str(MAX_STEPS - 1), tmp_dir)
    (tmp_dir / "commit_success.txt").unlink()
    assert list_steps(ckpt)[-1] == MAX_STEPS - 1

    log = tmp_path / "resume.log"
    with log.open("w") as err:
        proc = subprocess.run(command(tiny_dir, ckpt), cwd=REPO, env=environment(reference["cache"]),
                              stdout=subprocess.DEVNULL, stderr=err, timeout=600)
    assert proc.returncode == 0, tail(log)
    summary = json.loads((ckpt / "summary.json").read_text())
    assert (summary["resumed_from"], summary["steps"]) == (MAX_STEPS - 1, MAX_STEPS), tail(log)
    assert "set aside" in log.read_text()
    assert list((ckpt).glob(f"{MAX_STEPS}.incomplete-*")), sorted(p.name for p in ckpt.iterdir())
    assert train_rows(ckpt)[-1]["loss"] == reference["losses"][MAX_STEPS]
    assert_same_params(ckpt, reference["ckpt"], MAX_STEPS)
