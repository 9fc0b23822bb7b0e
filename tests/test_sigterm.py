
"""SIGTERM (the TPU preemption notice) at a safe point (gemma_tpu.train.preempt): the step in progress
finishes, is saved completely (an async save under way is waited for), the run exits 143, and the resumed
run ends bit-identical to an uninterrupted one, whether the signal came before step 1 or mid-run.

It used to save whatever state the handler interrupted: a data position one batch ahead of the step
(the resumed run skipped a batch), and `os._exit` right after a save that raised, leaving the announced
step as an unfinished Orbax temp dir."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_resume import (  # noqa: F401
    MAX_STEPS, assert_same_params, command, environment, reference, tail, tensorboard_scalars, train_rows)

# one xdist worker for this module: the reference run (a module-scoped fixture) is then made once, not per worker
pytestmark = pytest.mark.xdist_group("sigterm")

READY = "SIGTERM (preemption) from here on"


def _start(tiny_dir, ckpt: Path, cache: Path, log: Path, delay: float) -> subprocess.Popen:
    return subprocess.Popen(command(tiny_dir, ckpt), cwd=REPO, env=environment(cache, delay),
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def _wait_for(cond, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"exited early ({proc.returncode}): {tail(log)}"
        assert time.time() < deadline, tail(log)
        time.sleep(0.05)


def _resume_and_compare(tiny_dir, ckpt: Path, reference, log: Path) -> None:
    with log.open("w") as err:
        proc = subprocess.run(command(tiny_dir, ckpt), cwd=REPO, env=environment(reference["cache"]),
                              stdout=subprocess.DEVNULL, stderr=err, timeout=900)
    assert proc.returncode == 0, tail(log)
    rows = train_rows(ckpt)
    for row in rows:  # every loss ever logged, before and after the interruption
        assert row["loss"] == reference["losses"][row["step"]], (row, tail(log))
    # every step once: the saved step's record is written at the SIGTERM exit (Tunix held it back until the
    # next step, so it was lost before)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), [r["step"] for r in rows]
    assert_same_params(reference["ckpt"], ckpt, MAX_STEPS)
    # TensorBoard too: the signal's exit wrote out its events (they were lost with os._exit)
    assert [s for tag, s in tensorboard_scalars(ckpt / "tensorboard") if tag == "train/loss"] == list(
        range(1, MAX_STEPS + 1))


def test_sigterm_before_step_one_then_resume_is_bit_identical(tiny_dir, reference, tmp_path):
    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    proc = _start(tiny_dir, ckpt, reference["cache"], log, delay=2.0)  # the first batch waits 2 s
    _wait_for(lambda: READY in log.read_text(errors="replace"), proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143, tail(log)
    text = log.read_text(errors="replace")
    assert "SIGTERM before step 1: nothing to save" in text, tail(log)
    assert not [p for p in ckpt.iterdir() if p.name[:1].isdigit()]  # no step 0 with a data position ahead
    _resume_and_compare(tiny_dir, ckpt, reference, tmp_path / "resume.log")


def test_sigterm_mid_run_saves_the_announced_step_then_resume_is_bit_identical(tiny_dir, reference, tmp_path):
    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    proc = _start(tiny_dir, ckpt, reference["cache"], log, delay=0.3)
    _wait_for(lambda: len(list_steps(ckpt)) >= 3, proc, log)  # async saves every step, now mid-run
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143, tail(log)
    m = re.search(r"SIGTERM: step (\d+) is saved", log.read_text(errors="replace"))
    assert m, tail(log)
    step = int(m.group(1))
    assert 3 <= step < MAX_STEPS and list_steps(ckpt)[-1] == step
    assert not [p.name for p in ckpt.iterdir() if "tmp" in p.name or "incomplete" in p.name]
    _resume_and_compare(tiny_dir, ckpt, reference, tmp_path / "resume.log")
    assert f"resumed at step {step}; data position restored" in (tmp_path / "resume.log").read_text()


EVALS = ["data.eval_path=tests/data/chat_sample.jsonl", "data.eval_max_batches=2", "train.eval_every_steps=3"]


def _signal_during_eval(tiny_dir, ckpt: Path, reference, log: Path, sig, saved: bool = False) -> int:
    """Start a run that evaluates every 3 steps (1 s per batch), send `sig` while the eval after step 3 runs
    (`saved`: once step 3's async save is complete too)."""
    from gemma_tpu.checkpoint.metadata import list_steps

    proc = subprocess.Popen(command(tiny_dir, ckpt) + EVALS, cwd=REPO, env=environment(reference["cache"], 1.0),
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    _wait_for(lambda: "evaluating after step 3" in log.read_text(errors="replace")
              and (not saved or list_steps(ckpt)[-1:] == [3]), proc, log)
    proc.send_signal(sig)  # the eval's first batch is sleeping its 1 s
    return proc.wait(timeout=300)


def _resume_with_eval(tiny_dir, ckpt: Path, reference, log: Path) -> str:
    """Run the same command to the end; every logged train loss and the final params equal the reference's."""
    with log.open("w") as err:
        resumed = subprocess.run(command(tiny_dir, ckpt) + EVALS, cwd=REPO, env=environment(reference["cache"]),
                                 stdout=subprocess.DEVNULL, stderr=err, timeout=900)
    assert resumed.returncode == 0, tail(log)
    for row in train_rows(ckpt):
        assert row["loss"] == reference["losses"][row["step"]], (row, tail(log))
    # every step once: the step a kill found saved had lost its record (Tunix writes it when the next step ends)
    assert [r["step"] for r in train_rows(ckpt)] == list(range(1, MAX_STEPS + 1)), tail(ckpt / "metrics.jsonl")
    assert_same_params(reference["ckpt"], ckpt, MAX_STEPS)
    return log.read_text()


def test_sigterm_during_an_eval_finishes_it_saves_the_step_then_resume_is_bit_identical(tiny_dir, reference, tmp_path):
    """The notice lands while the evaluation after step 3 runs: the eval finishes (its row is logged), step 3 is
    saved, exit 143; the resumed run's training matches the uninterrupted one (evaluation changes no state)."""
    import json

    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    assert _signal_during_eval(tiny_dir, ckpt, reference, log, signal.SIGTERM) == 143, tail(log)
    assert "SIGTERM: step 3 is saved" in log.read_text(errors="replace"), tail(log)
    assert list_steps(ckpt)[-1] == 3
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if r.get("mode") == "eval"] == [0, 3]  # the interrupted eval ran to its end
    text = _resume_with_eval(tiny_dir, ckpt, reference, tmp_path / "resume.log")
    assert "resumed at step 3; data position restored" in text
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if r.get("mode") == "train"] == list(range(1, MAX_STEPS + 1))
    # one eval record per step: Tunix evaluates on entering the loop, and step 3, evaluated before the stop, was
    # evaluated (and recorded) again
    evals = [r["step"] for r in rows if r.get("mode") == "eval"]
    assert evals == [0, 3, 6, 9, 12], evals
    assert "step 3 was evaluated before the stop" in text
    # and in TensorBoard: the evaluation the signal let finish is there, written out at the exit
    shown = tensorboard_scalars(ckpt / "tensorboard")
    assert [s for tag, s in shown if tag == "eval/loss"] == [0, 3, 6, 9, 12], shown
    assert [s for tag, s in shown if tag == "train/loss"] == list(range(1, MAX_STEPS + 1)), shown


