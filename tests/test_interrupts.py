"""Ctrl-C and SIGTERM reach the command however they land: jax registers a gc callback, and a signal
handled while it runs raised KeyboardInterrupt (or the SIGTERM exit) inside it, where Python can only print
"Exception ignored" and go on: about one Ctrl-C in three during a merge was lost and the merge published.
These tests raise the signal inside a gc callback on purpose."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, assert_one_line_error

# `main` raises SIGNAL from a gc callback, as a signal arriving while jax's callback runs is handled,
# then goes on writing for a while (as a merge does) and publishes OUT.
SCRIPT = """
import gc, signal, sys, time
from gemma_tpu.core.atomic import AtomicDir
from gemma_tpu.core.cli import cli_main

def main(argv):
    out, sig = argv
    fired = []
    def callback(phase, info):
        if not fired:
            fired.append(phase)
            signal.raise_signal(getattr(signal, sig))
    ad = AtomicDir(out)
    with ad as tmp:
        (tmp / "a.txt").write_text("a")
        gc.callbacks.append(callback)
        gc.collect()
        gc.callbacks.remove(callback)
        for i in range(300):
            (tmp / "b.txt").write_text(str(i))
            time.sleep(0.01)
        ad.publish()
    print("published")
    return 0

sys.exit(cli_main(main))
"""


def _run(out, sig: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(out), sig], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)


def test_ctrl_c_inside_a_gc_callback_still_interrupts(tmp_path):
    proc = _run(tmp_path / "out", "SIGINT")
    assert_one_line_error(proc, "interrupted")
    assert proc.returncode == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing published, no temp dir


def test_sigterm_inside_a_gc_callback_still_stops_the_write(tmp_path):
    proc = _run(tmp_path / "out", "SIGTERM")
    assert_one_line_error(proc, "SIGTERM")
    assert proc.returncode == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sighup_inside_a_write_stops_it_and_leaves_nothing(tmp_path):
    """A closed terminal's SIGHUP ended a converter at once (its default action): the hidden temp output and the
    writer lock were left beside --out. Now it stops the write as SIGTERM does, exit 129."""
    proc = _run(tmp_path / "out", "SIGHUP")
    assert_one_line_error(proc, "SIGHUP")
    assert proc.returncode == 129
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_write_started_with_sighup_ignored_is_published(tmp_path):
    """`nohup python -m convert.merge_orbax ...`: SIGHUP ignored at the start stays ignored."""
    proc = subprocess.run([sys.executable, "-c", "import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN)\n" +
                           SCRIPT, str(tmp_path / "out"), "SIGHUP"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and "published" in proc.stdout, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _replace_without_exchange(tmp_path, monkeypatch, rename):
    """An --overwrite of `out` (holding v = "old") where the filesystem cannot exchange two names, every os.rename
    of the module going through `rename(real_rename, a, b)`: returns (out, its AtomicDir)."""
    import functools
    import os

    from gemma_tpu.core import atomic

    out = tmp_path / "out"
    out.mkdir()
    (out / "v").write_text("old")
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    monkeypatch.setattr(atomic.os, "rename", functools.partial(rename, os.rename))
    return out, atomic.AtomicDir(out, overwrite=True)


def test_ctrl_c_between_the_two_renames_of_a_replace_keeps_an_output(tmp_path, monkeypatch):
    """--overwrite where the filesystem cannot exchange two names: the old output is renamed aside, then the new
    one into place. A Ctrl-C between the two removed the new one (the temp dir) and left no target, the old
    one hidden as `.out.old-PID`, which the next run deletes. Now it waits until the new output is in place."""
    import os
    import signal

    import pytest

    def rename(real_rename, a, b):
        real_rename(a, b)
        if str(b).endswith(f".old-{os.getpid()}"):
            signal.raise_signal(signal.SIGINT)  # Ctrl-C right after the old output went aside

    out, ad = _replace_without_exchange(tmp_path, monkeypatch, rename)
    with pytest.raises(KeyboardInterrupt):
        with ad as tmp:
            (tmp / "v").write_text("new")
            ad.publish()
    assert (out / "v").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# an --overwrite of OUT (an old output holding files a and b) where SIGNAL lands while the old output is deleted,
# the new one already in place (after it deleted `a`); EXCHANGE 0: a filesystem without renameat2's exchange
REPLACE = """
import os, shutil, signal, sys
from gemma_tpu.core import atomic
from gemma_tpu.core.cli import cli_main

