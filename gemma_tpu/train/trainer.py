"""Tunix's PeftTrainer, extended with what a production run needs.

PeftTrainer brings the jitted step (LoRA-only gradients, optax, gradient accumulation), Orbax
checkpointing of params + optimizer state, eval, TensorBoard and a progress bar. We add: the data
position inside every checkpoint (exact resume), metrics.jsonl with tokens/s, TFLOP/s and MFU,
a compile counter that warns if the train step compiles again, and a non-finite-loss guard.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tunix.sft import hooks as tunix_hooks

from gemma_tpu.core import strict_json
from gemma_tpu.core.atomic import write_text_atomic
from gemma_tpu.core.errors import UserError
from gemma_tpu.train.finite_guard import FiniteCheckpoints, last_step_on_disk
from gemma_tpu.train.partition import fit_factored_state_annotations, keep_placement, shard_optimizer_state
from gemma_tpu.train.tunix_adapter import EVAL_STEP_FN, TRAIN_STEP_FN, TunixTrainer

log = logging.getLogger("gemma_tpu.train")


def signature(batch: dict[str, Any]) -> dict[str, tuple]:
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in batch.items()}


def examples_in(batch: dict[str, Any]) -> int:
    """Examples a batch trains: its segments, less the shared prefixes (segments that others continue)."""
    seg = np.asarray(batch["segment_ids"])
    n = int(seg.max(axis=-1).sum())
    if "prefix_segment_ids" in batch:
        n -= sum(len(np.unique(r[r > 0])) for r in np.asarray(batch["prefix_segment_ids"]))
    return n


class BatchFeed(tunix_hooks.DataHooks):
    """Feeds the trainer from our grain stream and eval batches, watching batch shapes."""

    def __init__(self, stream, eval_batches: list[dict] | None, put=None, dropout: bool = False,
                 grad_accum_steps: int = 1):
        self.stream = stream
        # lora.dropout > 0: each train batch carries `dropout_step` (train.loss.make_loss_fn): its optimizer step
        # and micro-batch, recomputed from the trainer's restored step on resume. A pair, not step × accum + micro:
        # a resume with another train.grad_accum_steps then repeated earlier steps' masks (or skipped some)
        self.dropout = dropout
        self.grad_accum_steps = max(1, grad_accum_steps)
        self._step_batches: list[dict] = []  # the rest of this optimizer step's micro-batches (`_next_batch`)
        self._micro = (-1, 0)  # (optimizer step, micro-batches fed in it)
        # this process's numpy rows -> global device arrays (mesh.global_batch); None: leave as is
        self.put = put or (lambda batch: batch)
        self.eval_batches = eval_batches or []
        self._eval_pos = 0
        self.first_signature: dict | None = None
        # Test hook: seconds to sleep per batch, so kill/resume tests can hit a run mid-flight.
        self.delay = float(os.environ.get("GEMMA_TPU_STEP_DELAY", "0") or 0)
        self.before_batch = None  # called with the trainer before each fetch (gemma_tpu.train.preempt)
        self.tokens = 0  # non-padding tokens fed
        self.useful = 0  # loss-bearing tokens fed
        self.examples = 0  # examples fed (a packed or shared-prefix row holds several)
        self.batches = 0
        # (tokens, useful, examples, learning rate) when the current optimizer step's first batch was asked for:
        # what the step before it fed, for its metrics record (Trainer.write_metrics), which Tunix writes later,
        # once this step has updated the learning rate the record would otherwise read
        self.step_mark: tuple | None = None
        # When the last dispatched optimizer step was seen done: (step, its last micro-batch's loss) until then, and
        # (step, time) after, looked at (never waited on) as each batch is asked for. Tunix writes a step's record
        # once the next step's micro-batches are all dispatched: with gradient accumulation its work had long ended
        # and the record took the next step's time (records alternated 0.36 / 1.18 s for 0.65 s steps)
        self._watched: tuple[int, Any] | None = None
        self.seen_done: tuple[int, float] | None = None

    def _look_for_done(self) -> None:
        if self._watched is not None:
            step, loss = self._watched
            if getattr(loss, "is_ready", lambda: True)():
                self.seen_done, self._watched = (step, time.perf_counter()), None

    def load_next_train_batch(self, train_ctx):
        self._look_for_done()
        if train_ctx.iter_steps % (train_ctx.config.get_with_default("gradient_accumulation_steps", 1) or 1) == 0:
            lr = train_ctx.learning_rate() if hasattr(train_ctx, "learning_rate") else None
            if lr is not None:  # a copy, not waited on: the step about to run donates the optimizer state it is in
                import jax.numpy as jnp

                lr = jnp.copy(lr)
            self.step_mark = (self.tokens, self.useful, self.examples, lr)
            losses = train_ctx.pending_train_losses() if hasattr(train_ctx, "pending_train_losses") else []
            self._watched = (train_ctx.train_steps, losses[-1]) if losses else None  # the step just dispatched
            self._look_for_done()
        if self.delay:
            time.sleep(self.delay)
        if self.before_batch is not None:
            self.before_batch(train_ctx)
        max_steps = train_ctx.config.max_steps
        if max_steps is not None and train_ctx.train_steps >= max_steps:
            # the run is over: Tunix would fetch one batch more before it stops, and the data position saved
            # with the last step (at close) then skipped that batch on resume
            return None
        batch = self._next_batch()
        if batch is None:
            return None
        sig = signature(batch)
        if self.first_signature is None:
            self.first_signature = sig
        elif sig != self.first_signature:
            changed = {k: (self.first_signature.get(k), v) for k, v in sig.items() if self.first_signature.get(k) != v}
            log.warning("RECOMPILE AHEAD: batch shapes changed from the first batch: %s", changed)
        self.tokens += int((batch["segment_ids"] > 0).sum())
        self.useful += int(batch["loss_weights"].sum())
        self.examples += examples_in(batch)
        self.batches += 1
        if self.dropout:
            step = train_ctx.train_steps
            micro = self._micro[1] if self._micro[0] == step else 0
            self._micro = (step, micro + 1)
            rows = batch["tokens"].shape[0]
            batch = {**batch, "dropout_step": np.tile(np.array([step, micro], np.int32), (rows, 1))}
        return self.put(batch)

    def _next_batch(self) -> dict | None:
        """The next training micro-batch, None when the data ran out. With gradient accumulation a step's
        micro-batches are read together, each carrying `loss_scale` (`train.loss.make_loss_fn`): its share of the
        step's loss tokens times their number. optax.MultiSteps averages the micro-batches' gradients, each the
        mean over its own tokens: rows of unequal token counts (shared-prefix trees, packed rows, chats of any
        length) weighted a token of a light micro-batch more than one of a heavy one, and the step's gradient
        and loss were not those of the one big batch it stands for. Scaled, they are.

        Where the data (data.num_epochs) ends inside a step, its micro-batches are not fed: the optimizer never applies
        a step it has not all of (optax.MultiSteps), and their loss was recorded as a step after the last one. The data
        position stays at the step's start, where a resume with more epochs begins it, as an uninterrupted run did."""
        if self.grad_accum_steps == 1:
            return next(self.stream, None)
        if not self._step_batches:
            start = self.stream.get_state() if hasattr(self.stream, "get_state") else None
            batches = []
            while len(batches) < self.grad_accum_steps:
                batch = next(self.stream, None)
                if batch is None:
                    if start is not None:
                        self.stream.set_state(start)
                    return None
                batches.append(batch)
            weights = np.asarray([float(np.asarray(b["loss_weights"]).sum()) for b in batches])
            import jax

            if batches and jax.process_count() > 1:  # each process holds its rows of every micro-batch: global counts
                from jax.experimental import multihost_utils

                weights = np.asarray(multihost_utils.process_allgather(weights)).sum(axis=0)
            total = weights.sum()
            self._step_batches = [
                {**b, "loss_scale": np.full((b["tokens"].shape[0],),
                                            self.grad_accum_steps * w / total if total > 0 else 1.0, np.float32)}
                for b, w in zip(batches, weights)]
        return self._step_batches.pop(0) if self._step_batches else None

    def load_next_eval_batch(self, train_ctx):
        if self._eval_pos >= len(self.eval_batches):
            self._eval_pos = 0
            return None
        if self._eval_pos == 0:
            log.info("evaluating after step %d (%d batches)", train_ctx.train_steps, len(self.eval_batches))
        if self.delay:
            time.sleep(self.delay)
        self._eval_pos += 1
        return self.put(self.eval_batches[self._eval_pos - 1])


