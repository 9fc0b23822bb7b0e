"""Never persist a non-finite model: every checkpoint save first checks that the parameters it would
write (the LoRA factors, or every parameter of a full fine-tune) and the optimizer state are finite.

`FiniteCheckpoints` wraps Tunix's CheckpointManager (every other attribute passes through). A save of
non-finite state writes nothing; it waits for saves already under way (so what is on disk is known),
then raises `NonFiniteState` naming the step, the first non-finite tensor and the last step on disk.
`before_save(step)` runs first: the trainer refuses there a step whose loss was not finite.
The check is one jitted all-finite reduction per tensor, run only for steps that are saved.

A save that fails (a full disk: Orbax's writer threads raise RESOURCE_EXHAUSTED; a directory gone) is one
`CheckpointSaveFailed` line naming the directory, the reason and the step left on disk, instead of the
exception of whichever Orbax thread surfaced it; the half-written step's Orbax temp dir is removed on the way
out (`CheckpointSaveFailed.partial`), so the space it took is free again.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from gemma_tpu.checkpoint.metadata import ORBAX_TMP, list_steps, step_of
from gemma_tpu.core.errors import UserError
from gemma_tpu.train.tunix_adapter import orbax_manager

log = logging.getLogger("gemma_tpu.train")


class NonFiniteState(UserError):
    """Parameters or optimizer state went NaN/inf; nothing was saved for that step. Exit code 3, like
    a non-finite loss: a scheduler should not simply retry."""

    exit_code = 3


class CheckpointSaveFailed(UserError):
    """A checkpoint could not be written; the previous complete step stays on disk. `partial`: the failed save's
    Orbax temp dir (removed on the way out, so the space it took is free again), None when nothing was written;
    `directory`: the checkpoint directory, where `remove_failed_saves` looks for more. `old_step`: where the new step
    was saved and removing this older one (checkpoint.max_to_keep) failed, with `on_disk` the last complete step."""

    def __init__(self, msg: str, partial: Path | None = None, directory: Path | None = None,
                 old_step: int | None = None, on_disk: int | None = None):
        super().__init__(msg)
        self.partial = partial
        self.directory = directory if directory is not None or partial is None else partial.parent
        self.old_step, self.on_disk = old_step, on_disk


def remove_failed_saves(directory: Path, quiet_s: float = 1.0, limit_s: float = 15.0) -> None:
    """Remove the temp dirs of the save that failed, until none has come back for `quiet_s` (at most `limit_s`).
    A save that fails synchronously leaves Orbax's other writer threads running: one removal raced them, and a
    thread still creating its directories brought `<step>.orbax-checkpoint-tmp` back (seen on a loaded 2-core
    machine). Only by the holder of the run lock (another trainer's save in progress looks the same)."""
    import time

    from gemma_tpu.checkpoint.metadata import remove_unfinished_saves

    start = time.monotonic()
    quiet_since = start
    while time.monotonic() - start < limit_s:
        try:
            if remove_unfinished_saves(directory) or any(ORBAX_TMP in p.name for p in directory.iterdir()):
                quiet_since = time.monotonic()
        except OSError:
            quiet_since = time.monotonic()
        if time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.1)


# errno -> strerror of the ways a disk says it is full (TensorStore reports a quota or the file-size limit as
# OUT_OF_RANGE with the errno at the end of a long message: the cut-off message never said why)
_FULL_DISK = {28: "No space left on device", 122: "Disk quota exceeded", 27: "File too large"}


def save_failure(manager, step, e: BaseException) -> CheckpointSaveFailed:
    """One line for a save that raised: directory, reason (a full disk said as such), the step on disk."""
    inner = orbax_manager(manager)
    where = str(getattr(inner, "directory", "")) or "the checkpoint directory"
    text = str(e)
    full = [words for code, words in _FULL_DISK.items()
            if words in text or f"os_error_code='{code}'" in text or getattr(e, "errno", None) == code]
    if full:
        reason = full[0]
    elif "RESOURCE_EXHAUSTED" in text:
        reason = "No space left on device"
    else:
        first = text.strip().splitlines()[0][:200] if text.strip() else ""
        reason = f"{type(e).__name__}: {first}" if first else type(e).__name__
    try:
        last = inner.latest_step() if inner is not None else None
    except Exception:  # noqa: BLE001 (the manager is in an unknown state; the message matters more)
        last = None
    try:  # what a restart reads: Orbax forgets a step whose async finalisation raised, though it is on disk
        last = max(list_steps(where), default=last)
    except OSError:
        pass
    kept = (f"the last complete step on disk is {last}, and a restart resumes from it" if last is not None
            else "no complete step is on disk, and a restart begins afresh")
    old = _step_being_removed(e)
    if old is not None:  # the new step was saved; the removal of an old one after it failed
        return CheckpointSaveFailed(f"removing the old checkpoint step {old} in {where} (checkpoint.max_to_keep) "
                                    f"failed ({reason}); {kept}", None, Path(where) if inner is not None else None,
                                    old_step=old, on_disk=last)
    partial = None
    try:  # with async saves, an earlier step's failure surfaces at the next save: its temp dir names it
        half = sorted((step_of(p.name.split(".", 1)[0]), p) for p in Path(where).iterdir()
                      if ORBAX_TMP in p.name and step_of(p.name.split(".", 1)[0]) is not None)
        step, partial = half[0] if half else (step, None)
    except OSError:
        pass
    return CheckpointSaveFailed(f"saving checkpoint step {step} in {where} failed ({reason}); {kept}", partial,
                                Path(where) if inner is not None else None)


