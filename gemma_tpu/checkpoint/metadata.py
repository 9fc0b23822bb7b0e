"""The on-disk checkpoint format: Orbax step directories plus one self-describing JSON file.

Layout under `checkpoint.dir`:

    gemma_tpu_run.json        base model (spec, local dir, revision, family, config.json), LoRA
                              (rank, alpha, targets), dtype and the whole run config
    <step>/model_params       Orbax PyTree: LoRA params (or every param for a full fine-tune),
                              nested as layers/<i>/<tunix module>/<weight>_lora_{a,b}/value
    <step>/optimizer_state    Orbax PyTree: optimizer state
    <step>/_CHECKPOINT_METADATA  Orbax's JSON; its `custom_metadata`: step, data-iterator state and layout, seed

Tunix's CheckpointManager writes the step directories; this module owns the metadata file and the
readers that the merger, the exporter and `convert.inspect` use without building a model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import typing
from pathlib import Path
from typing import Any

import numpy as np

from gemma_tpu.checkpoint.params import CheckpointParams
from gemma_tpu.core.atomic import write_text_atomic
from gemma_tpu.core.config import ModelConfig
from gemma_tpu.core.errors import UserError, read_json_object
from gemma_tpu.hf.directory import ADAPTER_RECORD, MERGE_RECORD, RUN_RECORD, hf_revision
from gemma_tpu.hf.fingerprint import fingerprint

log = logging.getLogger("gemma_tpu.checkpoint")

METADATA_FILE = RUN_RECORD
FORMAT = "gemma-tpu-checkpoint"
VERSION = 1


def write_metadata(ckpt_dir: str | Path, meta: dict[str, Any]) -> Path:
    """Atomically write the metadata file (`core.atomic`: a full disk is one line naming it, and leaves
    neither a cut-short file nor the temp file, which the own tmp + rename here used to leave behind)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(ckpt_dir / METADATA_FILE,
                             json.dumps({"format": FORMAT, "version": VERSION, **meta}, indent=2, default=str))


def step_holding(path: Path) -> tuple[Path, int] | None:
    """(checkpoint directory, step) when `path` is one of a checkpoint's step directories (`runs/x/64`) or lies
    inside one (`runs/x/64/model_params`, where the tensors are), else None. A relative path is followed up through
    its absolute form too (`.` given from inside a step)."""
    absolute = Path(os.path.abspath(path))
    for p in (path, *path.parents, *((absolute, *absolute.parents) if absolute != path else ())):
        if p.name.isascii() and p.name.isdigit() and (p.parent / METADATA_FILE).is_file():
            return p.parent, int(p.name)
    return None


def not_a_checkpoint(ckpt_dir: Path) -> str:
    """Why `ckpt_dir` is no checkpoint directory; one of its step directories (`runs/x/64`, the one that
    holds the weights), or a directory inside one, is named as such, with what to give instead."""
    held = step_holding(ckpt_dir)
    if held is not None:
        run, step = held
        if os.path.abspath(run) == os.path.dirname(os.path.abspath(ckpt_dir)):
            return f"{ckpt_dir} is step {step} of the checkpoint directory {run}: give {run} (and --step {step})"
        return (f"{ckpt_dir} is inside step {step} of the checkpoint directory {run}: give {run}, not {ckpt_dir} "
                f"(and --step {step})")
    for marker, what in (("adapter_config.json", "a PEFT adapter directory"),
                         ("config.json", "a Hugging Face model directory")):
        if (ckpt_dir / marker).is_file():  # a merge's or an export's output (or a base) given for the training run
            said = f"{ckpt_dir} is {what} ({marker}), not a gemma-tpu training checkpoint (no {METADATA_FILE})"
            made = _made_from(ckpt_dir)
            if made is None:
                return f"{said}: give the run's checkpoint.dir"
            run, step = made
            return f"{said}: it was made from {run if step is None else f'step {step} of {run}'}; give {run}"
    return f"{ckpt_dir}: no {METADATA_FILE} (not a gemma-tpu checkpoint directory)"


