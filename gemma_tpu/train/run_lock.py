"""One writer per run directory: `gemma_tpu_run.lock` in `checkpoint.dir` (and in a separate `train.run_dir`,
where metrics.jsonl and summary.json go), a `gemma_tpu.core.pidlock`.

Of two trainers started on the same directory exactly one gets it; the other fails with one line naming
the holder (its PID, host and start time). A dead holder's lock on this host is taken over with a warning.
Released at exit: normal end, exception, SIGTERM (the trainer's handler calls `release_all`).
"""

from __future__ import annotations

from pathlib import Path

from gemma_tpu.core import pidlock
from gemma_tpu.core.errors import UserError

LOCK_FILE = "gemma_tpu_run.lock"
release_all = pidlock.release_all


def _busy(key: str):
    def busy(path: Path, holder: dict) -> UserError:
        return UserError(f"{path.parent} is in use by another trainer ({pidlock.describe(holder)}); use another "
                         f"{key}, or remove {path} if that process is gone")
    return busy


def check_free(run_dir: str | Path, key: str = "checkpoint.dir") -> None:
    """Refuse early (writing nothing) when a live trainer holds `run_dir` (the option `key` names)."""
    pidlock.check_free(Path(run_dir) / LOCK_FILE, _busy(key))


def acquire(run_dir: str | Path, key: str = "checkpoint.dir") -> pidlock.PidLock:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return pidlock.PidLock(Path(run_dir) / LOCK_FILE, _busy(key)).acquire()


def clear_stale(run_dir: str | Path, key: str = "checkpoint.dir") -> None:
    """Remove the lock of a dead trainer on `run_dir` (taken over, with its warning, and released at once), for a
    run that ends without writing (a rerun of a finished run: "nothing to do"); a live holder is refused as by
    `acquire`, and nothing is created where there is no lock."""
    if (Path(run_dir) / LOCK_FILE).exists():
        pidlock.PidLock(Path(run_dir) / LOCK_FILE, _busy(key)).acquire().release()
