"""Publish an output directory (or a single file: `AtomicFile`) all at once, or not at all.

The output is built in `.<name>.tmp-<pid>` beside the target (same filesystem, so the final rename
is atomic). Any exception, Ctrl-C or SIGTERM removes it; a SIGKILL leaves only that hidden temp
dir, which the next run for the same target removes once its owner process is gone (its PID dead, or
reused by a process started after it: `pidlock.gone`, the writer lock's own rule). With
`--overwrite` an existing target is swapped with the new one in one `renameat2(RENAME_EXCHANGE)`
call (readers see the old or the new directory, never neither), then the old one is deleted; where
the filesystem cannot exchange, the fallback renames the old one aside first, leaving a window of
microseconds with no target; a run killed in it leaves the old one as `.<name>.old-<pid>`, which the next run
for the target puts back (`restore_set_aside`) before it checks the target. Once the new output is in place, the
old one is deleted under the temp dir's name (never put back); a Ctrl-C or SIGTERM then still stops the command,
saying that the output was published (`errors.interrupted_after`) and naming what is left of the old one.

One writer per target: while a process writes it, it holds `.<name>.writer.lock` beside it (a
`gemma_tpu.core.pidlock`), and a second process for the same target is refused naming the first (two
`--overwrite` runs both succeeded, the last one's output replacing the other's); a lock left by a killed
process is taken over with a warning.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import logging
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

from gemma_tpu.core import pidlock
from gemma_tpu.core.errors import SignalExit, UserError, interrupted_after, stop_signals_raise
from gemma_tpu.core.progress import human

log = logging.getLogger("gemma_tpu.core.atomic")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def check_writable(path: str | Path, what: str, room: int = 0) -> None:
    """Refuse, before any heavy work and without leaving anything, a path that cannot be created or written:
    the nearest existing ancestor must be a directory a file can be made in. (`what` names the option: `--out X`.)
    `room`: bytes that file must take too (a full disk still makes an empty file).

    The file is made unnamed (`O_TMPFILE`), so the directory is not changed at all: no entry appears, its mtime
    stays. A named probe file whose mtime change was then set back could undo another process's change of the
    directory made in that instant (another trainer's file in a shared checkpoint directory), and an mtime set
    back is what NFS clients and Python's import cache read as "nothing new here". Where the filesystem has no
    unnamed files (NFS, most FUSE mounts, sysfs) a named one is made and removed, its mtime change left as is."""
    p = Path(path).absolute()
    probe = p
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():  # a link to nothing passed, and the run failed at its end: "cannot create (File exists)"
            raise UserError(f"{what}: {probe} is a link to {os.readlink(probe)}, which does not exist (create that "
                            f"directory, or give another path)")
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"{what}: {probe} is not a directory")
    # a file made, not os.access: as root that says yes to a directory no one can write in (sysfs, a root-squashed
    # NFS export, a FUSE mount that checks for itself), and the run failed at its first write
    def refuse(e: OSError) -> UserError:
        missing = f"; {p} does not exist and cannot be created there" if probe != p else ""
        if e.errno == errno.ENOENT:  # the directory exists: a filesystem whose files the kernel makes (/proc)
            fs = _filesystem_type(probe)  # it was "/proc is not writable (No such file or directory)"
            return UserError(f"{what}: {probe} takes no new files ({f'a {fs} filesystem: ' if fs else ''}its files are "
                             f"the system's){missing}; give a path on a disk")
        return UserError(f"{what}: {probe} is not writable ({e.strerror or e}){missing}")

    name = fd = None
    if hasattr(os, "O_TMPFILE"):  # Linux
        try:
            fd = os.open(probe, os.O_TMPFILE | os.O_WRONLY, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):  # EISDIR: a kernel without O_TMPFILE
                raise refuse(e) from None
    if fd is None:
        try:
            fd, name = tempfile.mkstemp(prefix=".writable-", dir=probe)
        except OSError as e:
            raise refuse(e) from None
    full = None
    try:
        data = b"\0" * room
        while data:  # a short write says nothing; the next one says why
            data = data[os.write(fd, data):]
    except OSError as e:  # ENOSPC, EDQUOT, EFBIG
        full = e
    finally:
        os.close(fd)
        if name is not None:
            os.unlink(name)
    if full is not None:
        raise UserError(f"{what}: {probe} has no room for it ({full.strerror or full})")


def _filesystem_type(path: Path) -> str | None:
    """The type of the filesystem `path` is on (`proc`, `sysfs`), by the longest mount point holding it in
    /proc/self/mounts; None where that is not known."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for point, fs in mounts:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)  # a space is \040 there
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > len(best[0])):
            best = (point, fs)
    return best[1] if best else None


