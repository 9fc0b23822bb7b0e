"""`python -m gemma_tpu.train --config FILE [--dry-run] [section.key=value ...]`

Reads like a table of contents: join the other processes (multi-host), resolve the model, prepare
the data, build the mesh, load the model, apply LoRA, build the optimizer, run the trainer, save.
Everything that can be wrong with the input is checked before anything is written. `--dry-run`
prints the memory and time plan (`gemma_tpu.train.plan`) without loading any weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Sequence

from gemma_tpu import data, lora
from gemma_tpu.checkpoint import metadata as checkpoint
from gemma_tpu.checkpoint.metadata import COMMIT_MARKERS, METADATA_FILE
from gemma_tpu.checkpoint.params import check_item_files
from gemma_tpu.core import cli, strict_json, xla_cache
from gemma_tpu.core.atomic import check_writable, write_text_atomic
from gemma_tpu.core.config import RunConfig, validate_for_model
from gemma_tpu.core.errors import UserError, raise_signal_exit, read_json_object
from gemma_tpu.core.progress import human
from gemma_tpu.formats.function_calling import function_token_map
from gemma_tpu.hf.tokenizer import load_tokenizer
from gemma_tpu.models import load_model, resolve_model
from gemma_tpu.models.loading import check_weight_files
from gemma_tpu.models.registry import attention_dropout_warning
from gemma_tpu.train import flops as flops_lib
from gemma_tpu.train import mesh as mesh_lib
from gemma_tpu.train import plan, run_lock
from gemma_tpu.train.plan import abstract_model
from gemma_tpu.train.resume import check_data_position, check_resume_compatible, data_used_up, restore_failure

log = logging.getLogger("gemma_tpu.train")


def save_schedule(every_steps: int):
    """Orbax's save policy for `checkpoint.every_steps`: every N steps, and where JAX signals a preemption. Not
    Orbax's default built from `save_interval_steps` alone, which also saves the first step of a run with no
    checkpoint (its InitialSavePolicy): every fresh run saved step 1 whatever every_steps said (one save's time:
    minutes for a large full fine-tune), and max_to_keep later dropped it. The run's last step is saved at close."""
    from orbax.checkpoint import checkpoint_managers as policies

    return policies.AnySavePolicy([policies.FixedIntervalPolicy(every_steps),
                                   policies.PreemptionCheckpointingPolicy()])


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.parser("python -m gemma_tpu.train", __doc__, config="YAML run config (see configs/)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the mesh, per-device memory and step-time plan without loading weights; "
                        "exit 2 if it does not fit the accelerator (see gemma_tpu.train.plan)")
    plan.add_plan_arguments(p, "--dry-run: ")
    args = p.parse_args(list(argv))
    given = [o for o, v in (("--devices", args.devices), ("--assumed-mfu", args.assumed_mfu),
                            ("--no-compile", args.no_compile or None)) if v is not None]
    if given and not args.dry_run and not args.print_config:  # else ignored, and a whole training run started
        raise UserError(f"{given[0]} is an option of --dry-run; add --dry-run to plan the run (without it, "
                        f"leave {given[0]} out to train)")
    return args




def locked_dirs(cfg: RunConfig) -> list[tuple[Path, str]]:
    """The directories a trainer writes and locks, with their options: `checkpoint.dir`, and `train.run_dir`
    when it is another directory (two trainers with their own checkpoints but one run_dir interleaved their
    metrics.jsonl records and replaced each other's summary.json)."""
    dirs = [(Path(cfg.checkpoint.dir), "checkpoint.dir")]
    if cfg.train.run_dir and Path(cfg.train.run_dir).absolute().resolve() != dirs[0][0].absolute().resolve():
        dirs.append((Path(cfg.train.run_dir), "train.run_dir"))
    return dirs


