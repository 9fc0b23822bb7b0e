"""Typed run configuration: the dataclasses of a run, loaded from YAML with dotted command-line overrides.

The YAML tree mirrors the dataclass tree (`model`, `lora`, `data`, `train`, `checkpoint`, `mesh`), so
every knob is found by following names. Reading and typing the file is `gemma_tpu.core.typed_yaml`'s; this module
holds what a run's keys mean and how they are checked together (`validate`, `validate_for_model`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from gemma_tpu.core.accelerators import ACCELERATORS
from gemma_tpu.core.errors import UserError
from gemma_tpu.core.recipe_names import FOREIGN_NAMES
from gemma_tpu.core.typed_yaml import blame, did_you_mean, expand_env, key_lines, load_typed, named_override


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


# sections of the serving config (serving/config.py): a file holding them was given to a training entry point
SERVING_SECTIONS = {name: "a serving config (python -m serving.launch --config FILE)"
                    for name in ("server", "tool_calling", "container")}


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
            raise UserError(f"{named_override(text)}: a bare ~ is null to YAML, not the home directory; write "
                            f"{key}=null to leave it unset, or a path such as {key}=~/NAME")
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
            f"{did_you_mean(cfg.mesh.accelerator, list(ACCELERATORS))}")
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
