"""Partial files on resume: a checkpoint step whose Orbax data files are gone (a copy cut short) is one
line naming the step, not a traceback, and nothing newer is written. (The other partial-file classes,
for merge / export / inspect / model dirs, are cases of tests/test_bad_input.py.)"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.conftest import assert_one_line_error, run_cli


def test_resume_from_a_step_with_missing_data_files(tiny_dir, tmp_path):
    ck = tmp_path / "ck"
    args = ["--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}", "data.eval_path=null",
            "checkpoint.every_steps=1"]
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=1", env=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a one-step session: its only record is flushed at close, which times nothing; the progress bar's rate
    # metrics were then never logged and absl warned 'Metric tokens_per_s not found for mode train'
    assert "not found for mode" not in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(l) for l in (ck / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["mode"] == "train"] == [1]
    for p in (ck / "1" / "optimizer_state").glob("ocdbt.process_*/d/*"):
        p.unlink()
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=2")
    assert_one_line_error(proc, f"{ck / '1'}: cannot restore this checkpoint step", "move it aside")
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == ["1"]
    # moved aside as the message says, the run starts afresh and completes
    shutil.move(ck / "1", tmp_path / "1.damaged")
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=2", env=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # its step came from the first run's persistent compilation cache: said once, not JAX's ~20 WARNING lines
    assert "_train_step loaded from the persistent compilation cache" in proc.stderr, proc.stderr[-3000:]
    assert "Persistent compilation cache hit" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads((ck / "summary.json").read_text())["train_step_compiles"] == 1


def test_resume_from_a_step_with_damaged_data_names_the_tensor(tiny_dir, tmp_path):
    """A step whose data files are all there but damaged (zeroed by a disk fault, overwritten): the refusal
    gave Orbax's outer message, "Encountered error while reading array index: (slice(0, 128, 1), ...). See full
    TensorStore details: <bound method pybind11_detail_function_record_v1_...", naming neither the tensor nor the
    fault. It gives the cause: the tensor that could not be read, and why."""
    ck = tmp_path / "ck"
    args = ["--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}", "data.eval_path=null",
            "checkpoint.every_steps=1"]
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for p in (ck / "1" / "model_params").glob("ocdbt.process_*/d/*"):
        p.write_bytes(bytes(p.stat().st_size))
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=2")
    line = assert_one_line_error(proc, f"{ck / '1'}: cannot restore this checkpoint step", "move it aside")
    assert "bound method" not in line and re.search(r'Error reading "layers\.\d+\.[\w.]+_lora_[ab]', line), line


def test_resume_onto_another_shaped_base_names_the_setting_and_keeps_the_metadata(tiny_dir, tmp_path):
    """A sound step that does not fit this run (checkpoint.allow_base_mismatch let a base of another shape through)
    was 'cannot restore this checkpoint step; move it aside', which fails the same way at every step; and the failed
    resume had rewritten gemma_tpu_run.json to name the other base beside the old run's steps (a merge then used
    it). One line naming the tensor and the settings that differ; the metadata file is the one the steps belong to."""
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    other = write_tiny_gemma3(tmp_path / "wider", seed=1, intermediate_size=256)
    ck = tmp_path / "ck"
    args = ["--config", "configs/tiny.yaml", f"checkpoint.dir={ck}", "data.eval_path=null", "train.max_steps=2"]
    proc = run_cli("gemma_tpu.train", *args, f"model.path={tiny_dir}", "train.max_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = (ck / "gemma_tpu_run.json").read_bytes()
    proc = run_cli("gemma_tpu.train", *args, f"model.path={other}", "checkpoint.allow_base_mismatch=true")
    assert_one_line_error(proc, f"{ck / '1'}: the checkpoint does not fit this run (layers.0.mlp.down_proj."
                                f"kernel_lora_a is saved with shape (128, 4), this run's model has (256, 4))",
                          f"model.path ({tiny_dir} -> {other})", "intermediate_size (128 -> 256)",
                          "moving the step aside will not help")
    assert "move it aside" not in proc.stderr
    assert (ck / "gemma_tpu_run.json").read_bytes() == before
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == ["1"]


def test_a_full_disk_names_the_file_being_written_not_the_one_copied(tiny_dir, tmp_path):
    """Past a file-size limit (as a full disk), copying a base model's tokenizer.json into the output named the
    *source* (the merge said it failed in the base's tokenizer.json), and writing config.json named no file."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import REPO

    only_config = tmp_path / "base"
    only_config.mkdir()
    shutil.copyfile(tiny_dir / "config.json", only_config / "config.json")
    code = ("import json, resource, signal, sys; from pathlib import Path; signal.signal(signal.SIGXFSZ, "
            "signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100)); "
            "from gemma_tpu.hf.files import write_sidecar_files; base, out = Path(sys.argv[1]), Path(sys.argv[2]); "
            "out.mkdir()\ntry:\n    write_sidecar_files(base, out, json.loads((base / 'config.json').read_text()), "
            "'float32', ())\nexcept OSError as e:\n    print(e.filename)")
    for base, named in ((tiny_dir, "tokenizer.json"), (only_config, "config.json")):
        out = tmp_path / f"out-{named}"
        proc = subprocess.run([sys.executable, "-c", code, str(base), str(out)], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert proc.stdout.strip() == str(out / named), proc.stdout + proc.stderr[-2000:]
    # the tool-call markers published into a copied tokenizer (convert/tool_tokens.py): its rewrite is named too
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_dir / name, tok / name)
    code = ("import resource, signal, sys; from pathlib import Path; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100)); from convert.tool_tokens import "
            "install_tool_tokens; from gemma_tpu.formats.function_calling import vocab_token_map\n"
            "from transformers import AutoTokenizer\nout = Path(sys.argv[1])\ntry:\n    install_tool_tokens(out, "
            "vocab_token_map(AutoTokenizer.from_pretrained(out).get_vocab()))\nexcept OSError as e:\n"
            "    print(e.filename)")
    proc = subprocess.run([sys.executable, "-c", code, str(tok)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.strip() == str(tok / "tokenizer.json"), proc.stdout + proc.stderr[-2000:]


def test_merge_that_runs_out_of_space_publishes_nothing(tiny_dir, tmp_path):
    """A write failing mid-merge (here the file-size limit, as a full disk would: the write raises) is one
    line naming the file; nothing at --out, no temp dir left beside it."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.test_convert import make_checkpoint

    make_checkpoint(tiny_dir, tmp_path / "ck")

    # the write fails with EFBIG (SIGXFSZ ignored, which survives exec) past a 200 KB file-size limit
    limited = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
               "os.execv(sys.executable, [sys.executable, '-m', 'convert.merge_orbax', *sys.argv[1:]])")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", limited, "--checkpoint", str(tmp_path / "ck"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    line = assert_one_line_error(proc, f"writing {out} failed", "File too large", "nothing was published")
    # the shard being written, not only the temp dir it was in ("failed in OUT/.out.tmp-PID")
    assert re.search(rf"failed in {re.escape(str(tmp_path))}/\.out\.tmp-\d+/model\.safetensors \(", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    # the PEFT export (its adapter is ~50 KB) writes with the same writer: named too
    out = tmp_path / "adapter"
    limited = limited.replace("convert.merge_orbax", "convert.export_peft").replace("200_000", "20_000")
    proc = subprocess.run([sys.executable, "-c", limited, "--checkpoint", str(tmp_path / "ck"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    line = assert_one_line_error(proc, f"writing {out} failed", "File too large", "nothing was published")
    assert re.search(rf"failed in {re.escape(str(tmp_path))}/\.adapter\.tmp-\d+/adapter_model\.safetensors \(",
                     line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_ocdbt_walk_reaches_every_data_file_of_a_multi_level_tree(tmp_path):
    """Large checkpoints have interior B-tree nodes: the pre-restore check walks them and names a data file
    that is gone or cut short anywhere in the tree."""
    import os

    import tensorstore as ts

    from gemma_tpu.checkpoint.params import _missing_ocdbt_data

    root = tmp_path / "db"
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}/",
                          "config": {"max_decoded_node_bytes": 500, "max_inline_value_bytes": 16}}).result()
    for i in range(200):
        kv.write(f"k{i:04d}", b"x" * 40).result()
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{root}/").result()).result()
    assert manifest["versions"][-1]["root_height"] >= 2
    assert _missing_ocdbt_data(root) == []

    def reads_back() -> bool:
        store = ts.KvStore.open(f"file://{root}/", context=ts.Context()).result()  # no cache shared
        try:
            return all(store.read(f"k{i:04d}").result().value == b"x" * 40 for i in range(200))
        except Exception:  # noqa: BLE001 - any failed read
            return False

    # The files the latest version needs, found by reading, not by the walk under test: `d/` also keeps
    # superseded nodes of earlier versions that nothing reads, and damaging one of those is no damage.
    needed = []
    for f in sorted((root / "d").iterdir()):
        f.rename(f.with_suffix(".away"))
        if not reads_back():
            needed.append(f)
        f.with_suffix(".away").rename(f)
    assert len(needed) >= 3, needed
    # one fault at a time: a node cut short hides what lies below it, so with two faults the second file went
    # unnamed whenever it sat under the first (the files' names are random: 5 runs in 150 failed that way)
    gone, cut = needed[len(needed) // 2], needed[-1]
    gone.rename(gone.with_suffix(".away"))
    assert _missing_ocdbt_data(root) == [gone]
    gone.with_suffix(".away").rename(gone)
    os.truncate(cut, 10)
    assert _missing_ocdbt_data(root) == [cut]



def test_a_copy_that_fills_the_disk_names_the_output_not_its_source(tmp_path, small_disk):
    small_disk = small_disk("64k")
    """A full disk while copying an input into the output (the adapter's tokenizer files): the error named
    the copy's source ("writing OUT failed in BASE/tokenizer.json (No space left on device)"), blaming the
    input. It names the file being written."""
    from gemma_tpu.core.atomic import AtomicDir
    from gemma_tpu.core.errors import UserError

    src = tmp_path / "base" / "tokenizer.json"
    src.parent.mkdir()
    src.write_bytes(b"x" * 200_000)
    out = small_disk / "out"
    with pytest.raises(UserError) as e:
        with AtomicDir(out) as tmp:
            shutil.copyfile(src, tmp / "tokenizer.json")
    msg = str(e.value)
    assert f"writing {out} failed in {small_disk}/.out.tmp-" in msg, msg
    assert "/tokenizer.json (No space left on device)" in msg and str(src) not in msg, msg
    assert list(small_disk.iterdir()) == []


def test_training_whose_checkpoint_disk_fills_stops_in_one_line(tiny_dir, small_disk):
    """checkpoint.dir on a disk that holds step 1 but not step 2: the run ended with exit 1 and the traceback
    of whichever Orbax writer thread surfaced first, then hundreds of lines of its threads' errors. Now the
    last line says which save failed, why, and the step still on disk; the lock is released."""
    ck = small_disk("500k") / "ck"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}",
                   "data.eval_path=null", "checkpoint.every_steps=1", "train.max_steps=3")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [proc.stderr.splitlines()[-1]], proc.stderr[-3000:]
    assert errors[0].startswith(f"error: saving checkpoint step 2 in {ck} failed (No space left on device); "
                                "the last complete step on disk is 1"), errors
    # Orbax's writer threads each logged their traceback (~40 lines apiece) above it: now at DEBUG
    assert "Traceback" not in proc.stderr and " ERROR " not in proc.stderr, proc.stderr[-3000:]
    # the failed save's temp dir kept the space the disk had left (until a restart saved that step again): gone
    assert sorted(p.name for p in ck.iterdir() if p.name[0].isdigit()) == ["1"]
    assert not (ck / "gemma_tpu_run.lock").exists()


def test_failed_save_temp_dirs_brought_back_by_a_late_writer_are_removed(tmp_path):
    """A save failing synchronously leaves Orbax's other writer threads running: the one removal on the way out
    raced them and a late thread recreated `2.orbax-checkpoint-tmp` (CI, a loaded 2-core machine, 2026-11-27).
    The removal goes on until the directory stays quiet; a complete step and our files stay."""
    import threading
    import time

    from gemma_tpu.train.finite_guard import remove_failed_saves

    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "_CHECKPOINT_METADATA").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "2.orbax-checkpoint-tmp" / "default").mkdir(parents=True)

    def late_writer():
        for _ in range(3):
            time.sleep(0.3)
            (tmp_path / "2.orbax-checkpoint-tmp" / "optimizer_state.orbax-checkpoint-tmp").mkdir(parents=True,
                                                                                                exist_ok=True)

    writer = threading.Thread(target=late_writer)
    writer.start()
    remove_failed_saves(tmp_path, quiet_s=0.5)
    writer.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "metrics.jsonl"]


def test_training_on_a_disk_that_cannot_hold_one_checkpoint_is_refused_before_the_first_step(tiny_dir, small_disk):
    """A checkpoint.dir whose disk cannot hold one step: the run trained up to its first save (hours at a real
    checkpoint.every_steps) and only then failed. Now it is refused once the trainer is built, before any step,
    with the step's size (LoRA params + optimizer state) and the free space; a temp dir of a save that did not
    finish (a killed run's) is removed first, its space counted free."""
    ck = small_disk("64k") / "ck"
    stale = ck / "7.orbax-checkpoint-tmp" / "model_params"
    stale.mkdir(parents=True)
    (stale / "blob").write_bytes(b"x" * 20_000)
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}",
                   "data.eval_path=null", "checkpoint.every_steps=1", "train.max_steps=3")
    assert_one_line_error(proc, f"checkpoint.dir {ck}: ", "free on its disk, and a checkpoint step takes about",
                          "(the LoRA parameters and the optimizer state), so no step could be saved")
    need = float(re.search(r"takes about ([\d.]+) KB", proc.stderr).group(1))
    assert 85 < need < 100, proc.stderr[-2000:]  # 92 KB of tensors (~220 KB on disk with Orbax's metadata)
    assert f"removed {ck / '7.orbax-checkpoint-tmp'} (20.00 KB)" in proc.stderr, proc.stderr[-3000:]
    assert "step 1/" not in proc.stderr and not any(p.name[0].isdigit() for p in ck.iterdir())
    assert not (ck / "gemma_tpu_run.lock").exists()


def test_a_finished_run_on_a_full_disk_is_still_nothing_to_do(tiny_dir, small_disk):
    """The room check is for a step to come: a run already at train.max_steps, restarted on a disk that has since
    filled, says there is nothing to do (exit 0) rather than refusing the disk."""
    ck = small_disk("600k") / "ck"
    args = ["--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}", "data.eval_path=null",
            "train.max_steps=1"]
    proc = run_cli("gemma_tpu.train", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    free = shutil.disk_usage(ck).free
    (ck.parent / "filler").write_bytes(b"x" * max(0, free - 16_384))
    proc = run_cli("gemma_tpu.train", *args)
    assert proc.returncode == 0 and "nothing to do" in proc.stderr, proc.stderr[-3000:]


def test_a_resume_refused_for_a_full_disk_keeps_the_record_of_the_run_that_wrote_the_steps(tiny_dir, small_disk):
    """A resume refused because the disk has since filled (the room check, once the model is loaded) left
    gemma_tpu_run.json describing the refused session (its train.max_steps, learning rate), which trained nothing,
    beside the steps another session wrote: it was written before the check, and put back only for a failure while
    the trainer was built. The record is the run's that wrote the steps."""
    ck = small_disk("600k") / "ck"
    args = ["--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}", "data.eval_path=null"]
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = (ck / "gemma_tpu_run.json").read_bytes()
    free = shutil.disk_usage(ck).free
    (ck.parent / "filler").write_bytes(b"x" * max(0, free - 16_384))
    proc = run_cli("gemma_tpu.train", *args, "train.max_steps=3", "train.learning_rate=0.5")
    assert_one_line_error(proc, f"checkpoint.dir {ck}: ", "so no step could be saved")
    assert (ck / "gemma_tpu_run.json").read_bytes() == before


def test_a_resume_whose_first_save_fails_keeps_the_record_and_resumes_to_the_same_losses(tiny_dir, tmp_path):
    """A resume under a file-size limit (a full disk as a write sees it: EFBIG) fails its first save: one line,
    exit 2, the step before still the latest, and the record (gemma_tpu_run.json) the run's that wrote it, not the
    failed session's (train.max_steps=4); the rerun without the limit ends with the losses of an uninterrupted run."""
    import resource
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    def limited():  # in the child: SIGXFSZ ignored (it survives exec), so the write fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # Orbax's data files of a step are larger

    def args(ck, steps):
        return ["--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}",
                "data.eval_path=null", "checkpoint.every_steps=1", f"train.max_steps={steps}"]

    def losses(ck):
        rows = [json.loads(x) for x in (ck / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if r["mode"] == "train"]

    ref, ck = tmp_path / "ref", tmp_path / "ck"
    for c, steps in ((ref, 4), (ck, 2)):
        proc = run_cli("gemma_tpu.train", *args(c, steps))
        assert proc.returncode == 0, proc.stderr[-3000:]
    before = (ck / "gemma_tpu_run.json").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "gemma_tpu.train", *args(ck, 4)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, preexec_fn=limited)
    line = assert_one_line_error(proc, f"saving checkpoint step 3 in {ck} failed (File too large); the last "
                                       "complete step on disk is 2")
    assert proc.returncode == 2, line
    assert (ck / "gemma_tpu_run.json").read_bytes() == before
    assert sorted(p.name for p in ck.iterdir() if p.name[0].isdigit()) == ["1", "2"]
    proc = run_cli("gemma_tpu.train", *args(ck, 4))
    assert proc.returncode == 0 and "resumed at step 2" in proc.stderr, proc.stderr[-3000:]
    assert losses(ck) == losses(ref)


def test_a_restart_removes_the_temp_dirs_of_saves_that_did_not_finish(tmp_path):
    """`<step>.orbax-checkpoint-tmp` of a killed run (or an older failed save) held its disk space for good: Orbax
    never finishes one and no resume reads it. The run (holding the lock) removes them; steps stay."""
    from gemma_tpu.checkpoint.metadata import remove_unfinished_saves

    for name in ("2/model_params", "3.orbax-checkpoint-tmp/model_params", "4.orbax-checkpoint-tmp-1700000000/d",
                 "tensorboard.orbax-checkpoint-tmp"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "3.orbax-checkpoint-tmp" / "model_params" / "blob").write_bytes(b"x" * 1000)
    removed = remove_unfinished_saves(tmp_path)
    assert [(p.name, size) for p, size in removed] == [("3.orbax-checkpoint-tmp", 1000),
                                                     ("4.orbax-checkpoint-tmp-1700000000", 0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "tensorboard.orbax-checkpoint-tmp"]


# A save failing as Orbax's writer threads see it: the exception raised in Orbax's code and logged, traceback and
# all, from a background thread; then a write completing after its thread closed the event loop (unraisable).
BACKGROUND_FAILURE = """
import asyncio, sys, threading
from absl import logging as absl_logging
from gemma_tpu.core import cli

ns = {}
exec(compile("def write():\\n    raise OSError(28, 'No space left on device')", "/site-packages/orbax/fake.py", "exec"),
     ns)

class LateCompletion:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.loop.close()

    def __del__(self):
        self.loop.call_soon_threadsafe(print)

def writer():
    try:
        ns["write"]()
    except OSError as e:
        absl_logging.exception("_SignalingThread.run() raised an exception: %s", e)

def main(argv):
    cli.setup_logging()
    t = threading.Thread(target=writer)
    t.start()
    t.join()
    LateCompletion()
    raise OSError(28, "No space left on device", "ck/2.orbax-checkpoint-tmp")

sys.exit(cli.cli_main(main))
"""


@pytest.mark.parametrize("debug", [False, True])
def test_orbax_background_tracebacks_are_debug_output(debug):
    """A save that fills the disk: Orbax's background threads logged their tracebacks (one per writer) and
    TensorStore's late completions printed dozens of "Event loop is closed" ones, burying our one-line error.
    They are logged at DEBUG now; with GEMMA_TPU_DEBUG=1 all of them are shown, as a genuine bug's must be."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "GEMMA_TPU_DEBUG": "1" if debug else "0"}
    proc = subprocess.run([sys.executable, "-c", BACKGROUND_FAILURE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    if debug:
        assert proc.returncode != 0
        assert "raised an exception: [Errno 28]" in proc.stderr and "orbax/fake.py" in proc.stderr, proc.stderr
        assert "RuntimeError: Event loop is closed" in proc.stderr, proc.stderr
    else:
        assert_one_line_error(proc, "No space left on device: ck/2.orbax-checkpoint-tmp")
        assert proc.stderr.strip().splitlines() == ["error: No space left on device: ck/2.orbax-checkpoint-tmp"]


def test_training_whose_run_dir_fills_stops_in_one_line_naming_the_file(tiny_dir, tmp_path, small_disk):
    """train.run_dir (metrics.jsonl, TensorBoard) on a full disk: TensorBoard's writer thread died with a
    traceback (and could hang the run, see above), then the run said only "error: No space left on device",
    naming no file. Now one warning for TensorBoard, and one error line naming metrics.jsonl."""
    run_dir = small_disk("8k") / "run"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                   f"checkpoint.dir={tmp_path / 'ck'}", f"train.run_dir={run_dir}", "data.eval_path=null",
                   "train.max_steps=2")
    assert_one_line_error(proc, "No space left on device", str(run_dir / "metrics.jsonl"))
    assert not (tmp_path / "ck" / "gemma_tpu_run.lock").exists()


def test_training_on_a_full_disk_from_the_start_names_the_file_and_leaves_no_debris(tiny_dir, small_disk):
    """checkpoint.dir on a disk with room for the run lock only: the run metadata's own tmp + rename said
    "error: No space left on device", naming nothing, and left `gemma_tpu_run.tmp-PID` behind."""
    ck = small_disk("4k") / "ck"
    proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}", f"checkpoint.dir={ck}",
                   "data.eval_path=null", "train.max_steps=1")
    assert_one_line_error(proc, f"writing {ck / 'gemma_tpu_run.json'} failed", "No space left on device",
                          "nothing was published")
    assert list(ck.iterdir()) == []


def test_metrics_after_a_line_cut_short_stay_readable(tmp_path):
    """metrics.jsonl whose last line a crash cut short: the resumed run's first row was appended to it, and that
    row was lost to every reader (one unparseable line). It now starts on a line of its own."""
    import json

    from gemma_tpu.train.trainer import append_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 6.1}\n{"step": 2, "lo')
    append_jsonl(path, {"step": 2, "loss": 6.0})
    append_jsonl(path, {"step": 3, "loss": 5.9})
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    assert [r["step"] for r in rows] == [1, 2, 3]
    fresh = tmp_path / "fresh.jsonl"
    append_jsonl(fresh, {"step": 1})
    assert fresh.read_text() == '{"step": 1}\n'


def test_a_metrics_record_that_does_not_fit_leaves_the_file_as_it_was(tmp_path):
    """A metrics.jsonl record written on a full disk (here past a file-size limit) left its first bytes as a line
    cut short, which every line-by-line reader (pandas' read_json(lines=True) too) failed on after the run stopped.
    Now the error names the file and the file is as it was."""
    import resource
    import signal

    from gemma_tpu.train.trainer import append_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 6.1}\n')
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, limits[1]))  # this process's soft limit, put back below
        with pytest.raises(OSError, match=f"File too large: '{path}'"):
            append_jsonl(path, {"step": 2, "loss": 6.0, "note": "x" * 200})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert path.read_text() == '{"step": 1, "loss": 6.1}\n'


def test_an_abandoned_orbax_read_is_not_printed_after_the_error(monkeypatch):
    """A restore that fails on one array leaves Orbax's reads of the others unawaited; collected, each printed
    "Exception ignored in: <coroutine ...>" and a traceback after the one-line error (8-18 lines a run on the tiny
    model). The CLI's unraisable hook drops those, and still reports any other unraisable exception."""
    import os
    import sys
    import types

    from gemma_tpu.core import cli

    reported = []
    monkeypatch.setattr(sys, "__unraisablehook__", reported.append)
    where = os.path.join(os.sep, "venv", "orbax", "checkpoint", "serialization.py")
    scope: dict = {}
    exec(compile("async def _read_array_index_and_device_put():\n    pass\n", where, "exec"), scope)
    coro = scope["_read_array_index_and_device_put"]()  # an Orbax coroutine, never awaited
    unraisable = types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("read failed"), exc_traceback=None,
                                       err_msg=None, object=coro)
    cli._redeliver_interrupts(unraisable)
    coro.close()
    other = types.SimpleNamespace(**{**vars(unraisable), "object": sys})
    cli._redeliver_interrupts(other)
    assert reported == [other]


def test_check_writable_makes_a_file_rather_than_trusting_os_access(tmp_path):
    """`check_writable` asked os.access, which as root says yes to a directory no one can write in (sysfs here; a
    root-squashed NFS export, a FUSE mount): the run failed at its first write, after the heavy work. It makes (and
    removes) a file now, and leaves the directory as it found it."""
    import os

    from gemma_tpu.core.atomic import check_writable
    from gemma_tpu.core.errors import UserError

    before = (sorted(tmp_path.iterdir()), tmp_path.stat().st_mtime_ns)
    check_writable(tmp_path / "new" / "out.json", "--json X")
    assert (sorted(tmp_path.iterdir()), tmp_path.stat().st_mtime_ns) == before
    if not (os.path.isdir("/sys/kernel") and os.access("/sys/kernel", os.W_OK)):
        pytest.skip("needs /sys as root (os.access saying a read-only directory is writable)")
    with pytest.raises(UserError, match=r"^--out X: /sys/kernel is not writable \("):
        check_writable("/sys/kernel/no-such-output", "--out X")


def test_check_writable_says_what_the_directory_is(tmp_path):
    """A results file under a link to a directory that does not exist passed the up-front check, and the evaluation
    failed at its end ("--out ...: cannot create LINK (File exists)"), its results lost; one under /proc was "/proc
    is not writable (No such file or directory)", of a directory that exists. Each now says what the directory is,
    before the run, leaving nothing."""
    import os

    from gemma_tpu.core.atomic import check_results_file, write_text_atomic
    from gemma_tpu.core.errors import UserError

    (tmp_path / "link").symlink_to(tmp_path / "gone")
    for out in (tmp_path / "link" / "r.json", tmp_path / "link" / "sub" / "r.json"):
        with pytest.raises(UserError, match=rf"^--json {out}: {tmp_path}/link is a link to {tmp_path}/gone, which "
                                            r"does not exist \(create that directory"):
            check_results_file(out, results_key="models")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]
    (tmp_path / "gone").mkdir()  # made, the same path is written
    write_text_atomic(tmp_path / "link" / "r.json", "{}")
    assert (tmp_path / "gone" / "r.json").read_text() == "{}"
    # what the publish refuses to replace, refused before the run: `--json /dev/stdout` (a link) and a named pipe
    # passed, and the evaluation's results were refused at its end ("is a symbolic link...; refusing to replace")
    (tmp_path / "out").symlink_to("/dev/null")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UserError, match=rf"^--json {tmp_path}/out: is a symbolic link \(to /dev/null\), which the "):
        check_results_file(tmp_path / "out", results_key="models")
    with pytest.raises(UserError, match=rf"^--json {tmp_path}/fifo: exists and is not a regular file \(a device or a "):
        check_results_file(tmp_path / "fifo", results_key="models")
    if os.path.islink("/dev/stdout"):  # Linux's link to /proc/self/fd/1
        with pytest.raises(UserError, match=r"^--json /dev/stdout: is a symbolic link"):
            check_results_file("/dev/stdout", results_key="models")
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    with pytest.raises(UserError, match=r"^--json /proc/x.json: /proc takes no new files \(a proc filesystem: its "
                                        r"files are the system's\); give a path on a disk$"):
        check_results_file("/proc/x.json", results_key="models")
    with pytest.raises(UserError, match=r"^--json /proc/nope/x.json: /proc takes no new files .*; /proc/nope does not "
                                        r"exist and cannot be created there; give a path on a disk$"):
        check_results_file("/proc/nope/x.json", results_key="models")


def test_check_writable_never_sets_back_another_writers_change_of_the_directory(tmp_path, monkeypatch):
    """`check_writable` made a named probe file, removed it, then set the directory's mtime back to what it was
    before: a file another process made there meanwhile (another trainer in a shared checkpoint directory) was
    hidden from whatever reads the mtime for news (NFS clients' caches, Python's import cache). The probe is an
    unnamed file now, which changes nothing, so there is nothing to set back."""
    import os

    from gemma_tpu.core import atomic

    os.utime(tmp_path, ns=(10**18, 10**18))  # an mtime far from now, so the other writer's change shows
    seen = {}
    close = os.close

    def other_writer_meanwhile(fd):  # the probe's file is closed: another process adds its file in this instant
        close(fd)
        if not seen:
            (tmp_path / "other.txt").write_text("x")
            seen["mtime"] = tmp_path.stat().st_mtime_ns

    monkeypatch.setattr(atomic.os, "close", other_writer_meanwhile)
    atomic.check_writable(tmp_path / "out.json", "--json X", room=1)
    monkeypatch.undo()
    assert seen["mtime"] != 10**18 and tmp_path.stat().st_mtime_ns == seen["mtime"]
    assert [p.name for p in tmp_path.iterdir()] == ["other.txt"]


@pytest.mark.parametrize("command", [["serving.bench", "--model", "m", "--base-url"],
                                     ["gemma_tpu.evaluate", "--data", "tests/data/chat_sample.jsonl", "--endpoint"]])
def test_a_results_file_on_a_full_disk_is_refused_before_the_run(command, small_disk):
    """`--json` on a full disk passed the up-front check (an empty file can still be made there), the whole run went
    by (an hour's evaluation of the 270M, a benchmark) and its results were lost at the end. Refused first now, naming
    the file and the reason, leaving nothing."""
    disk = small_disk("64k")
    (disk / "filler").write_bytes(b"x" * 65536)
    out = disk / "results.json"
    proc = run_cli(*command, "http://127.0.0.1:9", "--json", str(out), timeout=120)
    assert_one_line_error(proc, f"--json {out}: {disk} has no room for it (No space left on device)")
    assert [p.name for p in disk.iterdir()] == ["filler"]


def test_a_full_disk_met_by_safetensors_is_one_line_naming_the_output(small_disk):
    """safetensors (transformers' save_pretrained: `gemma_tpu.assets prepare` builds with it) reports a full disk as
    its own `SafetensorError: ... I/O error: No space left on device (os error 28)`, not an OSError: the prepare
    ended in a traceback. It is the one line an OSError gets, and nothing is left."""
    import numpy as np
    from safetensors.numpy import save_file

    from gemma_tpu.core.atomic import AtomicDir
    from gemma_tpu.core.errors import UserError

    out = small_disk("64k") / "model"
    with pytest.raises(UserError) as e:
        with AtomicDir(out) as tmp:
            save_file({"w": np.zeros(100_000, np.float32)}, str(tmp / "model.safetensors"))
    assert str(e.value).startswith(f"writing {out} failed in {out.parent}/.model.tmp-"), e.value
    assert str(e.value).endswith(" (No space left on device); nothing was published"), e.value
    assert list(out.parent.iterdir()) == []


def test_a_preemption_whose_save_fills_the_disk_says_so_and_frees_the_space(tiny_dir, small_disk):
    """SIGTERM, and the step's save (asynchronous) meets a full disk: the exit said "could not save step 2 (ValueError:
    RESOURCE_EXHAUSTED: Error writing local file ...", exit 1, and left the save's temp dir holding what space the
    disk had. As for a save that fails while training: one line saying the disk is full and the step on disk, exit 2,
    the temp dir removed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    ck = small_disk("160k") / "ck"  # room for the run's files, not for a step
    cmd = [sys.executable, "-m", "gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
           f"checkpoint.dir={ck}", "data.eval_path=null", "train.max_steps=50", "checkpoint.every_steps=100",
           "checkpoint.async_save=true"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", "GEMMA_TPU_STEP_DELAY": "0.5"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = ""
    deadline = time.time() + 600
    while "step 1/" not in seen and time.time() < deadline:
        line = proc.stderr.readline()
        assert line, seen[-3000:]
        seen += line
    proc.send_signal(signal.SIGTERM)
    err = seen + proc.stderr.read()
    assert proc.wait(timeout=300) == 2, err[-3000:]
    assert re.search(rf"SIGTERM: could not save step \d+ \(CheckpointSaveFailed: saving checkpoint step \d+ in {ck} "
                     rf"failed \(No space left on device\); no complete step is on disk, and a restart begins "
                     rf"afresh\)$", err, re.M), err[-3000:]  # not followed by "the last complete checkpoint stays"
    assert not [p.name for p in ck.iterdir() if "orbax-checkpoint-tmp" in p.name], sorted(ck.iterdir())
    assert not (ck / "gemma_tpu_run.lock").exists()


def test_a_compilation_cache_entry_cut_short_is_compiled_again_once(tiny_dir, tmp_path):
    """JAX writes a persistent compilation cache entry in place and never replaces one: an entry cut short (the run
    killed while JAX wrote it) made every later run warn 'Error reading persistent compilation cache entry' and
    compile the step again. The run that meets it removes it (saying so) and writes it afresh; the next loads it."""
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}

    def train(name: str):
        proc = run_cli("gemma_tpu.train", "--config", "configs/tiny.yaml", f"model.path={tiny_dir}",
                       f"checkpoint.dir={tmp_path / name}", "data.eval_path=null", "train.max_steps=1", env=cache)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    train("first")
    [entry] = (tmp_path / "xla").glob("jit__train_step-*-cache")
    whole = entry.stat().st_size
    with entry.open("r+b") as f:
        f.truncate(whole // 2)
    err = train("second")
    assert "Error reading" not in err and "UserWarning" not in err, err[-3000:]  # JAX's warning: our one line instead
    assert f"removed {entry} ({whole // 2} bytes): an entry of the persistent compilation cache JAX could not " \
           f"read" in err, err[-3000:]
    assert entry.stat().st_size > whole // 2  # written afresh (its size varies a little from one compile to the next)
    err = train("third")
    assert "Error reading" not in err and "_train_step loaded from the persistent compilation cache" in err, err[-3000:]


def test_a_compilation_cache_entry_cut_short_is_healed_by_chat_too(tiny_long_dir, tmp_path):
    """Not only training compiles with JAX's persistent cache: `gemma_tpu.chat` (as evaluate and the dry run) met a
    decode step's entry cut short at every run, JAX's multi-line UserWarning each time, and compiled it again."""
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}

    def chat() -> str:
        proc = run_cli("gemma_tpu.chat", "--model", str(tiny_long_dir), "--once", "hi", "--max-new-tokens", "2",
                       env=cache)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    chat()
    [entry] = (tmp_path / "xla").glob("jit__decode-*-cache")
    whole = entry.stat().st_size
    with entry.open("r+b") as f:
        f.truncate(whole // 2)
    err = chat()
    assert f"removed {entry} ({whole // 2} bytes): an entry of the persistent compilation cache JAX could not " \
           f"read" in err, err[-3000:]
    assert "Error reading" not in err and "UserWarning" not in err, err[-3000:]
    assert entry.stat().st_size > whole // 2
    assert "Error reading" not in chat()


@pytest.mark.parametrize("where", ["file", "file/under"])
def test_a_compilation_cache_dir_that_is_a_file_is_said(tmp_path, monkeypatch, caplog, where):
    """JAX keeps no persistent cache, without a word, where JAX_COMPILATION_CACHE_DIR is a file or lies under one:
    every run compiled every program afresh. Every command says it once (cli_main turns the cache repair on)."""
    from gemma_tpu.core import xla_cache

    (tmp_path / "file").write_text("not a cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / where))
    with caplog.at_level("WARNING", logger="gemma_tpu"):
        xla_cache.heal_damaged_entries()
    assert [r.getMessage() for r in caplog.records] == [
        f"JAX_COMPILATION_CACHE_DIR={tmp_path / where}: {tmp_path / 'file'} is not a directory, so JAX keeps no "
        f"persistent compilation cache (every program is compiled afresh each run)"]
    caplog.clear()
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "new" / "cache"))  # made by JAX when first used
    with caplog.at_level("WARNING", logger="gemma_tpu"):
        xla_cache.heal_damaged_entries()
    assert caplog.records == []
