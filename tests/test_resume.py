"""Exact resume: a step directory left half-written (no Orbax commit markers) and an Orbax temp dir are
ignored, and the resumed run ends bit-identical to an uninterrupted one. The uninterrupted reference run and
the helpers here are shared with tests/test_sigterm.py. (Random SIGKILL/SIGTERM instants: the kill harness,
tests/test_kill_harness.py and benchmarks/kill_harness.py.)
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks import kill_harness
from benchmarks.kill_harness import train_rows  # noqa: F401 (shared with test_sigterm)
from tests.conftest import REPO

MAX_STEPS = 12


def command(tiny_dir: Path, ckpt: Path) -> list[str]:
    return kill_harness.command(tiny_dir, ckpt, MAX_STEPS)


def environment(cache: Path, delay: float = 0.0) -> dict:
    return kill_harness.environment(cache, delay)


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


def tensorboard_scalars(tb_dir: Path) -> list[tuple[str, int]]:
    """(tag, step) of every scalar in the events files under `tb_dir`, as TensorBoard shows them: files in the order
    of their names (their start times), a session's start marked at step s (tensorboardX's purge_step) hiding what
    the files before it hold at s and after (tensorboard's EventAccumulator, `_CheckForRestartAndMaybePurge`)."""
    import struct

    from tensorboardX.proto import event_pb2

    seen: list[tuple[str, int]] = []
    for path in sorted(tb_dir.rglob("events.out.tfevents.*"), key=lambda p: p.name):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):  # TFRecords: length (8 bytes), its CRC (4), the event, its CRC (4)
            n = struct.unpack("<Q", data[i:i + 8])[0]
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 16 + n
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                seen = [(tag, step) for tag, step in seen if step < event.step]
            seen += [(v.tag, event.step) for v in event.summary.value]
    return seen


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
    # kept (possibly the only copy), and never removed by a run: said with the space it takes, at every start
    assert re.search(rf"{re.escape(str(ckpt))} holds 1 step directory set aside as incomplete \(\d+\.\d\d KB: "
                     rf"{MAX_STEPS}\.incomplete-\d+\), kept as possibly the only copy of that step; no run removes "
                     rf"them", log.read_text()), tail(log)
    assert train_rows(ckpt)[-1]["loss"] == reference["losses"][MAX_STEPS]
    # the stopped run's record of step 12 (its checkpoint set aside) goes; the resumed run writes it: each step once
    assert [r["step"] for r in train_rows(ckpt)] == list(range(1, MAX_STEPS + 1)), tail(ckpt / "metrics.jsonl")
    assert_same_params(ckpt, reference["ckpt"], MAX_STEPS)
    # TensorBoard too: step 12, trained before the stop and again by the resumed run, is shown once (the resumed
    # run's), not as two points of one step
    losses = [step for tag, step in tensorboard_scalars(ckpt / "tensorboard") if tag == "train/loss"]
    assert losses == list(range(1, MAX_STEPS + 1)), (losses, sorted(set(tensorboard_scalars(ckpt / "tensorboard"))))


