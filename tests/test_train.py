"""Training end to end on the tiny model: determinism, metrics, bad input (kills: test_sigterm, test_kill_harness)."""

import json
import os
from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error, run_cli

# one xdist worker for this module: its module-scoped fixtures are then built once, not once per worker
pytestmark = pytest.mark.xdist_group("train")


def train(tiny_dir, ckpt, *extra, env=None):
    return run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={ckpt}", *extra, env=env)


def losses(ckpt) -> list[float]:
    rows = [json.loads(l) for l in (Path(ckpt) / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in rows if r["mode"] == "train"}
    return [by_step[k] for k in sorted(by_step)]


@pytest.fixture(scope="module")
def reference_run(tiny_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ref") / "ckpt"
    proc = train(tiny_dir, ckpt, "train.max_steps=8", "checkpoint.every_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt


def test_run_writes_checkpoints_metadata_and_metrics(reference_run):
    ck = reference_run
    meta = json.loads((ck / "gemma_tpu_run.json").read_text())
    assert meta["format"] == "gemma-tpu-checkpoint"
    assert meta["base_model"]["family"] == "gemma3"
    assert meta["lora"]["rank"] == 4 and meta["lora"]["alpha"] == 8.0
    assert sorted(meta["lora"]["targets"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"])
    assert meta["config"]["train"]["max_steps"] == 8
    steps = sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit())
    assert steps[-1] == 8
    assert (ck / "8" / "model_params").is_dir() and (ck / "8" / "optimizer_state").is_dir()
    summary = json.loads((ck / "summary.json").read_text())
    assert summary["train_step_compiles"] == 1
    assert summary["final_eval_loss"] < summary["first_eval_loss"]
    assert summary["examples_per_s"] > 0 and summary["useful_tokens_per_s"] > 0
    rows = [json.loads(x) for x in (ck / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["mode"] == "train" and "step_time_s" in r]
    # batch 4, pad: at least one conversation a row (a shared-prefix tree holds several), a whole number a step
    per_step = [r["examples_per_s"] * r["step_time_s"] for r in timed]
    assert timed and all(n >= 4 - 1e-6 and n == pytest.approx(round(n)) for n in per_step), per_step
    # a save or an evaluation is timed apart, in the record whose interval holds it (saves of steps 2, 4, 6 in those
    # of 3, 5, 7; the evaluations of steps 3 and 6 in those of 3 and 7), not in its step time: the record after a
    # save read as a step ~2x the others on the 270M (save time folded in)
    saved = {r["step"] for r in timed if r.get("save_s", 0) > 0}
    assert saved >= {3, 5, 7} and {r["step"] for r in timed if r.get("eval_s", 0) > 0} == {3, 7}, timed
    # the summary counts them all: the step-0 evaluation (in step 1's record), and the final save and evaluation,
    # which follow the last record (`test_summary_counts_the_saves_and_evaluations_after_the_last_record`)
    train_rows = [r for r in rows if r["mode"] == "train"]
    assert train_rows[0].get("eval_s", 0) > 0, train_rows[0]
    assert summary["save_s"] >= round(sum(r.get("save_s", 0) for r in train_rows), 2) - 0.01, summary
    assert summary["eval_s"] >= round(sum(r.get("eval_s", 0) for r in train_rows), 2) - 0.01, summary
    assert list((ck / "tensorboard").rglob("events.*"))
    l = losses(ck)
    assert len(l) == 8 and l[-1] < l[0]


# A W&B client as far as the trainer reaches it (metrax's backend calls wandb.init): without a key it refuses, as the
# real one does ("No API key configured"), with an error class of wandb's own; the real package is not a dependency
WANDB_WITHOUT_KEY = {
    "wandb/__init__.py": "from wandb import errors\nrun = None\n\n\ndef init(**kwargs):\n"
                         "    raise errors.UsageError('No API key configured. Use `wandb login` to log in.')\n",
    "wandb/errors.py": "class UsageError(Exception):\n    pass\n",
}


def test_wandb_is_used_only_when_asked_for(tiny_dir, tmp_path):
    """With wandb installed and no train.wandb_project, every run went to W&B (Tunix's default backends), and without
    a W&B key it stopped with a traceback before its first step; asked for, its refusal is one line naming the key;
    not installed, the key is refused before the model loads."""
    for name, text in WANDB_WITHOUT_KEY.items():
        (tmp_path / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / name).write_text(text)
    env = {"PYTHONPATH": str(tmp_path / "site")}
    proc = train(tiny_dir, tmp_path / "a", "train.max_steps=1", "data.eval_path=null", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = train(tiny_dir, tmp_path / "b", "train.max_steps=1", "data.eval_path=null", "train.wandb_project=coach",
                 env=env)
    assert_one_line_error(proc, "train.wandb_project=coach: W&B did not start (No API key configured.",
                          "WANDB_MODE=offline")
    proc = train(tiny_dir, tmp_path / "c", "train.max_steps=1", "train.wandb_project=coach")
    assert_one_line_error(proc, "train.wandb_project=coach: the wandb package is not installed")
    assert not (tmp_path / "c").exists()


def test_a_failure_building_the_trainer_on_a_resume_is_not_blamed_on_the_step(tiny_dir, tmp_path):
    """A resume whose trainer failed to start for a reason of its own (here W&B's client, which cannot write its
    directory: a PermissionError) was "cannot restore this checkpoint step (PermissionError: ...); move it aside to
    resume from the one before", of a sound step. The failure is said as what it is; the step and the run's record
    are kept, and the same resume without W&B goes on from the step."""
    site = tmp_path / "site" / "wandb"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("run = None\n\n\ndef init(dir=None, **kwargs):\n"
                                      "    raise PermissionError(13, 'Permission denied', dir + '/wandb')\n")
    ck = tmp_path / "ck"
    proc = train(tiny_dir, ck, "train.max_steps=1", "data.eval_path=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = (ck / "gemma_tpu_run.json").read_bytes()
    proc = train(tiny_dir, ck, "train.max_steps=2", "data.eval_path=null", "train.wandb_project=coach",
                 env={"PYTHONPATH": str(tmp_path / "site")})
    assert_one_line_error(proc, f"error: Permission denied: {ck}/wandb")
    assert "cannot restore" not in proc.stderr and "move it aside" not in proc.stderr
    assert (ck / "gemma_tpu_run.json").read_bytes() == before
    proc = train(tiny_dir, ck, "train.max_steps=2", "data.eval_path=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ck / "summary.json").read_text())["resumed_from"] == 1


def test_a_stop_while_the_trainer_is_built_keeps_the_record_of_the_run_that_wrote_the_steps(tiny_dir, reference_run,
                                                                                            tmp_path):
    """SIGTERM while a resume built its trainer (it restores the step there: minutes for a full fine-tune's optimizer
    state), before the preemption handler took over: exit 143, and gemma_tpu_run.json was left describing the stopped
    session (its train.max_steps, learning rate, ...), which trained nothing, beside the steps another session wrote;
    the next resume compared its schedule against that one. The record is put back, as after a failed restore."""
    import shutil
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    site = tmp_path / "site" / "wandb"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("import sys, time\nrun = None\n\n\ndef init(**kwargs):\n"
                                      "    print('wandb starting', file=sys.stderr, flush=True)\n    time.sleep(120)\n")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_run, ckpt)
    before = (ckpt / "gemma_tpu_run.json").read_bytes()
    proc = subprocess.Popen([sys.executable, "-m", "gemma_tpu.train", "--config", "configs/tiny.yaml",
                             f"model.path={tiny_dir}", f"checkpoint.dir={ckpt}", "train.max_steps=10",
                             "checkpoint.every_steps=2", "train.learning_rate=0.02", "train.wandb_project=coach"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = []
    for line in proc.stderr:
        err.append(line)
        if line.startswith("wandb starting"):
            proc.send_signal(signal.SIGTERM)
            break
    err += proc.stderr.readlines()
    assert proc.wait(timeout=300) == 143, "".join(err)[-3000:]
    assert (ckpt / "gemma_tpu_run.json").read_bytes() == before


def test_summary_names_the_checkpoint_it_summarizes(tiny_dir, reference_run, tmp_path):
    """summary.json said how a run went (its losses, step times) but not of which checkpoint: with a separate
    train.run_dir, or copied beside other results, nothing tied it to the steps it described. It names the
    checkpoint directory (absolute) and the step saved last."""
    summary = json.loads((reference_run / "summary.json").read_text())
    assert summary["checkpoint_dir"] == str(reference_run.resolve()) and summary["checkpoint_step"] == 8, summary
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    proc = train(tiny_dir, ck, "train.max_steps=3", "data.eval_path=null", f"train.run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoint_dir"] == str(ck.resolve()) and summary["checkpoint_step"] == 3, summary
    assert summary["steps"] == 3 and summary["resumed_from"] == 0  # the keys it had are kept


def test_a_new_run_into_a_run_dir_holding_another_runs_records_is_refused(tiny_dir, tmp_path):
    """Two runs (other checkpoint.dirs, other data.train_path) given one train.run_dir: the second appended its
    records to the first's metrics.jsonl (steps 0..N twice, read as one run by a plot and by the resume's own
    readers) and replaced its summary.json. A run that has not started in its checkpoint.dir (no gemma_tpu_run.json)
    is refused before anything is written, naming the file; the first run's files are left as they were."""
    import shutil

    run_dir = tmp_path / "run"
    proc = train(tiny_dir, tmp_path / "a", "train.max_steps=1", "data.eval_path=null", f"train.run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    part = tmp_path / "part.jsonl"
    part.write_text("".join(Path("tests/data/chat_sample.jsonl").read_text().splitlines(True)[:40]))
    proc = train(tiny_dir, tmp_path / "b", "train.max_steps=1", "data.eval_path=null", f"train.run_dir={run_dir}",
                 f"data.train_path={part}")
    assert_one_line_error(proc, f"{run_dir / 'metrics.jsonl'}: written by another run (checkpoint.dir=",
                          "use another train.run_dir, or move")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "b" / "gemma_tpu_run.json").exists()
    # the run's own run dir, resumed, goes on as before; so does a new run once the old records are moved out
    proc = train(tiny_dir, tmp_path / "a", "train.max_steps=2", "data.eval_path=null", f"train.run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.move(run_dir, tmp_path / "old-run")
    proc = train(tiny_dir, tmp_path / "b", "train.max_steps=1", "data.eval_path=null", f"train.run_dir={run_dir}",
                 f"data.train_path={part}")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_resume_into_the_run_dir_of_another_finished_run_is_refused(tiny_dir, reference_run, tmp_path):
    """A checkpoint resumed with train.run_dir set to another run's finished run dir (its summary.json names that
    run's checkpoint): the resume dropped that run's metrics.jsonl records after its own step ("that run stopped
    before saving them", of a run that had saved them all) and replaced its summary.json. Refused before anything
    is written, naming the checkpoint the summary is of."""
    import shutil

    other, ck = tmp_path / "other", tmp_path / "ck"
    shutil.copytree(reference_run, other)
    proc = train(tiny_dir, ck, "train.max_steps=1", "data.eval_path=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    proc = train(tiny_dir, ck, "train.max_steps=2", "data.eval_path=null", f"train.run_dir={other}")
    assert_one_line_error(proc, f"{other / 'summary.json'}: the summary of another run (checkpoint.dir="
                                f"{reference_run.resolve()})", "use another train.run_dir")
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before


def test_summary_counts_the_saves_and_evaluations_after_the_last_record(tiny_dir, tmp_path):
    """The last train record is written as the last step is saved: the run's final save and evaluation came after
    it, and summary.json (which summed the records) said save_s 0.0 and eval_s 0.0 for a run that saved its one
    checkpoint and evaluated twice."""
    ckpt = tmp_path / "ckpt"
    proc = train(tiny_dir, ckpt, "train.max_steps=2", "checkpoint.every_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2]
    summary = json.loads((ckpt / "summary.json").read_text())
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["mode"] == "eval"] == [0, 2]
    assert not any(r.get("save_s") for r in rows), rows  # the save is after every record
    assert summary["save_s"] > 0.05 and summary["eval_s"] > 0, summary


def test_step_times_are_ready_to_ready_around_saves(tiny_dir, tmp_path):
    """A step's time is from the step before it being done to its own being done: timed by when the next step's
    first batch was asked for (dispatch is asynchronous), the record after a save read 0.02 s and the one after it
    two steps' compute (0.019, 0.301 against ~0.16), and the last one, written at the run's end, none; timed when
    Tunix wrote the record (once the next step's micro-batches were all dispatched), records of accumulated steps
    alternated (0.36, 1.18 s for 0.65 s steps). Steps big enough that compute outweighs the host's work. The saves
    are checkpoint.every_steps' and the last step's alone: Orbax's default policy also saved step 1 of every run."""
    ckpt = tmp_path / "ckpt"
    proc = train(tiny_dir, ckpt, "train.max_steps=7", "checkpoint.every_steps=2", "train.batch_size=8",
                 "train.grad_accum_steps=4", "data.seq_len=384", "data.eval_path=null", "checkpoint.max_to_keep=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2, 4, 6, 7]
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    timed = {r["step"]: r["step_time_s"] for r in rows if r["mode"] == "train" and "step_time_s" in r}
    assert set(timed) == {2, 3, 4, 5, 6, 7} and rows[-1]["final_flush"], rows
    assert any(r.get("save_s", 0) > 0 for r in rows if r["step"] in (3, 5)), rows
    times = [timed[k] for k in sorted(timed)]
    median = sorted(times)[len(times) // 2]
    assert min(times) > 0.3 * median and max(times) < 3 * median, timed
    assert all(max(a, b) / min(a, b) < 2.2 for a, b in zip(times, times[1:])), timed  # no alternation


def test_same_seed_same_losses_with_profiling_on(tiny_dir, reference_run, tmp_path):
    """Same seed, same losses; this run also profiles steps 3..4 (train.profile_dir, relative to the run dir):
    the trace is written where the log says, and profiling changes no loss."""
    proc = train(tiny_dir, tmp_path / "again", "train.max_steps=8", "checkpoint.every_steps=2",
                 "train.profile_dir=prof")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "again") == losses(reference_run)
    traces = list((tmp_path / "again" / "prof" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, traces
    assert f"profiling steps 3..4 into {tmp_path / 'again' / 'prof'}" in proc.stderr
    assert f"profile written: {traces[0]}" in proc.stderr


def test_profile_window_past_max_steps_is_one_line_error(tiny_dir, tmp_path):
    proc = train(tiny_dir, tmp_path / "ck", "train.profile_dir=prof", "train.profile_steps=9")
    assert_one_line_error(proc, "train.profile_steps=9", "train.max_steps=6")
    assert not (tmp_path / "ck").exists()


def test_lora_dropout_trains_and_resumes_to_the_same_params(tiny_dir, reference_run, tmp_path):
    """lora.dropout > 0 trains (Qwix needs rngs for it; see gemma_tpu.lora.dropout_active), changes the
    run, and a run stopped at step 2 and resumed ends with the uninterrupted run's losses and params:
    each step's masks come from the seed and the step, not from how the run got there."""
    import numpy as np

    from gemma_tpu.checkpoint.metadata import read_params

    import shutil

    common = ["lora.dropout=0.3", "checkpoint.every_steps=2", "train.eval_every_steps=0", "train.max_steps=4"]
    full = train(tiny_dir, tmp_path / "full", *common)
    assert full.returncode == 0, full.stderr[-3000:]
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "4")  # as if stopped right after step 2's save
    part = train(tiny_dir, tmp_path / "resumed", *common)
    assert part.returncode == 0, part.stderr[-3000:]
    assert "resumed at step 2" in part.stderr
    assert losses(tmp_path / "resumed") == losses(tmp_path / "full")
    assert losses(tmp_path / "full")[1:] != losses(reference_run)[1:4]  # step 1: B = 0, nothing to drop yet
    a, b = read_params(tmp_path / "full", 4), read_params(tmp_path / "resumed", 4)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# A changed key (train.seed here) and changed rows (data.strategy) are the two ways the layout check names a change
# (pipeline._check_same_rows); train.batch_size 4 -> 2 was a third case, the seed's branch with another key (a CLI
# start-up of ~5 s): test_dry_run_refuses_the_resume_the_run_refuses checks that message through the same check.
@pytest.mark.parametrize("change, named", [
    (["data.strategy=pack"], "the rows' contents"),
    (["train.seed=1"], "train.seed 0 -> 1"),
    # the rows' number changed and nothing said why: the setting that did is named
    (["data.seq_len=256"], "rows 56 -> 53; the rows' contents: data.seq_len 192 -> 256)"),
])
def test_resume_with_other_training_rows_is_refused(tiny_dir, reference_run, tmp_path, change, named):
    """The stored data position counts batches of the saved rows; with other rows or another batch or
    order it would silently continue somewhere else. Refused before anything loads or is written."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_run, ckpt)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    proc = train(tiny_dir, ckpt, "train.max_steps=10", *change)
    assert_one_line_error(proc, f"{ckpt / '8'}: its data position is for other training rows (", named)
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def test_a_resume_with_nothing_left_to_train_keeps_the_runs_record(tiny_dir, reference_run, tmp_path):
    """train.max_steps below the step on disk: exit 0, "nothing to do" naming both numbers before the model loads,
    and gemma_tpu_run.json still the record of the run that wrote the steps (it was rewritten with this session's
    settings: a record saying max_steps=4 and another learning rate over steps trained to 8 with the first)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_run, ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    proc = train(tiny_dir, ckpt, "train.max_steps=4", "train.learning_rate=0.5", "checkpoint.every_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before
    assert "already at step 8 >= train.max_steps=4; nothing to do" in proc.stderr
    assert "trainable parameters" not in proc.stderr  # decided before the model loads (minutes for a large one)


def test_a_rerun_of_a_finished_run_with_another_run_dir_has_nothing_to_do(tiny_dir, reference_run, tmp_path):
    """A finished run rerun as it was but for train.run_dir loaded the model, evaluated its last step again and wrote
    a summary.json of that alone into the new directory (final_train_loss null, no step times), said as "the run did
    not finish", and recorded the new directory as the run's. The run's summary.json is where its record says: nothing
    to do, naming it, and nothing is written."""
    import shutil

    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    shutil.copytree(reference_run, ckpt)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    proc = train(tiny_dir, ckpt, "train.max_steps=8", "checkpoint.every_steps=2", f"train.run_dir={other}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"already at step 8 >= train.max_steps=8; nothing to do (a larger train.max_steps trains on); its "
            f"summary.json is in {ckpt}, the run dir its gemma_tpu_run.json names, not in {other}") in proc.stderr, \
        proc.stderr[-3000:]
    assert "trainable parameters" not in proc.stderr
    assert not other.exists()
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def test_resume_after_the_tokenizer_changed_is_refused_naming_it(tiny_dir, reference_run, tmp_path):
    """The same weights with another tokenizer (two tokens' ids swapped) make other rows: refused, and the
    message names the tokenizer among what may have changed (it named only the data file and data settings)."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    tok = json.loads((base / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [k for k in vocab if len(k) == 1 and k.isalpha()][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (base / "tokenizer.json").write_text(json.dumps(tok))
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_run, ckpt)
    proc = train(base, ckpt, "train.max_steps=10", "checkpoint.every_steps=2")
    assert_one_line_error(proc, f"{ckpt / '8'}: its data position is for other training rows (the rows' contents: "
                                "the data file, the tokenizer or a data setting that shapes rows)")


def test_empty_dataset(tiny_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = train(tiny_dir, tmp_path / "ck", f"data.train_path={empty}")
    assert_one_line_error(proc, str(empty), "empty")
    assert not (tmp_path / "ck").exists()


def test_bad_json_line_names_file_and_line(tiny_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n')
    proc = train(tiny_dir, tmp_path / "ck", f"data.train_path={bad}")
    assert_one_line_error(proc, f"{bad}:2")
    assert not (tmp_path / "ck").exists()


def test_resume_with_other_rank_is_refused(tiny_dir, reference_run, tmp_path):
    import shutil

    ck = tmp_path / "copy"
    shutil.copytree(reference_run, ck)
    before = sorted(p.name for p in ck.rglob("*"))
    proc = train(tiny_dir, ck, "train.max_steps=10", "lora.rank=8")
    assert_one_line_error(proc, "lora.rank=4", "8")
    assert sorted(p.name for p in ck.rglob("*")) == before


def test_grad_accumulation_equals_bigger_batch(tiny_dir, tmp_path):
    """train.grad_accum_steps=2 × batch 2 reaches the losses and LoRA params of batch 4, with micro-batches of
    unequal loss-token counts (answers of 1 to 40 tokens; half the chats share a system prompt, so some rows
    are shared-prefix trees). optax MultiSteps averages the micro-batches' gradients, each the mean over its own
    tokens: without each micro-batch's `loss_scale` (BatchFeed) a step's loss and gradient were not the big
    batch's (they agreed only when every micro-batch had equally many loss tokens)."""
    import random

    import numpy as np

    from gemma_tpu.checkpoint.metadata import read_params

    rng = random.Random(0)
    system = "You are a terse calculator; answer with letters only, never with digits or words."
    data = tmp_path / "uneven.jsonl"
    with data.open("w") as f:
        for i in range(16):
            q = "What is " + " plus ".join(str(rng.randint(1, 99)) for _ in range(rng.randint(2, 4))) + "?"
            answer = "".join(rng.choice("abcdefgh") for _ in range(rng.choice([1, 3, 25, 40])))
            turns = [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": ([{"role": "system", "content": system}] if i % 4 < 2 else []) + turns})
                    + "\n")
    common = [f"data.train_path={data}", "data.eval_path=null", "data.seq_len=192", "train.max_steps=3",
              "checkpoint.every_steps=3", "data.shuffle=false", "train.warmup_steps=2"]
    big = train(tiny_dir, tmp_path / "big", *common, "train.batch_size=4")
    assert big.returncode == 0, big.stderr[-3000:]
    acc = train(tiny_dir, tmp_path / "acc", *common, "train.batch_size=2", "train.grad_accum_steps=2")
    assert acc.returncode == 0, acc.stderr[-3000:]
    lb, la = losses(tmp_path / "big"), losses(tmp_path / "acc")
    assert len(lb) == len(la) == 3
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-6)
    pb, pa = read_params(tmp_path / "big", 3), read_params(tmp_path / "acc", 3)
    assert sorted(pa) == sorted(pb)
    for k in pb:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert not np.allclose(pb[next(k for k in pb if "lora_b" in k)], 0)  # trained, not just initialised
    # each step's record has the learning rate that step used (warmup 0, 0.005, then 0.01): it was read once the
    # next step had begun, so it showed the next step's (0.005, 0.01, 0.01), the last record's alone its own
    for ck in ("big", "acc"):
        rows = [json.loads(x) for x in (tmp_path / ck / "metrics.jsonl").read_text().splitlines()]
        assert [r["learning_rate"] for r in rows if r["mode"] == "train"] == pytest.approx([0.0, 0.005, 0.01]), ck


def test_profile_window_cut_short_by_the_data_still_writes_the_trace(tiny_dir, tmp_path):
    """Tunix stops its profiler only at the window's last step; a loop that ended first (the data ran out) never
    stopped it, and the trace was never written."""
    rows = Path("tests/data/chat_sample.jsonl").read_text().splitlines(keepends=True)[:12]  # 3 steps of batch 4
    (tmp_path / "rows.jsonl").write_text("".join(rows))
    proc = train(tiny_dir, tmp_path / "ck", f"data.train_path={tmp_path / 'rows.jsonl'}", "data.num_epochs=1",
                 "train.max_steps=8", "train.eval_every_steps=0", "train.profile_dir=prof",
                 "train.profile_skip_steps=2", "train.profile_steps=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "ck" / "prof").rglob("*.xplane.pb")), proc.stderr[-3000:]
    assert "training ended inside the profiled steps" in proc.stderr


@pytest.mark.parametrize("change, named", [
    ([], None),
    (["lora.rank=2"], "checkpoint was trained with lora.rank=4, this run has 2"),
    (["train.batch_size=2"], "its data position is for other training rows (train.batch_size 4 -> 2)"),
])
def test_dry_run_refuses_the_resume_the_run_refuses(tiny_dir, reference_run, change, named):
    """`--dry-run` on an existing checkpoint.dir with another LoRA rank or batch printed a plan that fits (exit 0);
    the run then refused to resume it. It is refused the same way, writing nothing; an unchanged resume plans."""
    import io

    from gemma_tpu.core.config import load_config
    from gemma_tpu.core.errors import UserError
    from gemma_tpu.train.plan import run_dry

    before = {p: p.stat().st_mtime_ns for p in reference_run.rglob("*")}
    cfg = load_config("configs/tiny.yaml", [f"model.path={tiny_dir}", f"checkpoint.dir={reference_run}",
                                            "train.max_steps=10", *change])
    if named is None:
        assert run_dry(cfg, compile_check=False, out=io.StringIO()) == 0
    else:
        with pytest.raises(UserError) as e:
            run_dry(cfg, compile_check=False, out=io.StringIO())
        assert named in str(e.value) and str(reference_run) in str(e.value)
    assert {p: p.stat().st_mtime_ns for p in reference_run.rglob("*")} == before


def test_a_last_step_off_the_save_interval_keeps_its_data_position(tiny_dir, reference_run, tmp_path):
    """train.max_steps=3 with checkpoint.every_steps=2: step 3 is saved by Tunix's close, which saved it without
    the data position; resuming it for more steps restarted the data at the first batch ("the data restarts"),
    retraining rows already seen. The resumed run now ends with the uninterrupted run's losses."""
    ck = tmp_path / "ck"
    part = train(tiny_dir, ck, "train.max_steps=3", "checkpoint.every_steps=2")
    assert part.returncode == 0, part.stderr[-3000:]
    meta = json.loads((ck / "3" / "_CHECKPOINT_METADATA").read_text())
    assert meta["custom_metadata"]["step"] == 3 and meta["custom_metadata"]["data_state"], meta
    resumed = train(tiny_dir, ck, "train.max_steps=8", "checkpoint.every_steps=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 3; data position restored" in resumed.stderr
    assert losses(ck) == losses(reference_run)


def test_log_every_steps_thins_the_train_records_and_the_end_is_evaluated(tiny_dir, tmp_path):
    """train.log_every_steps was checked (positive) and then ignored: metrics.jsonl had every step. Now every N-th
    train record and the last are written; evaluations are all kept, and the summary still counts every step."""
    ck = tmp_path / "ck"
    proc = train(tiny_dir, ck, "train.max_steps=5", "train.log_every_steps=2", "train.eval_every_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (ck / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["mode"] == "train"] == [2, 4, 5]
    evals = [r for r in rows if r["mode"] == "eval"]
    summary = json.loads((ck / "summary.json").read_text())
    assert summary["steps"] == 5
    # train.eval_every_steps=3 evaluated at 0 and 3 only: the model saved at step 5 was never evaluated, and the
    # summary gave step 3's loss as final_eval_loss. The end of the run is evaluated too.
    assert [r["step"] for r in evals] == [0, 3, 5] and summary["final_eval_loss"] == evals[-1]["loss"]


def test_a_rerun_of_a_run_whose_data_ran_out_has_nothing_to_do(tiny_dir, tmp_path):
    """A run that ended because data.num_epochs ran out (before train.max_steps) is finished too: its rerun (a retry
    loop, a scheduler) loaded the model, restored the last step, trained nothing and replaced summary.json with its
    own ("resumed_from" the last step, no step time, tokens/s or MFU: the run's record lost). Now it has nothing to
    do, as a run at train.max_steps, and leaves every file as it was; more epochs train on."""
    ckpt = tmp_path / "ckpt"
    args = ["data.eval_path=null", "data.num_epochs=1", "train.max_steps=20", "checkpoint.every_steps=5"]
    proc = train(tiny_dir, ckpt, *args)  # 56 rows, batches of 4: the data ends at step 14
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["steps"] == 14 and "median_step_time_s" in summary, summary
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    proc = train(tiny_dir, ckpt, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before
    assert "is at step 14, where its training data ends (data.num_epochs=1); nothing to do" in proc.stderr, \
        proc.stderr[-3000:]
    assert "trainable parameters" not in proc.stderr
    proc = train(tiny_dir, ckpt, *args[:1], "data.num_epochs=2", *args[2:])  # another epoch: it trains on
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ckpt / "summary.json").read_text())["steps"] == 20


def test_data_that_ends_mid_accumulation_ends_the_run_at_its_last_whole_step(tiny_dir, tmp_path):
    """data.num_epochs=1 ends 2 micro-batches into an optimizer step of train.grad_accum_steps=3 (56 rows, batches of
    4: 14 micro-batches, 4 steps). Those 2 were fed anyway: the optimizer never applied them (MultiSteps waits for 3),
    but metrics.jsonl got a "step 5" record with their loss scaled by 3/2 (7.8 after 5.4), which the summary gave as
    final_train_loss; and every rerun restored step 4, fed them again and replaced summary.json. The run ends at
    step 4, as the epochs warning says; its rerun has nothing to do. Its data position is the step's start: a resume
    with another epoch trains what an uninterrupted two-epoch run does (it began one step later, the 2 skipped)."""
    ckpt = tmp_path / "ckpt"
    args = ["data.eval_path=null", "data.num_epochs=1", "train.grad_accum_steps=3", "train.max_steps=20",
            "checkpoint.every_steps=100"]  # step 4 is saved as the run ends, with the position the feed left
    proc = train(tiny_dir, ckpt, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the run ends at step 4" in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["mode"] == "train"] == [1, 2, 3, 4]
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_train_loss"] == rows[-1]["loss"], summary
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    proc = train(tiny_dir, ckpt, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is at step 4, where its training data ends (data.num_epochs=1); nothing to do" in proc.stderr, \
        proc.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before
    two = [*args[:1], "data.num_epochs=2", *args[2:]]
    assert train(tiny_dir, ckpt, *two).returncode == 0
    assert train(tiny_dir, tmp_path / "two", *two).returncode == 0
    assert losses(ckpt) == losses(tmp_path / "two") and len(losses(ckpt)) == 9


def test_attention_dropout_of_the_config_is_said_not_applied(tiny_dir, tmp_path):
    """config.json's attention_dropout > 0 (transformers applies it in training; a PEFT recipe trained with it) was
    silently not applied: the JAX attention has none. One warning names the file and the key; the run trains."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.1}))
    proc = train(model, tmp_path / "ck", "train.max_steps=1", "data.eval_path=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "attention_dropout=" in line]
    assert len(said) == 1 and f"{model / 'config.json'}: attention_dropout=0.1 is not applied" in said[0], said
