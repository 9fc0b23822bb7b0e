"""One writer per run directory: `gemma_tpu_run.lock` in `checkpoint.dir`.

The lock file holds the holder's PID, host, start time and command line as JSON. It is created with
`O_CREAT | O_EXCL` (atomic on local filesystems and NFSv3+), so of two trainers started on the same
directory exactly one gets it; the other fails with one line naming the holder. A lock left by a
process that died without releasing it (SIGKILL, a crash of the machine) is taken over with a warning
when it was written on this host and its PID is no longer alive; a lock from another host is never
taken over automatically (its process cannot be checked from here): the message says which file to
remove. Released at exit: normal end, exception, SIGTERM (the trainer's handler calls `release_all`).

Limits: object stores (gs://, s3://) have no O_EXCL; on them, and on filesystems that do not honour it
(some FUSE mounts), two writers are not prevented. PID reuse after a reboot can make a stale lock look
alive: then remove the file by hand.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import sys
from pathlib import Path

from gemma_tpu.core.errors import UserError

LOCK_FILE = "gemma_tpu_run.lock"

log = logging.getLogger("gemma_tpu.train")
_held: list[RunLock] = []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def read_holder(path: Path) -> dict | None:
    """The lock's JSON, {} when unreadable (being written, or garbage), None when there is no lock."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def describe(holder: dict) -> str:
    if not holder:
        return "an unreadable lock"
    return f"PID {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"


def is_stale(holder: dict) -> bool:
    """Written on this host by a process that is gone."""
    pid = holder.get("pid")
    return (holder.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid()
            and not _pid_alive(pid))


def check_free(run_dir: str | Path) -> None:
    """Refuse early (writing nothing) when a live trainer holds `run_dir`."""
    path = Path(run_dir) / LOCK_FILE
    holder = read_holder(path)
    if holder is not None and not is_stale(holder) and holder.get("pid") != os.getpid():
        raise _busy(path, holder)


def _busy(path: Path, holder: dict) -> UserError:
    return UserError(f"{path.parent} is in use by another trainer ({describe(holder)}); use another "
                     f"checkpoint.dir, or remove {path} if that process is gone")


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "argv": sys.argv}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if holder is None:  # released meanwhile
                    continue
                if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                    for other in [h for h in _held if h.path == self.path]:  # an earlier run() in this process
                        other.release()
                    self.path.unlink(missing_ok=True)
                    continue
                if not is_stale(holder):
                    raise _busy(self.path, holder) from None
                self._take_over(holder)
                continue
            try:
                os.write(fd, json.dumps(info).encode())
                os.fsync(fd)
            except OSError as e:  # a full disk: an empty lock left here would refuse every later run
                os.close(fd)
                self.path.unlink(missing_ok=True)
                raise UserError(f"cannot write the run lock {self.path} ({e.strerror or e})") from None
            else:
                os.close(fd)
            self.held = True
            _held.append(self)
            atexit.register(self.release)
            return self
        raise _busy(self.path, read_holder(self.path) or {})

    def _take_over(self, holder: dict) -> None:
        """Move the stale lock aside by rename: of two processes taking over at once, one rename wins;
        the loser finds the winner's fresh lock on its next O_EXCL attempt."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = read_holder(aside) or {}
        if moved.get("pid") != holder.get("pid") or moved.get("started") != holder.get("started"):
            # someone else's fresh lock got moved (it replaced the stale one after we read it): put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.unlink(aside)
            return
        os.unlink(aside)
        log.warning("%s: taking over a stale lock (%s, no longer running)", self.path, describe(holder))

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = read_holder(self.path)
        if holder and holder.get("pid") == os.getpid():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self in _held:
            _held.remove(self)


def acquire(run_dir: str | Path) -> RunLock:
    return RunLock(run_dir).acquire()


def release_all() -> None:
    """Release every lock this process holds (the SIGTERM handler calls this before `os._exit`)."""
    for lock in _held[:]:
        lock.release()