class NonFiniteLoss(UserError):
    """The loss went NaN/inf (train.on_nonfinite=stop). Its update was dropped (optim.py), so every
    checkpoint on disk holds finite parameters; exit code 3 tells a scheduler not to simply retry."""

    exit_code = 3


class CompileCounter(logging.Filter):
    """Counts real XLA compilations per jitted function, from JAX's own compile log.

    `jax_log_compiles` makes JAX log every compilation; this filter counts them and swallows
    the lines, except that a second compilation of a watched step is reported loudly with the
    shapes and shardings JAX compiled it for. (A jitted function's cache size counts cache
    entries, which is 2 after one compilation: not a compile count.) With a persistent compilation
    cache (JAX_COMPILATION_CACHE_DIR), the same flag makes JAX log every cache hit as a WARNING, ~20
    per run: those are swallowed too, a watched step's hit said once at INFO.
    """

    LOGGERS = ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler")

    def __init__(self, watched=(TRAIN_STEP_FN, EVAL_STEP_FN)):
        super().__init__()
        self.watched = watched
        self.counts: dict[str, int] = {}
        self.last_signature: dict[str, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.name == "jax._src.compiler":
            m = re.match(r"Persistent compilation cache hit for '(?:jit_)?(\w+)'", msg)
            if m and m.group(1) in self.watched:
                log.info("%s loaded from the persistent compilation cache", m.group(1))
            return m is None  # its other lines are not compile logs
        m = re.search(r"Compiling jit\((\w+)\)", msg)
        if m and m.group(1) in self.watched:
            self.last_signature[m.group(1)] = msg
        m = re.search(r"Finished XLA compilation of jit\((\w+)\)", msg)
        if m:
            name = m.group(1)
            self.counts[name] = self.counts.get(name, 0) + 1
            if name in self.watched and self.counts[name] > 1:
                log.warning("RECOMPILATION #%d of %s: %s", self.counts[name], name,
                            self.last_signature.get(name, "")[:2000])
        return False

    def __enter__(self):
        import jax

        self._prev = jax.config.jax_log_compiles
        jax.config.update("jax_log_compiles", True)
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc):
        import jax

        jax.config.update("jax_log_compiles", self._prev)
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