def main(argv):
    out, sig, exchange = argv
    if exchange == "0":
        atomic._exchange = lambda a, b: False
    real = shutil.rmtree
    def rmtree(path, ignore_errors=False):
        os.unlink(os.path.join(path, "a"))
        signal.raise_signal(getattr(signal, sig))
        real(path, ignore_errors)
    ad = atomic.AtomicDir(out, overwrite=True)
    with ad as tmp:
        (tmp / "v").write_text("new")
        atomic.shutil.rmtree = rmtree
        ad.publish()
    print("published")

sys.exit(cli_main(main))
"""


@pytest.mark.parametrize("sig,exchange", [("SIGINT", "1"), ("SIGINT", "0"), ("SIGTERM", "0")])
def test_a_signal_while_the_replaced_output_is_deleted_says_it_was_published(tmp_path, sig, exchange):
    """A Ctrl-C (or SIGTERM) while `--overwrite` deleted the old output, the new one already in place, printed a
    bare 'error: interrupted' (exit 130): the output had been published. It now says so and names what is left of
    the old one; a rerun removes that (where renameat2 cannot exchange, the old one was left as `.out.old-PID`,
    which a later run that found `out` missing put back, half deleted, as the output)."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a", "b", "gemma_tpu_merge.json"):
        (out / name).write_text("old")
    proc = subprocess.run([sys.executable, "-c", REPLACE, str(out), sig, exchange], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    left = tmp_path / f".out.tmp-{next(p for p in tmp_path.iterdir() if p.name != 'out').name.rsplit('-', 1)[1]}"
    line = assert_one_line_error(proc, "interrupted" if sig == "SIGINT" else "stopped by SIGTERM",
                                 f" after {out} was published (the old output it replaced is left, in part, as "
                                 f"{left}: the next run for it removes it)")
    assert proc.returncode == (130 if sig == "SIGINT" else 143), line
    assert (out / "v").read_text() == "new" and sorted(p.name for p in left.iterdir()) == ["b", "gemma_tpu_merge.json"]
    shutil.rmtree(out)  # the user removes the output: the leftover is not put back in its place
    code = ("import sys; from gemma_tpu.core.atomic import AtomicDir\n"
            "ad = AtomicDir(sys.argv[1])\n"
            "with ad as tmp:\n    (tmp / 'v').write_text('newer'); ad.publish()\n")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert (out / "v").read_text() == "newer" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# `main` publishes OUT, saying "wrote OUT" in its block as the converters do (or keeps it at KEPT: `move_to`, as a
# failed verification does); SIGNAL is raised at MOMENT: as the rename is synced (`fsync`: the open of OUT's parent),
# as the writer lock beside OUT is removed (`unlock`, once the block is left) or after the block (`after`).
PUBLISHED = """
import os, signal, sys
from gemma_tpu.core.atomic import AtomicDir, writer_lock
from gemma_tpu.core.cli import cli_main

def main(argv):
    out, sig, moment, *keep = argv
    fired = []
    def stop():
        if not fired and os.path.isdir(keep[0] if keep else out):
            fired.append(1)
            signal.raise_signal(getattr(signal, sig))
    def hook(event, args):
        if (moment, event) in (("fsync", "open"), ("unlock", "os.remove")) and os.fspath(args[0]) in (
                os.path.dirname(out), str(writer_lock(out))):
            stop()
    sys.addaudithook(hook)
    ad = AtomicDir(out)
    with ad as tmp:
        (tmp / "a.txt").write_text("a")
        if keep:
            ad.move_to(keep[0])
        else:
            ad.publish()
            print(f"wrote {out}", file=sys.stderr)
    if moment == "after":
        stop()
    return 0

sys.exit(cli_main(main))
"""


@pytest.mark.parametrize("sig,moment", [("SIGTERM", "fsync"), ("SIGTERM", "unlock"), ("SIGINT", "fsync"),
                                        ("SIGINT", "unlock"), ("SIGHUP", "unlock"), ("SIGTERM", "after"),
                                        ("SIGHUP", "after")])
def test_a_stop_once_the_output_is_published_says_so(tmp_path, sig, moment):
    """A stop that lands once the output is in place, before the command returns. As the writer lock was removed
    (the stop handlers already set back) or after the block, a SIGTERM or SIGHUP ended the process by the signal
    (-15, -1), exit handlers not run; at the sync after the rename it said a bare 'stopped by SIGTERM'. Either way
    the output was published with nothing saying so. Now it stops saying that it was (or after 'wrote OUT' was
    said), exit 143, 130, 129, the lock gone."""
    import signal

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", PUBLISHED, str(out), sig, moment], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == (130 if sig == "SIGINT" else 128 + getattr(signal, sig)), proc.stderr
    said = "interrupted" if sig == "SIGINT" else f"stopped by {sig}"
    line = assert_one_line_error(proc, said)
    assert line == f"error: {said}" + ("" if moment == "after" else f" after {out} was published"), proc.stderr
    assert f"wrote {out}" in proc.stderr.splitlines() or moment == "fsync", proc.stderr
    assert (out / "a.txt").read_text() == "a" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_stop_once_the_output_is_kept_aside_says_it_was_not_published(tmp_path):
    """The same stop, as the writer lock is removed, after the output was kept aside (`move_to`: a failed
    verification's `<out>.unverified`): it says where the output is, not that it was published."""
    out, kept = tmp_path / "out", tmp_path / "out.unverified"
    proc = subprocess.run([sys.executable, "-c", PUBLISHED, str(out), "SIGTERM", "unlock", str(kept)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    line = assert_one_line_error(proc, "stopped by SIGTERM")
    assert line == f"error: stopped by SIGTERM after {out} was kept at {kept}, not published", proc.stderr
    assert (kept / "a.txt").read_text() == "a" and sorted(p.name for p in tmp_path.iterdir()) == [kept.name]


# `main` writes OUT; SIGTERM is raised as soon as its temp dir is made (when os.mkdir returns)
AT_THE_TEMP = """
import os, signal, sys
from pathlib import Path
from gemma_tpu.core.atomic import AtomicDir
from gemma_tpu.core.cli import cli_main

def main(argv):
    out = Path(argv[0])
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    def made(frame, event, arg):
        if event == "c_return" and arg is os.mkdir and tmp.is_dir():
            sys.setprofile(None)
            signal.raise_signal(signal.SIGTERM)
    ad = AtomicDir(out)
    sys.setprofile(made)
    with ad as tmp:
        sys.setprofile(None)
        (tmp / "a.txt").write_text("a")
        ad.publish()
    return 0

sys.exit(cli_main(main))
"""


def test_a_sigterm_as_the_temp_output_is_made_removes_it(tmp_path):
    """A SIGTERM right after the hidden temp dir was made, before the output's stop handling began: the temp dir was
    left beside --out (for the next run to remove), where a SIGTERM anywhere else removes it. Nothing is left."""
    out = tmp_path / "new" / "out"
    proc = subprocess.run([sys.executable, "-c", AT_THE_TEMP, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert_one_line_error(proc, "stopped by SIGTERM")
    assert list(tmp_path.iterdir()) == []


# a stop that lands while the interpreter finalizes `__main__`'s globals, after it set the signals Python handled back
# to their default action (as JAX's runtime is torn down after a converter's last line, about half a second)
AT_THE_END = """
import os, signal, sys, time
from gemma_tpu.core.cli import cli_main

class Late:
    def __init__(self, signum):
        self.signum, self.kill, self.pid, self.sleep, self.err = signum, os.kill, os.getpid(), time.sleep, sys.stderr

    def __del__(self):
        self.kill(self.pid, self.signum)
        self.sleep(0.2)
        self.err.write("ended by itself\\n")
        self.err.flush()

late = Late(getattr(signal, sys.argv[1]))

def main(argv):
    print("wrote out", file=sys.stderr)
    return 0

sys.exit(cli_main(main))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_stop_during_the_interpreters_last_teardown_keeps_the_exit_code(sig):
    """After the exit handlers (where `cli._end_on_stop`'s handler ends a finished command at once, exit 0) the
    interpreter sets the signals back to their default action, and a stop in the teardown left (JAX's runtime, some
    tenths of a second after `merge: wrote OUT`) killed the process by the signal: -15 after a complete output. It
    ends by itself with the command's exit code."""
    proc = subprocess.run([sys.executable, "-c", AT_THE_END, sig], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["wrote out", "ended by itself"], proc.stderr


def test_a_replace_whose_set_aside_copy_cannot_be_renamed_is_still_published(tmp_path, monkeypatch):
    """Without renameat2's exchange, the old output set aside is renamed to the temp name before its deletion; that
    rename failing must not report 'nothing was published' about an output already in place: the copy is deleted
    under its set-aside name."""
    import os

    def rename(real_rename, a, b):
        if str(a).endswith(f".old-{os.getpid()}") and ".tmp-" in str(b):
            raise PermissionError(13, "Permission denied", str(a))
        real_rename(a, b)

    out, ad = _replace_without_exchange(tmp_path, monkeypatch, rename)
    with ad as tmp:
        (tmp / "v").write_text("new")
        ad.publish()
    monkeypatch.undo()
    assert (out / "v").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("exchange", [True, False])
def test_ctrl_c_while_an_earlier_unverified_output_is_replaced_keeps_an_output(tmp_path, monkeypatch, exchange):
    """merge --verify keeps a failed merge at `<out>.unverified` (AtomicDir.move_to), replacing an earlier one: that
    was deleted first, then the new one renamed there, and a Ctrl-C during the deletion lost both (the new one as
    the unpublished temp dir). Now the new one is in place before the earlier one is deleted; the command still
    stops, saying where the output was kept, and what is left of the earlier one is a leftover the next run removes."""
    import os
    import signal

    from gemma_tpu.core import atomic

    out, unverified = tmp_path / "out", tmp_path / "out.unverified"
    unverified.mkdir()
    for name in ("a", "b", "m.json"):
        (unverified / name).write_text("old")
    real = shutil.rmtree

    def rmtree(path, ignore_errors=False):
        os.unlink(os.path.join(path, "a"))
        signal.raise_signal(signal.SIGINT)
        real(path, ignore_errors)

    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    monkeypatch.setattr(atomic.shutil, "rmtree", rmtree)
    ad = atomic.AtomicDir(out, marker="m.json")
    with pytest.raises(KeyboardInterrupt, match=f"{out} was kept at {unverified}, not published"):
        with ad as tmp:
            (tmp / "m.json").write_text("new")
            ad.move_to(unverified)
    monkeypatch.undo()
    assert (unverified / "m.json").read_text() == "new" and not out.exists()
    assert len(atomic.clean_stale(out)) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["out.unverified"]


def test_an_output_set_aside_by_a_killed_replace_is_put_back(tmp_path):
    """A SIGKILL between the two renames of a replace (filesystems without renameat2 exchange) left the old output
    as `.out.old-PID` and no `out`; the next run deleted it as a leftover, so the output it was replacing was
    lost. It is now put back first: without --overwrite the run refuses the (restored) output, with --overwrite
    it replaces it as usual."""
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    aside = tmp_path / f".out.old-{pid}"
    aside.mkdir()
    (aside / "v").write_text("old")
    (tmp_path / f".out.tmp-{pid}").mkdir()  # the new output, complete or not: removed as before
    code = ("import sys; from gemma_tpu.core.atomic import AtomicDir\n"
            "ad = AtomicDir(sys.argv[1], overwrite=sys.argv[2] == '1')\n"
            "with ad as tmp:\n    (tmp / 'v').write_text('new'); ad.publish()\n")
    proc = subprocess.run([sys.executable, "-c", code, str(out), "0"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0 and "already exists" in proc.stderr, proc.stderr
    assert (out / "v").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [f".out.tmp-{pid}", "out"]
    proc = subprocess.run([sys.executable, "-c", code, str(out), "1"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert (out / "v").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _in_new_pid_namespace(code: str, *args) -> subprocess.CompletedProcess:
    """Run `code` as a container restart would: in a fresh PID namespace whose PID 1 is a shell (alive, and
    started just now) and whose PIDs start again from 1."""
    import pytest

    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode != 0:
        pytest.skip("no PID namespaces here (unshare needs root)")
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", f'"{sys.executable}" -c "$@"; true',
                           "sh", code, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_leftovers_whose_pid_now_runs_another_process_are_recognised(tmp_path):
    """After a reboot or a container restart the PID of a killed merge or export is handed out again: its
    `.out.tmp-PID` was removed only once no process had that PID, so it stayed for good behind outputs written
    by a long-running service, and a replace's `.out.old-PID` was never put back. The writer lock's rule
    (`pidlock.gone`) now decides: a PID alive as a process started after the leftover last changed is gone."""
    import time

    from gemma_tpu.core.pidlock import CLOCK_SLACK_S

    (tmp_path / ".out.tmp-1").mkdir()  # a merge killed before the restart; PID 1 is the shell after it
    (tmp_path / ".out.tmp-1" / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / ".coach.gguf.tmp-1").write_bytes(b"GGUF")  # an export killed likewise
    (tmp_path / ".kept.old-1").mkdir()  # a replace killed between its two renames
    (tmp_path / ".kept.old-1" / "v").write_text("old")
    time.sleep(CLOCK_SLACK_S + 1.5)
    code = ("import sys; from gemma_tpu.core.atomic import AtomicDir, AtomicFile\n"
            "ad = AtomicDir(sys.argv[1])\n"
            "with ad as tmp:\n    (tmp / 'v').write_text('new'); ad.publish()\n"
            "af = AtomicFile(sys.argv[2])\n"
            "with af as tmp:\n    tmp.write_bytes(b'GGUF'); af.publish()\n"
            "AtomicDir(sys.argv[3]).__enter__()\n")
    proc = _in_new_pid_namespace(code, tmp_path / "out", tmp_path / "coach.gguf", tmp_path / "kept")
    assert "kept already exists" in proc.stderr, proc.stderr  # put back, so not overwritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coach.gguf", "kept", "out"]
    assert (tmp_path / "kept" / "v").read_text() == "old"


def test_leftovers_of_a_live_writer_are_kept(tmp_path):
    """The other side: a temp dir whose writer still runs (its PID alive, started before the temp last changed)
    is not touched."""
    import os

    from gemma_tpu.core.atomic import clean_stale

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp = tmp_path / f".out.tmp-{live.pid}"
        tmp.mkdir()
        dead = tmp_path / f".out.tmp-{2 ** 22 + 7}"  # above pid_max: no such process
        dead.mkdir()
        assert clean_stale(tmp_path / "out") == [dead]
        assert tmp.is_dir() and os.getpid() != live.pid
    finally:
        live.kill()
        live.wait()


def test_leftovers_of_an_output_named_like_a_pattern_are_found(tmp_path):
    """An --out such as `coach[v2]` was a glob pattern to the leftover search: its killed runs' temp dirs (and a
    replace's set-aside output) were never matched, so never removed or put back, while `coachv`'s were taken."""
    from gemma_tpu.core.atomic import clean_stale, restore_set_aside

    dead = 2 ** 22 + 7  # above pid_max: a writer that is gone
    for name in (f".coach[v2].tmp-{dead}", f".coachv.tmp-{dead}", f".coach[v2].old-{dead}", f".coachv.old-{dead}"):
        (tmp_path / name).mkdir()
    assert restore_set_aside(tmp_path / "coach[v2]") == tmp_path / f".coach[v2].old-{dead}"
    assert clean_stale(tmp_path / "coach[v2]") == [tmp_path / f".coach[v2].tmp-{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".coachv.old-{dead}", f".coachv.tmp-{dead}", "coach[v2]"]


# SIGTERM while the main thread waits for an XLA compilation (jax compiles in a thread pool): the exit tore down
# XLA's client under the compilation still running, a segmentation fault (exit 139, every time here; about one
# SIGTERM in three at the start of `gemma_tpu.evaluate`, while its decode step compiled).
COMPILING = """
import atexit, os, signal, sys, threading
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import raise_signal_exit

def main(argv):
    import jax, jax.numpy as jnp
    signal.signal(signal.SIGTERM, raise_signal_exit)
    atexit.register(lambda: print("exit handlers ran", file=sys.stderr, flush=True))
    def f(x):
        for i in range(40):  # ~2 s of XLA compilation on a 2-core CPU
            x = jnp.sin(x) @ x + i
        return x
    lowered = jax.jit(f).lower(jnp.ones((8, 8)))
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
    timer.start()
    lowered.compile()
    return 0

sys.exit(cli_main(main))
"""


def test_sigterm_while_xla_compiles_exits_143_not_a_segfault():
    proc = subprocess.run([sys.executable, "-c", COMPILING], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines() == ["error: stopped by SIGTERM", "exit handlers ran"], proc.stderr[-2000:]
