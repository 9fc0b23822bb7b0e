"""The one module that touches Tunix's private PeftTrainer members (written against google-tunix 0.1.7).

`gemma_tpu.train.trainer.Trainer` extends PeftTrainer through its public surface (`train`, `close`,
`train_steps`, `with_data_hooks`/`DataHooks`, `with_loss_fn`, `custom_checkpoint_metadata`,
`checkpoint_manager`, `metrics_logger`, `optimizer`, `config`) plus the public names defined here.
Tunix 0.1.7 offers no public way to do the following, so each is wrapped once, below:

* read the custom metadata restored with the latest checkpoint (`_restored_custom_metadata`): the
  data position lives there, and exact resume needs it;
* see every metrics record as Tunix writes it, eval records and aggregated additional metrics included
  (`_write_metrics`; `TrainingHooks.on_train_step_end` gets only the step and the loss of train steps),
  and whether the record is a train or an eval one (`_mode`);
* find the learning rate where optax wrappers nest it (`_try_get_learning_rate` misses the state of
  `optax.apply_if_finite`);
* choose the progress bar's metrics (`_tqdm_train_metrics`);
* write the record Tunix holds back for the last finished step (`_write_train_metrics`) when the run exits
  without `close` (SIGTERM), and read its losses before that step is saved (`_prev_buffered_train_metrics`);
* know whether only the LoRA params are checkpointed (`_lora_enabled`), to save on SIGTERM exactly as
  Tunix's own last save does;
* save the last step at `close` with the custom metadata (`_save_last_checkpoint` saves it without: a run whose
  train.max_steps is not a multiple of checkpoint.every_steps ended on a step that held no data position, and
  a resume of it for more steps took up the data from the first batch again);
* evaluate once more when the loop ends past the last evaluation (`_run_eval`, with the eval step Tunix jitted):
  Tunix evaluates only at multiples of eval_every_n_steps, so a train.max_steps that is not one (or data that ran
  out first) ended without evaluating the model it saved, and the summary's final_eval_loss was an older one;
* skip the evaluation Tunix runs on entering its loop (`_run_eval`, its first call in `train`) where the step was
  evaluated before (`skip_entry_eval`): every resume evaluated its step again, and metrics.jsonl had two eval
  records of it;
* the names JAX compiles the train and eval steps under (the methods `_train_step`, `_eval_step`),
  which the compile counter watches for in JAX's compile log;
* tell a failure of the restore apart from the other failures of PeftTrainer's `__init__` (`RestoreFailed`): it
  restores the latest step through the CheckpointManager it has just assigned, between building the metrics
  backends and the profiler, and only the restore's failure is the step's;
* reach the Orbax manager inside Tunix's CheckpointManager (`_checkpoint_manager`): its public
  surface (`save`, `latest_step`, `maybe_restore`, `close`) cannot wait for an async save to finish
  or ask whether a step is due, which the finite-state guard (`finite_guard`) needs;
* stop the JAX profiler Tunix started (`_prof`) when the loop ends before the profiled window does (the data ran
  out, a stop): Tunix stops it only at the window's last step, and a trace never stopped is never written.

After a Tunix upgrade, this module is what to check (the resume, metrics and SIGTERM tests exercise it).
"""

from __future__ import annotations

import contextlib
from typing import Any

from tunix.sft import peft_trainer, profiler

TUNIX_VERSION = "0.1.7"  # the version these private names were read from
TRAIN_STEP_FN = "_train_step"  # jit names of PeftTrainer's step methods, as JAX logs their compiles
EVAL_STEP_FN = "_eval_step"


def orbax_manager(checkpoint_manager) -> Any | None:
    """The `orbax.checkpoint.CheckpointManager` inside Tunix's CheckpointManager (None when checkpointing
    is off)."""
    return getattr(checkpoint_manager, "_checkpoint_manager", None)


def profiler_options(log_dir: str, skip_steps: int, steps: int, grad_accum_steps: int = 1):
    """Tunix's ProfilerOptions for `steps` optimizer steps after the session's first `skip_steps`: Tunix counts
    loop iterations (micro-batches), so both are scaled by the gradient accumulation."""
    k = max(1, grad_accum_steps)
    # python_tracer_level 0: Tunix's default (1) traces every Python call, 85% of the events of a tiny CPU
    # trace, which a device breakdown does not read and which swell the file
    return profiler.ProfilerOptions(log_dir=log_dir, skip_first_n_steps=skip_steps * k, profiler_steps=steps * k,
                                    python_tracer_level=0)


class RestoreFailed(Exception):
    """Restoring the latest checkpoint step into the model and optimizer failed; `__cause__` says why. Raised
    from the trainer's construction (Tunix restores there) only for the restore itself: the other failures of
    building the trainer (a metrics backend that does not start, ...) are not the step's and are raised as
    they are."""


class _RestoreMarked:
    """Tunix's CheckpointManager, whose `maybe_restore` raises `RestoreFailed` from the error."""

    def __init__(self, manager):
        self._manager = manager

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def maybe_restore(self, *args, **kwargs):
        try:
            return self._manager.maybe_restore(*args, **kwargs)
        except Exception as e:
            raise RestoreFailed(f"restoring the latest checkpoint step failed: {e}") from e