def append_jsonl(path: Path, rec: dict) -> None:
    """Append one JSON line, whole or not at all (a write that fails midway, on a full disk, leaves the file as it
    was: a line cut short broke every reader that reads each line, pandas' too). A last line cut short (a crash
    mid-write) is ended first: the resumed run's first row was glued to it, and both were unreadable. A failed
    write names the file (a failed write() carries no file name: "error: No space left on device" said nothing
    more), and a run directory removed mid-run is said to be gone."""
    try:
        with path.open("a+b", buffering=0) as f:
            end = f.seek(0, os.SEEK_END)
            prefix = b""
            if end > 0:
                f.seek(-1, os.SEEK_END)
                prefix = b"" if f.read(1) == b"\n" else b"\n"
            data = prefix + (strict_json.dumps(rec) + "\n").encode()
            try:
                while data:  # a short write says nothing; the next one says why
                    data = data[f.write(data):]
            except OSError:  # a full disk, a file-size limit: the part written goes, the file is as it was
                with contextlib.suppress(OSError):
                    f.truncate(end)
                raise
    except OSError as e:
        if isinstance(e, FileNotFoundError) and not path.parent.is_dir():  # "No such file or directory: …" said why not
            raise UserError(f"{path.parent} was removed or moved while training ({path.name} cannot be written); "
                            f"the run stops") from None
        raise OSError(e.errno, e.strerror, str(path)) from e


def drop_records_after(path: Path, step: int) -> int:
    """metrics.jsonl as a run resumed at `step` goes on with it: the records of later steps (written by the run that
    stopped before their checkpoint; this run trains and writes those steps again, and each appeared twice) and a
    line cut short are dropped. Rewritten at once, only where a line goes; returns how many went."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    keep = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            continue
        keep.append(line)
    if len(keep) < len(lines):
        write_text_atomic(path, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)


def metrics_records(path: Path) -> list[dict]:
    """The records of metrics.jsonl at `path` in file order (none where it cannot be read; a line cut short or not
    an object skipped)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def last_record(path: Path, mode: str, step: int) -> dict | None:
    """The last record of `mode` ("train" or "eval") at `step` in metrics.jsonl, or None."""
    found = None
    for rec in metrics_records(path):
        if rec.get("mode") == mode and rec.get("step") == step:
            found = rec
    return found


def first_eval_record(path: Path, eval_data: str | None) -> dict | None:
    """The evaluation of the earliest step on the eval set `eval_data` in metrics.jsonl (the run's first, mostly of
    the untrained model at step 0, whichever session wrote it), or None."""
    found = None
    for rec in metrics_records(path):
        if (rec.get("mode") == "eval" and isinstance(rec.get("step"), int) and eval_data is not None
                and rec.get("eval_data") == eval_data and (found is None or rec["step"] < found["step"])):
            found = rec
    return found


def step_evaluated(path: Path, step: int, eval_data: str | None) -> bool:
    """Whether metrics.jsonl at `path` holds an evaluation of `step` on the eval set `eval_data` (its
    data.eval_fingerprint): a resume with another data.eval_path skipped evaluating its step, the record being of the
    old eval set. A record from before fingerprints were kept is of an unknown set: not taken as this one's."""
    rec = last_record(path, "eval", step)
    return rec is not None and eval_data is not None and rec.get("eval_data") == eval_data


TENSORBOARD_STOP_S = 10.0


