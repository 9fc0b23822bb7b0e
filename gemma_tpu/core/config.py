"""Typed run configuration: dataclasses loaded from YAML with dotted command-line overrides.

The YAML tree mirrors the dataclass tree (`model`, `lora`, `data`, `train`, `checkpoint`, `mesh`), so
every knob is found by following names. Unknown keys and values of the wrong type are rejected
with a message naming the key and the file.
"""

from __future__ import annotations

import copy
import dataclasses
import decimal
import logging
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from gemma_tpu.core.accelerators import ACCELERATORS
from gemma_tpu.core.errors import UserError, shown, utf8_text

_log = logging.getLogger(__name__)

# host:port of the multi-process coordinator: a host name, an IPv4 address or a bracketed IPv6 one
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class ModelConfig:
    """Which base model to fine-tune and in what precision."""

    path: str = "embedded:gemma3-270m"  # local HF dir, hub id (org/name) or embedded:NAME
    revision: str | None = None  # hub revision (branch, tag or commit)
    family: str | None = None  # registry family; None: detected from config.json
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter and compute dtype
    remat: Literal["none", "block", "decoder"] = "none"  # older name of train.remat (used when that is unset)


@dataclasses.dataclass
class LoraConfig:
    """LoRA adapters through Qwix; targets are Hugging Face module names."""

    enabled: bool = True  # false: full fine-tuning of every parameter
    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = dataclasses.field(default_factory=lambda: list(ALL_TARGETS))
    dropout: float = 0.0  # on the LoRA input, training steps only (evaluation and generation never drop)
    base_quantization: Literal["nf4", "int8"] | None = None  # QLoRA: quantize the frozen base

    def __post_init__(self) -> None:
        if list(self.targets) == ["all-linear"]:  # PEFT's name for every linear layer but the output head
            self.targets = list(ALL_TARGETS)


@dataclasses.dataclass
class DataConfig:
    """Where the examples come from and how they become static-shape batches."""

    train_path: str | None = None
    eval_path: str | None = None
    # auto: by each example's keys; see gemma_tpu.data.records for the shapes
    format: Literal["auto", "messages", "prompt_completion", "sharegpt", "instruction", "text"] = "auto"
    seq_len: int = 512
    strategy: Literal["pad", "pack"] = "pad"
    overlength: Literal["truncate", "drop", "error"] = "truncate"
    loss_on: Literal["assistant", "all"] = "assistant"
    # auto: the family's format (the tokenizer's template where its vocabulary lacks Gemma 3's turn tokens);
    # template: the tokenizer's own chat template (loss spans by offsets)
    chat_format: Literal["auto", "gemma", "functiongemma", "template"] = "auto"
    # instruction-pair columns (Databricks Dolly names by default)
    instruction_field: str = "instruction"
    context_field: str | None = "context"
    response_field: str = "response"
    text_field: str = "text"  # language-modeling rows (TRL's dataset_text_field): every token trained
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat for as long as train.max_steps needs
    max_loss_tokens: int | None = None  # per-row loss buffer; None: measured from the data
    # shared prompt prefixes (issue 15): auto groups examples by the longest common prefix of their
    # token ids (loss-free tokens only) and reports the tokens sharing would save; off skips it
    share_prefix: Literal["auto", "off"] = "auto"  # on (YAML true) reads as auto
    share_prefix_min_tokens: int = 32  # shorter common prefixes do not form a group
    eval_max_batches: int | None = None