class TunixTrainer(peft_trainer.PeftTrainer):
    """PeftTrainer with public names for the private members a production trainer needs."""

    progress_bar_metrics: list[str] | None = None  # None: Tunix's default set

    @property
    def checkpoint_manager(self):
        return self._gemma_checkpoint_manager

    @checkpoint_manager.setter
    def checkpoint_manager(self, manager):
        """The first one assigned is Tunix's own, in `__init__`, which restores through it at once: marked
        (`RestoreFailed`); a wrapper assigned later (the trainer's save guard) wraps it as it is."""
        first = "_gemma_checkpoint_manager" not in self.__dict__
        self._gemma_checkpoint_manager = _RestoreMarked(manager) if first and manager is not None else manager

    @property
    def restored_custom_metadata(self) -> dict[str, Any]:
        """What `custom_checkpoint_metadata()` returned when the restored step was saved ({} if none)."""
        return self._restored_custom_metadata or {}

    @property
    def mode(self):
        """The metrics mode being written: Tunix's `Mode` (a str enum, "train" or "eval")."""
        return self._mode

    @property
    def lora_enabled(self) -> bool:
        """Whether only LoRA params are trained and checkpointed."""
        return self._lora_enabled

    def write_metrics(self, metrics_buffer: peft_trainer.MetricsBuffer) -> None:
        """Called for each buffered train or eval record; an override calls this to let Tunix log it."""
        peft_trainer.PeftTrainer._write_metrics(self, metrics_buffer)

    def flush_train_metrics(self) -> None:
        """Write the last finished step's record now. Tunix holds each step's record back until the next step
        (or `close`) to overlap its I/O; an exit that skips `close` (the SIGTERM save) lost it, so the saved
        step had no line in metrics.jsonl."""
        peft_trainer.PeftTrainer._write_train_metrics(self)

    def pending_train_losses(self) -> list:
        """The losses of the last finished step whose record Tunix still holds back (at a save: the step being
        saved); empty when none is held."""
        held = self._prev_buffered_train_metrics
        return list(held.losses) if held is not None else []

    def learning_rate(self):
        """The current learning rate, or None; an override may look further and fall back to this."""
        return peft_trainer.PeftTrainer._try_get_learning_rate(self)

    def stop_profiler(self) -> bool:
        """Stop the JAX profiler if this trainer started it and the window has not ended (writes the trace);
        True if it was running."""
        prof = getattr(self, "_prof", None)
        if prof is None or not getattr(prof, "_started_by_this_instance", False):
            return False
        import jax

        jax.profiler.stop_trace()
        profiler.Profiler._is_active = False
        prof._started_by_this_instance = False
        return True

    skip_entry_eval = False  # set before `train`: skip the evaluation Tunix runs on entering its loop

    def train(self, train_ds, eval_ds=None, *args, **kwargs):
        self.eval_ds = eval_ds  # for `evaluate_now`
        self._entry_eval_pending = bool(eval_ds)  # Tunix's first `_run_eval` in `train` is the one on entering
        try:
            return super().train(train_ds, eval_ds, *args, **kwargs)
        finally:
            self._entry_eval_pending = False

    def evaluate_now(self) -> None:
        """One evaluation at the current step, as Tunix's loop runs them (after `train` began, with its eval set)."""
        if getattr(self, "eval_ds", None):
            _, eval_step = self.jit_train_and_eval_step()  # the ones `train` jitted (cached)
            self._run_eval(self.eval_ds, eval_step)

    def evaluation_timer(self):
        """A context manager around each evaluation Tunix runs (an override times it); here, nothing."""
        return contextlib.nullcontext()

    def save_last_checkpoint(self) -> None:
        """At `close`: the last step, unless it is saved already, as every step is saved (with
        `custom_checkpoint_metadata()`, the data position)."""
        last = self.checkpoint_manager.latest_step()
        if last is None or last < self.train_steps:
            self.checkpoint_manager.save(self.train_steps, self.model, self.optimizer,
                                         save_only_lora_params=self.lora_enabled, force=True,
                                         custom_metadata=self.custom_checkpoint_metadata())

    # ---- Tunix's private hooks, routed to the public names above -----------------------
    def _save_last_checkpoint(self):
        self.save_last_checkpoint()

    def _run_eval(self, eval_ds, eval_step_fn):
        entry, self._entry_eval_pending = getattr(self, "_entry_eval_pending", False), False
        if entry and self.skip_entry_eval:
            return None
        with self.evaluation_timer():
            return super()._run_eval(eval_ds, eval_step_fn)

    def _write_metrics(self, metrics_buffer):
        self.write_metrics(metrics_buffer)

    def _try_get_learning_rate(self):
        return self.learning_rate()

    @property
    def _tqdm_train_metrics(self) -> list[str]:
        return self.progress_bar_metrics or super()._tqdm_train_metrics
