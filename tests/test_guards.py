"""Non-finite guard: a diverging run stops with the step named (or skips the bad batches), and no
checkpoint ever holds non-finite parameters."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import assert_one_line_error, run_cli

# lr 1e5 without clipping drives the tiny model's loss to NaN within a few steps
DIVERGE = ["train.learning_rate=1e5", "train.grad_clip=0", "train.max_steps=8", "data.eval_path=null",
           "checkpoint.every_steps=2"]


def _run(tiny_dir, ckpt, *extra):
    return run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={ckpt}", *DIVERGE, *extra)


def _finite_checkpoints(ckpt):
    from gemma_tpu.checkpoint.metadata import list_steps, read_params

    steps = list_steps(ckpt)
    assert steps
    for step in steps:
        for name, value in read_params(ckpt, step).items():
            assert np.isfinite(np.asarray(value)).all(), f"step {step}: {name} is not finite"
    return steps


@pytest.fixture(scope="module")
def stopped(tiny_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("nonfinite") / "stop"
    return ckpt, _run(tiny_dir, ckpt)


def test_stop_names_the_step_and_exits_3(stopped):
    ckpt, proc = stopped
    line = assert_one_line_error(proc, "non-finite loss", "at step")
    assert proc.returncode == 3
    bad = [json.loads(l) for l in (ckpt / "metrics.jsonl").read_text().splitlines()]
    first_bad = next(r["step"] for r in bad if r["mode"] == "train" and not np.isfinite(r["loss"]))
    assert f"at step {first_bad}" in line


def test_checkpoints_after_divergence_hold_finite_params(stopped):
    ckpt, _ = stopped
    _finite_checkpoints(ckpt)


def test_skip_runs_to_the_end_with_finite_params(tiny_dir, tmp_path):
    ckpt = tmp_path / "skip"
    proc = _run(tiny_dir, ckpt, "train.on_nonfinite=skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "non-finite loss" in proc.stderr  # warned, not silent
    steps = _finite_checkpoints(ckpt)
    assert max(steps) == 8