@dataclasses.dataclass
class TrainConfig:
    """Optimisation: steps, batch, optimizer and schedule."""

    max_steps: int = 100
    batch_size: int = 8
    learning_rate: float = 3e-4
    # null: adamw for LoRA, adafactor (factored second moments: memory-light) for full fine-tuning
    optimizer: Literal["adamw", "adafactor", "sgd"] | None = None
    schedule: Literal["constant", "warmup_cosine", "warmup_linear"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of learning_rate
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # global-norm clipping; None disables
    grad_accum_steps: int = 1  # micro-batches of batch_size per optimizer update (Tunix/optax MultiSteps)
    # activation rematerialisation (Tunix RematConfig): none | block (attention and MLP blocks each
    # recomputed in the backward pass) | decoder (whole decoder layers); null: model.remat
    remat: Literal["none", "block", "decoder"] | None = None
    seed: int = 0
    eval_every_steps: int = 0  # also at the start and at the end; 0: only there
    log_every_steps: int = 1  # a train record in metrics.jsonl every N steps (and the last); TensorBoard: every step
    on_nonfinite: Literal["stop", "skip"] = "stop"
    run_dir: str | None = None  # metrics.jsonl and TensorBoard; default: checkpoint.dir
    # JAX profiler trace (XProf/TensorBoard `*.xplane.pb`) of a few steps, written by process 0 only; a relative
    # path is under the run dir (train.run_dir, else checkpoint.dir); null: no profiling
    profile_dir: str | None = None
    profile_skip_steps: int = 2  # steps of this session run before profiling (the first ones compile)
    profile_steps: int = 2  # optimizer steps profiled (each with all its grad_accum_steps micro-batches)
    # Weights & Biases project the metrics also go to (process 0; `wandb login` or WANDB_API_KEY first, or
    # WANDB_MODE=offline); null: none. Asked for, never implied: with wandb merely installed, every run was sent to
    # W&B (Tunix's default), and without a key it stopped with a traceback before its first step
    wandb_project: str | None = None


@dataclasses.dataclass
class CheckpointConfig:
    """Orbax checkpoints of LoRA params, optimizer state, step and data position."""

    dir: str = "runs/default"
    every_steps: int = 50
    max_to_keep: int = 3
    async_save: bool = True
    allow_base_mismatch: bool = False  # resume even if the base's weights differ from the recorded fingerprint


@dataclasses.dataclass
class MeshConfig:
    """Device mesh (see gemma_tpu.train.mesh); -1 means 'the rest of the devices'."""

    data: int = 1  # data parallelism (weights replicated)
    fsdp: int = -1  # batch split and weights sharded
    tp: int = 1  # tensor parallelism (heads / MLP width)
    dcn_data: int = 1  # slices (multi-slice data parallelism over the data-centre network)
    accelerator: str = "cpu"  # v5e | v5p | v6e | v4 | h100 | h200 | cpu (gemma_tpu.core.accelerators.ACCELERATORS)
    price_per_hour: float = 0.0  # whole slice, for cost estimates
    # multi-process: all three (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID);
    # on a TPU pod slice JAX detects them itself
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass
class RunConfig:
    """The whole run: one YAML file mirrors this tree."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- typed construction


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


class _SpelledInt(int):
    """A YAML integer that remembers how it was written: a string key given `0123` (YAML 1.1 octal), `1_000`
    or `1:30` (base 60) keeps that text, not the number's digits."""

    raw: str

    def __repr__(self) -> str:
        return self.raw


class _SpelledFloat(float):
    """A YAML float that remembers how it was written (`checkpoint.dir=2024.10` stays '2024.10', not '2024.1')."""

    raw: str

    def __repr__(self) -> str:
        return self.raw


class _LongDigits(str):
    """An unquoted integer with more digits than Python converts (4,300): kept as its text, refused as too large."""


def _spelled(value: Any, raw: str) -> Any:
    """`value` (what YAML read from `raw`) carrying its spelling when it is a number."""
    kind = {int: _SpelledInt, float: _SpelledFloat}.get(type(value))
    if kind is None:
        return value
    out = kind(value)
    out.raw = raw.strip()
    return out


def _plain(value: Any) -> Any:
    """A spelled number as the plain number (what the config holds)."""
    if isinstance(value, _SpelledInt):
        return int(value)
    if isinstance(value, _SpelledFloat):
        return float(value)
    return value


def _refuse_yaml11_spelling(value: Any, where: str) -> None:
    """Refuse an integer that only YAML 1.1 reads as written: `010` is octal 8 (YAML 1.2, JSON and Python 3 read
    ten or refuse it) and `1:30` is base 60 (90): train.seed=010 ran with seed 8, lora.alpha=016 was 14."""
    raw = getattr(value, "raw", "").replace("_", "")
    if re.fullmatch(r"[-+]?0[0-7]+", raw):
        raise UserError(f"{where}: {value!r} is octal to YAML 1.1 ({_plain(value)}); write {_plain(value)}, or "
                        f"{int(raw, 10)} without the leading zero")
    if ":" in raw:
        raise UserError(f"{where}: {value!r} is a base-60 number to YAML 1.1 ({_plain(value)}); write the number "
                        f"itself")


def _whole_number(value: Any, where: str) -> int:
    """An integer key's value: an int, or a number written as a float or in scientific notation that is a
    whole number (`1e3` -> 1000, `2.0` -> 2; YAML 1.1 reads `1e3` as a string), read exactly from its text."""
    if isinstance(value, int) and not isinstance(value, bool):
        _refuse_yaml11_spelling(value, where)
        return int(value)
    if isinstance(value, (float, str)):
        try:
            number = decimal.Decimal(str(getattr(value, "raw", value)).strip())
        except decimal.InvalidOperation:
            number = None
        if number is not None and number.is_finite() and number.adjusted() > 100:  # 1e999999999: no such int
            raise UserError(f"{where}: {shown(value)} is too large for an integer")
        if number is not None and number.is_finite():
            if number == number.to_integral_value():
                return int(number)
            raise UserError(f"{where}: expected an integer, got {shown(value)} (not a whole number)")
    raise UserError(f"{where}: expected an integer, got {shown(value)}")


def _expected(where: str, kind: str, value: Any, tp: type) -> str:
    """The one wrong-type message of a number or boolean key: `{where}: expected {kind}, got {value}`. A quoted value
    is text to YAML whatever it spells, in the file as in an override (parsed as a YAML scalar): `max_steps: '5'`
    ran 5 steps where `async_save: 'true'` was refused; both are refused now, saying to drop the quotes."""
    hint = ""
    if isinstance(value, str):
        try:
            unquoted = yaml.load(value, Loader=_UniqueKeyLoader)  # safety: a SafeLoader
        except yaml.YAMLError:
            unquoted = None
        if isinstance(unquoted, tp) and not (tp is not bool and isinstance(unquoted, bool)) or \
                tp is float and isinstance(unquoted, int) and not isinstance(unquoted, bool):
            hint = f" (quoted, so text to YAML; write it without the quotes: {value.strip()})"
    return f"{where}: expected {kind}, got {shown(value)}{hint}"


_YAML_BOOL_HINT = " (YAML reads a bare yes/no/on/off/true/false as a boolean; quote it if you meant the word)"


def _did_you_mean(value: str, words: Sequence[str]) -> str:
    """' (did you mean 'pack'?)' for a choice written in another case or misspelt, else ''."""
    import difflib

    same = [w for w in words if w.lower() == value.strip().lower()]
    close = same or difflib.get_close_matches(value.strip().lower(), list(words), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_NULL_TEXTS = ("none", "null")  # null as Python spells it, or YAML's null quoted (`profile_dir: 'null'`)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`, with the few coercions YAML needs."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if value is None and origin not in (typing.Union, types.UnionType) and not dataclasses.is_dataclass(tp):
        # `max_steps:` with nothing after the colon (or null, ~) for a key that takes no null: it was "expected an
        # integer, got None", Python's word for what the file never said
        kind = ("one of " + ", ".join(repr(a) for a in args) if origin is Literal else "a list" if origin is list
                else "a mapping" if origin is dict else
                {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, _type_name(tp)))
        raise UserError(f"{where}: null (no value given), which this key does not take; give {kind}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        choices = [c for a in args if typing.get_origin(a) is Literal for c in typing.get_args(a)]
        if isinstance(value, str) and value.strip().lower() in _NULL_TEXTS and type(None) in args \
                and value not in choices:
            # Python's spelling, or YAML's quoted: taken as text, 'None' became a directory named None
            # (train.run_dir), a revision or a family of that name; 'null' a profile directory named null
            raise UserError(f"{where}: got the text {value!r}, not null; write null (unquoted) or ~ to leave it "
                            f"unset")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except UserError as e:
                errors.append(str(e))
        if isinstance(value, str) and not value.strip() and type(None) in args:  # `train.grad_clip=` (an empty $VAR)
            raise UserError(f"{where} is empty (give a value, or null to leave it unset)")
        raise UserError(errors[0] if len(errors) == 1 else f"{where}: {shown(value)} is not a valid {_type_name(tp)}")
    if origin is Literal:
        if isinstance(value, bool) and ("off" if not value else "on") in args:
            value = "off" if not value else "on"  # YAML 1.1 reads a bare off/on (no/yes) as a boolean
        elif (value is True or value == "on") and "on" not in args and {"auto", "off"} <= set(args):
            # a choice of auto|off (data.share_prefix): `off` worked and its opposite `on` was refused (quoted too,
            # as "off" is taken quoted)
            value = "auto"
        if value not in args:
            hint = ""
            if isinstance(value, bool):  # quoting helps only when the word itself is a choice
                words = ("yes", "on", "true") if value else ("no", "off", "false")
                hint = _YAML_BOOL_HINT if any(w in args for w in words) else \
                    " (YAML reads a bare yes/no/on/off/true/false as a boolean; write one of the choices)"
            ours = FOREIGN_VALUES.get(value) if isinstance(value, str) else None
            if ours and ours.split()[0] in args:
                hint = f" (that is the transformers/TRL spelling; here it is {ours})"
            elif isinstance(value, str):  # a typo or another case: 'packed', 'Pack', 'warmup_cosin'
                hint = _did_you_mean(value, [a for a in args if isinstance(a, str)])
            raise UserError(f"{where}: {shown(value)} is not one of {', '.join(repr(a) for a in args)}{hint}")
        return value
    if origin is list:
        if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
            # a list written as text (`targets: "[q_proj, v_proj]"`, a quoted override) reads as the list YAML
            # reads unquoted; split on commas it kept the brackets ('[q_proj') and was refused
            try:  # read as the file is: numbers keep their spelling, a key twice is refused
                value = yaml.load(value, Loader=_UniqueKeyLoader)  # safety: a SafeLoader
            except yaml.YAMLError:
                raise UserError(f"{where}: {shown(value)} is not a readable list (write it [a, b])") from None
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list, got {shown(value)}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {shown(value)}")
        return {_coerce(k, args[0], where): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(_expected(where, "true/false", value, bool))
    if tp is int:
        if isinstance(value, str) and not isinstance(value, _LongDigits):
            raise UserError(_expected(where, "an integer", value, int))
        return _whole_number(value, where)
    if tp is float:
        if isinstance(value, str) and not isinstance(value, _LongDigits):
            try:  # `nan`, `inf` (text to YAML, which spells them .nan, .inf) are said to be what they are
                finite = math.isfinite(float(value))
            except ValueError:
                finite = True
            if finite:
                raise UserError(_expected(where, "a number", value, float))
        _refuse_yaml11_spelling(value, where)
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise UserError(f"{where}: expected a number, got {shown(value)}")
        if not math.isfinite(number):  # .nan / .inf in YAML, 'nan' / '1e999' as strings
            raise UserError(f"{where}: must be a finite number, got {shown(value)}")
        value = number
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return getattr(value, "raw", str(value))  # as written: 2024.10, not 2024.1
        if not isinstance(value, str):
            hint = _YAML_BOOL_HINT if isinstance(value, bool) else ""  # model.path=yes, model.revision=on
            if isinstance(value, (list, tuple)) and where in ("data.train_path", "data.eval_path"):
                hint = " (a single file is read: concatenate the files into one)"
            raise UserError(f"{where}: expected a string, got {shown(value)}{hint}")
        if "\x00" in value:  # YAML's "\0" escape: a path holding one was a ValueError traceback (embedded null byte)
            raise UserError(f"{where}: {shown(value)} holds a NUL character, which no path, name or text here can hold")
        if value == "None" or value.strip().lower() == "null":  # meant as "unset": checkpoint.dir=None (or a quoted
            # 'null') made a directory of that name
            raise UserError(f"{where}: got the text {value!r}; this key cannot be null, give it a value")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    return _plain(value)


class _UnknownKey(UserError):
    """A key no dataclass of the tree has; `load_typed` words it with the closest real key."""

    def __init__(self, dotted: str, names: list[str], hint: str = ""):
        super().__init__(f"unknown config key '{dotted}' ({hint}known: {', '.join(names)})")
        self.dotted, self.names = dotted, names


# Names a transformers / TRL / PEFT (or MaxText) recipe uses for keys of RunConfig: (our key, what to know when
# moving it[, whose name it is when not transformers/TRL])
FOREIGN_NAMES: dict[str, tuple[str, ...]] = {
    "lr": ("train.learning_rate", ""),
    "per_device_train_batch_size": ("train.batch_size", "rows per optimizer step over all devices"),
    "train_batch_size": ("train.batch_size", "rows per optimizer step over all devices"),
    "gradient_accumulation_steps": ("train.grad_accum_steps", ""),
    "max_grad_norm": ("train.grad_clip", "null: no clipping"),
    "lr_scheduler_type": ("train.schedule", ""),
    "warmup_ratio": ("train.warmup_steps", "a number of steps, not a fraction of the run"),
    "optim": ("train.optimizer", ""),
    "logging_steps": ("train.log_every_steps", ""),
    "eval_steps": ("train.eval_every_steps", ""),
    "gradient_checkpointing": ("train.remat", "block or decoder rematerialise, none does not"),
    "num_train_epochs": ("data.num_epochs", "whole epochs; train.max_steps still ends the run"),
    "output_dir": ("checkpoint.dir", ""),
    "save_steps": ("checkpoint.every_steps", ""),
    "save_total_limit": ("checkpoint.max_to_keep", ""),
    "max_seq_length": ("data.seq_len", ""),
    "max_length": ("data.seq_len", ""),
    "truncation_mode": ("data.overlength", "truncate keeps the start, as TRL's keep_start; nothing keeps the end"),
    "packing": ("data.strategy", "pack, or pad for one example a row"),
    "dataset_text_field": ("data.text_field", ""),
    "validation_file": ("data.eval_path", "a JSONL file; null: no evaluation"),  # run_clm/run_sft scripts' arguments
    "completion_only_loss": ("data.loss_on", "assistant trains the completions and assistant turns only"),
    "assistant_only_loss": ("data.loss_on", "assistant trains the assistant turns only"),
    "r": ("lora.rank", ""),
    "lora_r": ("lora.rank", ""),
    "lora_alpha": ("lora.alpha", ""),
    "target_modules": ("lora.targets", ""),
    "lora_dropout": ("lora.dropout", ""),
    "model_name_or_path": ("model.path", ""),
    "base_model": ("model.path", "an HF repo id or a local directory", "axolotl"),
    "torch_dtype": ("model.dtype", ""),
    "bf16": ("model.dtype", "bfloat16"),
    "peft": ("lora", ""),
    # a MaxText recipe's mesh (ici_*: inside a slice, dcn_*: across slices; -1 takes the rest here too)
    "ici_data_parallelism": ("mesh.data", "", "MaxText"),
    "ici_fsdp_parallelism": ("mesh.fsdp", "", "MaxText"),
    "ici_tensor_parallelism": ("mesh.tp", "", "MaxText"),
    "dcn_data_parallelism": ("mesh.dcn_data", "the number of slices", "MaxText"),
    "dcn_fsdp_parallelism": ("mesh.dcn_data", "only data parallelism crosses slices here", "MaxText"),
    "per_device_batch_size": ("train.batch_size", "rows over all devices: per_device_batch_size × devices",
                              "MaxText"),
}


# transformers/TRL/PyTorch spellings of our choice values (a recipe's `bf16`, `adamw_torch`, `cosine`): the refusal
# names ours; a value is never rewritten silently (warmup and floor differ between the two schedules' families)
FOREIGN_VALUES = {
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16", "fp32": "float32", "torch.float32": "float32",
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
    "adam": "adamw (train.weight_decay=0, the default, makes it Adam)",
    "cosine": "warmup_cosine", "cosine_with_min_lr": "warmup_cosine (with train.min_lr_ratio)",
    "linear": "warmup_linear", "constant_with_warmup": "constant (train.warmup_steps applies to every schedule)",
    # quantization (transformers' quanto/torchao `int4`, bitsandbytes' `fp4` and 4/8-bit loading): `int4` was told
    # "did you mean 'int8'?", twice the memory of the 4-bit choice
    "int4": "nf4 (the 4-bit base quantization; int8 is 8-bit)", "fp4": "nf4 (4-bit NormalFloat, as QLoRA trains)",
    "4bit": "nf4", "8bit": "int8",
    # TRL's dataset types and its completion-only loss (they had no hint at all)
    "conversational": "messages", "language_modeling": "text",
    "completion": "assistant (the completion of prompt-completion rows, the assistant turns of chats)",
    "completion_only": "assistant (the completion of prompt-completion rows, the assistant turns of chats)",
}


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass tree, sections included."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        out.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            out += _leaf_keys(tp, f"{prefix}{name}.")
    return out


# Other words for a key of a section (another tool's, or the plain English one): `checkpoint.path` was told
# 'model.path' (the same leaf in another section), `model.name`, `data.file` and `mesh.dp` got no hint or a wrong one
SYNONYMS = {
    **dict.fromkeys(("model.name", "model.id", "model.model_id", "model.repo", "model.repo_id", "model.model_name",
                     "model.name_or_path", "model.base_model", "model.hf_path", "model.dir"), "model.path"),
    **dict.fromkeys(("data.file", "data.files", "data.dataset", "data.train", "data.train_files", "data.train_data",
                     "data.dataset_path", "data.data_path"), "data.train_path"),
    **dict.fromkeys(("data.eval", "data.validation", "data.test", "data.eval_data", "data.validation_files"),
                    "data.eval_path"),
    **dict.fromkeys(("mesh.dp", "mesh.data_parallel", "mesh.data_parallelism"), "mesh.data"),
    **dict.fromkeys(("mesh.model", "mesh.tensor", "mesh.mp", "mesh.tensor_parallel", "mesh.tensor_parallelism",
                     "mesh.model_parallel"), "mesh.tp"),
    **dict.fromkeys(("checkpoint.path", "checkpoint.directory", "checkpoint.save_dir", "checkpoint.output_dir",
                     "checkpoint.ckpt_dir"), "checkpoint.dir"),
    **dict.fromkeys(("checkpoint.save_every", "checkpoint.interval", "checkpoint.save_interval",
                     "checkpoint.save_steps", "checkpoint.period"), "checkpoint.every_steps"),
    **dict.fromkeys(("checkpoint.keep", "checkpoint.keep_last", "checkpoint.max_checkpoints"),
                    "checkpoint.max_to_keep"),
    **dict.fromkeys(("train.accumulation", "train.gradient_accumulation", "train.accumulate_grad_batches"),
                    "train.grad_accum_steps"),
    **dict.fromkeys(("lora.modules", "lora.target_layers", "lora.layers"), "lora.targets"),
}

# what other tools' configs name another config to start from with (Hydra's defaults list, axolotl's and
# MMEngine's bases): no such thing here
INCLUDE_KEYS = frozenset({"defaults", "extends", "base", "_base_", "include", "includes", "inherit", "inherits"})

# keys kept for configs written before their new home, never suggested: `lora.remat` was told 'model.remat'
OLDER_NAMES = {"model.remat": "train.remat"}


def _key_hint(root: type, dotted: str, names: Sequence[str], foreign: dict[str, tuple[str, ...]]) -> str:
    """What the user probably meant by an unknown key: a recipe's name for one of ours, the same name in
    another section, or a close spelling in its own section."""
    import difflib

    keys = _leaf_keys(root)
    if dotted in keys:  # `train.max_steps: 3` at the top of a file: a key of ours, spelt as an override spells it
        section, _, leaf = dotted.partition(".")
        return f"a dotted key is for the command line; in the file nest it under its section, {section}: " \
               f"{{{leaf}: ...}}; "
    section, _, leaf = dotted.rpartition(".")
    if not section and leaf in INCLUDE_KEYS:  # Hydra's `defaults:`, other tools' `extends:` / `base:`
        return "a config does not include another here: copy the file and change its keys, or give overrides; "
    if SYNONYMS.get(dotted) in keys:
        return f"did you mean '{SYNONYMS[dotted]}'? "
    if leaf in foreign and foreign[leaf][0] in keys:
        ours, note, origin = (*foreign[leaf], "transformers/TRL")[:3]
        return f"the {origin} name; here it is '{ours}'{f' ({note})' if note else ''}; "
    elsewhere = [k for k in keys if k.rpartition(".")[2] == leaf and k != dotted and k not in OLDER_NAMES]
    # a key of its own section named '<what>_<leaf>' first: `data.path` (axolotl's datasets' path) is the data file,
    # data.train_path, where the hint named model.path alone
    own = [k for k in keys if section and k.rpartition(".")[0] == section and k.endswith(f"_{leaf}")]
    meant = [f"'{k}'" for k in (own[:2] + elsewhere[:1] if own else elsewhere[:1])]
    if meant:
        return f"did you mean {' or '.join(meant) if len(meant) < 3 else ', '.join(meant[:-1]) + ' or ' + meant[-1]}? "
    # another case first: `train.MAX_STEPS` (an environment-variable habit) shared no letter with max_steps
    close = [n for n in names if n.lower() == leaf.lower()] or \
        difflib.get_close_matches(leaf.lower(), names, n=1, cutoff=0.6)
    # the same first word and as many words, the rest named otherwise: `data.eval_file` is data.eval_path (0.56 alike
    # by difflib, under its cutoff, where train_file -> train_path passed at 0.60)
    words = leaf.lower().split("_")
    close = close or [n for n in names if len(words) > 1 and n.split("_")[0] == words[0]
                      and len(n.split("_")) == len(words)][:1]
    if close:
        return f"did you mean '{section + '.' if section else ''}{close[0]}'? "
    # a close name in another section: `train.epochs` is data.num_epochs (it had no hint at all)
    leaves = {k.rpartition(".")[2]: k for k in sorted(keys) if "." in k}
    close = difflib.get_close_matches(leaf.lower(), leaves, n=1, cutoff=0.7) if section else []
    return f"did you mean '{leaves[close[0]]}'? " if close else ""


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        # a `name=dir` pair (vLLM's --lora-modules form) or other text: the mapping's keys are named
        fields = [f"{f.name}: ..." for f in dataclasses.fields(cls) if f.init]
        hint = f" (write it {{{', '.join(fields)}}})" if isinstance(data, str) and len(fields) <= 4 else ""
        raise UserError(f"{where}: expected a mapping, got {shown(data)}{hint}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        key_where = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise _UnknownKey(key_where, sorted(names))
        kwargs[key] = _coerce(value, hints[key], key_where)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any, source: str, cls: type | None = None) -> None:
    parts = dotted.split(".")
    node = tree
    for k, p in enumerate(parts[:-1]):
        if p not in node and _is_leaf(cls, parts[:k + 1]):  # `train.max_steps.deep=1` where no file gave max_steps:
            # it was built into {'deep': 1} and blamed on "config: train.max_steps: expected an integer"
            raise UserError(f"{source}: '{dotted}' goes through '{p}', which is not a section")
        child = node.setdefault(p, {})
        if child is None and _section_type(cls, parts[:k + 1]) is not None:
            # a section left empty in the file (`train:` with every key commented out) reads as null, which
            # builds as its defaults; its keys were refused as going through "'train', which is not a section"
            child = node[p] = {}
        if not isinstance(child, dict):
            raise UserError(f"{source}: '{dotted}' goes through '{p}', which is not a section")
        node = child
    last = parts[-1]
    section = _section_type(cls, parts)
    if value is None and section is not None:
        # 'train=null' would build the section from nothing: every key the file gave back to its default
        raise UserError(f"{source}: a section takes a mapping of its keys (e.g. {dotted}={{key: value}}), not "
                        f"null, which would put every key of '{dotted}' back to its default; override its keys "
                        f"one by one")
    if isinstance(value, dict) and isinstance(node.get(last), dict) and section is not None:
        # 'train={max_steps: 3}' sets those keys of the section: replacing it would silently put every
        # other key the file gave (batch_size, learning_rate, ...) back to its default. A mapping-valued
        # key (container.env) is still replaced whole.
        for k, v in value.items():
            _set_dotted(node[last], str(k), v, source, section)
        return
    node[last] = value


def _is_leaf(cls: type | None, parts: Sequence[str]) -> bool:
    """Whether the dotted path `parts` names a key of `cls`'s tree that holds a value, not keys (neither a section nor
    a mapping such as serving's container.env)."""
    tp: Any = cls
    for part in parts:
        if tp is None or not dataclasses.is_dataclass(tp):
            return False
        tp = typing.get_type_hints(tp).get(part)
    if tp is None or dataclasses.is_dataclass(tp):
        return False
    kinds = [tp, *typing.get_args(tp)] if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    return not any(k is dict or typing.get_origin(k) is dict or dataclasses.is_dataclass(k) or k is Any for k in kinds)


def _section_type(cls: type | None, parts: Sequence[str]) -> type | None:
    """The dataclass that the dotted path `parts` names in `cls`; None for a plain value or mapping."""
    tp: Any = cls
    for part in parts:
        if tp is None or not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
    return tp if tp is not None and dataclasses.is_dataclass(tp) else None


def _override(text: str) -> str:
    """An override named in an error: its key whole, a long value cut (a 5,000-character value made a 5,000-character
    error line, the value then repeated by the message)."""
    key, eq, raw = text.partition("=")
    if len(raw) > 80:
        raw = f"{raw[:60]}... ({len(raw)} characters)"
    if len(key) > 200:
        key = f"{key[:150]}... ({len(key)} characters)"
    return f"override '{key}{eq}{raw}'"


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return False


def parse_override(text: str) -> tuple[str, Any]:
    """`train.max_steps=20` -> ("train.max_steps", 20); values are parsed as YAML scalars."""
    if "=" not in text:
        hint = ""
        if text.lower().endswith((".yaml", ".yml")) or _is_file(text):
            hint = f" (a config file is given with --config {text})"
        elif ":" in text and len(text) <= 200:
            hint = f" (write it {text.split(':', 1)[0].strip()}={text.split(':', 1)[1].strip()})"
        raise UserError(f"{_override(text)} is not of the form section.key=value{hint}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or "" in key.split("."):  # '.x', 'x.', 'train..max_steps'
        raise UserError(f"{_override(text)} has no valid key")
    try:  # read as the file is (`_UniqueKeyLoader`: numbers keep their spelling, dates stay text)
        value = _spelled(yaml.load(raw, Loader=_UniqueKeyLoader), raw) if raw.strip() else ""  # safety: a SafeLoader
    except _DuplicateKey as e:
        raise UserError(f"{_override(text)}: {e.key!r} appears twice in one mapping; YAML would keep only the "
                        f"last") from None
    except yaml.YAMLError:
        if raw.strip().startswith(("[", "{")):  # `lora.targets=[q_proj, v_proj]` unquoted: the shell split it
            if raw.strip()[0] == "[":
                raise UserError(f"{_override(text)}: {shown(raw.strip())} is an unclosed YAML list; a space splits a "
                                f"shell word, so quote the whole override ('{key}=[a, b]') or leave out the spaces "
                                f"({key}=[a,b])") from None
            # a mapping keeps its spaces (`{a:b}` is the key 'a:b'): the advice to drop them led to an unknown key
            first = raw.strip()[1:].split(":", 1)[0].strip()
            first = first if re.fullmatch(r"[A-Za-z_]\w{0,40}", first) else ""  # a key, not 5,000 characters
            one = f"{key}.{first or 'KEY'}"
            raise UserError(f"{_override(text)}: {shown(raw.strip())} is an unclosed YAML mapping; a space splits a "
                            f"shell word, so quote the whole override ('{key}={{{first or 'k'}: ...}}', the space "
                            f"after the colon kept) or set its keys one by one ({one}=...)") from None
        value = raw
    comment = _yaml_comment(raw)
    if comment is not None:
        kept = raw[:len(raw) - len(comment)].strip()
        raise UserError(f"{_override(text)}: YAML reads {comment.strip()!r} as a comment, so the value would be "
                        f"{shown(kept) if kept else 'null'}; to keep the '#', quote the value inside the override "
                        f"({key}=\"{raw.strip() if len(raw.strip()) <= 80 else '...'}\", the whole override in single "
                        f"quotes for the shell)")
    return key, value


def _yaml_comment(raw: str) -> str | None:
    """The comment YAML drops from an override's value (`checkpoint.dir='runs/exp #2'` ran in runs/exp, another run's
    directory; `data.eval_path=#1` was null: no evaluation), or None. A shell comment never reaches us."""
    if "#" not in raw:
        return None
    try:
        node = yaml.compose(raw, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None  # read as the text itself
    end = node.end_mark.index if node is not None else 0
    rest = raw[end:]
    return rest if rest.strip().startswith("#") else None


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first: int):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line, self.first = key, line, first


_NOT_NAMES = {f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "timestamp")}


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently: a
    second `train:` section would drop every key of the first)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag in _NOT_NAMES:
                    # a key is a name: `~:` was "unknown config key 'None'" (no line), `yes:` was 'True'
                    key_node.tag = "tag:yaml.org,2002:str"
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base class reports it
                    continue
        return super().construct_mapping(node, deep=deep)

    def construct_spelled_number(self, node):
        """Numbers keep their text, for the string keys they may be given to (see `_SpelledInt`)."""
        try:
            value = (self.construct_yaml_int if node.tag.endswith(":int") else self.construct_yaml_float)(node)
        except ValueError:  # more digits than Python converts to an int (4,300): a traceback; the text, checked as such
            return _LongDigits(node.value)
        return _spelled(value, node.value)


# a number YAML 1.2 (and JSON, and Python) reads that YAML 1.1 reads as text: an exponent without a dot or without a sign
# (`1e3`, `3e-4`, `1.0e5`); as text it could not be told from a quoted '1e3'
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_spelled_number)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_spelled_number)
# no key takes a date: `checkpoint.dir: 2026-01-01` (a run named by its day) or a dated `model.revision` tag
# was refused as "expected a string, got datetime.date(2026, 1, 1)"; the text as written is what was meant
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:timestamp", lambda loader, node: node.value)


# sections of the serving config (serving/config.py): a file holding them was given to a training entry point
SERVING_SECTIONS = {name: "a serving config (python -m serving.launch --config FILE)"
                    for name in ("server", "tool_calling", "container")}


# data files given as --config (a YAML config may be .json: JSON is YAML)
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".parquet", ".arrow", ".csv")