def test_a_restart_with_no_step_saved_starts_metrics_afresh(tiny_dir, reference, tmp_path):
    """The run's directory with its records but no complete step (a kill during the save of step 1, the record of
    which is written as the save begins): the rerun trains from step 1 again, and step 1 was in metrics.jsonl twice
    (and the eval of step 0). Its records go; this one's are written once."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    for name in ("gemma_tpu_run.json", "metrics.jsonl"):
        shutil.copy(reference["ckpt"] / name, ckpt / name)
    log = tmp_path / "rerun.log"
    with log.open("w") as err:
        proc = subprocess.run(command(tiny_dir, ckpt) + ["train.max_steps=2"], cwd=REPO,
                              env=environment(reference["cache"]), stdout=subprocess.DEVNULL, stderr=err, timeout=600)
    assert proc.returncode == 0, tail(log)
    assert [(r["step"], r["loss"]) for r in train_rows(ckpt)] == [(1, reference["losses"][1]),
                                                                  (2, reference["losses"][2])], tail(log)
    assert "record(s) of the attempt that saved no step dropped" in log.read_text()


def test_a_run_stopped_after_its_last_save_is_finished_by_the_rerun(tiny_dir, reference, tmp_path):
    """A kill during the end-of-run evaluation leaves the last step saved and no summary.json: the rerun said
    "nothing to do", and the run never got its final evaluation nor its summary. The rerun finishes it (the
    evaluation of that step, once, and summary.json; nothing trained), and the next one has nothing to do."""
    from gemma_tpu.train.run import run_finished

    ckpt = tmp_path / "ck"
    shutil.copytree(reference["ckpt"], ckpt)
    (ckpt / "summary.json").unlink()
    assert not run_finished(ckpt, MAX_STEPS)
    log = tmp_path / "rerun.log"
    def rerun(eval_batches):
        with log.open("w") as err:
            return subprocess.run(command(tiny_dir, ckpt) + ["data.eval_path=tests/data/chat_sample.jsonl",
                                                             f"data.eval_max_batches={eval_batches}"],
                                  cwd=REPO, env=environment(reference["cache"]), stdout=subprocess.DEVNULL,
                                  stderr=err, timeout=600)

    proc = rerun(2)
    assert proc.returncode == 0, tail(log)
    assert "finishing it: the evaluation of that step and the summary" in log.read_text(), tail(log)
    assert run_finished(ckpt, MAX_STEPS)  # the next rerun: nothing to do
    assert [(r["step"], r["loss"]) for r in train_rows(ckpt)] == sorted(reference["losses"].items())
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["mode"] == "eval"] == [MAX_STEPS]
    summary = json.loads((ckpt / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_from"]) == (MAX_STEPS, MAX_STEPS)
    assert summary["final_train_loss"] == reference["losses"][MAX_STEPS]
    assert summary["final_eval_loss"] == rows[-1]["loss"] and rows[-1]["mode"] == "eval"
    assert_same_params(ckpt, reference["ckpt"], MAX_STEPS)
    # another eval set (data.eval_max_batches, like another data.eval_path, changes what was measured): the step is
    # evaluated again, where its record of the old set skipped it and the log promised an evaluation it did not run
    (ckpt / "summary.json").unlink()
    proc = rerun(1)
    assert proc.returncode == 0, tail(log)
    assert "finishing it: the evaluation of that step and the summary" in log.read_text(), tail(log)
    assert "evaluation in " in log.read_text() and "was of other eval data" in log.read_text(), tail(log)
    again = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()][len(rows):]
    assert [(r["mode"], r["step"]) for r in again] == [("eval", MAX_STEPS)], again
    assert again[0]["eval_data"] != rows[-1]["eval_data"] and again[0]["loss"] != rows[-1]["loss"]
    assert json.loads((ckpt / "summary.json").read_text())["final_eval_loss"] == again[0]["loss"]

    # the next rerun has nothing to do, and clears the lock a dead trainer left (it stayed until a run trained)
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = ckpt / "gemma_tpu_run.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "2026-11-28T00:00:00"}))
    with log.open("w") as err:
        proc = subprocess.run(command(tiny_dir, ckpt), cwd=REPO, env=environment(reference["cache"]),
                              stdout=subprocess.DEVNULL, stderr=err, timeout=600)
    assert proc.returncode == 0 and "nothing to do" in log.read_text(), tail(log)
    assert f"taking over a stale lock (PID {dead.pid}" in log.read_text() and not lock.exists(), tail(log)


def test_readers_of_the_latest_step_say_a_newer_one_is_incomplete(tmp_path, caplog):
    """The converters, evaluate and chat take the latest complete step when no --step is given: a newer step
    cut short (no commit markers) was passed over without a word, and the user merged an older step than the
    one they saw on disk."""
    import logging

    from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS, resolve_step
    from gemma_tpu.core.errors import UserError

    for step in (2, 4):
        (tmp_path / str(step) / "model_params").mkdir(parents=True)
        for m in COMMIT_MARKERS:
            (tmp_path / str(step) / m).write_text("{}")
    (tmp_path / "6" / "model_params").mkdir(parents=True)  # a save cut short
    (tmp_path / "6" / COMMIT_MARKERS[1]).write_text("{}")
    # Orbax's own leftover of a save that failed (a full disk) or was killed: passed over without a word too
    (tmp_path / "8.orbax-checkpoint-tmp" / "model_params").mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        assert resolve_step(tmp_path, None) == 4
        assert resolve_step(tmp_path, 2) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}: steps 6, 8 are incomplete (no Orbax commit markers: a save cut short or failed); using step 4, "
        "the last complete one"]
    with pytest.raises(UserError, match=r"no checkpoint for step 8 \(its save did not complete; have: 2, 4\)"):
        resolve_step(tmp_path, 8)


def test_a_resume_drops_the_stopped_runs_records_after_its_step(tmp_path):
    """metrics.jsonl after a kill holds records of steps past the last checkpoint; the resumed run trains and writes
    them again (each step appeared twice, a plot of it doubled back). They go, with a line cut short; the rest stays
    byte for byte, and a file with nothing to drop is not rewritten."""
    from gemma_tpu.train.trainer import drop_records_after

    path = tmp_path / "metrics.jsonl"
    assert drop_records_after(path, 4) == 0 and not path.exists()
    kept = ['{"mode": "eval", "step": 0, "loss": 5.0}', '{"mode": "train", "step": 4, "loss": 1.25}']
    path.write_text("\n".join([*kept, '{"mode": "train", "step": 5, "loss": 1.0}',
                               '{"mode": "eval", "step": 6, "loss": null}', '{"mode": "train", "st']))
    assert drop_records_after(path, 4) == 3
    assert path.read_text() == "\n".join(kept) + "\n"
    mtime = path.stat().st_mtime_ns
    assert drop_records_after(path, 4) == 0 and path.stat().st_mtime_ns == mtime


def test_a_resumed_step_counts_as_evaluated_only_on_the_same_eval_data(tmp_path):
    """A resume with another data.eval_path skipped evaluating its step: metrics.jsonl held a record of the old eval
    set. Only a record of this set (its eval_fingerprint: rows and how many evaluated) counts; one from before
    fingerprints were kept is of an unknown set."""
    import types

    from gemma_tpu.data import eval_fingerprint
    from gemma_tpu.train.trainer import step_evaluated

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"mode": "eval", "step": 4, "loss": 2.0, "eval_data": "abc:8"}\n'
                    '{"mode": "eval", "step": 6, "loss": 2.0}\n')
    assert step_evaluated(path, 4, "abc:8") and not step_evaluated(path, 4, "def:8")
    assert not step_evaluated(path, 6, "abc:8") and not step_evaluated(path, 2, "abc:8")
    assert not step_evaluated(path, 4, None)
    prepared = types.SimpleNamespace(rows=[[]] * 10, digest=lambda: "abc")
    assert eval_fingerprint(prepared, 4) == eval_fingerprint(prepared, 4, 3) == "abc:10"
    assert eval_fingerprint(prepared, 4, 2) == "abc:8"


def test_a_resumed_runs_summary_keeps_the_runs_first_evaluation(tmp_path):
    """summary.json's first_eval_loss (the untrained model's, what final_eval_loss is read against) was the first
    evaluation of the session that finished the run: after a preemption and resume, that of the restored step or the
    last one, often equal to final_eval_loss. It is now the run's first on this eval set, from metrics.jsonl."""
    import time
    import types

    from gemma_tpu.train.trainer import CompileCounter, Trainer

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"mode": "eval", "step": 0, "loss": 3.0, "eval_data": "old:8"}\n'
                    '{"mode": "eval", "step": 0, "loss": 2.5, "eval_data": "abc:8"}\n'
                    '{"mode": "train", "step": 3, "loss": 2.0}\n'
                    '{"mode": "eval", "step": 3, "loss": 1.8, "eval_data": "abc:8"}\n'
                    '{"mode": "eval", "step": 6, "loss": 1.5, "eval_data": "abc:8"}\n')

    def summary(resumed_from, history):
        t = types.SimpleNamespace(metrics_path=path, eval_data="abc:8", resumed_from=resumed_from, primary=True,
                                  train_steps=6, started=time.time(), compiles=1, compile_counter=CompileCounter(),
                                  history=history, price_per_hour=0.0)
        for name in ("_recorded_first_eval_loss", "_recorded_eval_loss", "_recorded_train_loss"):
            setattr(t, name, getattr(Trainer, name).__get__(t))
        return Trainer.summary(t)

    history = [{"mode": "train", "step": 6, "loss": 1.9}, {"mode": "eval", "step": 6, "loss": 1.5}]
    assert (summary(3, history)["first_eval_loss"], summary(3, history)["final_eval_loss"]) == (2.5, 1.5)
    assert summary(0, [{"mode": "eval", "step": 0, "loss": 4.0}, *history])["first_eval_loss"] == 4.0


