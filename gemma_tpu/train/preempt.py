"""SIGTERM (the TPU preemption notice) handled at a safe point, so the saved step is exactly a step.

The signal handler only records the request. The trainer's data hook (`BatchFeed.before_batch`) calls
`Preemption.at_batch_boundary` before it fetches the batch that starts a new optimizer step: there
the parameters, the optimizer state and the data position all belong to the same finished step (a
handler acting mid-step would save the data position one batch ahead, or parameters already updated
under the previous step's number). At that point the step in progress has finished; saves under way
are waited for; the current step is saved unless it already is; the lock is released; exit 143.
Before step 1 nothing is saved: a restart begins exactly as the interrupted run did.

SIGHUP (the terminal closed, an ssh session dropped) does the same, exit 129: the run's terminal output goes to
/dev/null from then on (writes to a hung-up terminal fail); a run started with SIGHUP ignored (nohup) goes on.
Ctrl-C (SIGINT) does the same, exit 130; a second Ctrl-C stops at once (KeyboardInterrupt), keeping the
last complete checkpoint. (A KeyboardInterrupt raised wherever the signal happened to land used to stop the
run mid-save: the step being written was left as an Orbax temp dir, and a traceback from its thread.)

Limits: the exit waits for the step (and an eval) in progress to finish; a platform that sends
SIGKILL before that leaves the last completed checkpoint, which the resume uses.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable

from gemma_tpu.core.errors import SignalExit, UserError, detach_hung_up_terminal
from gemma_tpu.train.finite_guard import CheckpointSaveFailed, last_step_on_disk, remove_failed_saves
from gemma_tpu.train.tunix_adapter import orbax_manager

log = logging.getLogger("gemma_tpu.train")

EXIT_CODE = 143  # 128 + SIGTERM, what a scheduler expects from a terminated process


class Preemption:
    def __init__(self, trainer, on_exit: Callable[[], None] = lambda: None):
        self.trainer = trainer
        self.on_exit = on_exit
        self.requested = False
        self.signum = signal.SIGTERM

    def install(self) -> "Preemption":
        signal.signal(signal.SIGTERM, self._handler)
        signal.signal(signal.SIGINT, self._handler)
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup's runs outlive their terminal
            signal.signal(signal.SIGHUP, self._handler)
        self.trainer.feed.before_batch = self.at_batch_boundary
        log.info("SIGTERM (preemption) from here on: the step in progress finishes, is saved, then exit %d; "
                 "SIGHUP and Ctrl-C the same (exit 129, 130), a second Ctrl-C stops at once", EXIT_CODE)
        return self

    @property
    def name(self) -> str:
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        if signum == signal.SIGHUP:
            detach_hung_up_terminal()
        if not self.requested:
            self.requested = True
            self.signum = signum
            log.warning("%s: saving and exiting at the next step boundary (%d steps done so far)%s", self.name,
                        self.trainer.train_steps, "; Ctrl-C again to stop at once" if signum == signal.SIGINT else "")
        elif signum == signal.SIGINT:  # the second Ctrl-C: stop now, the last complete checkpoint stays
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt

    def at_batch_boundary(self, train_ctx) -> None:
        if not self.requested:
            return
        accum = train_ctx.config.get_with_default("gradient_accumulation_steps", 1) or 1
        if train_ctx.iter_steps % accum:  # mid-accumulation: the step is not finished yet
            return
        self.save_and_exit()

    def exit_if_requested(self) -> None:
        """A notice that came after the last batch boundary (during the final save or the end-of-run
        evaluation) is a preemption too: once the run's end is saved, exit with the signal's code (it exited 0,
        and a scheduler took the preempted process for one that had finished on its own)."""
        if self.requested:
            log.warning("%s after the last step: step %d is saved; exiting %d", self.name, self.trainer.train_steps,
                        128 + self.signum)
            raise SignalExit(self.signum)

    def save_and_exit(self) -> None:
        t = self.trainer
        step = t.train_steps
        code = 128 + self.signum
        try:
            cm = t.checkpoint_manager
            last = last_step_on_disk(cm)  # waits for an async save of this step already under way
            if step > 0 and last != step:
                cm.save(step, t.model, t.optimizer, save_only_lora_params=t.lora_enabled, force=True,
                        custom_metadata=t.custom_checkpoint_metadata())
                last = last_step_on_disk(cm)
            cm.close()
            if step > 0:  # Tunix holds the finished step's record back until the next step
                try:
                    t.write_last_record()
                except Exception as e:  # noqa: BLE001 - the step is saved; a lost log line must not hide it
                    log.warning("%s: step %d's metrics record was not written (%s)", self.name, step, e)
            self._close_tensorboard()
            if step == 0:
                log.warning("%s before step 1: nothing to save; a restart begins afresh", self.name)
            else:
                log.warning("%s: step %d is saved (latest on disk: %s); exiting", self.name, step, last)
        except KeyboardInterrupt:  # Ctrl-C again during the save: the stop at once asked for, not a failed save
            # (it was "ERROR could not save step N (KeyboardInterrupt: )" and exit 1)
            log.warning("Ctrl-C again: stopped at once; step %d was not saved, the last complete checkpoint stays",
                        step)
            code = 128 + signal.SIGINT
        except CheckpointSaveFailed as e:
            if e.old_step is None or e.on_disk != step:
                code = self._failed(step, e)
            else:  # the step is saved; only the removal of an older one after it failed (it said "could not save")
                log.warning("%s: step %d is saved, but %s; exiting", self.name, step, e)
                self._close_tensorboard()
        except BaseException as e:  # exit anyway: the platform will not wait
            code = self._failed(step, e)
        finally:
            self.on_exit()
            logging.shutdown()
            os._exit(code)

    def _close_tensorboard(self) -> None:
        try:  # TensorBoard's events not yet written out (the writer's queue, its file's buffer) were lost with
            # the exit, which skips `close`: the evaluation just finished, the last steps' losses
            self.trainer.metrics_logger.close()
        except Exception as e:  # noqa: BLE001 - the step is saved; a lost log line must not hide it
            log.warning("%s: TensorBoard's last events were not written (%s)", self.name, e)

    def _failed(self, step: int, e: BaseException) -> int:
        """Say why `step` could not be saved (`e`); the exit code."""
        t = self.trainer
        # what is on disk: a failed save's own line says it ("no complete step is on disk"), and was followed
        # by "the last complete checkpoint stays", as was a failure before the save (metrics.jsonl on a disk
        # turned read-only) where there was none
        kept = "" if isinstance(e, CheckpointSaveFailed) else f"; {_kept_on_disk(t.checkpoint_manager)}"
        log.error("%s: could not save step %d (%s: %s)%s", self.name, step, type(e).__name__, e, kept)
        if isinstance(e, CheckpointSaveFailed) and e.directory is not None and getattr(t, "primary", True):
            remove_failed_saves(e.directory)  # the failed save's temp dir kept what space a full disk had
        # a UserError's own code: a step whose loss or state went non-finite is 3 (do not simply retry), as
        # when it stops the run without a signal
        return getattr(e, "exit_code", 1) if isinstance(e, UserError) else 1


def _kept_on_disk(manager) -> str:
    """What a restart resumes from after a preemption's save failed, as Orbax knows it (`save_failure` says the same
    for a failed save)."""
    inner = orbax_manager(manager)
    try:
        last = inner.latest_step() if inner is not None else -1
    except Exception:  # noqa: BLE001 - the manager is in an unknown state; the line matters more
        last = -1
    if last is None:
        return "no checkpoint is on disk, and a restart begins afresh"
    if last == -1:
        return "the last complete checkpoint stays"
    return f"the last complete step on disk is {last}, and a restart resumes from it"