def load_typed(cls: type, path: str | Path | None, overrides: Sequence[str] = (),
               foreign: dict[str, tuple[str, ...]] | None = None, elsewhere: dict[str, str] | None = None,
               example: str = "configs/tiny.yaml") -> Any:
    """Build the dataclass tree `cls` from a YAML file (optional) and dotted overrides; `example` is a config of
    this kind the errors point to (a serving config's: the launcher's empty file was told of configs/tiny.yaml).

    The generic half of `load_config`, shared by every typed config (runs, serving): unknown keys,
    wrong types and bad YAML are one-line `UserError`s that name the file.
    """
    tree: dict = {}
    where = "config"
    if path is not None:
        p = Path(path)
        where = str(p)
        if p.is_dir():  # "not found" sent users looking for a typo in a path that exists
            raise UserError(f"config file {p} is a directory; give a YAML file (e.g. {example})")
        if p.exists() and not p.is_file():  # "not found" of a path that exists; it is read more than once
            raise UserError(f"config file {p} is not a regular file (a pipe or device, as a shell's <(...) gives); "
                            f"write the config to a file and give that")
        if not p.is_file():
            raise UserError(f"config file not found: {p}")
        if p.name.lower().endswith(DATA_SUFFIXES):  # was "not valid YAML (expected '<document start>' ...)", or
            # "unknown config key 'messages'" for a one-line JSONL
            data = " (training data is given as data.train_path=FILE)" if "data" in {f.name for f in
                                                                                      dataclasses.fields(cls)} else ""
            raise UserError(f"config file {p} is a data file, not a YAML config{data}")
        # another encoding was "not UTF-8 text (byte offset 0)", naming none (the data reader said UTF-16)
        text = utf8_text(p.read_bytes(), str(p))
        try:
            tree = yaml.load(text, Loader=_UniqueKeyLoader)  # safety: a SafeLoader subclass
        except _DuplicateKey as e:
            raise UserError(f"{p} line {e.line}: {e.key!r} appears twice in one mapping (first on line {e.first}); "
                            f"YAML would keep only the last and drop the first silently: merge them") from None
        except yaml.reader.ReaderError as e:  # a NUL or other control byte: PyYAML's message spans two lines, no line
            line = text[:e.position].count("\n") + 1
            code = ord(e.character) if isinstance(e.character, str) else e.character
            what = "a NUL byte, as a file cut short by a crash is padded" if code == 0 else "a control character"
            raise UserError(f"{p} line {line}: not valid YAML (character #x{code:04x}, which YAML does not allow in "
                            f"a file; {what})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            problem = str(getattr(e, "problem", None) or e)
            context, at = getattr(e, "context", None), getattr(e, "context_mark", None)
            if context and problem:  # "second occurrence" alone, of a duplicate anchor, or "but found another document"
                first = f" (line {at.line + 1})" if at and mark and at.line != mark.line else ""
                problem = f"{context}{first}, {problem}"
            tab = " - YAML indents with spaces, not tabs" if "'\\t'" in problem else ""
            if tab and mark and text.splitlines()[mark.line][:mark.column].strip():
                # after a key's colon or a value (`seed: 1<TAB># note`): that tab indents nothing
                tab = (" - a tab after text on its line, before a value or a comment, which PyYAML (the reader here) "
                       "refuses where YAML 1.2 allows it; write a space")
            raise UserError(f"{p}{line}: not valid YAML ({problem}{tab})") from None
        if tree is None:  # empty or only comments: a truncated or mistyped file would otherwise run on defaults
            raise UserError(f"{p}: empty config file (no sections); give a config such as {example} "
                            f"or leave --config out")
        if not isinstance(tree, dict):
            raise UserError(f"{p}: the top level must be a mapping of sections")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in _template_keys(text) - set(names):
            del tree[key]
        stray = [k for k in tree if k not in names and k in (elsewhere or {})]
        if stray:  # another tool's config: its first shared section's keys made a misleading 'unknown key'
            raise UserError(f"{p}: its '{stray[0]}' section says this is {elsewhere[stray[0]].replace('FILE', str(p))}; "
                            f"this command takes a config with the sections {', '.join(names)}")
    given: dict[str, tuple[str, Any]] = {}
    for text in overrides:
        key, value = parse_override(text)
        if key in given and given[key][1] != value:  # the last wins (Helm's --set, OmegaConf's dotlist), said:
            # a launcher's appended override silently beat the one the user typed (or the other way round)
            first, last = (_override(t).removeprefix("override ") for t in (given[key][0], text))
            _log.warning("%s is overridden twice (%s, then %s): the last wins", key, first, last)
        given[key] = (text, value)
        _set_dotted(tree, key, value, _override(text), cls)
    try:
        try:
            return _build(cls, tree, "")
        except _UnknownKey as e:  # worded with the key meant (a typo, another section, a recipe's name)
            raise UserError(str(_UnknownKey(e.dotted, e.names, _key_hint(cls, e.dotted, e.names, foreign or {}))))
    except UserError as e:
        raise UserError(f"{blame(str(e), where, overrides, key_lines(path))}: {e}") from None


def _template_keys(text: str) -> set[str]:
    """Top-level keys whose value is there to be reused: anchored and aliased elsewhere in the file (`common: &c
    {...}`, merged into sections with `<<: *c`). They were refused as unknown keys; a key nothing refers to still
    is (a misspelt section)."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(root, yaml.MappingNode):
        return set()
    merge = "tag:yaml.org,2002:merge"
    tops = {id(v): k.value for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.tag != merge}
    used: set[str] = set()
    seen: set[int] = set()
    for k, v in root.value:  # `<<: *defaults` at the top level merges a template's sections into the file's
        if k.tag == merge:
            used.update(tops[id(n)] for n in (v.value if isinstance(v, yaml.SequenceNode) else [v]) if id(n) in tops)

    def walk(node: Any) -> None:
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        for child in children:
            if id(child) in tops:  # a top-level value reached from inside another: an alias
                used.add(tops[id(child)])
            if id(child) not in seen:
                seen.add(id(child))
                walk(child)

    for _, value in root.value:
        walk(value)
    return used


def key_lines(path: str | Path | None) -> dict[str, int]:
    """The line of each dotted key in a YAML config (`{'train.max_steps': 14}`), so that an error about a
    value points into the file; empty when there is no file or it cannot be read. Keys merged with `<<`
    and reached through an alias point to where their text is."""
    if path is None:
        return {}
    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str, depth: int) -> None:
        if not isinstance(node, yaml.MappingNode) or depth > 8:  # an alias cycle ends here
            return
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                for merged in value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]:
                    walk(merged, prefix, depth + 1)
                continue
            if isinstance(key_node, yaml.ScalarNode):
                dotted = prefix + key_node.value
                lines.setdefault(dotted, key_node.start_mark.line + 1)
                walk(value_node, dotted + ".", depth + 1)

    walk(root, "", 0)
    return lines


def keys_given(path: str | Path | None, overrides: Sequence[str] = ()) -> set[str]:
    """The dotted keys (sections included) that the file or the overrides set, as opposed to defaults: for a
    command with a default of its own where a key is not given (a checkpoint runs in its training dtype)."""
    given = set(key_lines(path))
    todo = [parse_override(text) for text in overrides]
    while todo:
        key, value = todo.pop()
        given.add(key)
        if isinstance(value, dict):  # `model={dtype: bfloat16}` sets model.dtype
            todo += [(f"{key}.{k}", v) for k, v in value.items()]
    return given


def _line_of(message: str, lines: dict[str, int]) -> int | None:
    """The file line of the key `message` names first (the longest key where two start at one place): a
    dotted key anywhere, a section only as the subject (`train: expected a mapping`) or quoted."""
    found = []
    for key, line in lines.items():
        pattern = rf"(?<![\w.])({re.escape(key)})(?![\w]|\.\w)" if "." in key else \
            rf"^({re.escape(key)}):|'({re.escape(key)})'"
        m = re.search(pattern, message)
        if m:
            found.append((m.start(), -len(key), line))
    return min(found)[2] if found else None


def blame(message: str, where: str, overrides: Sequence[str], lines: dict[str, int] | None = None) -> str:
    """Where a config error comes from: the command-line override that set the key it names (the last
    one, which wins), else the file, with the line of that key when `lines` (from `key_lines`) has it."""
    unknown = re.match(r"unknown config key '([^']*)'", message)
    for text in reversed(list(overrides)):
        key = text.split("=", 1)[0].strip()
        u = unknown.group(1) if unknown else None
        if u is not None and not (key == u or key.startswith(u + ".") or u.startswith((key + ".", key + "["))):
            # only the override that set the unknown key is to blame, not the key it suggests instead (a key in a
            # list the override gave, 'lora.adapters[0].rank', was blamed on the file's line of lora.adapters)
            continue
        if key and re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message):
            return _override(text)
        parts = key.split(".")  # 'foo.bar=1' is refused as "unknown config key 'foo'": a section it created
        for n in range(1, len(parts)):
            if re.search(rf"unknown config key '{re.escape('.'.join(parts[:n]))}'", message):
                return _override(text)
    line = _line_of(message.removeprefix(where + ": "), lines or {})
    return f"{where} line {line}" if line else where


# Local paths a run reads or writes, `~` expanded: the shell leaves `checkpoint.dir=~/runs/a` alone (not a
# variable assignment), and the run wrote a directory named `~` in the working directory.
PATH_KEYS = (("data", "train_path"), ("data", "eval_path"), ("checkpoint", "dir"), ("train", "run_dir"),
             ("train", "profile_dir"))


# The optional text keys that no other check covers, with what null means: an empty value is refused like an
# empty data.eval_path (mesh.coordinator_address alone reads empty as unset: the JAX_* environment, or one host)
NULL_MEANS = {"model.revision": "the hub's default branch", "model.family": "the family config.json describes",
              "data.context_field": "no context field", "train.run_dir": "checkpoint.dir",
              "train.wandb_project": "no Weights & Biases logging"}


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML config, apply dotted overrides, and build the typed tree."""
    for text in overrides:  # `train.run_dir=~` was YAML's null: the run wrote to checkpoint.dir, not the home dir
        key, _, raw = text.partition("=")
        if raw.strip() == "~" and tuple(key.strip().split(".")) in PATH_KEYS:
            key = key.strip()
            raise UserError(f"{_override(text)}: a bare ~ is null to YAML, not the home directory; write {key}=null "
                            f"to leave it unset, or a path such as {key}=~/NAME")
    cfg = load_typed(RunConfig, path, overrides, FOREIGN_NAMES, SERVING_SECTIONS)
    if cfg.train.optimizer is None:
        cfg.train.optimizer = "adamw" if cfg.lora.enabled else "adafactor"
    where = str(path) if path is not None else "config"
    try:
        _expand_paths(cfg, where)
        validate(cfg, where)
    except UserError as e:
        origin = blame(str(e), where, overrides, key_lines(path))
        if origin == where:
            raise
        raise UserError(f"{origin}: {str(e).removeprefix(where + ': ')}") from None
    return cfg


# `$NAME`, `${NAME}`, docker compose's `${NAME:-default}` / `${NAME-default}` (the default when unset or empty / unset)
# and `${NAME:?why}` / `${NAME?why}` (refused then), and `$$`, a `$` of the path itself
_ENV_VAR = re.compile(r"\$(?:([A-Za-z_]\w*)|\{([A-Za-z_]\w*)(?:(:?[-?])([^}$]*))?\})|\$\$")


def expand_env(value: str, key: str, home: bool = True) -> str:
    """`value` (the config key `key`'s path) with its environment variables (`$HOME`, `${DATA}`, `${DATA:-/data}`)
    expanded, and with `home` a leading `~` or `~user`; a variable that is not set, or a user this machine does not
    know, is refused naming the key (the run config's paths here, the serving config's in serving.config); `$$` is a
    `$` of the path (as docker compose writes it: a directory named `$x` could not be given). Expanded once, when the
    config is read, every consumer sees the same path (serving's --print showed '~/m' where the container mounted
    /root/m) and an error names the key, not the consumer. A `${` or `$(` left that is none of these forms is refused:
    `${RUNS:-runs}/a` (a default) and `$(pwd)/a` were kept as written, a directory of that name made in the working
    directory."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(2), m.group(3), m.group(4)
        got = os.environ.get(name)
        missing = got is None or (bool(op) and op.startswith(":") and got == "")
        if op and op.endswith("-"):
            return arg if missing else got
        if op and missing:  # `${NAME:?why}`
            empty = "set but empty" if got is not None else "not set"
            raise UserError(f"{key}={value!r}: the environment variable {name} is {empty}"
                            f"{': ' + arg if arg.strip() else ''}")
        if got is None:
            raise UserError(f"{key}={value!r} names the environment variable {name}, which is not set; set it or "
                            f"write the path out ($$ for a $ of the path)")
        return got

    left = re.search(r"\$[({]", _ENV_VAR.sub("", value))
    if left:
        if left.group() == "$(":
            raise UserError(f"{key}={value!r}: '$(' is a shell's command substitution, not run here: write the path "
                            f"out ($$ for a $ of the path)")
        raise UserError(f"{key}={value!r}: '${{' starts no variable form read here ($NAME, ${{NAME}}, "
                        f"${{NAME:-default}}, ${{NAME:?message}}; $$ for a $ of the path)")
    expanded = _ENV_VAR.sub(one, value)
    if home and expanded.startswith("~"):
        expanded = os.path.expanduser(expanded)
        if expanded.startswith("~"):  # expanduser leaves a user it cannot find as it was: a directory named '~bob'
            user = expanded[1:].split("/", 1)[0]
            raise UserError(f"{key}={value!r}: {'~' + user!r} is the home directory of user {user!r}, whom this "
                            f"machine does not know; write the path out")
    return expanded


# the run's outputs: written with this machine's file operations (Orbax aside: the lock, metadata, metrics, the
# profile), so `checkpoint.dir=gs://b/run` trained into a local directory named `gs:` and failed at the first save
OUTPUT_KEYS = (("checkpoint", "dir"), ("train", "run_dir"), ("train", "profile_dir"))
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str | os.PathLike) -> bool:
    """Whether a path is a URL (`https://...`, `gs://...`, `hf://...`), not a path of this machine's disk."""
    return bool(_URL.match(str(path)))


def _refuse_url_outputs(cfg: RunConfig) -> None:
    for section, key in OUTPUT_KEYS:
        value = getattr(getattr(cfg, section), key)
        if isinstance(value, str) and is_url(value):
            raise UserError(f"{section}.{key}={value!r}: a URL; the run writes its outputs to a directory of this "
                            f"machine: give a local disk, or mount the bucket (gcsfuse BUCKET /mnt/BUCKET) and give "
                            f"the path under it")


def as_written(cfg: RunConfig) -> RunConfig:
    """A copy of `cfg` as a config file writes it: the expanded paths' `$` as `$$` (`--print-config` printed a path
    given as `/runs/a$$b` as `/runs/a$b`, which `--config` read back as the variable b and refused)."""
    cfg = copy.deepcopy(cfg)
    for section, key in (*PATH_KEYS, ("model", "path")):
        value = getattr(getattr(cfg, section), key)
        if isinstance(value, str) and not value.startswith("embedded:"):
            setattr(getattr(cfg, section), key, value.replace("$", "$$"))
    return cfg


def _expand_paths(cfg: RunConfig, where: str) -> None:
    """`~` and environment variables (`$HOME`, `${DATA}`) in the local paths (PATH_KEYS, and model.path when it is
    one): nothing expands them in a YAML file, nor in an override the shell passes quoted, and `checkpoint.dir:
    $HOME/runs/a` made a directory named `$HOME` in the working directory. A variable that is not set is refused."""
    try:
        _refuse_url_outputs(cfg)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    for section, key in (*PATH_KEYS, ("model", "path")):
        value = getattr(getattr(cfg, section), key)
        if not isinstance(value, str) or value.startswith("embedded:"):
            continue
        try:
            expanded = expand_env(value, f"{section}.{key}", home=(section, key) in PATH_KEYS)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        setattr(getattr(cfg, section), key, expanded)


INT32_MAX = 2**31 - 1
# why an integer key stops at INT32_MAX, where it says more than "a 32-bit integer": `train.grad_accum_steps=1e30`
# was taken, and the run read micro-batches for ever, holding each in memory (the step's are read together)
INT32_WHY = {"train.max_steps": "optax counts steps in int32",
             "train.grad_accum_steps": "optax counts micro-batches in int32"}


def _int_values(node: Any, prefix: str = "") -> list[tuple[str, int]]:
    """(dotted key, value) of every integer the dataclass tree `node` holds."""
    out = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out += _int_values(value, f"{prefix}{f.name}.")
        elif isinstance(value, int) and not isinstance(value, bool):
            out.append((prefix + f.name, value))
    return out


def validate(cfg: RunConfig, where: str = "config") -> None:
    """Cross-field checks that the type system cannot express."""

    def bad(msg: str) -> None:
        raise UserError(f"{where}: {msg}")

    def at_least(key: str, value, low, what: str = "") -> None:
        if value is not None and value < low:
            bad(f"{key} must be {what or f'at least {low}'}, got {value}")

    def in_range(key: str, value, low, high, closed_high: bool = True) -> None:
        if value is not None and not (low <= value <= high if closed_high else low <= value < high):
            bad(f"{key} must be in [{low}, {high}{']' if closed_high else ')'}, got {value}")

    for key, value in _int_values(cfg):  # one bound for every count and size (train.seed's is 2**63, below)
        if key != "train.seed" and value > INT32_MAX:
            bad(f"{key} must be at most {INT32_MAX} ({INT32_WHY.get(key, 'a 32-bit integer')}), got {value}")
    if not cfg.model.path.strip():  # else read as the working directory: "config.json: missing"
        bad("model.path is empty (give a Hugging Face directory, hub id or embedded:NAME)")
    if cfg.lora.enabled:
        at_least("lora.rank", cfg.lora.rank, 1)
        if cfg.lora.alpha <= 0:
            bad(f"lora.alpha must be positive, got {cfg.lora.alpha}")
        if not cfg.lora.targets:
            bad("lora.targets is empty")
        unknown = [t for t in cfg.lora.targets if t not in ALL_TARGETS]
        if unknown:
            bad(f"lora.targets: unknown module {unknown[0]!r} (known: {', '.join(ALL_TARGETS)})")
        twice = [t for i, t in enumerate(cfg.lora.targets) if t in cfg.lora.targets[:i]]
        if twice:  # counted twice in the FLOPs estimate, once in the model
            bad(f"lora.targets: {twice[0]!r} is listed twice")
        in_range("lora.dropout", cfg.lora.dropout, 0.0, 1.0, closed_high=False)
    else:  # settings full fine-tuning would silently ignore
        if cfg.lora.base_quantization:
            bad(f"lora.base_quantization={cfg.lora.base_quantization} needs lora.enabled=true (QLoRA quantizes "
                f"the frozen base under the adapters; full fine-tuning trains every weight in model.dtype)")
        if cfg.lora.dropout:
            bad(f"lora.dropout={cfg.lora.dropout} needs lora.enabled=true (it drops the adapters' input; full "
                f"fine-tuning has no adapters)")
    for key in ("train_path", "eval_path"):  # `data.eval_path=` (an empty $VAR) was read as unset: no evaluation
        path = getattr(cfg.data, key)
        if path is not None and not path.strip():
            bad(f"data.{key} is empty (give a file{', or null for no evaluation' if key == 'eval_path' else ''})")
    for key, unset in NULL_MEANS.items():  # `train.run_dir=` (an empty $VAR) was read as unset, silently
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not value.strip():
            bad(f"{key} is empty (give a value, or null for {unset})")
    for key in ("instruction_field", "response_field", "text_field"):  # else "missing field ''" in every row
        if not getattr(cfg.data, key).strip():
            bad(f"data.{key} is empty (the name of a field of the data's rows)")
    # one field named for two parts of an instruction row: its answer would be its question (an echo trained), or a
    # field in the prompt twice
    fields = [("instruction_field", cfg.data.instruction_field), ("context_field", cfg.data.context_field),
              ("response_field", cfg.data.response_field)]
    same = next(((a, b, x) for i, (a, x) in enumerate(fields) for b, y in fields[i + 1:] if x is not None and x == y),
                None)
    if same:
        bad(f"data.{same[0]} and data.{same[1]} both name {same[2]!r}: an instruction row's question, context and "
            f"answer are three fields")
    at_least("data.seq_len", cfg.data.seq_len, 8)
    at_least("data.num_epochs", cfg.data.num_epochs, 1)
    at_least("data.max_loss_tokens", cfg.data.max_loss_tokens, 1)
    at_least("data.share_prefix_min_tokens", cfg.data.share_prefix_min_tokens, 1)
    at_least("data.eval_max_batches", cfg.data.eval_max_batches, 1)
    t = cfg.train
    at_least("train.batch_size", t.batch_size, 1, "positive")
    at_least("train.max_steps", t.max_steps, 1, "positive")
    at_least("train.grad_accum_steps", t.grad_accum_steps, 1, "positive")
    if t.learning_rate <= 0:
        bad(f"train.learning_rate must be positive, got {t.learning_rate}")
    at_least("train.warmup_steps", t.warmup_steps, 0)
    in_range("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0)
    at_least("train.weight_decay", t.weight_decay, 0.0)
    if t.optimizer == "sgd" and t.weight_decay:  # optax.sgd takes none: the run went on without decay, silently
        bad(f"train.weight_decay={t.weight_decay} is not applied by train.optimizer=sgd (plain SGD has no weight "
            f"decay here); use adamw or adafactor, or set train.weight_decay=0")
    if t.schedule == "constant" and t.min_lr_ratio:  # the floor of a decay that a constant schedule never makes
        bad(f"train.min_lr_ratio={t.min_lr_ratio} is the floor of a decaying schedule, and train.schedule=constant "
            f"does not decay; use warmup_cosine or warmup_linear, or set train.min_lr_ratio=0")
    if t.grad_clip is not None and t.grad_clip < 0:
        bad(f"train.grad_clip must be positive (0 or null: no clipping), got {t.grad_clip}")
    at_least("train.seed", t.seed, 0)
    if t.seed >= 2 ** 63:  # JAX's PRNG keys take a signed 64-bit seed: an OverflowError once the model had loaded
        bad(f"train.seed must be below 2**63 (a 64-bit signed integer), got {t.seed}")
    at_least("train.eval_every_steps", t.eval_every_steps, 0)
    at_least("train.log_every_steps", t.log_every_steps, 1, "positive")
    at_least("train.profile_skip_steps", t.profile_skip_steps, 0)
    at_least("train.profile_steps", t.profile_steps, 1, "positive")
    if t.profile_dir is not None:
        if not t.profile_dir.strip():  # else the run dir itself, among the checkpoints
            bad("train.profile_dir is empty (give a directory, or null for no profiling)")
        if t.profile_skip_steps + t.profile_steps > t.max_steps:  # Tunix would cut it short or refuse it
            bad(f"train.profile_skip_steps={t.profile_skip_steps} + train.profile_steps={t.profile_steps} "
                f"go past train.max_steps={t.max_steps}")
    if t.warmup_steps > t.max_steps:  # every schedule warms up (constant too): the set rate would never be reached
        bad(f"train.warmup_steps={t.warmup_steps} is longer than train.max_steps={t.max_steps}")
    if not cfg.checkpoint.dir.strip():  # else the working directory: checkpoints among the user's files
        bad("checkpoint.dir is empty (give a directory for the run, e.g. runs/NAME)")
    at_least("checkpoint.every_steps", cfg.checkpoint.every_steps, 1, "positive")
    at_least("checkpoint.max_to_keep", cfg.checkpoint.max_to_keep, 1)
    at_least("mesh.price_per_hour", cfg.mesh.price_per_hour, 0.0)
    at_least("mesh.num_processes", cfg.mesh.num_processes, 1)
    address = cfg.mesh.coordinator_address
    if address:  # empty or null: one host (or the JAX_* environment); else jax.distributed fails at start-up
        m = _HOST_PORT.fullmatch(address)
        if not m or not 1 <= int(m.group(1)) <= 65535:
            bad(f"mesh.coordinator_address must be host:port with a port in 1..65535 (e.g. 10.0.0.2:1234), "
                f"got {address!r}")
    at_least("mesh.process_id", cfg.mesh.process_id, 0)
    if cfg.mesh.num_processes is not None and cfg.mesh.process_id is not None \
            and cfg.mesh.process_id >= cfg.mesh.num_processes:
        bad(f"mesh.process_id={cfg.mesh.process_id} must be below mesh.num_processes={cfg.mesh.num_processes}")
    for name in ("data", "fsdp", "tp", "dcn_data"):
        v = getattr(cfg.mesh, name)
        if v == 0 or v < -1:
            bad(f"mesh.{name} must be a positive integer or -1, got {v}")
    if cfg.mesh.dcn_data == -1:
        bad("mesh.dcn_data must be the number of slices, not -1")
    free = [f"mesh.{name}" for name in ("data", "fsdp", "tp") if getattr(cfg.mesh, name) == -1]
    if len(free) > 1:  # else refused only when the mesh is built, after the data and model were read
        both = "both" if len(free) == 2 else "all"
        bad(f"{', '.join(free[:-1])} and {free[-1]} are {both} -1: at most one axis may take the remaining "
            f"devices; give the others a size")

    if cfg.mesh.accelerator not in ACCELERATORS:
        bad(f"mesh.accelerator: unknown {cfg.mesh.accelerator!r} (known: {', '.join(ACCELERATORS)})"
            f"{_did_you_mean(cfg.mesh.accelerator, list(ACCELERATORS))}")
    if cfg.train.remat is not None and cfg.model.remat != "none" and cfg.model.remat != cfg.train.remat:
        bad(f"model.remat={cfg.model.remat} and train.remat={cfg.train.remat} disagree; set train.remat only")


def validate_for_model(cfg: RunConfig, hf_config: dict, where: str = "config",
                       projection_shapes: dict[str, tuple[tuple[int, int], ...]] | None = None) -> None:
    """Checks that need the base's config.json (read before any weight): a LoRA rank no larger than
    the smallest dimension of a targeted projection in any layer (a larger one adds parameters, not rank;
    `projection_shapes`: the family's, `Family.projection_shapes`), a sequence no longer than the model's
    positions, a sliding window that is a positive integer."""
    text = hf_config.get("text_config") or hf_config

    def dim(key: str) -> int | None:
        v = text.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    if cfg.lora.enabled:
        for target in cfg.lora.targets:
            side = min((min(shape) for shape in (projection_shapes or {}).get(target, ())), default=None)
            if side is not None and cfg.lora.rank > side:
                raise UserError(f"{where}: lora.rank={cfg.lora.rank} exceeds the smallest dimension of "
                                f"{target} ({side}) in this model; use at most {side}")
    max_pos = dim("max_position_embeddings")
    if max_pos and cfg.data.seq_len > max_pos:
        raise UserError(f"{where}: data.seq_len={cfg.data.seq_len} exceeds the model's "
                        f"max_position_embeddings={max_pos}")
    window = text.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise UserError(f"{where}: the model's config.json has sliding_window={window!r}; expected a "
                        f"positive integer")