def test_a_run_stopped_before_its_first_save_leaves_nothing_to_refuse(tmp_path, caplog):
    """A run killed before step 1 (data preparation, model load, the first compile) leaves gemma_tpu_run.json and no
    step: a rerun with another lora.rank was refused as 'checkpoint was trained with lora.rank=4', naming a
    checkpoint never written. It starts afresh now; once a step is on disk the change is refused as before."""
    import logging

    from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS, write_metadata
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.resume import check_resume_compatible

    def meta(rank: int) -> dict:
        return {"base_model": {"local_dir": "/models/base", "family": "gemma3"}, "dtype": "float32",
                "lora": {"enabled": True, "rank": rank, "alpha": 8.0, "targets": ["q_proj"]},
                "config": {"train": {"max_steps": 6}}}

    write_metadata(tmp_path, meta(4))
    with caplog.at_level(logging.INFO, logger="gemma_tpu.train"):
        check_resume_compatible(tmp_path, meta(8))
    assert "no checkpoint step saved yet" in caplog.text
    (tmp_path / "2" / "model_params").mkdir(parents=True)
    for marker in COMMIT_MARKERS:
        (tmp_path / "2" / marker).write_text("{}")
    with pytest.raises(UserError, match=r"checkpoint was trained with lora.rank=4, this run has 8; resume it with "
                                        r"lora.rank=4, or use another checkpoint.dir"):
        check_resume_compatible(tmp_path, meta(8))


