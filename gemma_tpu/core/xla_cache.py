"""JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) heals a damaged entry.

JAX writes an entry in place (no temporary file and rename) and never replaces an existing one: a process killed
while writing one (a SIGKILL, a preemption mid-compile) left it cut short, and every later run warned "Error
reading persistent compilation cache entry for 'jit__train_step': ... incomplete or truncated stream" and compiled
that program again (minutes for a large model), for good. JAX logs a miss, with the entry's key, right after a read
that failed: an entry file present at that moment is one JAX could not use, and is removed, so the compilation that
follows writes it afresh. A normal start reads nothing more (one file check per miss). JAX's own warning of the
failed read (a bare multi-line Python warning) is left out: the removal is said in one log line instead.

Every command turns this on at its start (`cli.cli_main`): evaluation, chat and the dry run's compile check compile
with the same cache as training. It imports nothing (a logging filter, a warnings filter)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

log = logging.getLogger("gemma_tpu")

COMPILER_LOGGER = "jax._src.compiler"
MISS = "PERSISTENT COMPILATION CACHE MISS for"  # JAX's log of a miss: (module name, cache key)
READ_ERROR = "Error reading persistent compilation cache entry for "  # JAX's warning, just before that miss


class _DamagedEntries(logging.Filter):
    """Sees JAX's cache-miss records (logged at DEBUG, so the compiler's logger is opened to DEBUG) and lets through
    only what the logger showed before."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger, self.level = logger, logger.level  # NOTSET: the parent's level, read at each record

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(MISS) and isinstance(record.args, tuple) \
                and len(record.args) == 2:
            remove_damaged_entry(str(record.args[0]), str(record.args[1]))
        shown = self.level if self.level != logging.NOTSET else self.logger.parent.getEffectiveLevel()
        return record.levelno >= shown


def remove_damaged_entry(module: str, key: str) -> None:
    """JAX missed `key` (of program `module`) in its cache: an entry file there could not be read, and goes."""
    try:
        import jax

        cache_dir = jax.config.jax_compilation_cache_dir
        if not cache_dir or "://" in str(cache_dir):  # none, or a remote store (not ours to inspect)
            return
        entry = Path(cache_dir) / f"{key}-cache"
        if not entry.is_file():  # a plain miss
            return
        size = entry.stat().st_size
        try:
            entry.unlink()
        except OSError as e:  # a read-only cache: said, as JAX's warning (left out) would have
            log.warning("%s: an entry of the persistent compilation cache JAX could not read, and it cannot be "
                        "removed (%s): %s is compiled again at every run until it is", entry, e.strerror or e, module)
            return
        (Path(cache_dir) / f"{key}-atime").unlink(missing_ok=True)  # its LRU time, where eviction is on
    except Exception as e:  # noqa: BLE001 (inside JAX's compile: never fail it)
        log.debug("persistent compilation cache entry %s not checked: %s", key, e)
        return
    log.warning("removed %s (%d bytes): an entry of the persistent compilation cache JAX could not read (cut short "
                "by a process killed while writing it); %s is compiled again and its entry written afresh",
                entry, size, module)


def heal_damaged_entries() -> None:
    """From now on, a persistent compilation cache entry JAX fails to read is removed (and rewritten by the
    compilation that follows), and JAX's warning of it is left out. Idempotent; imports nothing."""
    _check_cache_dir(os.environ.get("JAX_COMPILATION_CACHE_DIR", ""))
    logger = logging.getLogger(COMPILER_LOGGER)
    if any(isinstance(f, _DamagedEntries) for f in logger.filters):
        return
    logger.addFilter(_DamagedEntries(logger))
    if "://" not in os.environ.get("JAX_COMPILATION_CACHE_DIR", ""):  # a remote store's entries are not ours to remove
        warnings.filterwarnings("ignore", message=READ_ERROR, category=UserWarning, module=r"jax\._src\.compiler")
    if not logger.isEnabledFor(logging.DEBUG):
        logger.setLevel(logging.DEBUG)


def _check_cache_dir(where: str) -> None:
    """A JAX_COMPILATION_CACHE_DIR that is a file, or lies under one, is said once a command: JAX then keeps no
    persistent cache without a word, and every run compiled every program afresh (minutes for a large model)."""
    if not where or "://" in where:
        return
    path = Path(where).expanduser()
    blocked = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        log.warning("JAX_COMPILATION_CACHE_DIR=%s: %s is not a directory, so JAX keeps no persistent compilation cache "
                    "(every program is compiled afresh each run)", where, blocked)