def guard_tensorboard_writer() -> None:
    """Keep a failing TensorBoard writer from hanging the run. tensorboardX queues events (at most 10) for a
    writer thread; when a write of that thread failed (a full disk), the thread ended with a traceback and the
    next `put` on the full queue blocked forever: a run whose disk filled hung (jax's monitoring events, which
    Tunix sends to TensorBoard, are recorded inside Orbax's save) instead of reporting the failure. Now the
    thread's failure is one warning and later events are dropped; the run goes on to fail, or not, on its own
    writes (metrics.jsonl, the checkpoint), which say so in one line.

    Closing waits at most TENSORBOARD_STOP_S for the writer thread: a second Ctrl-C ("stop at once") can land inside
    the queue's own machinery, after which the stop signal never reached the thread and the exit-time close joined
    it forever (the process printed "error: interrupted" and hung)."""
    try:
        from tensorboardX import event_file_writer as efw
    except ImportError:
        return
    if getattr(efw.EventFileWriter.add_event, "_gemma_tpu_guard", False):
        return
    import queue

    thread_run = efw._EventLoggerThread.run

    def run(self):
        try:
            thread_run(self)
        except OSError as e:
            log.warning("TensorBoard: writing events failed (%s%s); metrics go on to metrics.jsonl only",
                        e.strerror or e, f": {e.filename}" if e.filename else "")

    def add_event(self, event):
        if self._closed:
            return
        while self._worker.is_alive():
            try:
                self._event_queue.put(event, timeout=1.0)
                return
            except queue.Full:
                continue

    writer_flush = efw.EventFileWriter.flush

    def flush(self):
        try:
            writer_flush(self)
        except OSError as e:
            log.warning("TensorBoard: flushing events failed (%s)", e.strerror or e)

    def close(self):  # tensorboardX's own puts a stop signal on the queue: forever, with the writer thread gone
        if self._closed:
            return
        self.flush()
        worker, events = self._worker, self._event_queue
        if worker.is_alive():
            try:
                events.put(worker._shutdown_signal, timeout=1.0)
            except (queue.Full, ValueError, OSError):  # full, or closed under us
                pass
            worker.join(timeout=TENSORBOARD_STOP_S)
        if worker.is_alive():  # a daemon thread: the process exits without it
            log.warning("TensorBoard: the event writer did not stop within %.0f s; its last events may be lost",
                        TENSORBOARD_STOP_S)
        else:
            try:
                self._ev_writer.close()
            except OSError:
                pass  # flush said so
        events.close()
        events.cancel_join_thread()  # nor wait at exit for a feeder thread whose reader is gone
        self._event_queue, self._worker, self._closed = None, None, True

    add_event._gemma_tpu_guard = True
    efw._EventLoggerThread.run = run
    efw.EventFileWriter.add_event = add_event
    efw.EventFileWriter.flush = flush
    efw.EventFileWriter.close = close


class TensorboardBackend:
    """What Tunix logs TensorBoard scalars through (metrax's TensorboardBackend: one events file a session, flushed at
    most every FLUSH_S), with tensorboardX's `purge_step`, which metrax does not pass: the step a resumed run trains
    first. TensorBoard then hides what earlier sessions wrote at that step and after (the steps a killed run trained
    past its last save, trained again now), which it drew twice, the stopped run's line beside the resumed run's."""

    FLUSH_S = 30.0

    def __init__(self, log_dir: str, purge_step: int | None = None):
        from tensorboardX import writer

        self._writer = writer.SummaryWriter(logdir=log_dir, purge_step=purge_step)
        self._last_flush = time.time()

    def log_scalar(self, event: str, value, **kwargs) -> None:
        step = kwargs.get("step")
        self._writer.add_scalar(event.lstrip("/"), value, 0 if step is None else int(step))
        if time.time() - self._last_flush >= self.FLUSH_S:
            self._writer.flush()
            self._last_flush = time.time()

    def close(self) -> None:
        self._writer.close()


def metrics_logging_options(log_dir: str, resumed_from: int | None, wandb_project: str | None = None,
                            run_name: str | None = None):
    """Tunix's MetricsLoggerOptions: TensorBoard under `log_dir` (`TensorboardBackend`, purging from the step after
    `resumed_from`, the step the run restores; None: it starts afresh, from step 0), and Weights & Biases where
    `wandb_project` names a project (train.wandb_project; Tunix's defaults log to W&B whenever it is installed)."""
    import functools

    from tunix.sft import metrics_logger

    factories = [functools.partial(TensorboardBackend, log_dir, 0 if resumed_from is None else resumed_from + 1)]
    if wandb_project:  # W&B's files in the run directory (the working directory's ./wandb otherwise)
        factories.append(functools.partial(wandb_backend, wandb_project, run_name, str(Path(log_dir).parent)))
    return metrics_logger.MetricsLoggerOptions(log_dir=log_dir, flush_every_n_steps=1,
                                               backend_kwargs={"custom_backend": factories})


def check_wandb(project: str | None) -> None:
    """train.wandb_project needs the wandb package: refused before the model loads, not at the trainer's start."""
    import importlib.util

    if project and importlib.util.find_spec("wandb") is None:
        raise UserError(f"train.wandb_project={project}: the wandb package is not installed (pip install wandb), "
                        f"or set train.wandb_project=null")