def test_a_step_that_is_a_symbolic_link_is_refused_naming_it(tmp_path):
    """A link named like a step (`3 -> ../other_run/3`) was taken for the latest step: the run resumed from another
    run's step without a word, and when max_to_keep dropped it, Orbax's clean-up failed ("Cannot call rmtree on a
    symbolic link") and stopped the run mid-way. It is refused before anything loads, naming the link."""
    from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS, write_metadata
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.resume import check_resume_compatible

    meta = {"base_model": {"local_dir": "/models/base", "family": "gemma3"}, "dtype": "float32",
            "lora": {"enabled": True, "rank": 4, "alpha": 8.0, "targets": ["q_proj"]},
            "config": {"train": {"max_steps": 2}}}
    run, other = tmp_path / "run", tmp_path / "other"
    for d, step in ((run, 2), (other, 3)):
        write_metadata(d, meta)
        (d / str(step) / "model_params").mkdir(parents=True)
        for marker in COMMIT_MARKERS:
            (d / str(step) / marker).write_text("{}")
    check_resume_compatible(run, meta)
    (run / "3").symlink_to(other / "3")
    with pytest.raises(UserError, match=rf"^{run / '3'}: a symbolic link named like a checkpoint step \(to "
                                        rf"{other / '3'}\)"):
        check_resume_compatible(run, meta)
    assert (other / "3" / "model_params").is_dir()


@pytest.mark.parametrize("what, was, hint", [
    ("lora.rank", 4, "resume it with lora.rank=4, or "),
    ("lora.enabled", False, "resume it with lora.enabled=false, or "),
    ("lora.targets", ["q_proj", "v_proj"], "resume it with lora.targets=[q_proj,v_proj], or "),
    ("model.dtype", "bfloat16", "resume it with model.dtype=bfloat16, or "),
    ("lora.base_quantization", None, "resume it with lora.base_quantization=null, or "),
    ("train.grad_accum_steps", 2, "resume it with train.grad_accum_steps=2, or "),
    ("base model", "/models/base", "resume it with model.path=/models/base, or "),
    ("family", "gemma3", "resume it with a gemma3 base (model.path), or "),
    ("lora.enabled", None, ""),  # a damaged record: nothing to set back
])
def test_a_refused_resume_says_how_to_resume(what, was, hint):
    """'checkpoint was trained with lora.rank=4, this run has 8; use another checkpoint.dir' did not say the other
    way out, which the data position's refusal does: the override that sets the recorded value back."""
    from gemma_tpu.train.resume import resume_hint

    assert resume_hint(what, was) == hint


