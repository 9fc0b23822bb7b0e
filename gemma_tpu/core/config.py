"""Typed run configuration: dataclasses loaded from YAML with dotted command-line overrides.

The YAML tree mirrors the dataclass tree (`model`, `lora`, `data`, `train`, `checkpoint`, `mesh`), so
every knob is found by following names. Unknown keys and values of the wrong type are rejected
with a message naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from gemma_tpu.core.errors import UserError

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
    dropout: float = 0.0
    base_quantization: Literal["nf4", "int8"] | None = None  # QLoRA: quantize the frozen base


@dataclasses.dataclass
class DataConfig:
    """Where the examples come from and how they become static-shape batches."""

    train_path: str | None = None
    eval_path: str | None = None
    format: Literal["auto", "messages", "instruction"] = "auto"
    seq_len: int = 512
    strategy: Literal["pad", "pack"] = "pad"
    overlength: Literal["truncate", "drop", "error"] = "truncate"
    loss_on: Literal["assistant", "all"] = "assistant"
    # auto: the family's format; template: the tokenizer's own chat template (loss spans by offsets)
    chat_format: Literal["auto", "gemma", "functiongemma", "template"] = "auto"
    # instruction-pair columns (Databricks Dolly names by default)
    instruction_field: str = "instruction"
    context_field: str | None = "context"
    response_field: str = "response"
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat for as long as train.max_steps needs
    max_loss_tokens: int | None = None  # per-row loss buffer; None: measured from the data
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
    eval_every_steps: int = 0  # 0: evaluate only at the start and the end
    log_every_steps: int = 1
    on_nonfinite: Literal["stop", "skip"] = "stop"
    run_dir: str | None = None  # metrics.jsonl and TensorBoard; default: checkpoint.dir


@dataclasses.dataclass
class CheckpointConfig:
    """Orbax checkpoints of LoRA params, optimizer state, step and data position."""

    dir: str = "runs/default"
    every_steps: int = 50
    max_to_keep: int = 3
    async_save: bool = True


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


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`, with the few coercions YAML needs."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except UserError as e:
                errors.append(str(e))
        raise UserError(errors[0] if len(errors) == 1 else f"{where}: {value!r} is not a valid {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise UserError(f"{where}: {value!r} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        return {_coerce(k, args[0], where): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise UserError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise UserError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    return value


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        key_where = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise UserError(f"unknown config key '{key_where}' (known: {', '.join(sorted(names))})")
        kwargs[key] = _coerce(value, hints[key], key_where)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise UserError(f"{source}: '{dotted}' goes through '{p}', which is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.max_steps=20` -> ("train.max_steps", 20); values are parsed as YAML scalars."""
    if "=" not in text:
        raise UserError(f"override '{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or key.startswith(".") or key.endswith("."):
        raise UserError(f"override '{text}' has no valid key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def load_typed(cls: type, path: str | Path | None, overrides: Sequence[str] = ()) -> Any:
    """Build the dataclass tree `cls` from a YAML file (optional) and dotted overrides.

    The generic half of `load_config`, shared by every typed config (runs, serving): unknown keys,
    wrong types and bad YAML are one-line `UserError`s that name the file.
    """
    tree: dict = {}
    where = "config"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise UserError(f"config file not found: {p}")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise UserError(f"{p}{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(tree, dict):
            raise UserError(f"{p}: the top level must be a mapping of sections")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value, f"override '{text}'")
    try:
        return _build(cls, tree, "")
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML config, apply dotted overrides, and build the typed tree."""
    cfg = load_typed(RunConfig, path, overrides)
    if cfg.train.optimizer is None:
        cfg.train.optimizer = "adamw" if cfg.lora.enabled else "adafactor"
    validate(cfg, str(path) if path is not None else "config")
    return cfg


def validate(cfg: RunConfig, where: str = "config") -> None:
    """Cross-field checks that the type system cannot express."""

    def bad(msg: str) -> None:
        raise UserError(f"{where}: {msg}")

    if cfg.lora.enabled:
        if cfg.lora.rank <= 0:
            bad(f"lora.rank must be positive, got {cfg.lora.rank}")
        if not cfg.lora.targets:
            bad("lora.targets is empty")
        unknown = [t for t in cfg.lora.targets if t not in ALL_TARGETS]
        if unknown:
            bad(f"lora.targets: unknown module {unknown[0]!r} (known: {', '.join(ALL_TARGETS)})")
    if cfg.data.seq_len < 8:
        bad(f"data.seq_len must be at least 8, got {cfg.data.seq_len}")
    if cfg.train.batch_size <= 0:
        bad(f"train.batch_size must be positive, got {cfg.train.batch_size}")
    if cfg.train.max_steps <= 0:
        bad(f"train.max_steps must be positive, got {cfg.train.max_steps}")
    if cfg.train.grad_accum_steps <= 0:
        bad(f"train.grad_accum_steps must be positive, got {cfg.train.grad_accum_steps}")
    if cfg.train.learning_rate <= 0:
        bad(f"train.learning_rate must be positive, got {cfg.train.learning_rate}")
    if cfg.checkpoint.every_steps <= 0:
        bad(f"checkpoint.every_steps must be positive, got {cfg.checkpoint.every_steps}")
    for name in ("data", "fsdp", "tp", "dcn_data"):
        v = getattr(cfg.mesh, name)
        if v == 0 or v < -1:
            bad(f"mesh.{name} must be a positive integer or -1, got {v}")
    if cfg.mesh.dcn_data == -1:
        bad("mesh.dcn_data must be the number of slices, not -1")
    from gemma_tpu.core.accelerators import ACCELERATORS

    if cfg.mesh.accelerator not in ACCELERATORS:
        bad(f"mesh.accelerator: unknown {cfg.mesh.accelerator!r} (known: {', '.join(ACCELERATORS)})")
    if cfg.train.remat is not None and cfg.model.remat != "none" and cfg.model.remat != cfg.train.remat:
        bad(f"model.remat={cfg.model.remat} and train.remat={cfg.train.remat} disagree; set train.remat only")