def _step_being_removed(e: BaseException) -> int | None:
    """The old step whose removal (checkpoint.max_to_keep, after a new step is saved) raised `e`, from Orbax's
    deleter in its traceback (its cause's, or the exception it was raised while handling); None for another failure."""
    import os
    import traceback

    deleter = os.sep.join(("orbax", "checkpoint", "_src", "path", "deleter.py"))
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame, _ in traceback.walk_tb(e.__traceback__):
            step = frame.f_locals.get("step")
            if frame.f_code.co_filename.endswith(deleter) and isinstance(step, int):
                return step
        e = e.__cause__ or e.__context__
    return None


def _path_name(path) -> str:
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if str(key) != "value":
            parts.append(str(key))
    return ".".join(parts)


def first_nonfinite(tree: Any) -> str | None:
    """The dotted name of the first floating-point leaf of `tree` holding NaN/inf, or None."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    named = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and getattr(leaf, "size", 0):
            named.append((_path_name(path), leaf))
    if not named:
        return None
    flags = _all_finite([x for _, x in named])
    for (name, _), ok in zip(named, np.asarray(jax.device_get(flags))):
        if not ok:
            return name
    return None


def _nbytes(tree: Any) -> int:
    """Bytes of the arrays (or shape structs) of `tree`; a global array's whole size, as a checkpoint holds it."""
    import math

    import jax

    def size(leaf) -> int:
        try:
            return math.prod(leaf.shape) * leaf.dtype.itemsize
        except (AttributeError, TypeError):  # not an array (a count kept as a Python int)
            return 0

    return sum(size(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def check_checkpoint_room(ckpt_dir: str | Path, model, tx, lora_only: bool) -> None:
    """Refuse, before the first step, a checkpoint disk that cannot hold one step: the run trained until its first
    save (hours, at checkpoint.every_steps) and then failed on the full disk. A step's size is taken as the bytes
    of what a save writes, the parameters it keeps and the state `tx` (the optax optimizer) makes for them; Orbax
    adds its metadata (small beside a real model's tensors), so this refuses only a disk that clearly cannot."""
    import shutil

    import jax
    from flax import nnx

    from gemma_tpu.core.progress import human

    params = nnx.state(model, nnx.LoRAParam) if lora_only else nnx.state(model)
    trained = nnx.state(model, nnx.LoRAParam) if lora_only else nnx.state(model, nnx.Param)
    need = _nbytes(params) + _nbytes(jax.eval_shape(tx.init, trained))
    free = shutil.disk_usage(ckpt_dir).free
    if free < need:
        what = "the LoRA parameters" if lora_only else "every parameter"
        raise UserError(f"checkpoint.dir {ckpt_dir}: {human(free)} free on its disk, and a checkpoint step takes "
                        f"about {human(need)} ({what} and the optimizer state), so no step could be saved; free "
                        f"some space or set checkpoint.dir to a larger disk")


def _all_finite(leaves):
    import jax
    import jax.numpy as jnp

    global _JIT
    if _JIT is None:
        _JIT = jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))
    return _JIT(leaves)


_JIT = None


def last_step_on_disk(manager) -> int | None:
    """The newest finished step, after any async save under way has finished; that save's failure (a full disk)
    is `save_failure`'s one line (the preemption's exit waits here for the step it saves: it said "could not save step
    2 (ValueError: RESOURCE_EXHAUSTED: Error writing local file ...", exit 1, the temp dir left)."""
    inner = orbax_manager(manager)
    if inner is None:
        return None
    try:
        inner.wait_until_finished()
    except Exception as e:
        raise save_failure(manager, "in progress", e) from e
    return inner.latest_step()


class FiniteCheckpoints:
    """Tunix's CheckpointManager with a finiteness check in front of `save`."""

    def __init__(self, manager, before_save=None, timed=None):
        self._manager = manager
        self._before_save = before_save
        self._timed = timed  # a context manager factory timing the save proper (the trainer's, to keep it apart)

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def save(self, step, model, optimizer=None, save_only_lora_params: bool = False, force: bool = False,
             custom_metadata=None) -> bool:
        inner = orbax_manager(self._manager)
        if inner is None:
            return False
        if not force and not inner.should_save(step):
            return False
        if self._before_save is not None:
            self._before_save(step)
        with self._timed() if self._timed is not None else contextlib.nullcontext():
            return self._checked_save(step, model, optimizer, save_only_lora_params, force, custom_metadata)

    def _checked_save(self, step, model, optimizer, save_only_lora_params, force, custom_metadata) -> bool:
        from flax import nnx

        params = nnx.state(model, nnx.LoRAParam) if save_only_lora_params else nnx.state(model)
        bad = first_nonfinite(params)
        what = "parameter"
        if bad is None and optimizer is not None:
            bad, what = first_nonfinite(nnx.state(optimizer, nnx.optimizer.OptState)), "optimizer state"
        if bad is not None:
            last = last_step_on_disk(self._manager)
            kept = f"the last checkpoint on disk is step {last}" if last is not None else "no checkpoint was written"
            raise NonFiniteState(f"non-finite {what} {bad} at step {step}: step {step} was not saved; {kept} "
                                 f"(check train.learning_rate and the data)")
        try:
            return self._manager.save(step, model, optimizer, save_only_lora_params=save_only_lora_params,
                                      force=force, custom_metadata=custom_metadata)
        except Exception as e:  # an async save of an earlier step may surface here too
            raise save_failure(self._manager, step, e) from e

    def close(self) -> None:
        """Waits for a save under way: its failure is one line too."""
        inner = orbax_manager(self._manager)
        step = inner.latest_step() if inner is not None else None
        try:
            self._manager.close()
        except Exception as e:
            raise save_failure(self._manager, "in progress" if step is None else f"after {step}", e) from e