def check_run_dirs_apart(cfg: RunConfig, base_dir: Path) -> None:
    """`checkpoint.dir` and `train.run_dir` are neither the base model's directory nor inside it, nor another
    model's directory (config.json, no run metadata): training wrote its steps, gemma_tpu_run.json, metrics and
    TensorBoard files among the model's own, and the converters then took the base for a checkpoint."""
    base = base_dir.resolve()
    for key, d in (("checkpoint.dir", cfg.checkpoint.dir), ("train.run_dir", cfg.train.run_dir)):
        if not d:
            continue
        p = Path(d).resolve()
        if p == base or base in p.parents:
            raise UserError(f"{key}={d} is {'the' if p == base else 'inside the'} base model's directory "
                            f"{base_dir} (model.path); write the run elsewhere")
        if (p / "config.json").is_file() and not (p / METADATA_FILE).is_file():
            raise UserError(f"{key}={d} holds a model (config.json), not a training run; write the run elsewhere")
    # a run dir in checkpoint.dir named like a step (runs/x/2) was taken for an incomplete step at the start and set
    # aside with the run's lock in it, and the run failed at its first save ("lost its run lock while training")
    ckpt, run_dir = Path(cfg.checkpoint.dir).resolve(), Path(cfg.train.run_dir).resolve() if cfg.train.run_dir else None
    if run_dir is not None and ckpt in run_dir.parents:
        top = run_dir.relative_to(ckpt).parts[0]
        if top.isascii() and top.isdigit():  # `04` too: refused as a misnamed step by the next resume
            # (Orbax itself reads only `4`: for `04` the refusal is the reason, not what Orbax would do)
            why = (", which Orbax takes for a step (set aside, deleted as old steps are dropped)"
                   if checkpoint.step_of(top) is not None else
                   f" with leading zeros ({top}), which a run on checkpoint.dir refuses as a misnamed step (Orbax "
                   f"reads a step only by its plain number)")
            raise UserError(f"train.run_dir={cfg.train.run_dir} is {'' if run_dir.parent == ckpt else 'inside '}a "
                            f"directory of checkpoint.dir={cfg.checkpoint.dir} named like checkpoint step {int(top)}"
                            f"{why}; write the run elsewhere")
    # a directory of another run named like one of its steps (`runs/a/1`, or inside one) was trained into without a
    # word: that run's Orbax deleted it with its step 1 as max_to_keep dropped it, and the converters given
    # `runs/a/1` read runs/a's step 1, not this run
    for key, d in (("checkpoint.dir", cfg.checkpoint.dir), ("train.run_dir", cfg.train.run_dir)):
        held = checkpoint.step_holding(Path(d)) if d else None
        if held is not None:
            other, step = held
            inside = Path(d).absolute().resolve().parent != other.absolute().resolve()
            converters = "" if inside else f"; the converters given {d} read that step"
            raise UserError(f"{key}={d} is {'inside ' if inside else ''}a directory of the run in {other} named like "
                            f"its checkpoint step {step} (that run's Orbax takes it for the step, and deletes it with "
                            f"the step as checkpoint.max_to_keep drops old steps{converters}); write the run elsewhere")


def check_run_dirs_writable(cfg: RunConfig) -> None:
    """`checkpoint.dir` and `train.run_dir` can be made and written (`core.atomic.check_writable`, which leaves
    nothing): the run checks them before the data is read, and so does `--dry-run`, which planned a checkpoint.dir
    that is a file, or one on a read-only disk, as a run that fits."""
    check_writable(cfg.checkpoint.dir, f"checkpoint.dir={cfg.checkpoint.dir}")
    if cfg.train.run_dir:
        check_writable(cfg.train.run_dir, f"train.run_dir={cfg.train.run_dir}")


# what a run writes under its run dir by these names: True a directory, False a file
RUN_OUTPUTS = {"metrics.jsonl": False, "summary.json": False, "tensorboard": True}


def check_run_outputs(run_dir: Path, key: str) -> None:
    """The run's own outputs in `run_dir` (`key`: the option naming it), where they exist, are of their kind: a
    directory named metrics.jsonl failed the run after its metadata was written (on a resume as "cannot restore this
    checkpoint step ...; move it aside", of a sound step), a summary.json directory after every step had trained."""
    for name, is_dir in RUN_OUTPUTS.items():
        p = run_dir / name
        if not p.exists() or (p.is_dir() if is_dir else p.is_file()):
            continue
        raise UserError(f"{p}: not a {'directory' if is_dir else 'regular file'} (the run writes its "
                        f"{'TensorBoard events' if is_dir else name} there); move it out of {key}={run_dir}")


def check_run_dir_contents(cfg: RunConfig) -> None:
    """What the run dir (train.run_dir, else checkpoint.dir) already holds is this run's, of its kind
    (`check_run_outputs`, `check_run_dir_is_this_runs`): the run checks it before the data is read, and so does
    `--dry-run`, which planned such runs as runs that fit."""
    key = "train.run_dir" if cfg.train.run_dir else "checkpoint.dir"
    run_dir = Path(cfg.train.run_dir or cfg.checkpoint.dir)
    check_run_outputs(run_dir, key)
    check_run_dir_is_this_runs(Path(cfg.checkpoint.dir), run_dir, key)