def test_sigkill_during_an_eval_then_resume_is_bit_identical(tiny_dir, reference, tmp_path):
    """SIGKILL (no notice) while the evaluation after step 3 runs, step 3 saved: the directory stays resumable, the
    resumed run's training ends identical to the uninterrupted one, and step 3's record is in metrics.jsonl (it was
    written when step 4 ended, so the kill lost it, and the resume from step 3 never wrote it)."""
    import json

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    assert _signal_during_eval(tiny_dir, ckpt, reference, log, signal.SIGKILL, saved=True) == -signal.SIGKILL
    text = _resume_with_eval(tiny_dir, ckpt, reference, tmp_path / "resume.log")
    assert "resumed at step 3; data position restored" in text
    # the killed evaluation left no record of step 3: the resumed run evaluates it on entering the loop, once
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if r.get("mode") == "eval"] == [0, 3, 6, 9, 12]


def test_ctrl_c_mid_run_saves_the_step_like_sigterm(tiny_dir, reference, tmp_path):
    """Ctrl-C (SIGINT) is a preemption notice too: exit 130 with the step saved whole. It raised
    KeyboardInterrupt wherever it landed: mid-save, the step was left as an Orbax temp dir, with a traceback
    from Orbax's thread. A second Ctrl-C stops at once, the lock released. (The save is SIGTERM's, whose
    resume the test above holds bit-identical; not resumed again here, ~20 s of the suite.)"""
    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    proc = _start(tiny_dir, ckpt, reference["cache"], log, delay=0.3)
    _wait_for(lambda: len(list_steps(ckpt)) >= 3, proc, log)  # async saves every step, now mid-run
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130, tail(log)
    text = log.read_text(errors="replace")
    m = re.search(r"Ctrl-C: step (\d+) is saved", text)
    assert m and "Traceback" not in text, tail(log)
    step = int(m.group(1))
    assert 3 <= step < MAX_STEPS and list_steps(ckpt)[-1] == step
    assert not [p.name for p in ckpt.iterdir() if "tmp" in p.name or "incomplete" in p.name or "lock" in p.name]

    ckpt2, log2 = tmp_path / "ck2", tmp_path / "run2.log"  # twice: out at once, in one line, unlocked
    proc = _start(tiny_dir, ckpt2, reference["cache"], log2, delay=2.0)
    _wait_for(lambda: READY in log2.read_text(errors="replace"), proc, log2)
    proc.send_signal(signal.SIGINT)
    _wait_for(lambda: "Ctrl-C again to stop at once" in log2.read_text(errors="replace"), proc, log2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, tail(log2)
    assert "error: interrupted" in log2.read_text(errors="replace")
    assert not (ckpt2 / "gemma_tpu_run.lock").exists()


def test_tensorboard_close_is_bounded_when_its_stop_signal_never_arrives(tmp_path, monkeypatch, caplog):
    """A second Ctrl-C landing inside the TensorBoard queue's machinery left the stop signal undelivered: the
    exit-time close joined the writer thread forever ("error: interrupted", then a hang). Close now gives up
    after TENSORBOARD_STOP_S with a warning (the thread is a daemon: the process exits without it)."""
    import threading

    from tensorboardX import SummaryWriter

    from gemma_tpu.train import trainer

    trainer.guard_tensorboard_writer()
    monkeypatch.setattr(trainer, "TENSORBOARD_STOP_S", 0.5)
    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("loss", 1.0, 1)
    events = writer._get_file_writer().event_writer
    monkeypatch.setattr(events._event_queue, "put", lambda *a, **k: None)  # what the interrupted queue did
    closing = threading.Thread(target=writer.close, daemon=True)
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive(), "close() still waiting for the writer thread"
    assert "TensorBoard: the event writer did not stop within 0 s" in caplog.text


EARLY_SIGTERM = """
import os, signal, sys, time
from gemma_tpu.checkpoint import metadata
def write_metadata(*args, **kwargs):  # the lock is held; the preemption handler comes after the model loads
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
metadata.write_metadata = write_metadata
from gemma_tpu.core.cli import cli_main
from gemma_tpu.train.run import main
sys.exit(cli_main(main))
"""


def test_sigterm_before_the_preemption_handler_releases_the_run_lock(tiny_dir, tmp_path):
    """SIGTERM while the model loads (after the run lock is taken, before the preemption handler exists): its
    default action killed the process where it stood, leaving the lock for another host to wait out (5 min).
    Now it is one line, exit 143, the lock released."""
    import sys

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    with log.open("w") as err:
        proc = subprocess.run([sys.executable, "-c", EARLY_SIGTERM, *command(tiny_dir, ckpt)[3:]], cwd=REPO,
                              env=environment(tmp_path / "cache"), stdout=subprocess.DEVNULL, stderr=err, timeout=300)
    assert proc.returncode == 143, tail(log)
    assert "error: stopped by SIGTERM" in log.read_text(), tail(log)
    assert ckpt.is_dir() and not (ckpt / "gemma_tpu_run.lock").exists(), sorted(p.name for p in ckpt.iterdir())


# SIGTERM sent to itself right after `where` returns, in a gap between writing this session's record and the
# preemption handler (the stop raises SignalExit there)
SIGTERM_AFTER = """
import os, signal, sys
from gemma_tpu.checkpoint import metadata
from gemma_tpu.train import loss
owner, name = {where}
original = getattr(owner, name)
def stopped_after(*args, **kwargs):
    out = original(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return out
setattr(owner, name, stopped_after)
from gemma_tpu.core.cli import cli_main
from gemma_tpu.train.run import main
sys.exit(cli_main(main))
"""


@pytest.mark.parametrize("where", ["loss, 'make_loss_fn'", None],
                         ids=["before-the-handler-is-installed", "at-the-first-batch-boundary"])
def test_a_resume_stopped_before_its_first_save_keeps_the_record_of_the_run_that_wrote_the_steps(
        tiny_dir, reference, tmp_path, where):
    """A resume writes its own gemma_tpu_run.json (its train.max_steps, learning rate) before it trains; stopped
    before it saved a step, it left that record, of a session that trained nothing, beside the steps another session
    wrote, and the next resume compared its schedule against it. Only a stop while the trainer was built put the
    record back: one just after the record was written, or once the trainer was built but before the preemption
    handler took over, or at the first batch boundary (the handler: nothing to save, exit 143) did not. (A resume
    writes its record at its first save now: the test below kills one before it.)"""
    import shutil
    import sys

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    shutil.copytree(reference["ckpt"], ckpt)
    before = (ckpt / "gemma_tpu_run.json").read_bytes()
    cmd = [a.replace(f"train.max_steps={MAX_STEPS}", f"train.max_steps={MAX_STEPS + 2}")
           for a in command(tiny_dir, ckpt)] + ["train.learning_rate=0.02"]
    if where is None:  # the first batch waits 2 s: the signal lands before the session's first step
        proc = subprocess.Popen(cmd, cwd=REPO, env=environment(reference["cache"], 2.0), stdout=subprocess.DEVNULL,
                                stderr=log.open("w"))
        _wait_for(lambda: READY in log.read_text(errors="replace"), proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, tail(log)
        assert f"SIGTERM: step {MAX_STEPS} is saved" in log.read_text(errors="replace"), tail(log)
    else:
        with log.open("w") as err:
            proc = subprocess.run([sys.executable, "-c", SIGTERM_AFTER.format(where=where), *cmd[3:]], cwd=REPO,
                                  env=environment(reference["cache"]), stdout=subprocess.DEVNULL, stderr=err,
                                  timeout=300)
        assert proc.returncode == 143, tail(log)
    assert (ckpt / "gemma_tpu_run.json").read_bytes() == before, tail(log)
    assert not (ckpt / "gemma_tpu_run.lock").exists()


def test_a_resume_killed_before_its_first_save_keeps_the_record_of_the_run_that_wrote_the_steps(
        tiny_dir, reference, tmp_path):
    """SIGKILL (no handler runs) once a resume has restored its step and built its trainer, before its first save:
    the session's own gemma_tpu_run.json, written before the restore, stayed beside the steps another session wrote,
    of a session that trained nothing. It is written at the session's first save; a resume then saves as it should."""
    import json
    import shutil
    import sys

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    shutil.copytree(reference["ckpt"], ckpt)
    before = (ckpt / "gemma_tpu_run.json").read_bytes()
    cmd = [a.replace(f"train.max_steps={MAX_STEPS}", f"train.max_steps={MAX_STEPS + 1}")
           for a in command(tiny_dir, ckpt)] + ["train.learning_rate=0.02"]
    killed = SIGTERM_AFTER.format(where="loss, 'make_loss_fn'").replace("signal.SIGTERM", "signal.SIGKILL")
    with log.open("w") as err:
        proc = subprocess.run([sys.executable, "-c", killed, *cmd[3:]], cwd=REPO, env=environment(reference["cache"]),
                              stdout=subprocess.DEVNULL, stderr=err, timeout=300)
    assert proc.returncode == -signal.SIGKILL, tail(log)
    assert (ckpt / "gemma_tpu_run.json").read_bytes() == before, tail(log)
    with log.open("w") as err:
        proc = subprocess.run(cmd, cwd=REPO, env=environment(reference["cache"]), stdout=subprocess.DEVNULL,
                              stderr=err, timeout=300)
    assert proc.returncode == 0, tail(log)
    meta = json.loads((ckpt / "gemma_tpu_run.json").read_text())
    assert meta["config"]["train"]["learning_rate"] == 0.02 and meta["config"]["train"]["max_steps"] == MAX_STEPS + 1


def test_a_resume_killed_during_its_first_save_keeps_the_record_of_the_run_that_wrote_the_steps(
        tiny_dir, reference, tmp_path):
    """SIGKILL once a resume has written its own gemma_tpu_run.json at its first save, before Orbax committed that
    step: its record, of a session that saved nothing, stayed beside the steps another session wrote (and a next
    resume stopped before its own first save put back that record, not the writer's). The next start puts back the
    record it replaced."""
    import shutil
    import sys

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    shutil.copytree(reference["ckpt"], ckpt)
    before = (ckpt / "gemma_tpu_run.json").read_bytes()
    cmd = [a.replace(f"train.max_steps={MAX_STEPS}", f"train.max_steps={MAX_STEPS + 1}")
           for a in command(tiny_dir, ckpt)] + ["train.learning_rate=0.02"]
    for where, sig in (("metadata, 'write_metadata'", signal.SIGKILL), ("loss, 'make_loss_fn'", signal.SIGTERM)):
        script = SIGTERM_AFTER.format(where=where).replace("signal.SIGTERM", f"signal.{sig.name}")
        with log.open("w") as err:
            proc = subprocess.run([sys.executable, "-c", script, *cmd[3:]], cwd=REPO,
                                  env=environment(reference["cache"]), stdout=subprocess.DEVNULL, stderr=err,
                                  timeout=300)
        assert proc.returncode in (-signal.SIGKILL, 143), tail(log)
    # the second (stopped before its first save) started from the first's leftovers: the writer's record is back
    assert (ckpt / "gemma_tpu_run.json").read_bytes() == before, tail(log)
    assert "put back the record of the run that wrote step" in log.read_text(errors="replace"), tail(log)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".")) == [], sorted(ckpt.iterdir())