def free_space(path: str | Path) -> int:
    """Free bytes on the filesystem that would hold `path` (its nearest existing parent)."""
    probe = Path(path).absolute().parent
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


SPACE_MARGIN = 64 << 20  # left free beside an output (the other files of the directory, the filesystem's own)


def check_space(out: str | Path, nbytes: int) -> None:
    """Refuse, before writing, an output whose bytes (plus SPACE_MARGIN) do not fit: a full disk midway left only an
    error naming a temp folder. The margin is named: 'need 428.54 KB, 4.19 MB free' read as a contradiction.
    What killed runs for the same target left beside it (`stale_leftovers`, removed before writing starts) counts
    as free: a merge SIGKILLed near its end held the space of a whole output, and every rerun was refused for it."""
    free = free_space(out)
    if free < nbytes + SPACE_MARGIN:
        leftovers = stale_leftovers(Path(out).absolute())
        held = sum(_disk_usage(p) for p in leftovers)
        if free + held >= nbytes + SPACE_MARGIN:
            return
        also = (f" ({human(held)} of it held by what killed runs left, e.g. {leftovers[0].name}, removed before "
                f"writing)" if held else "")
        raise UserError(f"not enough disk space for {out}: need {human(nbytes)} plus {human(SPACE_MARGIN)} to spare, "
                        f"{human(free + held)} free{also}")


