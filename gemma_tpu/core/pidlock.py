"""One writer at a time: a lock file holding its holder's PID, host, start time and command line as JSON.

The file appears with its content: written as `<lock>.new-<pid>`, then hard-linked into place, which fails on an
existing name as `O_CREAT | O_EXCL` does (atomic on local filesystems and NFSv3+; where there are no hard links,
`O_EXCL` and a write in place), so of two processes started at once exactly one gets it; the other is refused
with one line naming the holder, and a process killed while writing its lock leaves none. A lock left by a
process that died without releasing it (SIGKILL, a crash of the machine) is taken over with a warning when
it was written on this host and its process is gone: its PID is not alive, or is alive but started at
another time than the holder (after a reboot or a container restart PIDs are handed out again, and the
PID of a preempted trainer is often alive as an unrelated process). A lock from another host cannot be checked
from here, so its holder keeps it fresh instead: a thread touches every held lock each `HEARTBEAT_S` seconds,
and another host's lock untouched for `LEASE_S` is stale too (a preempted VM's trainer, restarted on a new VM
over the same shared checkpoint directory, was refused until the file was removed by hand). So is an unreadable
lock (empty: written in place, where there are no hard links, by a process that died first) untouched for
`LEASE_S`. Released at exit (normal end, exception) and by `release_all` (what a SIGTERM handler that ends
with `os._exit` calls). Users: the trainer's run directory (gemma_tpu.train.run_lock) and every published output
(gemma_tpu.core.atomic).

Limits: object stores (gs://, s3://) have no O_EXCL; on them, and on filesystems that do not honour it
(some FUSE mounts), two writers are not prevented. Without /proc (not Linux), a reused PID makes a stale
lock look alive: then remove the file by hand.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import glob
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from gemma_tpu.core.errors import UserError

log = logging.getLogger("gemma_tpu.core.pidlock")
_held: list[PidLock] = []
HEARTBEAT_S = 30.0  # how often a holder touches its locks
LEASE_S = 300.0  # another host's lock untouched this long is stale (ten heartbeats: slow NFS, clock skew)
_beating = threading.Event()  # the heartbeat thread is running


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def started_at(pid: int) -> float | None:
    """When process `pid` started, in wall-clock seconds (the boot time plus `start_time`); None where unknown."""
    ticks = start_time(pid)
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return None if ticks is None else boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


CLOCK_SLACK_S = 1.0  # `started_at` is truncated to whole seconds of boot time; file times are exact


def gone(pid: int, pid_start: int | None = None, alive_at: float | None = None) -> bool:
    """Whether the process that had PID `pid` is gone: the PID is not alive, or it is alive as another process
    (after a reboot or a container restart PIDs are handed out again), one that started at another time than
    the holder's recorded `pid_start` (`start_time`), or after `alive_at` (wall-clock seconds at which the
    holder was known to run: the change time of a file it wrote)."""
    if not pid_alive(pid):
        return True
    if isinstance(pid_start, int):
        now = start_time(pid)
        return now is not None and now != pid_start
    if alive_at is not None:
        start = started_at(pid)
        return start is not None and start > alive_at + CLOCK_SLACK_S
    return False


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


def idle_seconds(path: Path) -> float | None:
    """Seconds since the lock at `path` was last touched (None: gone)."""
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return None


def is_stale(holder: dict, path: Path | None = None) -> bool:
    """Written on this host by a process that is gone (its PID dead, or now another process's), or on another
    host by a holder that keeps it fresh (`heartbeat`) and has not touched it (at `path`) for `LEASE_S`."""
    pid = holder.get("pid")
    if not holder:  # empty or garbage: its writer died between creating and writing it (a VM lost before the
        # fsync leaves an empty file); it was refused for ever. A live holder's heartbeat keeps even such a file fresh
        idle = idle_seconds(path) if path is not None else None
        return idle is not None and idle > LEASE_S
    if holder.get("host") != socket.gethostname():
        idle = idle_seconds(path) if path is not None and holder.get("heartbeat") else None
        return idle is not None and idle > LEASE_S
    if not isinstance(pid, int) or _mine(holder):
        return False
    return gone(pid, pid_start=holder.get("pid_start"))


def _mine(holder: dict | None) -> bool:
    """Written by this very process (not an earlier one that had its PID)."""
    if not holder or holder.get("pid") != os.getpid() or holder.get("host") != socket.gethostname():
        return False
    recorded = holder.get("pid_start")
    return not isinstance(recorded, int) or recorded == start_time(os.getpid())


# `busy(path, holder)`: the error for a lock another live process holds
Busy = Callable[[Path, dict], UserError]


def check_free(path: str | Path, busy: Busy) -> None:
    """Refuse early (writing nothing) when a live process other than this one holds the lock `path`."""
    path = Path(path)
    holder = read_holder(path)
    if holder is not None and not is_stale(holder, path) and not _mine(holder):
        raise busy(path, holder)


class PidLock:
    def __init__(self, path: str | Path, busy: Busy):
        self.path = Path(path)
        self.busy = busy
        self.held = False

    def acquire(self) -> PidLock:
        info = {"pid": os.getpid(), "pid_start": start_time(os.getpid()), "host": socket.gethostname(),
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "argv": sys.argv, "heartbeat": HEARTBEAT_S}
        data = json.dumps(info).encode()
        _clean_debris(self.path)
        for _ in range(3):
            if not self._create(data):
                holder = read_holder(self.path)
                if holder is None:  # released meanwhile
                    continue
                if _mine(holder):
                    for other in [h for h in _held if h.path == self.path]:  # an earlier holder in this process
                        other.release()
                    self.path.unlink(missing_ok=True)
                    continue
                if not is_stale(holder, self.path):
                    raise self.busy(self.path, holder) from None
                self._take_over(holder)
                continue
            self.held = True
            _held.append(self)
            atexit.register(self.release)
            _start_heartbeat()
            return self
        raise self.busy(self.path, read_holder(self.path) or {})

    def _create(self, data: bytes) -> bool:
        """Make the lock file appear with `data` in it, or return False when it exists. `data` is written and
        fsynced in `<lock>.new-<pid>`, then hard-linked into place (a link fails on an existing name, as O_EXCL
        does): a process killed between creating the lock and writing it (SIGKILL, the OOM killer) left an empty
        lock that refused every run for that output or run directory for LEASE_S. Where the filesystem has no hard
        links (some FUSE mounts), the lock is created with O_EXCL and written in place."""
        tmp = self.path.with_name(f"{self.path.name}.new-{os.getpid()}")
        try:
            self._write(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, data)
            try:
                os.link(tmp, self.path)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                    raise
        finally:
            tmp.unlink(missing_ok=True)
        try:
            self._write(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, data, remove=True)
        except FileExistsError:
            return False
        return True

    def _write(self, path: Path, flags: int, data: bytes, remove: bool = False) -> None:
        """Write `data` to a new file `path`, fsynced; a failure (a full disk, a signal's exit raised here)
        removes what was created when `remove`, and an OSError is one line naming the lock."""
        fd = os.open(path, flags, 0o644)
        try:
            while data:  # a write cut short (a file-size limit, a disk filling) says nothing: the next one
                # raises why. One short write left the lock's JSON cut off, an "unreadable lock" this process
                # could not recognise as its own to remove, refusing every run for the same output for LEASE_S
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except BaseException as e:  # a full disk, or a signal's exit raised just here (SIGTERM before the
            # run's handler): an empty lock left here refused every later run, or until the lease ran out
            os.close(fd)
            if remove:
                path.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise UserError(f"cannot write the lock {self.path} ({e.strerror or e})") from None
            raise
        os.close(fd)

    def _take_over(self, holder: dict) -> None:
        """Move the stale lock aside by rename: of two processes taking over at once, one rename wins;
        the loser finds the winner's fresh lock on its next O_EXCL attempt."""
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}")
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
        if not holder or holder.get("host") != socket.gethostname():
            log.warning("%s: taking over a stale lock (%s, not kept fresh for %.0f s)", self.path, describe(holder),
                        LEASE_S)
        else:
            log.warning("%s: taking over a stale lock (%s, no longer running)", self.path, describe(holder))

    def still_held(self) -> bool:
        """Whether the lock file is still this holder's (not removed, with its directory, or replaced)."""
        return self.held and _mine(read_holder(self.path))

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if _mine(read_holder(self.path)):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:  # a directory made read-only, a disk gone: raised here (at exit, in `finally`), it
                # replaced the error that stopped the writer ("Read-only file system: …/gemma_tpu_run.lock")
                log.warning("%s: cannot remove this lock (%s); it is left, and the next writer takes it over once "
                            "this process has ended", self.path, e.strerror or e)
        if self in _held:
            _held.remove(self)


def _clean_debris(path: Path) -> None:
    """Remove what killed processes left beside the lock `path`: `<lock>.new-<pid>` (killed while writing their
    lock, before linking it into place) and `<lock>.stale-<pid>` (killed while taking a stale one over)."""
    for kind in ("new", "stale"):
        for p in path.parent.glob(f"{glob.escape(path.name)}.{kind}-*"):
            pid = p.name.rsplit("-", 1)[1]
            try:
                changed = p.lstat().st_ctime
            except OSError:
                continue
            if pid.isdigit() and int(pid) != os.getpid() and gone(int(pid), alive_at=changed):
                p.unlink(missing_ok=True)


def release_all() -> None:
    """Release every lock this process holds (a SIGTERM handler calls this before `os._exit`)."""
    for lock in _held[:]:
        lock.release()


def _start_heartbeat() -> None:
    """Touch every held lock each HEARTBEAT_S seconds, from one daemon thread (started with the first lock)."""
    if _beating.is_set():
        return
    _beating.set()

    def beat():
        while True:
            time.sleep(HEARTBEAT_S)
            for lock in _held[:]:
                try:
                    os.utime(lock.path)
                except OSError:  # released meanwhile, or the disk went away: the holder finds out when it writes
                    pass

    threading.Thread(target=beat, name="pidlock-heartbeat", daemon=True).start()