def test_a_refused_resume_gives_both_values_as_an_override_spells_them(tmp_path):
    """'checkpoint was trained with lora.enabled=True, this run has False; resume it with lora.enabled=true' gave
    Python's spelling beside the override's, and lora.targets as a Python list with quotes."""
    from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS, write_metadata
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.resume import check_resume_compatible

    def meta(enabled: bool, targets: list[str]) -> dict:
        return {"base_model": {"local_dir": "/models/base", "family": "gemma3"}, "dtype": "float32",
                "lora": {"enabled": enabled, "rank": 4, "alpha": 8.0, "targets": targets},
                "config": {"train": {"max_steps": 2}}}

    write_metadata(tmp_path, meta(True, ["q_proj", "v_proj"]))
    (tmp_path / "2" / "model_params").mkdir(parents=True)
    for marker in COMMIT_MARKERS:
        (tmp_path / "2" / marker).write_text("{}")
    with pytest.raises(UserError) as e:
        check_resume_compatible(tmp_path, meta(False, ["q_proj", "v_proj"]))
    assert "checkpoint was trained with lora.enabled=true, this run has false; resume it with lora.enabled=true, " \
           "or use another checkpoint.dir" in str(e.value)
    with pytest.raises(UserError) as e:
        check_resume_compatible(tmp_path, meta(True, ["q_proj"]))
    assert "checkpoint was trained with lora.targets=[q_proj,v_proj], this run has [q_proj]; resume it with " \
           "lora.targets=[q_proj,v_proj], or " in str(e.value)


def test_a_file_named_like_a_step_is_refused_naming_it(tmp_path):
    """A plain file named like a step (`checkpoints/4`: notes, a copy's leftover) was deleted without a word by
    Orbax when the run saved step 4 (the user's file lost). It is refused before anything loads, naming the file,
    with run metadata or without, and is left as it was."""
    from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS, write_metadata
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.resume import check_resume_compatible

    meta = {"base_model": {"local_dir": "/models/base", "family": "gemma3"}, "dtype": "float32",
            "lora": {"enabled": True, "rank": 4, "alpha": 8.0, "targets": ["q_proj"]},
            "config": {"train": {"max_steps": 2}}}
    fresh, run = tmp_path / "fresh", tmp_path / "run"
    fresh.mkdir()
    write_metadata(run, meta)
    (run / "2" / "model_params").mkdir(parents=True)
    for marker in COMMIT_MARKERS:
        (run / "2" / marker).write_text("{}")
    check_resume_compatible(run, meta)
    for d in (fresh, run):
        (d / "4").write_text("my notes\n")
        with pytest.raises(UserError, match=rf"^{d / '4'}: a file named like a checkpoint step, not a step directory;"
                                            rf" saving step 4 would replace it: move it out of checkpoint.dir"):
            check_resume_compatible(d, meta)
        assert (d / "4").read_text() == "my notes\n"