def test_sigterm_during_the_end_of_run_eval_exits_143_with_the_last_step_saved(tiny_dir, tmp_path):
    """The evaluation after the last step (4, off the eval interval: run when the loop has ended) is past every
    batch boundary: a SIGTERM there was recorded and the run exited 0, as if it had not been preempted. Now the
    eval finishes, the last step is on disk, exit 143."""
    import json

    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    cmd = command(tiny_dir, ckpt) + EVALS + ["train.max_steps=4"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=environment(tmp_path / "cache", 1.0), stdout=subprocess.DEVNULL,
                            stderr=log.open("w"))
    _wait_for(lambda: "evaluating after step 4" in log.read_text(errors="replace"), proc, log)
    proc.send_signal(signal.SIGTERM)  # the eval's first batch is sleeping its 1 s
    assert proc.wait(timeout=300) == 143, tail(log)
    assert "SIGTERM after the last step: step 4 is saved" in log.read_text(errors="replace"), tail(log)
    assert list_steps(ckpt)[-1] == 4 and not (ckpt / "gemma_tpu_run.lock").exists()
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if r.get("mode") == "eval"] == [0, 3, 4]


def test_the_entry_point_gives_back_the_callers_signal_handlers(tiny_dir, tmp_path):
    """`main` takes SIGTERM from its start (the test above); an in-process caller (the bad-input corpus) got it
    back changed, and each such test was named in a warning. The caller's handlers come back on every exit."""
    import contextlib
    import io

    from gemma_tpu.core.cli import cli_main
    from gemma_tpu.train.run import main

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with contextlib.redirect_stderr(io.StringIO()) as err:
        rc = cli_main(main, ["--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                             f"checkpoint.dir={tmp_path / 'ck'}", f"data.train_path={tmp_path / 'none.jsonl'}"])
    assert rc == 2 and "data file not found" in err.getvalue(), err.getvalue()
    assert {s: signal.getsignal(s) for s in before} == before


SECOND_CTRL_C_IN_SAVE = """
import os, signal, sys
import orbax.checkpoint as ocp
save = ocp.CheckpointManager.save
def save_interrupted(self, *args, **kwargs):  # the second Ctrl-C lands as the preemption's save begins
    os.kill(os.getpid(), signal.SIGINT)
    return save(self, *args, **kwargs)
ocp.CheckpointManager.save = save_interrupted
from gemma_tpu.core.cli import cli_main
from gemma_tpu.train.run import main
sys.exit(cli_main(main))
"""


def test_a_second_ctrl_c_during_the_preemption_save_stops_at_once_with_130(tiny_dir, tmp_path):
    """Ctrl-C, then Ctrl-C again while the step it asked for is being saved: "a second Ctrl-C stops at once", but the
    run exited 1 with "ERROR ... could not save step N (KeyboardInterrupt: )", as if the save had failed. It is the
    stop the user asked for: exit 130, said as such, the step not saved, the lock released."""
    import sys

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    cmd = [sys.executable, "-c", SECOND_CTRL_C_IN_SAVE, *command(tiny_dir, ckpt)[3:], "checkpoint.every_steps=100"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=environment(tmp_path / "cache", 0.5), stdout=subprocess.DEVNULL,
                            stderr=log.open("w"))
    _wait_for(lambda: "step 1/" in log.read_text(errors="replace"), proc, log)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130, tail(log)
    text = log.read_text(errors="replace")
    assert re.search(r"Ctrl-C again: stopped at once; step \d+ was not saved", text), tail(log)
    assert " ERROR " not in text and "Traceback" not in text, tail(log)
    assert not [p for p in ckpt.iterdir() if p.name[:1].isdigit()] and not (ckpt / "gemma_tpu_run.lock").exists()


ON_A_TERMINAL = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                 "os.execv(sys.argv[1], sys.argv[1:])")


def _on_a_terminal(cmd: list[str], env: dict) -> tuple[subprocess.Popen, int]:
    """Start `cmd` in its own session whose controlling terminal is a new pty (as a login shell's job is); returns the
    process and the pty's master end: closing it hangs the terminal up (SIGHUP, and EIO on every later write)."""
    import os
    import pty
    import sys

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", ON_A_TERMINAL, *cmd], cwd=REPO, env=env, stdin=slave,
                            stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    return proc, master


def test_a_closed_terminal_saves_the_step_like_sigterm_then_resume_is_bit_identical(tiny_dir, reference, tmp_path):
    """The terminal closes (SIGHUP) mid-run: the run stopped where it stood (SIGHUP's default action), the step
    in progress unsaved and the run lock left behind. Now it is a preemption notice like SIGTERM: the step is
    saved whole, exit 129, the lock released, though every write to the hung-up terminal fails (EIO)."""
    import os
    import select

    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt, seen = tmp_path / "ck", b""
    proc, master = _on_a_terminal(command(tiny_dir, ckpt), environment(reference["cache"], 0.3))
    try:
        deadline = time.time() + 600
        while len(list_steps(ckpt)) < 3:  # async saves every step, now mid-run; the terminal is read meanwhile
            assert proc.poll() is None and time.time() < deadline, (proc.returncode, seen[-3000:])
            if select.select([master], [], [], 0.05)[0]:
                seen += os.read(master, 65536)
        assert READY.encode() in seen, seen[-3000:]
    finally:
        os.close(master)  # the terminal goes away
    assert proc.wait(timeout=300) == 129
    step = list_steps(ckpt)[-1]
    assert 3 <= step < MAX_STEPS
    assert not [p.name for p in ckpt.iterdir() if "tmp" in p.name or "incomplete" in p.name or "lock" in p.name]
    _resume_and_compare(tiny_dir, ckpt, reference, tmp_path / "resume.log")
    assert f"resumed at step {step}; data position restored" in (tmp_path / "resume.log").read_text()


def test_a_run_started_with_sighup_ignored_outlives_its_terminal(tiny_dir, reference, tmp_path):
    """nohup's runs ignore SIGHUP: the preemption handler leaves that as it is, and the run trains to its end."""
    import json

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    proc = subprocess.Popen(["nohup", *command(tiny_dir, ckpt), "train.max_steps=4"], cwd=REPO,
                            env=environment(reference["cache"], 0.3), stdout=subprocess.DEVNULL, stderr=log.open("w"))
    _wait_for(lambda: "step 1/" in log.read_text(errors="replace"), proc, log)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=300) == 0, tail(log)
    assert json.loads((ckpt / "summary.json").read_text())["steps"] == 4