def wandb_backend(project: str, run_name: str | None, run_dir: str):
    """Tunix's (metrax's) W&B backend for `project`; W&B's own refusal (no API key, no network) as one line naming
    the key, not a traceback out of the trainer's start."""
    from tunix.sft import metrics_logger

    try:
        return metrics_logger.WandbBackend(project=project, name=run_name, dir=run_dir)
    except Exception as e:  # noqa: BLE001 - only W&B's own errors are turned into a user's error
        if not type(e).__module__.startswith("wandb"):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"train.wandb_project={project}: W&B did not start ({why}); log in (wandb login, or "
                        f"WANDB_API_KEY), or set WANDB_MODE=offline, or train.wandb_project=null") from None


class Trainer(TunixTrainer):
    """PeftTrainer + data position in checkpoints, metrics.jsonl, compile counter, guards.

    Tunix is reached through its public surface and the public names of `tunix_adapter.TunixTrainer`."""

    progress_bar_metrics = ["loss", "learning_rate", "tokens_per_s", "useful_tokens_per_s"]

    def __init__(self, model, optimizer, training_config, *, feed: BatchFeed, run_dir: str | Path,
                 tokens_per_step: int, flops=None, peak_flops: float = 0.0,
                 price_per_hour: float = 0.0, on_nonfinite: str = "stop", seed: int = 0,
                 metrics_logger=None, compile_counter: CompileCounter | None = None, mesh=None,
                 log_every_steps: int = 1, before_save=None, eval_data: str | None = None):
        guard_tensorboard_writer()
        self.eval_data = eval_data  # the eval set's fingerprint (data.eval_fingerprint), kept in each eval record
        self.mesh = mesh  # before Tunix's __init__, which builds the optimizer (see `optimizer`) and restores
        super().__init__(model, optimizer, training_config, metrics_logger=metrics_logger)
        # no non-finite state on disk, and with on_nonfinite=stop no step whose loss was not finite; `before_save(step)`
        # (the run's own check that its directory is still its own) first
        self._before_save_hook = before_save
        # seconds spent saving and evaluating since the last train record was written, which is where they were spent:
        # kept out of the next record's step time and rates (a step that saved read ~16 s on the 270M), given apart
        self._paused = {"save_s": 0.0, "eval_s": 0.0}
        self.checkpoint_manager = FiniteCheckpoints(self.checkpoint_manager, before_save=self._before_save,
                                                    timed=lambda: self._pause("save_s"))
        if mesh is not None:
            # optimizer state (created or restored) placed like its parameters right away
            shard_optimizer_state(self.optimizer, mesh)
        import jax

        self.primary = jax.process_index() == 0  # the one process that writes metrics files
        self.compile_counter = compile_counter or CompileCounter()
        self.feed = feed
        self.with_data_hooks(feed)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.tokens_per_step = tokens_per_step
        self.flops = flops  # gemma_tpu.train.flops.StepFlops
        self.peak_flops = peak_flops
        self.price_per_hour = price_per_hour
        self.on_nonfinite = on_nonfinite
        self.seed = seed
        self.log_every_steps = max(1, log_every_steps)
        self.resumed_from = self.train_steps
        if self.resumed_from and self.primary:
            dropped = drop_records_after(self.metrics_path, self.resumed_from)
            if dropped:
                log.info("%s: %d record(s) after step %d dropped (that run stopped before saving them; they are "
                         "trained again)", self.metrics_path, dropped, self.resumed_from)
        # the resumed step evaluated before the stop (its eval record kept): Tunix evaluated it again on entering the
        # loop, and metrics.jsonl had two eval records of one step. Process 0's answer for all (it reads the file;
        # every process runs the evaluation)
        self._metrics_written = self.metrics_path.is_file()  # a file this run has (or kept): one gone later is said
        self.skip_entry_eval = self._resumed_step_evaluated()
        if self.skip_entry_eval:
            log.info("step %d was evaluated before the stop (its record is in %s); not evaluated again",
                     self.resumed_from, self.metrics_path)
        state = self.restored_custom_metadata.get("data_state")
        if state is not None:
            feed.stream.set_state(state, self.restored_custom_metadata.get("data_layout"),
                                  f"{training_config.checkpoint_root_directory}/{self.train_steps}")
            log.info("resumed at step %d; data position restored", self.train_steps)
        elif self.train_steps:
            log.warning("%s/%d: the checkpoint step has no data position (its _CHECKPOINT_METADATA holds no "
                        "data_state: written by another trainer, or edited); the data restarts from the first batch, "
                        "so batches already trained are trained again", training_config.checkpoint_root_directory,
                        self.train_steps)
        self._t_last = None
        self._step_last = self.train_steps
        self._tok_last = 0
        self._useful_last = 0
        self._examples_last = 0
        self.compiles = 0
        self.history: list[dict] = []
        self.started = time.time()

    @property
    def optimizer(self):
        return self._nnx_optimizer

    @optimizer.setter
    def optimizer(self, optimizer):
        """Tunix's __init__ builds the nnx.Optimizer and at once restores the latest step into it, placing the state
        by its sharding annotations: adafactor's factored moments carried their parameter's (another rank), and
        every adafactor resume failed (IndexError / IndivisibleError, on one device too). Fitted on assignment."""
        fit_factored_state_annotations(optimizer, self.mesh)
        self._nnx_optimizer = optimizer

    def create_train_step_fn(self):
        """Tunix's step, handing back the trainable params and optimizer state as it got them (one compile)."""
        step = super().create_train_step_fn()
        if self.mesh is None or self.mesh.empty:
            return step
        from flax import nnx

        return keep_placement(step, self.model, self.optimizer, nnx.LoRAParam if self.lora_enabled else nnx.Param)

    # ---- checkpoint contents ---------------------------------------------------------
    def custom_checkpoint_metadata(self) -> dict[str, Any]:
        return {"data_state": self.feed.stream.get_state(), "data_layout": self.feed.stream.layout,
                "step": self.train_steps, "seed": self.seed}

    def _before_save(self, step: int) -> None:
        if self._before_save_hook is not None:
            self._before_save_hook(step)
        self._refuse_nonfinite_loss(step)
        # the step's own record, written before the step is saved: Tunix holds it back until the next step ends,
        # and a SIGKILL between this save and then lost it for good (the resume starts after this step and never
        # writes it again: metrics.jsonl went 3, 5, 6, ...). A save cut short by the kill is set aside on resume,
        # which drops the record with it (drop_records_after)
        if self.pending_train_losses():
            self._flushing_at_save = True  # the step ends now: its rates are measured to here (write_metrics)
            try:
                self.flush_train_metrics()
            finally:
                self._flushing_at_save = False

    def _refuse_nonfinite_loss(self, step: int) -> None:
        """With on_nonfinite=stop, a step whose loss is NaN/inf is not saved: its update was dropped, so the
        step held the previous step's weights under a later step number and data position, and a resume went
        on past the batch that stopped the run (as `skip` does). Writing the held-back record stops the run
        (`write_metrics`) naming the step really on disk."""
        if self.on_nonfinite != "stop":
            return
        losses = self.pending_train_losses()
        if all(np.isfinite(np.asarray(l, np.float32)).all() for l in losses):
            return
        self.flush_train_metrics()  # raises NonFiniteLoss
        raise NonFiniteLoss(f"non-finite loss at step {step}; step {step} was not saved")

    # ---- metrics ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _pause(self, kind: str):
        """Time a save or an evaluation (`kind`: save_s, eval_s) for the next train record, which leaves it out of
        its step time (from the later of its start and the last record's end: a record written as a save begins
        ends where the save's own time starts)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t_last = getattr(self, "_t_last", None)
            self._paused[kind] += time.perf_counter() - max(t0, t_last if t_last is not None else t0)

    def evaluation_timer(self):
        import jax

        # the step before it may still be running (dispatch is asynchronous, on CPU too): its time is the step's
        jax.block_until_ready(self.pending_train_losses())
        return self._pause("eval_s")

    def _compile_count(self) -> int:
        return self.compile_counter.counts.get(TRAIN_STEP_FN, 0)

    def _log_placeholder_rates(self, step: int) -> None:
        """Rates of 0 for a step that times nothing, so that the progress bar's rate metrics exist."""
        for key in ("tokens_per_s", "useful_tokens_per_s"):
            self.metrics_logger.log(self.metrics_prefix, key, 0.0, self.mode, step)

    def write_metrics(self, metrics_buffer):
        mode = str(self.mode)
        loss = float(np.asarray(metrics_buffer.loss))
        rec: dict[str, Any] = {"step": int(metrics_buffer.step), "mode": mode, "loss": loss,
                               "perplexity": float(math.exp(min(loss, 80.0))), "time": round(time.time(), 3)}
        if mode == "eval" and self.eval_data is not None:
            rec["eval_data"] = self.eval_data
        if mode == "train":
            if not math.isfinite(loss):
                self._append(rec)
                if self.on_nonfinite == "stop":
                    last = last_step_on_disk(self.checkpoint_manager)
                    raise NonFiniteLoss(f"non-finite loss {loss} at step {metrics_buffer.step}; " + (
                        f"the last checkpoint on disk is step {last} (finite)" if last is not None
                        else "no checkpoint was written"))
                log.warning("non-finite loss at step %d", metrics_buffer.step)
            for k, (vals, op) in metrics_buffer.additional_metrics.items():
                rec[k] = float(op(np.asarray([np.asarray(v, np.float32) for v in vals])))
            # where this step ended (ready to ready: dispatch is asynchronous, on CPU too, and the time the next
            # step's first batch was asked for came before this step's compute had run: the record after a save
            # read 0.01 s, the next one two steps' time): when the feed saw it done, else now, its loss read above.
            # What it fed: counted when the next step's first batch was asked for (Tunix writes a step's record
            # once the next step is under way), or now for a record written as its step is saved. The learning
            # rate too: read when the record was written, it was the next step's (the last record's alone its own)
            seen = self.feed.seen_done
            now = seen[1] if seen is not None and seen[0] == rec["step"] else time.perf_counter()
            mark = None if getattr(self, "_flushing_at_save", False) else self.feed.step_mark
            tokens, useful, examples, lr = mark or (self.feed.tokens, self.feed.useful, self.feed.examples,
                                                    self.learning_rate())
            if lr is not None:
                rec["learning_rate"] = float(np.asarray(lr))
            steps = rec["step"] - self._step_last
            if getattr(self, "_closing", False):
                rec["final_flush"] = True  # written by close() (or the SIGTERM exit), timed like the others
            # saving and evaluating since the last record, left out of the step time and the rates (in the session's
            # first record: the evaluation before it, step 0's)
            paused = {k: v for k, v in self._paused.items() if v > 0}
            rec.update(paused)
            if self._t_last is not None and steps > 0:
                dt = max(now - self._t_last - sum(paused.values()), 1e-9)
                rec["step_time_s"] = dt / steps
                rec["tokens_per_s"] = steps * self.tokens_per_step / dt
                rec["nonpad_tokens_per_s"] = (tokens - self._tok_last) / dt
                rec["useful_tokens_per_s"] = (useful - self._useful_last) / dt
                # the fair rate when layouts differ (packing, shared prefixes): trained examples per second
                rec["examples_per_s"] = (examples - self._examples_last) / dt
                if self.flops is not None:
                    done = self.flops.step(steps * self.tokens_per_step, useful - self._useful_last)
                    tflops = done / dt / 1e12
                    rec["tflops_per_s"] = tflops
                    if self.peak_flops:
                        rec["mfu"] = tflops * 1e12 / self.peak_flops
                for key in ("tokens_per_s", "useful_tokens_per_s", "mfu"):
                    if key in rec:
                        self.metrics_logger.log(self.metrics_prefix, key, rec[key], self.mode, rec["step"])
            else:  # the session's first step (max_steps=1, or one step after a resume: also its last)
                rec["includes_compile"] = True
                self._log_placeholder_rates(rec["step"])  # the progress bar asks for them (absl warned)
            self._t_last, self._step_last = now, rec["step"]
            self._paused = dict.fromkeys(self._paused, 0.0)
            self._tok_last, self._useful_last, self._examples_last = tokens, useful, examples
            self.compiles = self._compile_count()
            rec["train_step_compiles"] = self.compiles
            self._log_progress(rec)
        # TensorBoard's learning rate (Tunix reads it through `learning_rate` as it logs) is the record's too
        self._record_learning_rate = rec.get("learning_rate")
        try:
            super().write_metrics(metrics_buffer)
        finally:
            self._record_learning_rate = None
        self._append(rec)

    def _log_progress(self, rec: dict) -> None:
        """Without a terminal (CI, nohup, a pod's log) tqdm's bar is invisible: log rate and ETA instead,
        at most every 30 s and at the last step."""
        if sys.stderr.isatty():
            return
        total = self.config.max_steps or 0
        now = time.time()
        if rec["step"] < total and now - getattr(self, "_last_progress_log", 0.0) < 30:
            return
        self._last_progress_log = now
        rate = rec.get("step_time_s")
        eta = f", ETA {datetime.timedelta(seconds=round(rate * (total - rec['step'])))}" if rate and total else ""
        log.info("step %d/%s loss %.4f%s%s", rec["step"], total or "?", rec["loss"],
                 f", {rate:.2f} s/step, {rec['tokens_per_s']:.0f} tok/s" if rate
                 else " (compiling)" if rec.get("includes_compile") else "", eta)

    def close(self):
        evals = [self.resumed_from] if self.skip_entry_eval else []  # evaluated before the stop
        evals += [r["step"] for r in self.history if r["mode"] == "eval"]
        if evals and evals[-1] < self.train_steps:  # the loop ended past the last evaluation: evaluate the model
            # it saves (train.max_steps not a multiple of eval_every_steps, or data ran out), saved first (a
            # preemption's SIGKILL during the evaluation would otherwise lose the step)
            self.save_last_checkpoint()
            self.evaluate_now()
        self._closing = True
        self.flush_train_metrics()  # the last step's record, timed to now: before the profiler's trace is written
        if self.stop_profiler():  # the loop ended inside the profiled window
            log.warning("training ended inside the profiled steps; the trace holds fewer steps")
        return super().close()

    def write_last_record(self) -> None:
        """The last finished step's metrics record, written now, as `close` writes it (the SIGTERM exit skips
        `close`)."""
        self._closing = True
        self.flush_train_metrics()

    def _append(self, rec: dict) -> None:
        """Every record into the history (the summary's medians); into metrics.jsonl the eval records and every
        `train.log_every_steps`-th train record, the last one and a non-finite one always (the key was read
        and checked, then ignored: every step was written)."""
        self.history.append(rec)
        if not self.primary:
            return
        if rec["mode"] == "train" and rec["step"] % self.log_every_steps and not rec.get("final_flush") \
                and rec["step"] != self.config.max_steps and math.isfinite(rec["loss"]):
            return
        if self._metrics_written and not self.metrics_path.exists() and self.metrics_path.parent.is_dir():
            # deleted mid-run: recreated without a word, a file starting mid-run read as the run's whole history
            log.warning("%s was removed while training: the records before it are gone; a new file starts at step %d",
                        self.metrics_path, rec["step"])
        append_jsonl(self.metrics_path, rec)
        self._metrics_written = True

    def learning_rate(self):
        """The injected learning rate, wherever optax wrappers put it (apply_if_finite nests it, and
        gradient accumulation's MultiSteps as `inner_opt_state`: no record of such a run had a learning rate)."""
        if getattr(self, "_record_learning_rate", None) is not None:  # a record being written: its step's
            return self._record_learning_rate
        state = self.optimizer.opt_state
        for _ in range(4):
            hyper = getattr(state, "hyperparams", None)
            if hyper is not None:
                lr = hyper["learning_rate"]
                return getattr(lr, "value", lr)
            state = getattr(state, "inner_state", None) or getattr(state, "inner_opt_state", None)
            if state is None:
                break
        return super().learning_rate()

    def _resumed_step_evaluated(self) -> bool:
        """Whether metrics.jsonl has an eval record of the step this run resumes at (process 0's answer, for all)."""
        import jax

        found = bool(self.resumed_from) and self.primary and step_evaluated(
            self.metrics_path, self.resumed_from, self.eval_data)
        if self.resumed_from and self.primary and not found and last_record(
                self.metrics_path, "eval", self.resumed_from) is not None:
            log.info("step %d's evaluation in %s was of other eval data (data.eval_path, its rows or "
                     "data.eval_max_batches changed); it is evaluated again", self.resumed_from, self.metrics_path)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            found = bool(multihost_utils.broadcast_one_to_all(np.int32(found)))
        return found

    def _recorded_eval_loss(self) -> float | None:
        """The loss of the restored step's evaluation from metrics.jsonl, where this session did not evaluate it."""
        rec = last_record(self.metrics_path, "eval", self.train_steps) if self.train_steps else None
        return rec.get("loss") if rec else None

    def _recorded_train_loss(self) -> float | None:
        """The loss of the restored step from metrics.jsonl: a session that trained no step (one finishing a run
        stopped after its last save) has none of its own."""
        rec = last_record(self.metrics_path, "train", self.train_steps) if self.train_steps else None
        return rec.get("loss") if rec else None

    def _recorded_first_eval_loss(self) -> float | None:
        """The run's first evaluation loss where this session resumed it: its first evaluation was of the restored
        (or a later) step, and summary.json's first_eval_loss after a preemption and resume was that, often equal
        to final_eval_loss, while the untrained model's was in metrics.jsonl."""
        rec = first_eval_record(self.metrics_path, self.eval_data) if self.resumed_from and self.primary else None
        return rec.get("loss") if rec else None

    def summary(self) -> dict[str, Any]:
        train = [r for r in self.history if r["mode"] == "train"]
        steady = [r for r in train if "step_time_s" in r]
        evals = [r for r in self.history if r["mode"] == "eval"]
        first_eval = self._recorded_first_eval_loss()
        out: dict[str, Any] = {
            "steps": self.train_steps,
            "resumed_from": self.resumed_from,
            "wall_s": round(time.time() - self.started, 1),
            "train_step_compiles": self.compiles,
            "eval_step_compiles": self.compile_counter.counts.get(EVAL_STEP_FN, 0),
            "final_train_loss": train[-1]["loss"] if train else self._recorded_train_loss(),
            "final_eval_loss": evals[-1]["loss"] if evals else self._recorded_eval_loss(),
            "first_eval_loss": first_eval if first_eval is not None else evals[0]["loss"] if evals else None,
        }
        if steady:
            def med(key):
                vals = sorted(r[key] for r in steady if key in r)
                return vals[len(vals) // 2] if vals else None

            out["median_step_time_s"] = round(med("step_time_s"), 4)
            out["tokens_per_s"] = round(med("tokens_per_s"), 1)
            out["useful_tokens_per_s"] = round(med("useful_tokens_per_s"), 1)
            out["examples_per_s"] = round(med("examples_per_s"), 3)
            if med("tflops_per_s") is not None:
                out["tflops_per_s"] = round(med("tflops_per_s"), 4)
            if med("mfu") is not None:
                out["mfu"] = round(med("mfu"), 4)
            # this session's saving and evaluating, outside the step times; the last record is written before the
            # run's final save and evaluation, whose time is still held (they read 0.0 where a save and an
            # evaluation had followed the last step)
            for key in ("save_s", "eval_s"):
                out[key] = round(sum(r.get(key, 0.0) for r in train) + self._paused[key], 2)
            if self.price_per_hour:
                out["est_cost_per_run"] = round(self.price_per_hour * out["wall_s"] / 3600, 4)
        return out