def _made_from(out_dir: Path) -> tuple[str, int | None] | None:
    """(checkpoint dir, step) as the merge or the PEFT export recorded them in `out_dir`; None without a record."""
    for record in (MERGE_RECORD, ADAPTER_RECORD):
        try:
            made = json.loads((out_dir / record).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(made, dict) and isinstance(made.get("checkpoint"), str):
            step = made.get("step")
            return made["checkpoint"], step if isinstance(step, int) and not isinstance(step, bool) else None
    return None


def read_metadata(ckpt_dir: str | Path) -> dict[str, Any]:
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.exists() and not ckpt_dir.is_dir():  # "does not exist" sent users looking for a typo
        raise UserError(f"checkpoint directory {ckpt_dir} is a file, not a directory (give the run's "
                        f"checkpoint.dir, which holds {METADATA_FILE})")
    if not ckpt_dir.is_dir():
        raise UserError(f"checkpoint directory {ckpt_dir} does not exist")
    path = ckpt_dir / METADATA_FILE
    # the "not a checkpoint" message looks about (parents, a merge's record): built only where the file is missing
    meta = read_json_object(path, f"{path}: missing" if path.is_file() else not_a_checkpoint(ckpt_dir))
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    check_metadata(path, meta)
    return meta


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))


_DTYPES = typing.get_args(typing.get_type_hints(ModelConfig)["dtype"])  # model.dtype's choices