def test_a_directory_of_ones_own_named_like_an_old_step_is_refused_naming_it(tiny_dir, reference, tmp_path):
    """A directory the user made in checkpoint.dir named like a step older than the last (`2/notes.txt`) was taken by
    Orbax for step 2 and deleted with the user's files as checkpoint.max_to_keep dropped old steps, without a word
    of ours. It is refused before anything is written, naming it and what it holds; what a save or a clean-up cut
    short leaves of a step (Orbax's names alone) is not refused."""
    from gemma_tpu.train.resume import check_resume_compatible

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    (ckpt / "2" / "model_params").mkdir(parents=True)  # a clean-up of step 2 killed midway: Orbax's names
    meta = json.loads((ckpt / "gemma_tpu_run.json").read_text())
    check_resume_compatible(ckpt, meta)
    (ckpt / "2" / "notes.txt").write_text("mine\n")
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    log = tmp_path / "resume.log"
    with log.open("w") as err:
        proc = subprocess.run(kill_harness.command(tiny_dir, ckpt, MAX_STEPS + 2), cwd=REPO,
                              env=environment(reference["cache"]), stdout=subprocess.DEVNULL, stderr=err, timeout=600)
    lines = [l for l in log.read_text().splitlines() if l.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in log.read_text(), tail(log)
    assert lines[0] == (f"error: {ckpt / '2'}: a directory named like checkpoint step 2 that is not one (it holds "
                        f"notes.txt, which no save writes); Orbax takes it for a step and deletes it with its files as "
                        f"checkpoint.max_to_keep drops old steps: move it out of checkpoint.dir")
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def test_step_names_orbax_does_not_read_are_not_taken_for_steps(tmp_path):
    """`04` (a copy of step 4 named by a script's %02d) was taken here for step 4, which Orbax does not read: the
    resume failed naming `4/_CHECKPOINT_METADATA: missing`, a path that was never there. It is refused naming it.
    `²` and `³` (digits to str.isdigit, not to int()) were a ValueError traceback before anything was said; they
    are no step to anyone and are left alone."""
    import shutil as sh

    from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS, list_steps, set_aside_incomplete_steps, write_metadata
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.resume import check_resume_compatible

    meta = {"base_model": {"local_dir": "/models/base", "family": "gemma3"}, "dtype": "float32",
            "lora": {"enabled": True, "rank": 4, "alpha": 8.0, "targets": ["q_proj"]},
            "config": {"train": {"max_steps": 2}}}
    write_metadata(tmp_path, meta)
    (tmp_path / "2" / "model_params").mkdir(parents=True)
    for marker in COMMIT_MARKERS:
        (tmp_path / "2" / marker).write_text("{}")
    (tmp_path / "²").mkdir()
    (tmp_path / "³").write_text("notes")
    assert set_aside_incomplete_steps(tmp_path) == [] and list_steps(tmp_path) == [2]
    check_resume_compatible(tmp_path, meta)
    sh.copytree(tmp_path / "2", tmp_path / "04")
    assert list_steps(tmp_path) == [2]
    with pytest.raises(UserError, match=rf"^{tmp_path / '04'}: named like checkpoint step 4, but Orbax reads a step "
                                        rf"only by its plain number: rename it 4, or move it out of checkpoint.dir$"):
        check_resume_compatible(tmp_path, meta)


def test_a_full_finetune_recording_no_lora_settings_resumes(tiny_dir, reference, tmp_path):
    """A full fine-tune whose gemma_tpu_run.json records `"lora": null` (or {}), which the converters take for what
    its step holds, was refused on resume as 'trained with lora.enabled=null, this run has false'. It resumes, and
    a full fine-tune's unused LoRA settings (lora.rank) are not compared. A LoRA run's step recording no LoRA
    settings is refused saying what it is; so is a LoRA resume of the full fine-tune. (`{}` and an absent section
    are read as null is, by one test.)"""
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.resume import check_resume_compatible
    from tests.conftest import assert_one_line_error, run_cli

    ck = tmp_path / "full"
    args = ["--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}", "lora.enabled=false",
            "data.eval_path=null", "checkpoint.every_steps=1"]
    env = environment(reference["cache"])
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=1", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((ck / "gemma_tpu_run.json").read_text())
    (ck / "gemma_tpu_run.json").write_text(json.dumps({**meta, "lora": None}))
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=2", "lora.enabled=true", env=env)
    assert_one_line_error(proc, f"{ck}: checkpoint was trained with lora.enabled=false, this run has true")
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=2", "lora.rank=8", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ck / "summary.json").read_text())["resumed_from"] == 1
    assert [r["step"] for r in train_rows(ck)] == [1, 2]

    lora_run = tmp_path / "lora"
    shutil.copytree(reference["ckpt"], lora_run)
    meta = json.loads((lora_run / "gemma_tpu_run.json").read_text())
    (lora_run / "gemma_tpu_run.json").write_text(json.dumps({**meta, "lora": None}))
    with pytest.raises(UserError, match=rf"lora is null \(no LoRA settings recorded\) but step {MAX_STEPS} holds LoRA"):
        check_resume_compatible(lora_run, {**meta, "config": {**meta["config"], "train": {
            **meta["config"]["train"], "max_steps": MAX_STEPS + 1}}})