def check_run_dir_is_this_runs(ckpt_dir: Path, run_dir: Path, key: str) -> None:
    """The run dir (`run_dir`, the option `key` names) holds no other run's records. A run that has not started in
    `ckpt_dir` (no gemma_tpu_run.json, no step) finds none there at all: two runs (other checkpoint.dirs, other data)
    given one train.run_dir mixed their records in one metrics.jsonl (steps 0..N twice, read as one run by a plot
    and by the resume's readers), and the second replaced the first's summary.json. A resume into a separate run dir
    finds no summary.json of another checkpoint there: it dropped that run's metrics.jsonl records after its own
    step and replaced its summary. (A run dir that is the checkpoint dir is the run's own, copied or moved too.)"""
    if not (ckpt_dir / METADATA_FILE).is_file() and not checkpoint.list_steps(ckpt_dir):  # steps alone: refused later
        for name in ("metrics.jsonl", "summary.json"):
            p = run_dir / name
            if p.is_file() and p.stat().st_size:
                raise UserError(f"{p}: written by another run (checkpoint.dir={ckpt_dir} holds no run); this run's "
                                f"records would be mixed with its: use another {key}, or move {name} out of it")
        return
    if run_dir.absolute().resolve() == ckpt_dir.absolute().resolve():
        return
    try:
        owner = json.loads((run_dir / "summary.json").read_text()).get("checkpoint_dir")
    except (OSError, ValueError, AttributeError):  # none, or a summary that names no checkpoint: nothing to compare
        return
    if isinstance(owner, str) and Path(owner).resolve() != ckpt_dir.absolute().resolve():
        raise UserError(f"{run_dir / 'summary.json'}: the summary of another run (checkpoint.dir={owner}); this "
                        f"run would drop its metrics.jsonl records and replace its summary: use another {key}, or "
                        f"move them out of it")


def check_resume_step_files(ckpt_dir: Path) -> None:
    """The step a resume would restore has the files Orbax needs (named when missing), checked before
    the model loads, and before its data position is read from the step's own record (_CHECKPOINT_METADATA: cut
    short by a copy, it was one line without the way out)."""
    steps = checkpoint.list_steps(ckpt_dir)
    if steps:
        step_dir = ckpt_dir / str(steps[-1])
        try:
            read_json_object(step_dir / COMMIT_MARKERS[0], f"{step_dir / COMMIT_MARKERS[0]}: missing")
            for item in ("model_params", "optimizer_state"):
                check_item_files(step_dir / item)
        except UserError as e:
            raise UserError(f"{step_dir}: cannot restore this checkpoint step ({e}); "
                            f"move it aside to resume from the one before") from e