# What `build_metadata` writes, as (key path, test, what it must be): a damaged or hand-edited file with another
# value died in an AttributeError or TypeError traceback (`"lora": [...]`, `"base_model": "x"`), or was used:
# lora.rank 4.7 merged at alpha/4.7 with factors of rank 4, lora.alpha "nan" wrote a model of NaNs, lora.alpha
# "8" went into adapter_config.json as a string, lora.targets "q_proj" was read as the targets q, _, p, ...
_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("base_model", lambda v: isinstance(v, dict), "an object"),
    ("hf_config", lambda v: isinstance(v, dict), "an object"),
    ("lora", lambda v: isinstance(v, dict), "an object"),
    ("config", lambda v: isinstance(v, dict), "an object"),
    ("base_model.path", lambda v: isinstance(v, str), "a string"),
    ("base_model.local_dir", lambda v: isinstance(v, str), "a string"),
    ("base_model.revision", lambda v: isinstance(v, str), "a string"),
    ("base_model.family", lambda v: isinstance(v, str), "a string"),
    ("base_model.fingerprint", lambda v: isinstance(v, dict), "an object"),
    # its entries are read by name (`gemma_tpu.hf.fingerprint.first_difference`): a TypeError traceback otherwise
    ("base_model.fingerprint.files", lambda v: isinstance(v, list) and all(isinstance(e, dict) and isinstance(
        e.get("name"), str) for e in v), "a list of files (objects with a name)"),
    ("lora.enabled", lambda v: isinstance(v, bool), "true or false"),
    ("lora.rank", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"),
    ("lora.alpha", lambda v: _is_number(v) and v > 0, "a positive number"),
    ("lora.targets", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of names"),
    ("lora.base_quantization", lambda v: isinstance(v, str), "a string"),
    # FunctionGemma markers -> the reserved tokens they were trained on (`function_token_map`), which the merge and
    # the exports install in the tokenizer: a string was an AttributeError traceback
    ("token_map", lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, str)
                                                        for k, t in v.items()), "an object of marker -> token names"),
    # the run's own LoRA dropout, which the PEFT export writes into adapter_config.json: a string was a ValueError
    # traceback, 2.5 an adapter that peft refuses to load
    ("config.lora", lambda v: isinstance(v, dict), "an object"),
    ("config.lora.dropout", lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ("lora.dropout", lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    # what evaluate and chat load the model in: "fp16" was a KeyError traceback once the base was read
    ("dtype", lambda v: v in _DTYPES, " or ".join(_DTYPES)),
)


def check_metadata(path: Path, meta: dict[str, Any]) -> None:
    """Refuse, naming the key, a value of another type than the trainer writes (null and absent keys pass: older
    files lack some, a full fine-tune's LoRA fields are unused)."""
    for key, ok, what in _FIELDS:
        parent, _, name = key.rpartition(".")
        holder = meta
        for part in parent.split(".") if parent else ():
            holder = holder.get(part) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or holder.get(name) is None:
            continue
        if parent == "lora" and holder.get("enabled") is False:
            continue
        if not ok(holder[name]):
            raise UserError(f"{path}: {key}={holder[name]!r} is not {what} (the file is damaged or was edited)")


# Orbax writes both into a step before it publishes it (rename on local disks; on object stores the
# commit file is the only sign that a step is finished).
COMMIT_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt")


# the items Tunix's CheckpointManager saves into a step directory, beside Orbax's markers
STEP_ITEMS = ("model_params", "optimizer_state")


def foreign_entries(step_dir: Path) -> list[str]:
    """The names at the top of `step_dir` (a directory named like a step) that no save writes there: the commit
    markers, the items and Orbax's temporary names are a step's, or what a save or a clean-up cut short left of
    one; anything else (`notes.txt`, `data/`) is someone's own, which Orbax deletes with the directory as it
    drops old steps (checkpoint.max_to_keep)."""
    try:
        names = sorted(p.name for p in step_dir.iterdir())
    except OSError:
        return []
    return [n for n in names if n not in COMMIT_MARKERS and n not in STEP_ITEMS and ORBAX_TMP not in n]


def step_of(name: str) -> int | None:
    """The step of an entry of `checkpoint.dir` named `name`, as Orbax names step directories (`4`), else None: Orbax
    reads neither `04` (taken here for step 4, whose files were then looked for in `4`) nor `²` (str.isdigit's, a
    ValueError traceback from int())."""
    return int(name) if name.isascii() and name.isdigit() and str(int(name)) == name else None


def is_complete_step(p: Path) -> bool:
    return (p.is_dir() and step_of(p.name) is not None and (p / "model_params").is_dir()
            and all((p / m).is_file() for m in COMMIT_MARKERS))


def list_steps(ckpt_dir: str | Path) -> list[int]:
    """Completed steps (Orbax marks a finished step with its metadata and commit files)."""
    steps = []
    for p in Path(ckpt_dir).iterdir() if Path(ckpt_dir).is_dir() else []:
        if is_complete_step(p):
            steps.append(int(p.name))
    return sorted(steps)


def saved_data_layout(ckpt_dir: str | Path) -> tuple[Path, dict[str, Any] | None, Any] | None:
    """(latest complete step dir, the data layout stored with its data position, the position) or None without
    steps; the layout is None for steps saved before layouts were stored."""
    steps = list_steps(ckpt_dir)
    if not steps:
        return None
    step_dir = Path(ckpt_dir) / str(steps[-1])
    meta = read_json_object(step_dir / COMMIT_MARKERS[0], f"{step_dir}: no {COMMIT_MARKERS[0]}")
    custom = meta.get("custom_metadata")
    custom = custom if isinstance(custom, dict) else {}
    return step_dir, custom.get("data_layout"), custom.get("data_state")


def set_aside_incomplete_steps(ckpt_dir: str | Path) -> list[Path]:
    """Rename step directories newer than the last complete step that lack Orbax's commit markers
    (a non-atomic save or a copy cut short) to `<step>.incomplete-<time>`: Orbax would take such a
    directory for the latest step and resume from it without the data position. (Older remnants, of
    a clean-up of old steps that was killed, are left to Orbax's own clean-up.)"""
    import time

    done = list_steps(ckpt_dir)
    moved = []
    for p in sorted(Path(ckpt_dir).iterdir()) if Path(ckpt_dir).is_dir() else []:
        step = step_of(p.name)
        if p.is_dir() and step is not None and step > (done[-1] if done else -1) and not is_complete_step(p):
            dest = p.with_name(f"{p.name}.incomplete-{time.time_ns()}")
            os.rename(p, dest)
            moved.append(dest)
    return moved


def set_aside_steps(ckpt_dir: str | Path) -> list[tuple[Path, int]]:
    """The step directories `set_aside_incomplete_steps` renamed, this run's and earlier ones', with their sizes in
    bytes, oldest name first. Never removed by a run (possibly the only copy of a step a copy cut short); each one
    kept the space of a whole step, unsaid after the start that set it aside."""
    out = []
    for p in sorted(Path(ckpt_dir).iterdir()) if Path(ckpt_dir).is_dir() else []:
        step, _, stamp = p.name.partition(".incomplete-")
        if step_of(step) is not None and stamp.isdigit() and p.is_dir() and not p.is_symlink():
            out.append((p, sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())))
    return out


