"""One error type for bad user input (`UserError`: the message names the file, line or key; entry
points print it as one line through `gemma_tpu.core.cli.cli_main`), and a checked JSON-object reader."""

from __future__ import annotations

import os
import reprlib
import signal
from typing import Any


class UserError(Exception):
    """Bad input that the user can fix; the message names the file, line or key."""

    exit_code = 2


_SHOWN = reprlib.Repr()  # a value quoted in an error: a 5,000-item list in the wrong place made a 35 KB line, an
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 6, 6, 6  # alias of an alias (YAML's "billion
_SHOWN.maxstring = _SHOWN.maxother = 80  # laughs") a 34 MB one, a message's text given as its role a 10 KB one


def shown(value: Any) -> str:
    """`repr(value)` for an error message, cut to a line: long texts and large or deep structures elided."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 120 else text[:116] + " ..."


class SignalExit(SystemExit):
    """The exit a signal handler asks for (`SystemExit(128 + signum)`), carrying `signum` so that one
    raised where Python can only report it, not propagate it (a gc callback: jax registers one), is
    delivered again (`gemma_tpu.core.cli.cli_main`)."""

    def __init__(self, signum: int, after: str = ""):
        super().__init__(128 + signum)
        self.signum = signum
        self.after = after  # what was done before it, said in its message (`interrupted_after`)


def interrupted_after(exc: BaseException, done: str) -> BaseException:
    """The same interruption (a KeyboardInterrupt, a `SignalExit`), saying what was done before it: `cli_main`
    prints `error: interrupted after <done>` (exit 130, 143 as before). A Ctrl-C that landed while an output was
    published (the new one already in place) printed a bare 'interrupted', which read as nothing published."""
    if isinstance(exc, SignalExit):
        return SignalExit(exc.signum, after=done)
    return KeyboardInterrupt(done)


def raise_signal_exit(signum, frame):  # noqa: ARG001
    """A signal handler (for SIGTERM, SIGHUP) that raises `SignalExit`, so that `finally` blocks and handlers run."""
    if signum == signal.SIGHUP:
        detach_hung_up_terminal()
    raise SignalExit(signum)


class stop_signals_raise:
    """In the block, SIGTERM and SIGHUP raise `SignalExit` (`raise_signal_exit`: `finally` blocks and cleanups run,
    as for Ctrl-C), restored on leaving. A converter or an evaluation closed with its terminal (SIGHUP's default
    action) ended at once: its temp output and writer lock left, its finished results lost. A SIGHUP ignored at
    the start (`nohup`) stays ignored; outside the main thread, where Python runs no handlers, nothing changes."""

    def __enter__(self) -> "stop_signals_raise":
        self.saved: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(signum)
            if signum == signal.SIGHUP and previous is signal.SIG_IGN:
                continue
            try:
                signal.signal(signum, raise_signal_exit)
            except ValueError:  # not the main thread
                break
            self.saved[signum] = previous
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self.saved.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)


def detach_hung_up_terminal() -> None:
    """Point the standard streams that were a terminal now hung up (closed, its ssh session dropped: the SIGHUP's
    cause) at /dev/null. Every write to such a stream fails with EIO, so the stop the hangup asks for (a save, the
    lock released, its one-line message) died on its first log line or progress bar update instead."""
    import errno
    import termios

    for fd in (0, 1, 2):
        try:
            termios.tcgetattr(fd)
        except termios.error as e:  # ENOTTY: a file or pipe, written as before; EIO: a hung-up terminal
            if e.args and e.args[0] == errno.EIO:
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, fd)
                os.close(null)
        except OSError:  # a closed descriptor
            pass


def other_unicode(head: bytes) -> str | None:
    """What a file's first bytes say it is when it is Unicode text but not UTF-8 (UTF-32, UTF-16: with a byte-order
    mark, or ASCII with every other byte NUL), worded for an error ('UTF-16 text (...)'), or None. One test for data
    files and config files: a config saved as UTF-16 was 'not UTF-8 text (byte offset 0)', naming no encoding."""
    if head[:4] in (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff") or (
            len(head) >= 4 and head[1:4] == b"\x00\x00\x00" and 0 < head[0] < 0x80):
        return "UTF-32 text"
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):  # what Windows PowerShell's `>` writes
        return "UTF-16 text (it starts with a UTF-16 byte-order mark)"
    if len(head) >= 4 and ((0 < head[0] < 0x80 and head[1] == 0 and 0 < head[2] < 0x80 and head[3] == 0) or
                           (head[0] == 0 and 0 < head[1] < 0x80 and head[2] == 0 and 0 < head[3] < 0x80)):
        return "UTF-16 text (ASCII characters with NUL bytes between them)"
    return None


def not_utf8(raw: bytes, start: int) -> str:
    """What follows 'not UTF-8 text (byte N': the byte, and the character it is in Windows-1252 (Latin-1), the usual
    other encoding of a file that is not UTF-8 ('café' from Excel or an old editor); was the position alone."""
    byte = raw[start:start + 1]
    if not byte:
        return ""
    try:
        char = byte.decode("cp1252")
    except UnicodeDecodeError:  # 0x81, 0x8d, 0x8f, 0x90, 0x9d: no character there
        char = ""
    legacy = f", {char!r} in Latin-1/Windows-1252" if char.isprintable() and char else ""
    return f": 0x{byte[0]:02x}{legacy}); save it as UTF-8"


def utf8_text(raw: bytes, where: str) -> str:
    """A text file's bytes as UTF-8 text, or a one-line UserError about `where` (a file name) naming the encoding it
    is in (`other_unicode`) or the line and byte that is not UTF-8 (`not_utf8`): configs and JSON files alike."""
    form = other_unicode(raw[:6])
    if form:
        raise UserError(f"{where}: {form}; save it as UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"{where} line {line}: not UTF-8 text (byte offset {e.start}{not_utf8(raw, e.start)}") from None


def read_json_object(path, missing: str) -> dict:
    """A JSON object from `path`; a missing file, bad JSON or a non-object is a one-line UserError."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise UserError(missing)
    try:  # UTF-8 whatever the locale (read_text took the locale's encoding); it said "not UTF-8 text" alone
        obj = json.loads(utf8_text(path.read_bytes(), str(path)))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object")
    return obj
