"""Non-finite guard: a diverging run stops with the step named (or skips the bad batches), and no
checkpoint ever holds non-finite parameters."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import assert_one_line_error, run_cli

# one xdist worker for this module: its module-scoped fixtures are then built once, not once per worker
pytestmark = pytest.mark.xdist_group("guards")

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
    return ckpt, _run(tiny_dir, ckpt, "checkpoint.every_steps=1")  # whichever step diverges is a save step


def test_stop_names_the_step_and_exits_3(stopped):
    ckpt, proc = stopped
    line = assert_one_line_error(proc, "non-finite loss", "at step")
    assert proc.returncode == 3
    first_bad = _first_nonfinite_step(ckpt)
    assert f"at step {first_bad}" in line


def _first_nonfinite_step(ckpt) -> int:
    """metrics.jsonl read as strict JSON (jq, JavaScript): a NaN loss was written as the bare word NaN, which made
    the line unreadable to them; now null, named in the record's `nonfinite`."""
    def refuse(word):
        raise AssertionError(f"{word} in metrics.jsonl is not JSON")

    recs = [json.loads(l, parse_constant=refuse) for l in (ckpt / "metrics.jsonl").read_text().splitlines()]
    bad = [r for r in recs if r["mode"] == "train" and r["loss"] is None]
    assert bad and bad[0]["nonfinite"]["loss"] in ("nan", "inf", "-inf"), bad
    return bad[0]["step"]


def test_the_step_whose_loss_went_nonfinite_is_not_saved(stopped):
    """Its update was dropped, so the step was saved holding the previous step's weights under its own
    number and data position: a resume went on past the batch that stopped the run. As for non-finite
    weights, nothing is saved for that step and the message names the step before it."""
    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt, proc = stopped
    first_bad = _first_nonfinite_step(ckpt)
    assert max(list_steps(ckpt)) == first_bad - 1
    assert_one_line_error(proc, f"at step {first_bad}; the last checkpoint on disk is step {first_bad - 1} (finite)")


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


def test_stop_message_names_the_step_really_on_disk(stopped):
    """The message used to say "the last good checkpoint is kept" whatever was on disk."""
    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt, proc = stopped
    line = assert_one_line_error(proc, "non-finite loss")
    assert "last good checkpoint is kept" not in line
    assert f"the last checkpoint on disk is step {max(list_steps(ckpt))} (finite)" in line


def test_a_nonfinite_state_is_never_saved(tmp_path):
    """FiniteCheckpoints in front of Tunix's CheckpointManager: a finite step is saved; a step whose
    LoRA factor (or optimizer state) holds a NaN is refused naming the tensor and the step on disk."""
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tunix.sft.checkpoint_manager import CheckpointManager

    from gemma_tpu.checkpoint.metadata import list_steps
    from gemma_tpu.train.finite_guard import FiniteCheckpoints, NonFiniteState

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 4)))
            self.w_lora_a = nnx.LoRAParam(jnp.ones((4, 2)))
            self.w_lora_b = nnx.LoRAParam(jnp.zeros((2, 4)))

    model = Tiny()
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)
    cm = FiniteCheckpoints(CheckpointManager(str(tmp_path), ocp.CheckpointManagerOptions(
        save_interval_steps=1, enable_async_checkpointing=True)))
    assert cm.save(1, model, opt, save_only_lora_params=True)
    model.w_lora_b.value = model.w_lora_b.value.at[1, 2].set(jnp.nan)
    with pytest.raises(NonFiniteState, match=r"w_lora_b at step 2: step 2 was not saved; the last checkpoint on "
                                             r"disk is step 1"):
        cm.save(2, model, opt, save_only_lora_params=True)
    model.w_lora_b.value = jnp.zeros((2, 4))
    opt.opt_state[0].mu["w_lora_a"].value = jnp.full((4, 2), jnp.inf)
    with pytest.raises(NonFiniteState, match=r"optimizer state .*w_lora_a at step 3"):
        cm.save(3, model, opt, save_only_lora_params=True, force=True)
    cm.close()
    assert list_steps(tmp_path) == [1]