ORBAX_TMP = ".orbax-checkpoint-tmp"  # what an Orbax save writes into until it renames it `<step>`


def unfinished_steps(ckpt_dir: str | Path, after: int = -1) -> list[int]:
    """Steps after `after` whose save did not finish: a step directory without Orbax's commit markers (a
    non-atomic save or a copy cut short), or Orbax's `<step>.orbax-checkpoint-tmp` (a save that failed, a full
    disk, or was killed; or one still in progress)."""
    out = set()
    for p in Path(ckpt_dir).iterdir() if Path(ckpt_dir).is_dir() else []:
        name = p.name.split(ORBAX_TMP, 1)[0] if ORBAX_TMP in p.name else p.name
        if p.is_dir() and step_of(name) is not None and step_of(name) > after and not is_complete_step(p):
            out.add(step_of(name))
    return sorted(out)


def remove_unfinished_saves(ckpt_dir: str | Path) -> list[tuple[Path, int]]:
    """Delete Orbax's `<step>.orbax-checkpoint-tmp` directories (a save that failed on a full disk, or was killed):
    Orbax never finishes one later and no resume reads it, but it kept its disk space, often what the next save
    needed. Only with the run lock held (another trainer's save in progress looks the same). Returns (path, bytes)."""
    import shutil

    removed = []
    for p in sorted(Path(ckpt_dir).iterdir()) if Path(ckpt_dir).is_dir() else []:
        if ORBAX_TMP in p.name and p.name.split(ORBAX_TMP, 1)[0].split(".", 1)[0].isdigit() and p.is_dir():
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append((p, size))
    return removed


def resolve_step(ckpt_dir: str | Path, step: int | None) -> int:
    steps = list_steps(ckpt_dir)
    unfinished = unfinished_steps(ckpt_dir, steps[-1] if steps else -1)
    if not steps:
        also = f" (step {', '.join(map(str, unfinished))}: its save did not complete)" if unfinished else ""
        raise UserError(f"{ckpt_dir}: no completed checkpoint step found{also}")
    if step is None:
        if unfinished:  # the user asked for the latest step and would otherwise not know it is not the newest
            log.warning("%s: %s incomplete (no Orbax commit markers: a save cut short or failed); using step %d, "
                        "the last complete one", ckpt_dir,
                        f"step {unfinished[0]} is" if len(unfinished) == 1 else
                        f"steps {', '.join(map(str, unfinished))} are", steps[-1])
        return steps[-1]
    if step not in steps:
        why = " its save did not complete;" if step in unfinished else ""
        raise UserError(f"{ckpt_dir}: no checkpoint for step {step} ({why} have: {', '.join(map(str, steps))})"
                        .replace("( ", "("))
    return step


def read_params(ckpt_dir: str | Path, step: int) -> dict[str, np.ndarray]:
    """Flat {'layers.0.attn.q_einsum.w_lora_a': ndarray} read straight to host memory; a missing or
    damaged file, or a non-finite tensor, is a one-line UserError naming it."""
    params = CheckpointParams(ckpt_dir, step)
    return params.read(params.names())


def build_metadata(run_config: Any, resolved: Any) -> dict[str, Any]:
    """What a checkpoint needs to describe itself: base model, family, LoRA shape, dtype, config."""

    return {
        "base_model": {
            "path": resolved.spec,
            "local_dir": str(Path(resolved.local_dir).resolve()),
            "revision": resolved.revision or hf_revision(resolved.local_dir),
            "family": resolved.family.name,
            "fingerprint": fingerprint(resolved.local_dir),  # gemma_tpu.hf.fingerprint: is the base still the base?
        },
        "hf_config": resolved.hf_config,
        "lora": {
            "enabled": run_config.lora.enabled,
            "rank": run_config.lora.rank,
            "alpha": run_config.lora.alpha,
            "targets": list(run_config.lora.targets),
            "base_quantization": run_config.lora.base_quantization,
        },
        "dtype": run_config.model.dtype,
        "config": run_config.to_dict(),
    }
