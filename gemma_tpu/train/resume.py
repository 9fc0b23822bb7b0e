"""What a run on an existing `checkpoint.dir` must agree with to resume it, checked before anything loads or is
written: by the run (`gemma_tpu.train.run`) and by `--dry-run` (`gemma_tpu.train.plan`), which planned a resume
the run then refused (another LoRA rank, batch or data) as one that fits."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from gemma_tpu.checkpoint import metadata as checkpoint
from gemma_tpu.checkpoint.metadata import METADATA_FILE, read_metadata, step_of
from gemma_tpu.core.config import RunConfig
from gemma_tpu.core.errors import UserError
from gemma_tpu.hf.fingerprint import check_base

log = logging.getLogger("gemma_tpu.train")


def check_resume_compatible(ckpt_dir: Path, meta: dict, allow_base_mismatch: bool = False) -> None:
    """A checkpoint directory from another base, family, rank or target set, or whose optimizer state has
    another tree (`optim.state_layout`), is refused. The base is
    compared by its weights' fingerprint (gemma_tpu.hf.fingerprint) where the run recorded one, else
    by its path."""

    entries = sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []
    padded = [p for p in entries if p.name.isascii() and p.name.isdigit() and step_of(p.name) is None]
    if padded:  # taken for step 4 here (its files looked for in `4`), not a step at all to Orbax
        raise UserError(f"{padded[0]}: named like checkpoint step {int(padded[0].name)}, but Orbax reads a step only "
                        f"by its plain number: rename it {int(padded[0].name)}, or move it out of checkpoint.dir")
    files = sorted((p for p in entries if step_of(p.name) is not None and not p.is_symlink() and not p.is_dir()),
                   key=lambda p: step_of(p.name))
    if files:  # Orbax deleted it without a word as it saved that step: the user's file was lost
        raise UserError(f"{files[0]}: a file named like a checkpoint step, not a step directory; saving step "
                        f"{step_of(files[0].name)} would replace it: move it out of checkpoint.dir")
    foreign = [(p, names) for p in entries if step_of(p.name) is not None and p.is_dir() and not p.is_symlink()
               and not checkpoint.is_complete_step(p) and (names := checkpoint.foreign_entries(p))]
    if foreign:  # Orbax took it for a step, and deleted it with what it held as max_to_keep dropped old steps
        p, names = foreign[0]
        raise UserError(f"{p}: a directory named like checkpoint step {step_of(p.name)} that is not one (it holds "
                        f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}, which no save writes); Orbax "
                        f"takes it for a step and deletes it with its files as checkpoint.max_to_keep drops old "
                        f"steps: move it out of checkpoint.dir")
    if not (ckpt_dir / METADATA_FILE).is_file():
        if any(step_of(p.name) is not None for p in entries):
            raise UserError(f"{ckpt_dir}: has checkpoint steps but no {METADATA_FILE}; refusing to mix runs")
        return
    links = sorted((p for p in entries if step_of(p.name) is not None and p.is_symlink()),
                   key=lambda p: step_of(p.name))
    if links:  # taken for a step: resumed from without a word, and Orbax's clean-up (max_to_keep) failed on it
        raise UserError(f"{links[0]}: a symbolic link named like a checkpoint step (to {os.readlink(links[0])}); a "
                        f"run's steps are its own directories (Orbax cannot delete a link when checkpoint.max_to_keep "
                        f"drops the step): copy the step in its place, or remove the link")
    steps = checkpoint.list_steps(ckpt_dir)
    if not steps:
        # a run stopped before its first save (killed while its data was prepared, the model loaded or the step
        # compiled) left only this file: there is nothing to resume, so nothing of its settings to keep. Another
        # lora.rank, dtype or base was refused as "checkpoint was trained with ...", naming a checkpoint that was
        # never written; the run starts afresh and the file is rewritten with this run's settings
        log.info("%s: no checkpoint step saved yet (the run that wrote %s stopped before its first save); "
                 "starting afresh with this run's settings", ckpt_dir, METADATA_FILE)
        return
    old = read_metadata(ckpt_dir)
    # a section missing from a damaged or hand-edited file (read_metadata lets absent keys pass) was a KeyError
    # traceback; compared as unset instead, it is refused naming the key
    old_base, old_lora = old.get("base_model") or {}, old.get("lora") or {}
    if not old_lora:  # null, {} or absent: taken for what the step holds, as the converters take it; a full fine-tune
        # recording `"lora": null` was refused as "trained with lora.enabled=null, this run has false"
        from gemma_tpu.checkpoint.params import CheckpointParams
        from gemma_tpu.checkpoint.restore import lora_config  # deferred: imports the models

        # LoRA factors whose rank, alpha and targets nobody recorded are refused so
        lora_config(ckpt_dir, old, steps[-1], CheckpointParams(ckpt_dir, steps[-1]).holds_lora_factors)
        old_lora = {"enabled": False}

    recorded = old_base.get("fingerprint")
    check_base(recorded, meta["base_model"]["local_dir"], allow_base_mismatch,
               "set checkpoint.allow_base_mismatch=true", lambda msg: log.warning("%s: %s", ckpt_dir, msg))
    pairs = [] if recorded else [
        ("base model", old_base.get("local_dir"), meta["base_model"]["local_dir"])]
    pairs += [
        ("family", old_base.get("family"), meta["base_model"]["family"]),
        ("lora.enabled", old_lora.get("enabled"), meta["lora"]["enabled"]),
    ]
    if old_lora.get("enabled") is not False:  # a full fine-tune's LoRA settings are unused: not compared
        pairs += [
            ("lora.rank", old_lora.get("rank"), meta["lora"]["rank"]),
            ("lora.alpha", old_lora.get("alpha"), meta["lora"]["alpha"]),
            ("lora.targets", sorted(old_lora.get("targets", [])), sorted(meta["lora"]["targets"])),
        ]
    pairs.append(("model.dtype", old.get("dtype"), meta["dtype"]))
    if "base_quantization" in old_lora and old_lora.get("enabled") is not False:  # the base the factors were trained
        # against (QLoRA), as model.dtype is
        pairs.append(("lora.base_quantization", old_lora["base_quantization"], meta["lora"]["base_quantization"]))
    # optimizer settings that change the saved optimizer state's tree: Orbax's restore failed after the
    # model loaded, with advice to move a sound step aside
    from gemma_tpu.train.optim import state_layout  # deferred: imports optax

    old_config = old.get("config", {})  # `"config": null` was an AttributeError traceback
    if not isinstance(old_config, dict):
        raise UserError(f"{ckpt_dir / METADATA_FILE}: config is not a mapping (the file is damaged or was edited)")
    old_train, new_train = old_config.get("train", {}), meta["config"]["train"]
    if not isinstance(old_train, dict):  # `"train": null` was not checked at all
        raise UserError(f"{ckpt_dir / METADATA_FILE}: config.train is not a mapping (the file is damaged or was "
                        f"edited)")
    # runs recorded before the whole config was are not checked
    if "optimizer" in old_train:
        try:
            was_layout = state_layout(old_train)
        except TypeError:  # `"grad_accum_steps": "2"`: a TypeError traceback
            raise UserError(f"{ckpt_dir / METADATA_FILE}: config.train holds a value of the wrong type (the file is "
                            f"damaged or was edited)") from None
        now_layout = state_layout(new_train)
        pairs += [(key, old_train.get(key.split(".")[1]), new_train.get(key.split(".")[1]))
                  for key in was_layout if was_layout[key] != now_layout[key]]
    for what, was, now in pairs:
        if was != now:  # the values as an override gives them: "lora.enabled=True, this run has False" was Python's
            raise UserError(f"{ckpt_dir}: checkpoint was trained with {what}={as_override(was)}, this run has "
                            f"{as_override(now)}; {resume_hint(what, was)}use another checkpoint.dir")
    warning = steps and steps[-1] < new_train["max_steps"] and learning_rate_warning(old_train, new_train, steps[-1])
    if warning:
        log.warning("%s: %s", ckpt_dir, warning)


NULLABLE = ("lora.base_quantization", "train.grad_clip", "train.optimizer")  # keys whose null is a setting


def resume_hint(what: str, was: Any) -> str:
    """How to resume a checkpoint refused for `what` (a key of check_resume_compatible's pairs) having been `was`:
    the override that sets it back, as the data position's refusal says 'resume with the data and settings it was
    saved with'. Nothing where the record holds no value (a damaged file): another checkpoint.dir is the way."""
    if was is None and what not in NULLABLE:
        return ""
    if what == "family":  # the base's own, not a setting
        return f"resume it with a {was} base (model.path), or "
    key = "model.path" if what == "base model" else what
    return f"resume it with {key}={as_override(was)}, or "


def as_override(value: Any) -> str:
    """`value` as a `key=value` override spells it: true, false, null, [a,b]."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


SCHEDULE_KEYS = ("learning_rate", "schedule", "warmup_steps", "min_lr_ratio", "max_steps")


def learning_rate_warning(old_train: dict, new_train: dict, step: int) -> str | None:
    """One line when a resume at `step` changes the learning rate there (None otherwise): the schedule is
    recomputed from this run's `train.*`, so a longer train.max_steps re-stretched a decayed cosine or linear
    schedule and the resumed run jumped from its floor back to mid-schedule without a word."""
    import types

    from gemma_tpu.train.optim import make_schedule  # deferred: imports optax

    if all(old_train.get(k) == new_train[k] for k in SCHEDULE_KEYS):
        return None
    try:  # a run recorded before these settings were, or a damaged record: nothing to compare
        was, now = (float(make_schedule(types.SimpleNamespace(**{k: t[k] for k in SCHEDULE_KEYS}))(step))
                    for t in (old_train, new_train))
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    if abs(was - now) <= 1e-3 * max(abs(was), abs(now), 1e-12):
        return None
    changed = ", ".join(f"train.{k} {old_train[k]} -> {new_train[k]}" for k in SCHEDULE_KEYS
                        if old_train[k] != new_train[k])
    return (f"the learning rate at step {step}, where this run resumes, was {was:.3g} and is now {now:.3g} ({changed}:"
            f" the schedule is recomputed for this run's settings)")


def check_data_position(cfg: RunConfig, train_split: Any) -> None:
    """The latest step's data position names these rows, batch, seed and order (`data.check_layout`)."""
    from gemma_tpu import data  # deferred: imports the tokenizer stack
    from gemma_tpu.data.pipeline import position

    saved = checkpoint.saved_data_layout(cfg.checkpoint.dir)
    if saved is not None:
        data.check_layout(saved[1], data.stream_layout(train_split, cfg.train.batch_size, cfg.train.seed,
                                                       cfg.data.shuffle, cfg.data.num_epochs), str(saved[0]),
                          position(saved[2], str(saved[0])), data_settings_changed(cfg))


# data.* keys that do not shape the training rows, or that the stored layout itself compares
NOT_ROW_SHAPING = ("eval_path", "eval_max_batches", "num_epochs", "shuffle")


def data_settings_changed(cfg: RunConfig) -> list[str]:
    """'data.seq_len 192 -> 256': the data settings of this run that differ from those recorded in the checkpoint's
    gemma_tpu_run.json (none where it records none, or cannot be read)."""
    try:
        old = read_metadata(cfg.checkpoint.dir).get("config", {}).get("data")
    except (UserError, AttributeError):
        return []
    if not isinstance(old, dict):
        return []
    now = cfg.to_dict()["data"]
    return [f"data.{k} {old[k]} -> {v}" for k, v in now.items()
            if k not in NOT_ROW_SHAPING and k in old and old[k] != v]


def data_used_up(cfg: RunConfig, train_split: Any) -> bool:
    """Whether the latest step's data position is at the end of a finite stream (`data.num_epochs`), or less than
    one optimizer step (train.grad_accum_steps micro-batches) before it: a run that ended because its data ran out,
    before train.max_steps, on which a rerun has nothing left to train."""
    from gemma_tpu.data.pipeline import position

    epochs = cfg.data.num_epochs
    saved = checkpoint.saved_data_layout(cfg.checkpoint.dir) if epochs is not None else None
    read = position(saved[2], str(saved[0])) if saved is not None else None
    left = len(train_split.rows) * epochs // cfg.train.batch_size - read if read is not None else None
    return left is not None and left < max(1, cfg.train.grad_accum_steps)


def restore_failure(ckpt_dir: Path, step: int, model, kind, old: dict, new: dict, error: BaseException) -> UserError:
    """Why restoring `step` into `model` (its `kind` params: nnx.LoRAParam, or every param) failed, as one line.

    Moving the step aside helps only where the step itself is at fault (files missing, cut short, unreadable).
    A sound step whose tensors do not fit this run's model (another base shape let through by
    checkpoint.allow_base_mismatch, say) fails the same way at every step: that is said, naming the first
    tensor that differs and the settings this run (`new`: its metadata, `checkpoint.build_metadata`) differs in
    from the one that wrote the checkpoint (`old`: its metadata, as it was before this run started)."""
    from gemma_tpu.checkpoint.params import CheckpointParams, short_reason
    from gemma_tpu.train.partition import flat_params

    step_dir = ckpt_dir / str(step)
    aside = "move it aside to resume from the one before"
    try:
        saved = {name: spec.shape for name, spec in CheckpointParams(ckpt_dir, step).specs.items()}
    except UserError as e:
        return UserError(f"{step_dir}: cannot restore this checkpoint step ({e}); {aside}")
    from flax import nnx  # deferred: imports jax

    state = nnx.state(model, kind) if kind is not None else nnx.state(model)
    have = {path: tuple(value.shape) for path, value in flat_params(state)}
    misfit = next((f"{name} is saved with shape {saved[name]}, this run's model has {shape}"
                   for name, shape in have.items() if name in saved and saved[name] != shape), None)
    if misfit is None and saved.keys() != have.keys():
        name = min(saved.keys() ^ have.keys())
        misfit = f"{name} is {'in the step but not in' if name in saved else 'in'} this run's model" + (
            "" if name in saved else " but not in the step")
    if misfit is None:
        return UserError(f"{step_dir}: cannot restore this checkpoint step ({short_reason(error)}); {aside}")
    differs = _settings_that_differ(old, new)
    return UserError(f"{step_dir}: the checkpoint does not fit this run ({misfit}); "
                     + (f"this run differs from the one that wrote it in {differs}; " if differs else "")
                     + "moving the step aside will not help: resume with that run's settings or use another "
                       "checkpoint.dir")


_NOT_SHAPES = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "auto_map"}


def _settings_that_differ(old: dict, new: dict, limit: int = 3) -> str:
    """'model.path (a -> b), the base's config.json intermediate_size (128 -> 256)': the run's config keys and
    the base's config.json keys that differ between a checkpoint's metadata and this run's, those that decide
    the tensors' shapes first."""

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix[:-1]: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            if k not in _NOT_SHAPES:
                out.update(flat(v, f"{prefix}{k}."))
        return out

    items = []
    for where, a, b in (("", old.get("config"), new.get("config")),
                        ("the base's config.json ", old.get("hf_config"), new.get("hf_config"))):
        fa, fb = flat(a or {}), flat(b or {})
        items += [f"{where}{k} ({fa[k]} -> {fb[k]})" for k in fa if k in fb and fa[k] != fb[k]]
    items.sort(key=lambda item: not item.startswith(("model.", "lora.", "the base's")))  # what shapes the tensors
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")