def test_a_preemption_save_refused_as_nonfinite_exits_3(tmp_path):
    """SIGTERM at the step whose loss went NaN: its save is refused (on_nonfinite=stop) and the exit said 1, a
    plain failure a scheduler retries; the same refusal without a signal exits 3."""
    import subprocess
    import sys

    from tests.conftest import REPO

    script = (
        "from types import SimpleNamespace\n"
        "from gemma_tpu.train.preempt import Preemption\n"
        "from gemma_tpu.train.trainer import NonFiniteLoss\n"
        "class Manager:\n"
        "    def save(self, *a, **k):\n"
        "        raise NonFiniteLoss('non-finite loss nan at step 6; the last checkpoint on disk is step 4 (finite)')\n"
        "t = SimpleNamespace(train_steps=6, checkpoint_manager=Manager(), model=None, optimizer=None,\n"
        "                    lora_enabled=True, custom_checkpoint_metadata=dict)\n"
        "Preemption(t).save_and_exit()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "could not save step 6 (NonFiniteLoss: non-finite loss nan at step 6" in proc.stderr


@pytest.mark.parametrize("code, words", [(27, "File too large"), (122, "Disk quota exceeded"),
                                         (28, "No space left on device")])
def test_a_save_that_hits_a_quota_or_the_file_size_limit_says_so(tmp_path, code, words):
    """TensorStore reports a disk quota or the file-size limit as OUT_OF_RANGE, the errno at the end of a long
    message; the one line showed its first 200 characters, which never said why the save failed."""
    from gemma_tpu.train.finite_guard import save_failure

    (tmp_path / "3.orbax-checkpoint-tmp").mkdir()
    e = ValueError(f'OUT_OF_RANGE: Error writing "opt_state.count/0" in OCDBT database at local file '
                   f'"{tmp_path}/3.orbax-checkpoint-tmp/optimizer_state/ocdbt.process_0/": Failed writing: '
                   f'"{tmp_path}/3.orbax-checkpoint-tmp/optimizer_state/d/5d27": Failed to write 18502 bytes to '
                   f"file 11: {words} [os_error_code='{code}']")
    inner = type("Orbax", (), {"directory": tmp_path, "latest_step": lambda self: 2})()
    manager = type("Tunix", (), {"_checkpoint_manager": inner})()
    assert str(save_failure(manager, 3, e)) == (
        f"saving checkpoint step 3 in {tmp_path} failed ({words}); the last complete step on disk is 2, and a "
        "restart resumes from it")


def test_a_failed_first_save_says_a_restart_begins_afresh(tmp_path):
    """With no complete step on disk the line ended "no complete step is on disk, and a restart resumes from it":
    from nothing. It says the restart begins afresh."""
    from gemma_tpu.train.finite_guard import save_failure

    inner = type("Orbax", (), {"directory": tmp_path, "latest_step": lambda self: None})()
    manager = type("Tunix", (), {"_checkpoint_manager": inner})()
    assert str(save_failure(manager, 1, OSError(28, "No space left on device"))) == (
        f"saving checkpoint step 1 in {tmp_path} failed (No space left on device); no complete step is on disk, and "
        "a restart begins afresh")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_removal_of_an_old_step_is_not_said_to_be_a_failed_save(tmp_path, async_save):
    """checkpoint.max_to_keep removes the oldest step once a new one is saved; a removal that failed (a file of the
    old step that cannot be deleted) was said as "saving checkpoint step 2 ... failed" while step 2 was on disk, and
    with async saves "no complete step is on disk, and a restart begins afresh" (Orbax forgets the step whose
    finalisation raised): the restart resumed from step 2. The line names the removal and the step really on disk."""
    import subprocess

    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tunix.sft.checkpoint_manager import CheckpointManager

    from gemma_tpu.checkpoint.metadata import list_steps
    from gemma_tpu.train.finite_guard import CheckpointSaveFailed, FiniteCheckpoints, last_step_on_disk

    class Tiny(nnx.Module):
        def __init__(self):
            self.w_lora_a = nnx.LoRAParam(jnp.ones((4, 2)))

    model = Tiny()
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)
    ckpt = tmp_path / "ck"
    cm = FiniteCheckpoints(CheckpointManager(str(ckpt), ocp.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=1, enable_async_checkpointing=async_save)))
    assert cm.save(1, model, opt, save_only_lora_params=True)
    last_step_on_disk(cm)  # the async save of step 1 finished
    stuck = ckpt / "1" / "commit_success.txt"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot make a file undeletable here (chattr +i needs root and ext4 or the like)")
    try:
        with pytest.raises(CheckpointSaveFailed) as raised:
            cm.save(2, model, opt, save_only_lora_params=True)
            cm.save(3, model, opt, save_only_lora_params=True)  # an async save's failure surfaces at the next one
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=False)
    assert str(raised.value) == (
        f"removing the old checkpoint step 1 in {ckpt} (checkpoint.max_to_keep) failed (PermissionError: [Errno 1] "
        "Operation not permitted: 'commit_success.txt'); the last complete step on disk is 2, and a restart resumes "
        "from it")
    assert list_steps(ckpt) == [2]