def _disk_usage(path: Path) -> int:
    """Bytes a file or a directory tree takes on disk (its allocated blocks; links not followed)."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    total = st.st_blocks * 512
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
    return total


def writer_lock(target: str | Path) -> Path:
    """The lock file a process writing `target` holds (beside it: the target itself is swapped whole)."""
    target = Path(target).absolute()
    return target.parent / f".{target.name}.writer.lock"


def _busy_writing(path: Path, holder: dict) -> UserError:
    target = path.parent / path.name[1:-len(".writer.lock")]
    return UserError(f"{target} is being written by another process ({pidlock.describe(holder)}); wait for it to "
                     f"end, or remove {path} if that process is gone")


def check_not_being_written(path: str | Path) -> None:
    """Refuse to read an output that another process is writing anew (its writer lock is held: a merge's
    --overwrite of a directory read as `--merged DIR` or as a model): what was read would be replaced when that
    run publishes, midway through the read or just after it."""
    def busy(lock: Path, holder: dict) -> UserError:
        return UserError(f"{Path(path)} is being written anew by another process ({pidlock.describe(holder)}), which "
                         f"replaces it when it ends; wait for it, or remove {lock} if that process is gone")

    pidlock.check_free(writer_lock(path), busy)


def check_target(target: Path, overwrite: bool, protected: list[Path] = (), kind: str = "dir",
                 marker: str | None = None, magic: bytes | None = None) -> None:
    """Refuse an existing target without --overwrite, a target of the other kind (or a link) in its
    place, targets that hold our own inputs, and targets that cannot be written.
    `kind`: "dir" or "file". `marker`: the file every output of this tool holds (its provenance JSON);
    given, --overwrite replaces only an empty directory or an earlier output, never a directory of
    other files (`--out . --overwrite` would otherwise delete the working directory's contents).
    `magic`: for a file, the bytes every output of this tool starts with; given, --overwrite replaces only an
    empty file or an earlier output (`--out train.jsonl --overwrite` would otherwise replace the data)."""
    target = Path(target)
    pidlock.check_free(writer_lock(target), _busy_writing)
    restore_set_aside(target)
    # what --overwrite would refuse is said without it too: "use --overwrite", then a refusal, was a dead end (the
    # checks of the inputs and of what the target holds came after it: `--out BASE` said "use --overwrite")
    exists = target.exists() or target.is_symlink()
    if exists:
        if target.is_symlink():  # 'is not a directory' of a link to one sent users looking at the wrong thing
            raise UserError(f"{target} is a symbolic link (to {os.readlink(target)}); refusing to replace the link: "
                            f"give the path it points to, or remove the link")
        if not (target.is_dir() if kind == "dir" else target.is_file()):
            what = "a directory" if kind == "dir" else "a regular file"
            raise UserError(f"{target} exists and is not {what}; refusing to replace it")
        if os.path.ismount(target):  # the rename at the end failed with EBUSY, after all the work was done
            raise UserError(f"--out {target} is a mount point, which an output cannot replace (it is built beside "
                            f"the target and renamed into place); give a path inside it, e.g. {target / 'out'}")
    resolved = target.resolve()
    for p in protected:
        p = Path(p).resolve()
        if kind == "dir" and (resolved == p or resolved in p.parents):
            raise UserError(f"--out {target} would replace an input ({p})")
        if resolved == p or p in resolved.parents:  # e.g. a step-like name inside a checkpoint dir
            raise UserError(f"--out {target} is inside an input ({p}); write it elsewhere")
    if kind == "dir":
        holder = next((a for a in resolved.parents if _holds_model(a, marker)), None)
        if holder is not None:  # a model nested in another's files: their loaders and cleaners see each other's
            held = (f"an earlier output: {marker}" if marker and (holder / marker).is_file()
                    else "config.json and weights")
            raise UserError(f"--out {target} is inside {holder}, which holds a model ({held}); write it elsewhere")
    if kind == "dir" and marker is not None and target.is_dir() and not (target / marker).is_file():
        held = sorted(p.name for p in target.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise UserError(f"--out {target}: --overwrite replaces an earlier output (a directory with {marker}), "
                            f"and this one holds other files ({shown}); choose another --out, or remove it yourself")
    if kind == "file" and magic is not None and target.is_file() and not target.is_symlink():
        try:
            with target.open("rb") as f:
                head = f.read(len(magic))
        except OSError as e:
            raise UserError(f"--out {target}: cannot read it ({e.strerror or e}); refusing to replace it") from None
        if head and head != magic:
            raise UserError(f"--out {target}: --overwrite replaces an earlier output (a file starting with "
                            f"{magic!r}), and this file is something else; choose another --out, or remove it yourself")
    if exists and not overwrite:
        raise UserError(f"{target} already exists (use --overwrite to replace it)")
    check_writable(target.parent, f"--out {target}")


def _holds_model(d: Path, marker: str | None) -> bool:
    """An earlier output of the tool (its `marker` file), or an HF model directory (config.json beside weights)."""
    if marker and (d / marker).is_file():
        return True
    return (d / "config.json").is_file() and (any(d.glob("*.safetensors"))
                                              or (d / "model.safetensors.index.json").is_file())


def check_file_target(target: Path, overwrite: bool, protected: list[Path] = (), magic: bytes | None = None) -> None:
    """`check_target` for a single output file."""
    check_target(target, overwrite, protected, kind="file", magic=magic)


def restore_set_aside(target: Path) -> Path | None:
    """Put back an output that a replace set aside as `.<name>.old-<pid>` when its process was killed
    (SIGKILL, power loss) between its two renames: the target is missing and the old output is whole. Left
    alone, the next run's `clean_stale` deleted it, so a killed `--overwrite` lost the output it was replacing."""
    target = Path(target).absolute()
    if target.exists() or target.is_symlink() or not target.parent.is_dir():
        return None
    aside = [p for p in target.parent.glob(f".{glob.escape(target.name)}.old-*")
             if _owner(p) not in (None, os.getpid()) and _left_behind(p)]
    if not aside:
        return None
    newest = max(aside, key=lambda p: p.lstat().st_mtime)
    os.rename(newest, target)
    log.warning("%s: restored the output a killed run had set aside as %s", target, newest.name)
    return newest


def _owner(leftover: Path) -> int | None:
    """The PID a `.<name>.tmp-<pid>` / `.<name>.old-<pid>` names (None: not such a name)."""
    pid = leftover.name.rsplit("-", 1)[-1]
    return int(pid) if pid.isdigit() else None


def _left_behind(leftover: Path) -> bool:
    """Whether the process that wrote `leftover` is gone (`pidlock.gone`): its PID is dead, or alive as a
    process that started after it last renamed or wrote the leftover (the change time, which a copy or
    `touch` cannot set back). After a reboot the PID of a killed merge is often alive as another process,
    and its temp dir was kept for good."""
    try:
        changed = leftover.lstat().st_ctime
    except FileNotFoundError:
        return False
    return pidlock.gone(_owner(leftover), alive_at=changed)


def stale_leftovers(target: Path) -> list[Path]:
    """The `.<name>.tmp-<pid>` / `.<name>.old-<pid>` beside `target` whose writer is gone (killed) or is this
    process."""
    parent = target.parent
    if not parent.is_dir():
        return []
    name = glob.escape(target.name)  # `run[v2]` as a pattern matched `runv` and `run2`, never itself
    return [p for kind in ("tmp", "old") for p in sorted(parent.glob(f".{name}.{kind}-*"))
            if _owner(p) is not None and (_owner(p) == os.getpid() or _left_behind(p))]


def clean_stale(target: Path) -> list[Path]:
    """Remove `.<name>.tmp-<pid>` / `.<name>.old-<pid>` left by merges that were killed."""
    removed = stale_leftovers(target)
    for p in removed:
        _remove(p)
    return removed


def _remove(path: Path) -> None:
    """Delete a leftover temp directory or file, whichever it is."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class _signals_held:
    """Ctrl-C, SIGTERM and SIGHUP wait (recorded, then raised again on leaving) while a publish swaps names: the old
    output is renamed aside, then the new one into place, and the handler's exception between the two
    (KeyboardInterrupt, SignalExit) removed the new one, leaving no target and the old one as debris that the
    next run deletes. (Python handlers, not a signal mask: any thread may receive a process's signal.) Outside
    the main thread, where Python runs no handlers, it does nothing."""

    def __enter__(self):
        self.saved, self.got = {}, []
        try:
            for signum in _HELD:
                previous = signal.getsignal(signum)
                if previous is None:  # set outside Python: leave it alone
                    continue
                signal.signal(signum, lambda n, frame: self.got.append(n))
                self.saved[signum] = previous
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self.saved.items():
            signal.signal(signum, previous)
        for signum in self.got:
            signal.raise_signal(signum)  # to the handler now in place, after the swap


def write_file(path: Path, data: str | bytes, fsync: bool = False) -> None:
    """`data` written to `path` (text as UTF-8), flushed to disk with `fsync`; a failed write (a full disk, a
    file-size limit) names `path`: Path.write_text's error names no file, and a publish's message then named only
    its temp directory."""
    try:
        with open(path, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def library_os_error(exc: BaseException | None) -> OSError | None:
    """The OSError inside another library's exception: safetensors (`SafetensorError: Error while serializing: I/O
    error: No space left on device (os error 28)`, what transformers' save_pretrained raises on a full disk) and
    tokenizers report I/O errors of their Rust code as their own types, with the errno only in the text. None
    for anything else."""
    match = _RUST_OS_ERROR.search(str(exc)) if isinstance(exc, Exception) else None
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code))


class _AtomicOutput:
    """What AtomicDir and AtomicFile share: the hidden temp path beside the target, SIGTERM and SIGHUP turned into
    SignalExit while it exists (so the cleanup runs), and the temp removed unless published."""

    kind = "dir"

    def __init__(self, target: str | Path, overwrite: bool = False, marker: str | None = None,
                 magic: bytes | None = None, lock: bool = True):
        self.target = Path(target).absolute()
        self.overwrite = overwrite
        self.marker = marker  # see check_target
        self.magic = magic
        self.tmp = self.target.parent / f".{self.target.name}.tmp-{os.getpid()}"
        self.published = False  # the temp is in place (at the target, or kept elsewhere: `move_to`)
        self._done = ""  # what became of it, said by a stop that comes after (`_exit_published`)
        self._made: list[Path] = []  # the target's parent directories this output created, deepest first
        self._stop_signals = stop_signals_raise()
        self._lock = pidlock.PidLock(writer_lock(self.target), _busy_writing) if lock else None

    def __enter__(self) -> Path:
        check_target(self.target, self.overwrite, kind=self.kind, marker=self.marker, magic=self.magic)
        # SIGTERM and SIGHUP -> SignalExit from here, so the cleanups run: entered after the temp was made, a SIGTERM
        # landing in between left it behind (the default action, or the exception outside this `try`)
        self._stop_signals.__enter__()
        try:
            self._made = [d for d in (self.target.parent, *self.target.parent.parents) if not os.path.lexists(d)]
            self.target.parent.mkdir(parents=True, exist_ok=True)
            if self._lock is not None:
                self._lock.acquire()
            clean_stale(self.target)
            if self.kind == "dir":
                self.tmp.mkdir()
            else:
                self.tmp.touch(exist_ok=False)
        except OSError as e:
            self._undo_enter()
            raise UserError(f"--out {self.target}: cannot create {e.filename or self.tmp} "
                            f"({e.strerror or e})") from None
        except BaseException:  # a stop (Ctrl-C, SIGTERM), the lock held by another writer
            self._undo_enter()
            raise
        return self.tmp

    def _undo_enter(self) -> None:
        """What `__enter__` made, removed (the temp is this process's: its name holds our PID)."""
        _remove(self.tmp)
        self._release()
        self._remove_made()
        self._stop_signals.__exit__(None, None, None)

    def _stopped_after_publish(self, stop: BaseException, old: Path | None) -> None:
        """A Ctrl-C or SIGTERM that came once the new output was in place (held during the swap, or during the
        old one's deletion) still stops the command, saying that the output was published and naming what is
        left of the old one: a bare 'interrupted' read as nothing published."""
        done = f"{self.target} was published"
        if old is not None and os.path.lexists(old):
            done += f" (the old output it replaced is left, in part, as {old}: the next run for it removes it)"
        raise interrupted_after(stop, done) from None

    def _exit_published(self, exc: BaseException | None) -> None:
        """Leave the block of a published output. A Ctrl-C or SIGTERM that came after the publish (in the block's
        last lines, or as the writer lock is removed, which it waits for) stops the command saying that the output
        was published: the lock was removed after the stop signals were set back, and a SIGTERM there ended the
        process by the signal (-15), its output complete and nothing said."""
        stop = exc if isinstance(exc, (KeyboardInterrupt, SignalExit)) else None
        try:
            try:
                with _signals_held():
                    self._release()
            finally:
                self._stop_signals.__exit__(None, None, None)
        except (KeyboardInterrupt, SignalExit) as e:  # held, and raised as the handlers came back
            stop = stop or e
        said = stop is not None and (stop.after if isinstance(stop, SignalExit) else str(stop))
        if stop is not None and not said:
            raise interrupted_after(stop, self._done or f"{self.target} was published") from None

    def _refuse_if_appeared(self) -> None:
        if not (self.target.exists() or self.target.is_symlink()):
            return
        if not self.overwrite:
            raise UserError(f"{self.target} appeared while writing; not replacing it (use --overwrite)")
        why = self._not_replaceable()
        if why:  # --overwrite replaces what `check_target` let it at the start, not what was put there since
            raise UserError(f"{self.target} was made anew while writing and is {why}; not replacing it, nothing "
                            f"was published")

    def _not_replaceable(self) -> str | None:
        """Why the target now there is not what --overwrite replaces (`check_target`'s rules: a link, the other kind,
        a directory of other files than an earlier output's, a file of other bytes), or None. A directory of a
        user's files made at --out during a merge was swapped out and deleted; a file, left as the temp's name for
        the next run to delete."""
        t = self.target
        if t.is_symlink():
            return f"a symbolic link (to {os.readlink(t)})"
        if self.kind == "dir" and not t.is_dir():
            return "not a directory"
        if self.kind == "file" and not t.is_file():
            return "not a regular file"
        if self.kind == "dir" and self.marker is not None and not (t / self.marker).is_file():
            held = sorted(p.name for p in t.iterdir())
            if held:
                return f"a directory of other files ({', '.join(held[:3])}{' ...' if len(held) > 3 else ''})"
        if self.kind == "file" and self.magic is not None:
            with t.open("rb") as f:
                head = f.read(len(self.magic))
            if head and head != self.magic:
                return f"a file that does not start with {self.magic!r}"
        return None

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def _remove_made(self) -> None:
        """The parent directories made for an output that was not published, while empty: a failed merge to
        `new/run/merged` left `new/run/` behind, "nothing written" but for them."""
        for d in self._made:
            try:
                d.rmdir()
            except OSError:  # something else is in it now (an unverified output set aside, another writer's files)
                break

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.published:
            self._exit_published(exc)
            return
        self._stop_signals.__exit__(exc_type, exc, tb)
        _remove(self.tmp)
        self._release()
        self._remove_made()
        exc = exc if isinstance(exc, OSError) else library_os_error(exc)
        if exc is not None:  # a full disk (ENOSPC), a file too large, an I/O error mid-write
            raise UserError(f"writing {self.target} failed in {self._written_path(exc)} "
                            f"({exc.strerror or exc}); nothing was published") from None

    def _written_path(self, exc: OSError) -> str:
        """The path an OSError names: for a full disk or a file too large, the one written (a copy's
        `filename` is its source: "failed in base/tokenizer.json (No space left)" blamed the input)."""
        names = [n for n in (exc.filename, exc.filename2) if n]
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            inside = [n for n in names if Path(os.fsdecode(n)).absolute().is_relative_to(self.tmp)]
            return str(inside[0] if inside else self.tmp)
        return str(names[0] if names else self.tmp)


class AtomicDir(_AtomicOutput):
    """`with AtomicDir(target) as tmp: ...write into tmp...; ad.publish()`.

    Leaving the block without `publish()` (an error, a signal) deletes the temp dir.
    """

    def publish(self) -> Path:
        """Move the finished temp dir to the target (replacing an old one when allowed)."""
        _fsync_dir(self.tmp)
        old = None
        stop = None
        try:
            with _signals_held():  # a Ctrl-C between the two renames of the fallback lost both outputs
                self._refuse_if_appeared()
                if self.target.exists():
                    if _exchange(self.tmp, self.target):
                        old = self.tmp  # now holds the old output
                    else:
                        old = self.target.parent / f".{self.target.name}.old-{os.getpid()}"
                        os.rename(self.target, old)
                        try:
                            os.rename(self.tmp, self.target)
                        except OSError:  # put the old one back: never no output where there was one
                            os.rename(old, self.target)
                            old = None
                            raise
                        self.published = True
                        try:  # named as a temp dir, which no run puts back: a `.old-` copy cut short by a kill in
                            # its deletion was restored as the output by a later run that found the target missing
                            os.rename(old, self.tmp)
                            old = self.tmp
                        except OSError:
                            pass
                else:
                    os.rename(self.tmp, self.target)
                self.published = True
        except (KeyboardInterrupt, SignalExit) as e:  # held during the swap, delivered once it was done
            if not self.published:
                raise
            stop = e
        if old is not None:
            try:
                shutil.rmtree(old, ignore_errors=True)  # if killed here, the next run removes it
            except (KeyboardInterrupt, SignalExit) as e:
                stop = stop or e
        _fsync_dir(self.target.parent)
        if stop is not None:
            self._stopped_after_publish(stop, old)
        return self.target

    def move_to(self, other: Path) -> Path:
        """Publish under another name instead (e.g. `<out>.unverified`), replacing an earlier such output
        there (one holding the marker file); anything else there is kept and `<other>-<pid>` is used. The earlier
        one is swapped out (or renamed aside), then deleted: it was deleted first, and a Ctrl-C before the rename
        lost both."""
        other = Path(other).absolute()
        replace = other.is_dir() and not other.is_symlink() and (self.marker is None or (other / self.marker).is_file())
        if not replace and (other.exists() or other.is_symlink()):
            other = other.with_name(f"{other.name}-{os.getpid()}")
        old = stop = None
        try:
            with _signals_held():
                if replace and _exchange(self.tmp, other):
                    old = self.tmp  # now holds the earlier output
                elif replace:  # a temp dir's name: the next run for the target removes it if killed here
                    old = other.parent / f".{self.target.name}.tmp-old-{os.getpid()}"
                    os.rename(other, old)
                    try:
                        os.rename(self.tmp, other)
                    except OSError:
                        os.rename(old, other)
                        old = None
                        raise
                else:
                    os.rename(self.tmp, other)
                self.published = True
                self._done = f"{self.target} was kept at {other}, not published"
        except (KeyboardInterrupt, SignalExit) as e:
            if not self.published:
                raise
            stop = e
        if old is not None:
            try:
                shutil.rmtree(old, ignore_errors=True)
            except (KeyboardInterrupt, SignalExit) as e:
                stop = stop or e
        _fsync_dir(other.parent)
        if stop is not None:
            raise interrupted_after(stop, self._done) from None
        return other


class AtomicFile(_AtomicOutput):
    """`with AtomicFile(target) as tmp: ...write the file tmp...; af.publish()`.

    The file is written as `.<name>.tmp-<pid>` beside the target and renamed over it at the end
    (`rename` replaces a file atomically: readers see the old or the new file). Leaving the block
    without `publish()` (an error, Ctrl-C, SIGTERM) deletes the temp file; one left by a SIGKILL
    is removed by the next run for the same target."""

    kind = "file"

    def publish(self) -> Path:
        fd = os.open(self.tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._refuse_if_appeared()
        try:
            with _signals_held():
                os.replace(self.tmp, self.target)
                self.published = True
        except (KeyboardInterrupt, SignalExit) as e:
            if not self.published:
                raise
            _fsync_dir(self.target.parent)
            self._stopped_after_publish(e, None)
        _fsync_dir(self.target.parent)
        return self.target


# bytes a results file's directory must take before the run (`check_results_file`): one byte takes a block, which a
# full disk refuses (a `ulimit -f` smaller than the results is still met only at the end)
RESULTS_ROOM = 1


def check_results_file(path: str | Path | None, inputs: dict[str, str | Path | None] = {},  # noqa: B006
                       results_key: str | None = None) -> None:
    """Refuse, before the work, a `--json` results file that cannot be written, is a directory, or is one
    of the run's inputs (`--json data/test.jsonl` would replace the test data with the results).
    `inputs`: option -> path. `results_key`: a key every results file of the command holds; an existing,
    non-empty file without it (the training data, a config: anything but an earlier result) is refused
    rather than replaced."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--json {path}: is a directory (give a file name)")
    # what write_text_atomic refuses to replace (check_target), refused before the work: `--json /dev/stdout` (a
    # link) or a named pipe passed here, and the evaluation's results were refused at its end
    if p.is_symlink():
        raise UserError(f"--json {path}: is a symbolic link (to {os.readlink(p)}), which the results file would "
                        f"replace, not write through: give the path it points to, or a file name")
    if p.exists() and not p.is_file():
        raise UserError(f"--json {path}: exists and is not a regular file (a device or a pipe), which the results "
                        f"file would replace: give a file name (the table is printed on stdout)")
    for option, src in inputs.items():
        if src and Path(src).exists() and p.exists() and p.resolve() == Path(src).resolve():
            raise UserError(f"--json {path} is the {option} input; the results would replace it (give another "
                            f"file name)")
    if results_key and p.is_file() and p.stat().st_size:
        try:
            earlier = json.loads(p.read_bytes())
        except (ValueError, OSError):  # not JSON (or JSON Lines), not UTF-8, unreadable
            earlier = None
        if not (isinstance(earlier, dict) and results_key in earlier):
            raise UserError(f"--json {path}: exists and is not an earlier results file of this command (no "
                            f"{results_key!r}); the results would replace it (remove it or give another file name)")
    # with a byte in it: on a full disk an empty file is still made, and the results of the whole run (an hour's
    # evaluation, a benchmark) were lost when it ended
    check_writable(p.parent, f"--json {path}", room=RESULTS_ROOM)


def write_text_atomic(target: str | Path, text: str) -> Path:
    """Publish a small results file (`--json`) all at once: an existing file is replaced (results files
    are rewritten by every run), never left cut short by a full disk, Ctrl-C or SIGTERM mid-write."""
    af = AtomicFile(target, overwrite=True, lock=False)  # last one wins: a refusal after the run would lose it
    with af as tmp:
        tmp.write_text(text, encoding="utf-8")
        af.publish()
    return af.target