def run(cfg: RunConfig) -> dict:
    """Train as configured; returns the run summary."""
    #    other JAX call
    mesh_lib.initialize_distributed(cfg.mesh)
    import jax

    xla_cache.heal_damaged_entries()  # an entry cut short by a kill is compiled again once, not at every run

    from gemma_tpu.train import optim, partition  # deferred: imports jax/torch
    from gemma_tpu.train.trainer import (  # deferred: jax/torch
        BatchFeed, Trainer, check_wandb, drop_records_after, metrics_logging_options, step_evaluated)
    from gemma_tpu.train.finite_guard import check_checkpoint_room  # deferred: imports Tunix

    primary = jax.process_index() == 0
    if primary:
        check_wandb(cfg.train.wandb_project)

    # 1. model files and tokenizer (nothing loaded into memory yet)
    resolved = resolve_model(cfg.model.path, cfg.model.revision, cfg.model.family)
    validate_for_model(cfg, resolved.text_config, str(resolved.local_dir),
                       resolved.family.projection_shapes(resolved.text_config))
    check_run_dirs_apart(cfg, resolved.local_dir)
    if primary:  # before the data is read (minutes for a large set): a writable directory, no other trainer on it
        check_run_dirs_writable(cfg)
        for d, key in locked_dirs(cfg):
            run_lock.check_free(d, key)
        check_run_dir_contents(cfg)
    tokenizer = load_tokenizer(resolved.local_dir)  # a dir without tokenizer files is refused by name
    tunix_cfg = resolved.tunix_config()
    if cfg.lora.enabled:
        resolved.family.targets_to_modules(tunix_cfg, list(cfg.lora.targets))
    check_weight_files(resolved, tunix_cfg)  # headers, shards, shapes: before minutes of data preparation
    # the mesh and what it splits, from the model's shapes alone (nothing allocated): a mesh that cannot split the
    # model (tp=8 over 4 heads) was refused only after the data had been prepared, minutes for a large set
    mesh = mesh_lib.build_mesh(cfg.mesh)
    check_batch_divisible(cfg, dict(mesh.shape), jax.process_count())
    remat = effective_remat(cfg)
    with mesh:
        abstract, _ = abstract_model(resolved.family, resolved.hf_config, cfg.model.dtype, remat)
        partition.check_divisible(resolved.family, tunix_cfg, abstract, mesh)

    # 2. data, fully validated before anything is written
    if not cfg.data.train_path:
        raise UserError("data.train_path is not set")
    token_map = function_token_map(tokenizer)
    renderer = data.make_renderer(tokenizer, cfg.data, resolved.family.chat_format, token_map,
                                  vocab_size=tunix_cfg.num_embed)
    train_split, eval_split = data.prepare_splits(renderer, cfg.data, cfg.train.seed, cfg.train.batch_size)
    st = train_split.stats()
    log.info("train data %s: %d examples kept of %d (%d truncated, %d dropped) -> %d rows of %d (%d shared-prefix "
             "trees: %.1f computed tokens per example, %.1f one by one); useful-token fraction %.3f",
             cfg.data.train_path, st["examples_kept"], st["examples_read"], st["truncated"], st["dropped"],
             st["rows"], cfg.data.seq_len, st["trees"], st["computed_tokens_per_example"],
             st["computed_tokens_per_example_unshared"], st["useful_fraction"])
    for split in (train_split, eval_split):
        for warning in (split and data.overlength_warning(split, cfg.data.overlength),
                        split and data.duplicates_warning(split)):
            if warning:
                log.warning(warning)
    # what an evaluation measures (its rows and how many): a resume evaluates its step again on other eval data
    eval_data = data.eval_fingerprint(eval_split, cfg.train.batch_size, cfg.data.eval_max_batches) if eval_split \
        else None
    warning = data.overlap_warning(train_split, eval_split)
    if warning:
        log.warning(warning)
    warning = data.epochs_warning(train_split, cfg.train.batch_size, cfg.train.grad_accum_steps,
                                  cfg.data.num_epochs, cfg.train.max_steps)
    if warning:
        log.warning(warning)

    ckpt_dir = Path(cfg.checkpoint.dir)
    meta = checkpoint.build_metadata(cfg, resolved)
    meta["token_map"] = token_map
    meta["chat_format"] = renderer.chat_format
    check_resume_compatible(ckpt_dir, meta, cfg.checkpoint.allow_base_mismatch)
    if primary:  # before loading anything (writes nothing)
        check_resume_step_files(ckpt_dir)
    check_data_position(cfg, train_split)  # a resume's data position must name these rows
    done = checkpoint.list_steps(ckpt_dir)
    run_dir = Path(cfg.train.run_dir or ckpt_dir)
    # decided before the mesh and the model (minutes for a large one). A run whose data ran out (data.num_epochs)
    # before train.max_steps ended too: its rerun restored the last step, trained nothing and replaced the run's
    # summary.json (its step time, tokens/s, MFU) with its own
    if done and (done[-1] >= cfg.train.max_steps or data_used_up(cfg, train_split)):
        summary_dir = None if done[-1] > cfg.train.max_steps else finished_run_dir(
            ckpt_dir, run_dir, done[-1], jax.process_count() > 1)
        if done[-1] > cfg.train.max_steps or summary_dir is not None:
            # a rerun with another train.run_dir loaded the model, evaluated the step again and wrote a summary.json
            # of that alone there (no train loss, no step times), "finishing" a run that had finished
            where = ("" if summary_dir is None or summary_dir.absolute() == run_dir.absolute() else
                     f"; its summary.json is in {summary_dir}, the run dir its {METADATA_FILE} names, not in {run_dir}")
            if done[-1] >= cfg.train.max_steps:
                log.info("checkpoint %s is already at step %d >= train.max_steps=%d; nothing to do (a larger "
                         "train.max_steps trains on)%s", ckpt_dir, done[-1], cfg.train.max_steps, where)
            else:
                log.info("checkpoint %s is at step %d, where its training data ends (data.num_epochs=%d); nothing to "
                         "do (a larger data.num_epochs trains on)%s", ckpt_dir, done[-1], cfg.data.num_epochs, where)
            if primary:  # a dead trainer's lock stayed until the next run that trained: this one trains nothing
                for d, key in locked_dirs(cfg):
                    run_lock.clear_stale(d, key)
            return {"steps": done[-1], "resumed_from": done[-1], "nothing_to_do": True}
        # stopped after its last save (a kill during the end-of-run evaluation): this rerun said "nothing to do",
        # and the run never got its final evaluation nor a summary.json. The trainer restores the step and trains
        # nothing; it evaluates the step unless metrics.jsonl has its eval record of this eval set
        # (Trainer.skip_entry_eval): the log said it would evaluate the step whenever there was eval data
        work = ("the summary" if not eval_split else
                f"the summary (step {done[-1]}'s evaluation on this eval data is in metrics.jsonl)"
                if step_evaluated(run_dir / "metrics.jsonl", done[-1], eval_data) else
                "the evaluation of that step and the summary")
        log.info("checkpoint %s is at its last step %d, but the run did not finish (no summary.json of step %d in "
                 "%s); finishing it: %s", ckpt_dir, done[-1], done[-1], run_dir, work)

    # 3. model, LoRA on the mesh checked above: weights go straight into their shards (gemma_tpu.train.partition)
    warning = attention_dropout_warning(resolved.hf_config, str(resolved.local_dir / "config.json"))
    if warning:
        log.warning(warning)
    with mesh:  # the mesh PeftTrainer reads (thread resources) for input sharding
        ruled = dataclasses.replace(resolved, family=partition.with_rules(resolved.family))
        model, tunix_cfg = load_model(ruled, cfg.model.dtype, remat, mesh=mesh)
        if cfg.lora.enabled:
            model = lora.apply_lora(model, resolved.family, tunix_cfg, cfg.lora, seed=cfg.train.seed, mesh=mesh)
        from flax import nnx

        trainable = lora.count_params(model, nnx.LoRAParam if cfg.lora.enabled else None)
        log.info("trainable parameters: %s", f"{trainable:,}")

        # 4. data streams, optimizer, trainer
        stream = data.TrainStream(train_split, cfg.train.batch_size, cfg.train.seed, cfg.data.shuffle,
                                  cfg.data.num_epochs, jax.process_index(), jax.process_count())
        evals = (data.eval_batches(eval_split, cfg.train.batch_size, cfg.data.eval_max_batches,
                                   jax.process_index(), jax.process_count(), token_weighted=True)
                 if eval_split else None)
        feed = BatchFeed(stream, evals, put=functools.partial(mesh_lib.global_batch, mesh),
                         dropout=cfg.lora.enabled and cfg.lora.dropout > 0,
                         grad_accum_steps=cfg.train.grad_accum_steps)
        import orbax.checkpoint as ocp
        from tunix.sft.peft_trainer import TrainingConfig

        from gemma_tpu.train.tunix_adapter import RestoreFailed, profiler_options

        locks, previous, resumed = [], None, None
        if primary:
            for d, key in locked_dirs(cfg):  # one writer per run directory, from the first write on
                locks.append((run_lock.acquire(d, key), key))
            for p in checkpoint.set_aside_incomplete_steps(ckpt_dir):
                log.warning("set aside %s: a step without Orbax's commit markers; resuming from the last "
                            "complete one", p)
            aside = checkpoint.set_aside_steps(ckpt_dir)
            if aside:
                log.warning("%s holds %d step director%s set aside as incomplete (%s: %s), kept as possibly the only "
                            "copy of %s; no run removes them: delete them once not needed", ckpt_dir, len(aside),
                            "y" if len(aside) == 1 else "ies", human(sum(size for _, size in aside)),
                            ", ".join(p.name for p, _ in aside), "that step" if len(aside) == 1 else "those steps")
            for p, size in checkpoint.remove_unfinished_saves(ckpt_dir):
                log.warning("removed %s (%s): a save that did not finish (a full disk, or the run was killed)", p,
                            human(size))
            recover_record(ckpt_dir)
            # the run that wrote the steps, put back if they cannot be restored into this one: a failed resume left
            # the file describing this run's base and settings beside the other run's steps, which a merge then
            # combined and the next resume's checks compared against
            previous = (ckpt_dir / METADATA_FILE).read_text() if (ckpt_dir / METADATA_FILE).is_file() else None
            resumed = (checkpoint.list_steps(ckpt_dir) or [None])[-1]
        # until this session has saved a step of its own, any exit (a refusal such as a disk without room for a step,
        # a failed restore, a stop: SIGTERM before the preemption handler took over, or at its first boundary) puts
        # back the record of the run that wrote the steps; each gap between writing it and the handler (or the
        # `try`) let a stop leave this session's record, of a session that trained nothing, beside another's steps
        put_back = functools.partial(put_back_record, ckpt_dir, previous, resumed, locks) if primary else lambda: None
        # a resume's own record goes in at its first save: written here, a SIGKILL before that save (the restore, the
        # compile, the first steps: minutes) left it, of a session that trained nothing, beside another's steps
        before_save = SessionRecord(ckpt_dir, meta, locks, write=primary and resumed is not None, previous=previous,
                                    resumed=resumed)
        try:
            if primary and resumed is None:
                checkpoint.write_metadata(ckpt_dir, meta)
            if primary and previous is not None and not checkpoint.list_steps(ckpt_dir):
                # this run's directory, restarted with no step saved (stopped before or during its first save): it
                # starts afresh, and so does metrics.jsonl (a kill during the save of step 1 left its record, and the
                # rerun wrote step 1 again; an eval of step 0 twice)
                dropped = drop_records_after(run_dir / "metrics.jsonl", -1)
                if dropped:
                    log.info("%s: %d record(s) of the attempt that saved no step dropped (trained again)",
                             run_dir / "metrics.jsonl", dropped)
            profile_dir = profile_window(cfg, run_dir, ckpt_dir)
            tcfg = TrainingConfig(
                eval_every_n_steps=cfg.train.eval_every_steps or cfg.train.max_steps,
                max_steps=cfg.train.max_steps,
                gradient_accumulation_steps=cfg.train.grad_accum_steps if cfg.train.grad_accum_steps > 1 else None,
                checkpoint_root_directory=str(ckpt_dir.resolve()),
                checkpointing_options=ocp.CheckpointManagerOptions(
                    save_interval_steps=cfg.checkpoint.every_steps, max_to_keep=cfg.checkpoint.max_to_keep,
                    enable_async_checkpointing=cfg.checkpoint.async_save,
                    save_decision_policy=save_schedule(cfg.checkpoint.every_steps)),
                metrics_logging_options=metrics_logging_options(str((run_dir / "tensorboard").resolve()),
                                                                (checkpoint.list_steps(ckpt_dir) or [None])[-1],
                                                                cfg.train.wandb_project, ckpt_dir.resolve().name),
                data_sharding_axis=mesh_lib.DATA_SHARDING_AXIS,
                pbar_description="train",
                profiler_options=(profiler_options(str(profile_dir), cfg.train.profile_skip_steps,
                                                   cfg.train.profile_steps, cfg.train.grad_accum_steps)
                                  if profile_dir else None),
            )
            chunk = 1024
            step_flops = plan.step_flops(cfg, tunix_cfg, plan.model_dims(abstract, tunix_cfg))  # as --dry-run counts
            tx = optim.make_optimizer(cfg.train)
            if primary:  # a disk that cannot hold one step to save: refused now, not at the first save
                check_checkpoint_room(ckpt_dir, model, tx, cfg.lora.enabled)
            try:  # restores the latest step, if any
                trainer = Trainer(
                    model, tx, tcfg, feed=feed, run_dir=run_dir,
                    tokens_per_step=cfg.train.batch_size * cfg.data.seq_len * cfg.train.grad_accum_steps,
                    flops=step_flops, peak_flops=flops_lib.peak_flops(cfg.mesh.accelerator, jax.device_count()),
                    price_per_hour=cfg.mesh.price_per_hour, on_nonfinite=cfg.train.on_nonfinite, seed=cfg.train.seed,
                    mesh=mesh, log_every_steps=cfg.train.log_every_steps,
                    before_save=before_save, eval_data=eval_data,
                )
            except RestoreFailed as e:
                # only the restore's own failure is the step's: another (a metrics backend that did not start) was
                # "cannot restore this checkpoint step ...; move it aside", of a sound step, naming no real cause
                steps = checkpoint.list_steps(ckpt_dir)
                if not steps:
                    raise
                kind = nnx.LoRAParam if cfg.lora.enabled else None
                cause = e.__cause__ if isinstance(e.__cause__, Exception) else e
                if isinstance(cause, UserError):
                    raise cause from None
                raise restore_failure(ckpt_dir, steps[-1], model, kind,
                                      json.loads(previous) if previous else {}, meta, cause) from cause
            from gemma_tpu.train.loss import make_loss_fn  # deferred: imports jax/torch

            trainer.with_loss_fn(make_loss_fn(chunk, dropout_seed=cfg.train.seed))
            trainer.with_data_hooks(feed)
            preemption = _install_sigterm(trainer, put_back)
            with trainer.compile_counter:
                trainer.train(train_ds=stream, eval_ds=evals or None)
        except BaseException:
            put_back()
            raise
    # the checkpoint it summarizes (a separate train.run_dir, or a summary copied beside others, named none)
    summary = {**trainer.summary(), "checkpoint_dir": str(ckpt_dir.resolve()),
               "checkpoint_step": (checkpoint.list_steps(ckpt_dir) or [None])[-1]}
    if profile_dir and primary:
        traces = sorted(profile_dir.glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        if traces:
            log.info("profile written: %s (summary: python benchmarks/profile_summary.py %s)", traces[-1],
                     profile_dir)
        else:
            log.warning("no profile written under %s", profile_dir)
    if primary:
        write_text_atomic(run_dir / "summary.json", strict_json.dumps(summary, indent=2))  # never a cut-short one
        drop_record_aside(ckpt_dir)  # this session's steps are committed: its record is theirs
    log.info("done: %s", json.dumps(summary))
    preemption.exit_if_requested()
    return summary


def put_back_record(ckpt_dir: Path, previous: str | None, resumed: int | None, locks: list) -> None:
    """Put `previous` (gemma_tpu_run.json's text before this session wrote its own) back when this session, which
    started at step `resumed`, ends with no step of its own saved: its record described a session that trained
    nothing (its train.max_steps, learning rate, run dir) beside the steps another one wrote, and the next resume
    compared its schedule against it. Nothing where no step was saved before (a fresh start is this session's), nor
    where this session no longer holds its run locks (`locks`: (PidLock, key) pairs; the directory is another's)."""
    if previous is None or resumed is None or not all(lock.still_held() for lock, _ in locks):
        return
    if checkpoint.list_steps(ckpt_dir)[-1:] != [resumed]:
        drop_record_aside(ckpt_dir)
        return
    try:
        write_text_atomic(ckpt_dir / METADATA_FILE, previous)
    except (OSError, UserError) as e:  # the exit's own cause (a full disk) is what must be said
        log.warning("%s: the record of the run that wrote step %d was not put back (%s); %s describes this session, "
                    "which saved no step", ckpt_dir, resumed, e, METADATA_FILE)
        return
    drop_record_aside(ckpt_dir)


RECORD_ASIDE = f".{METADATA_FILE}.before-step-"  # + the step the resume started from: the record of its writer


def recover_record(ckpt_dir: Path) -> None:
    """At a start, before anything reads the record: a resume killed (SIGKILL, no handler) between writing its own
    gemma_tpu_run.json at its first save and Orbax committing that step left its record, of a session that saved
    nothing, beside the steps another wrote. The record it replaced (kept aside until then, `SessionRecord`) is put
    back where no step after the one it started from was committed; otherwise the aside copy is stale and goes."""
    latest = (checkpoint.list_steps(ckpt_dir) or [None])[-1]
    for aside in ckpt_dir.glob(f"{RECORD_ASIDE}*"):
        started = aside.name[len(RECORD_ASIDE):]
        if started.isdigit() and latest == int(started):
            write_text_atomic(ckpt_dir / METADATA_FILE, aside.read_text())
            log.warning("%s: put back the record of the run that wrote step %d (a resume killed during its first "
                        "save had replaced it, and saved no step)", ckpt_dir / METADATA_FILE, latest)
        aside.unlink(missing_ok=True)


def drop_record_aside(ckpt_dir: Path) -> None:
    for aside in ckpt_dir.glob(f"{RECORD_ASIDE}*"):
        aside.unlink(missing_ok=True)


def run_finished(run_dir: Path, step: int, several_processes: bool = False) -> bool:
    """Whether the run ended at `step`: its summary.json (written last, by process 0) says so. With several
    processes, process 0's answer for all (a run_dir on its local disk is not on the others')."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        finished = isinstance(summary, dict) and summary.get("steps") == step
    except (OSError, ValueError):
        finished = False
    if several_processes:
        import numpy as np
        from jax.experimental import multihost_utils

        finished = bool(multihost_utils.broadcast_one_to_all(np.int32(finished)))
    return finished


def finished_run_dir(ckpt_dir: Path, run_dir: Path, step: int, several_processes: bool = False) -> Path | None:
    """Where the run that ended at `step` wrote its summary.json (`run_finished`), or None: this run's `run_dir`, or
    the run dir recorded in the checkpoint's gemma_tpu_run.json (its train.run_dir, else the checkpoint directory),
    for a rerun given another train.run_dir."""
    if run_finished(run_dir, step, several_processes):
        return run_dir
    try:
        recorded = checkpoint.read_metadata(ckpt_dir).get("config", {}).get("train", {}).get("run_dir")
    except (UserError, AttributeError):
        recorded = None
    other = Path(recorded) if isinstance(recorded, str) and recorded else ckpt_dir
    if other.absolute() == run_dir.absolute():
        return None
    return other if run_finished(other, step, several_processes) else None


class SessionRecord:
    """The trainer's `before_save(step)`: `check_run_intact`, then, where `write` (a resume, on process 0), this
    session's gemma_tpu_run.json (`meta`) before its first save; until then the record is the one of the session
    that wrote the steps (`put_back_record` puts it back where a save fails). That record (`previous`, of the session
    that wrote step `resumed`) is kept aside first, until this session's step is committed: a SIGKILL in between
    leaves it for the next start to put back (`recover_record`)."""

    def __init__(self, ckpt_dir: Path, meta: dict, locks: list, write: bool, previous: str | None = None,
                 resumed: int | None = None):
        self.ckpt_dir, self.meta, self.locks, self.pending = ckpt_dir, meta, locks, write
        self.previous, self.resumed = previous, resumed

    def __call__(self, step: int) -> None:
        check_run_intact(self.ckpt_dir, self.locks, step)
        if self.pending:
            if self.previous is not None and self.resumed is not None:
                write_text_atomic(self.ckpt_dir / f"{RECORD_ASIDE}{self.resumed}", self.previous)
            checkpoint.write_metadata(self.ckpt_dir, self.meta)
            self.pending = False


def check_run_intact(ckpt_dir: Path, locks: list, step: int) -> None:
    """Before a step is saved: the run's metadata file and its locks (`locks`: (PidLock, key) pairs, held by process
    0) are still there. A `checkpoint.dir` removed, moved or emptied mid-run was recreated by Orbax for the next step
    (with a separate train.run_dir the run went on to exit 0): steps without gemma_tpu_run.json, which neither a
    merge nor a resume accepts, and no lock keeping a second trainer out."""
    from gemma_tpu.core import pidlock
    from gemma_tpu.train.finite_guard import CheckpointSaveFailed

    lost: dict[str, list[str]] = {}
    if not (ckpt_dir / METADATA_FILE).is_file():
        lost.setdefault(f"checkpoint.dir={ckpt_dir}", []).append(METADATA_FILE)
    for lock, key in locks:
        if lock.still_held():
            continue
        holder = pidlock.read_holder(lock.path)
        if holder:  # taken over: this process was stopped (Ctrl-Z, a frozen VM) past the lease, and another started
            raise CheckpointSaveFailed(f"{key}={lock.path.parent}: another trainer holds its run lock now "
                                       f"({pidlock.describe(holder)}); step {step} was not saved, the directory is "
                                       f"left to it")
        lost.setdefault(f"{key}={lock.path.parent}", []).append("run lock")
    gone = [f"{where} lost its {' and its '.join(what)}" for where, what in lost.items()]
    if gone:
        raise CheckpointSaveFailed(f"{'; '.join(gone)} while training (removed, moved or emptied); step {step} was "
                                   f"not saved (a step without the run's metadata can be neither merged nor resumed)")


def profile_window(cfg: RunConfig, run_dir: Path, ckpt_dir: Path) -> Path | None:
    """Where this session's profiler trace goes (train.profile_dir, relative to the run dir), or None: no
    profiling, or a resumed run whose remaining steps end before the profiled window starts."""
    t = cfg.train
    if t.profile_dir is None:
        return None
    steps = checkpoint.list_steps(ckpt_dir)
    left = t.max_steps - (steps[-1] if steps else 0)
    if t.profile_skip_steps >= left:
        log.warning("not profiling: train.profile_skip_steps=%d is not below the %d step(s) left to train",
                    t.profile_skip_steps, left)
        return None
    import jax

    out = (run_dir / t.profile_dir).resolve()
    if jax.process_index() == 0:
        first = (steps[-1] if steps else 0) + t.profile_skip_steps + 1
        last = min(first + t.profile_steps - 1, t.max_steps)
        log.info("profiling %s into %s", f"steps {first}..{last}" if last > first else f"step {first}", out)
    return out


def effective_remat(cfg: RunConfig) -> str:
    """`train.remat`, or the older `model.remat` when train.remat is not set."""
    return cfg.train.remat or cfg.model.remat


def check_batch_divisible(cfg: RunConfig, mesh_sizes: dict[str, int], process_count: int) -> None:
    """The global batch is split over (data, fsdp); an indivisible batch would be silently replicated
    by Tunix (every device computing every example), which across processes is wrong, not just slow."""
    warning = mesh_lib.check_batch_layout(cfg.train.batch_size, mesh_sizes, process_count)
    if warning:
        log.warning(warning)


def _install_sigterm(trainer, put_back: Callable[[], None]):
    """On SIGTERM (TPU preemption notice) finish the step in progress, save it, release the run lock and
    exit 143; at a batch boundary, so the saved step is exactly a step (gemma_tpu.train.preempt). `put_back`
    (`put_back_record`) runs first: a stop before this session saved a step keeps the record of the run that did."""
    from gemma_tpu.train.preempt import Preemption  # deferred: imports jax (through Tunix)

    def on_exit() -> None:
        try:
            put_back()
        finally:
            run_lock.release_all()

    return Preemption(trainer, on_exit=on_exit).install()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv or [])
    cfg = cli.run_config(args, required=not args.print_config)
    if cfg is None:
        return 0
    if args.dry_run:
        return plan.run_dry(cfg, devices=args.devices, assumed_mfu=args.assumed_mfu, compile_check=not args.no_compile)
    cli.setup_logging()
    from gemma_tpu.train.finite_guard import CheckpointSaveFailed

    # until the preemption handler takes over (data preparation, model load, restore: minutes), SIGTERM's
    # default action ended the process where it stood, leaving the run lock for another host to wait out; the
    # caller's handlers come back at the end (an in-process caller kept ours, and the preemption handler's)
    # (SIGHUP too, a closed terminal: it ended the run where it stood, the lock left behind; not where ignored: nohup)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, raise_signal_exit)
    if handlers[signal.SIGHUP] is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, raise_signal_exit)
    try:
        run(cfg)
    except CheckpointSaveFailed as e:
        # Orbax's writer threads go on failing and reporting it (hundreds of lines of tracebacks while the
        # interpreter shuts down, burying this line): say it once, last, and leave at once. The failed save's
        # temp dir goes first (by process 0, which holds the run lock): it kept the space a full disk had left
        import jax

        from gemma_tpu.train.finite_guard import remove_failed_saves

        logging.disable(logging.CRITICAL)
        threading.excepthook = lambda args: None
        if e.directory is not None and jax.process_index() == 0:
            remove_failed_saves(e.directory)
        run_lock.release_all()
        logging.shutdown()
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(e.exit_code)
    finally:
        run_lock.release_all()
        for signum, handler in handlers.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    return 0