def test_a_preemption_whose_step_is_saved_but_an_old_step_not_removed_exits_143(tiny_dir, tmp_path):
    """SIGTERM, the step saved, then checkpoint.max_to_keep's removal of an older step failed (a file of it that
    cannot be deleted): the run said "ERROR SIGTERM: could not save step N (... the last complete step on disk is
    N ...)" and exited 2, a failure to a scheduler, with the step it was preempted for on disk. It says the step is
    saved and what failed after, and exits 143."""
    from gemma_tpu.checkpoint.metadata import list_steps

    ckpt, log = tmp_path / "ck", tmp_path / "run.log"
    first = subprocess.run(command(tiny_dir, ckpt) + ["train.max_steps=2", "checkpoint.every_steps=2"], cwd=REPO,
                           env=environment(tmp_path / "cache"), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    stuck = ckpt / "2" / "commit_success.txt"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot make a file undeletable here (chattr +i needs root and ext4 or the like)")
    try:
        proc = subprocess.Popen(command(tiny_dir, ckpt) + ["checkpoint.every_steps=100", "checkpoint.max_to_keep=1"],
                                cwd=REPO, env=environment(tmp_path / "cache", 0.5), stdout=subprocess.DEVNULL,
                                stderr=log.open("w"))
        _wait_for(lambda: "step 3/" in log.read_text(errors="replace"), proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, tail(log)
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=False)
    text = log.read_text(errors="replace")
    m = re.search(r"SIGTERM: step (\d+) is saved, but removing the old checkpoint step 2 in \S+ "
                  r"\(checkpoint.max_to_keep\) failed \(PermissionError: [^)]*\); the last complete step on disk is "
                  r"(\d+), and a restart resumes from it; exiting", text)
    assert m and m.group(1) == m.group(2), tail(log)
    assert list_steps(ckpt)[-1] == int(m.group(1)) > 2 and " ERROR " not in text, tail(log)
