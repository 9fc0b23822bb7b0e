"""Typed serving configuration, and the checks a model directory must pass before vLLM-TPU sees it.

`configs/serve-*.yaml` mirror `ServeConfig` (sections `model`, `server`, `tool_calling`, `lora`,
`container`) and load through gemma_tpu's config loader: dotted overrides (`server.port=8001`),
unknown keys and wrong types rejected by name.

`inspect_model` reads a merged directory the way vLLM-TPU will and refuses, in one line, what would
fail on the TPU VM minutes into a container start: a missing config/weights/shard/generation
config/tokenizer, an architecture vLLM-TPU does not serve, a tensor-parallel size that does not
divide the KV-head count, a tool-call parser for the wrong family, a LoRA rank vLLM cannot take, an
adapter whose weights do not fit the base (an adapter of another model).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from gemma_tpu.core.typed_yaml import blame, expand_env, key_lines, load_typed
from gemma_tpu.core.errors import UserError, other_unicode, read_json_object
from gemma_tpu.formats.function_calling import FUNCTION_MARKERS
from gemma_tpu.hf.adapter import (
    adapter_modules,
    check_adapter_fits as check_adapter_sites,
    check_vllm_scaling,
    largest_rank,
    module_names,
    read_adapter_config,
)
from gemma_tpu.hf.directory import (
    ADAPTER_RECORD,
    MERGE_RECORD,
    check_same_directory,
    dir_identity,
    training_run_hint,
)
from gemma_tpu.hf.fingerprint import first_difference
from gemma_tpu.hf.safetensors_io import WeightsDir
from gemma_tpu.hf.tokenizer import tokens_named
from gemma_tpu.models.registry import Family, families, text_config

# The official vLLM TPU image, pinned (docker.io/vllm/vllm-tpu, tags vX.Y.Z = tpu-inference releases).
# serving/Dockerfile builds FROM exactly this; tests check that the two agree.
VLLM_TPU_IMAGE = "vllm/vllm-tpu:v0.27.0"
# What serving/Dockerfile is built as (launch builds it when missing).
DEFAULT_IMAGE = "gemma-tpu-serve:v0.27.0"

# vLLM's LoRAConfig.max_lora_rank must be one of these (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _secret_like(value: str) -> bool:
    """Whether a value given for a variable's *name* is a key or token itself: an OpenAI-style `sk-...`, or a run of 16
    or more letters and digits mixed (a Hugging Face `hf_...` token, `openssl rand -hex 16`), which no variable name
    people write holds."""
    return value.startswith("sk-") or any(
        len(part) >= 16 and re.search(r"\d", part) and re.search(r"[A-Za-z]", part)
        for part in re.split(r"[_-]", value))
SECRET_ENV = ("HF_TOKEN", "VLLM_API_KEY", "HUGGING_FACE_HUB_TOKEN")
# tpu-inference's MODEL_IMPL_TYPE (tpu_inference/envs.py, 0.27.0): auto picks its JAX model where it has one (Gemma 4)
# and vLLM's PyTorch model through torchax otherwise (Gemma 3); it refuses other values when the engine starts, and
# "jetpack", which its list takes, has no model loader (NotImplementedError at model load)
MODEL_IMPL_TYPES = ("auto", "flax_nnx", "vllm")
# tpu-inference's implementation variables and the values each takes (tpu_inference/envs.py, 0.27.0; a speculative
# decoding draft model has its own, whose list has no "jetpack")
IMPL_ENV = {"MODEL_IMPL_TYPE": MODEL_IMPL_TYPES, "DRAFT_MODEL_IMPL_TYPE": MODEL_IMPL_TYPES}
# vLLM's own --model-impl (vllm/config/model.py ModelImpl): which of vLLM's PyTorch model classes its loader builds.
# tpu-inference reads it on its vllm (torchax) path only; its JAX models (flax_nnx) are chosen by MODEL_IMPL_TYPE alone
VLLM_MODEL_IMPLS = ("auto", "vllm", "transformers", "terratorch")
# `vllm serve` options the launcher renders from the config (serving/launch.py), by the key that sets them:
# repeated in server.extra_args, vLLM's parser keeps the last, so the server ran on another port, context
# or model name than the config (and the clients) said. --api-key would put the secret on the command line.
RENDERED_FLAGS = {
    "--model": "model.dir", "--served-model-name": "model.name", "--host": "server.host", "--port": "server.port",
    "--tensor-parallel-size": "server.tensor_parallel_size", "-tp": "server.tensor_parallel_size",
    "--max-model-len": "server.max_model_len", "--max-num-batched-tokens": "server.max_num_batched_tokens",
    "--max-num-seqs": "server.max_num_seqs", "--dtype": "server.dtype", "--api-key": "server.api_key_env",
    "--chat-template-content-format": "server.chat_template_content_format",
    "--enable-auto-tool-choice": "tool_calling.enabled", "--tool-call-parser": "tool_calling.parser",
    "--chat-template": "tool_calling.chat_template", "--enable-lora": "lora.adapters",
    "--lora-modules": "lora.adapters", "--max-lora-rank": "lora.max_lora_rank", "--max-loras": "lora.max_loras",
}


@dataclasses.dataclass
class ModelSection:
    """The merged Hugging Face directory to serve (on the machine that runs the container)."""

    dir: str | None = None
    name: str | None = None  # served model name and mount /models/NAME; default: the directory's name


@dataclasses.dataclass
class ServerSection:
    """`vllm serve` engine and API settings."""

    host: str = "127.0.0.1"  # the container shares the host network: 0.0.0.0 exposes the API
    port: int = 8000
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: DEFAULT_CONTEXT, or the model's context where shorter (`served_context`)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    dtype: Literal["bfloat16"] = "bfloat16"  # vLLM-TPU refuses float16 for Gemma 3
    api_key_env: str | None = None  # name of the host variable holding the API key; never its value
    # how vLLM hands message content to the chat template: "openai" passes content parts as a list, which Gemma's
    # templates and ours join with nothing between them, as training joined them; "string" joins text parts with
    # newlines before the template sees them, and "auto" picks one of the two by reading the template's source
    chat_template_content_format: Literal["openai", "string", "auto"] = "openai"
    extra_args: list[str] = dataclasses.field(default_factory=list)  # appended to `vllm serve`


@dataclasses.dataclass
class ToolCallingSection:
    """OpenAI `tools` / `tool_calls` through vLLM's tool-call parser."""

    enabled: bool = False
    parser: Literal["functiongemma", "gemma4"] = "functiongemma"
    # "model": the directory's own template; else a .jinja file on the host (passed with tool calling off too)
    chat_template: str = "model"


def resolved_once(section: Any, written: str, key: str) -> Path:
    """`written` (a path of `section`) resolved, links followed, once for each value it takes: the checks, the mounts
    and the local server then name one directory, where a link retargeted meanwhile (a new merge published under
    `models/coach`) had the command mount a model never checked."""
    done, resolved = section.__dict__.get(key, (None, None))
    if done != written:
        done, resolved = written, Path(written).expanduser().resolve()
        section.__dict__[key] = (done, resolved)
    return resolved


@dataclasses.dataclass
class AdapterSection:
    name: str = ""
    dir: str = ""  # a PEFT adapter directory (python -m convert.export_peft)

    @property
    def path(self) -> Path:
        return resolved_once(self, self.dir, "_dir_resolved")


@dataclasses.dataclass
class LoraSection:
    """LoRA adapters served next to the base (`--enable-lora --lora-modules name=/adapters/name`)."""

    adapters: list[AdapterSection] = dataclasses.field(default_factory=list)
    max_lora_rank: int | None = None  # default: the smallest rank vLLM accepts that fits every adapter
    # adapters a batch may mix (vLLM's --max-loras, whose own default of 1 makes requests for different adapters
    # wait for one another); default: every adapter configured
    max_loras: int | None = None


@dataclasses.dataclass
class ContainerSection:
    """The `docker run` around `vllm serve`."""

    image: str = DEFAULT_IMAGE
    build: bool = True  # build `image` from serving/Dockerfile when missing (false: docker run pulls it)
    name: str | None = None  # container name; default gemma-tpu-serve-<model name>
    shm_size: str = "16g"
    compile_cache: str = "~/.cache/vllm"  # persisted JAX/XLA compile cache, mounted at /root/.cache/vllm
    hf_token_env: str | None = "HF_TOKEN"  # passed by name (docker -e NAME), never by value
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # non-secret settings, e.g. MODEL_IMPL_TYPE


@dataclasses.dataclass
class ServeConfig:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    server: ServerSection = dataclasses.field(default_factory=ServerSection)
    tool_calling: ToolCallingSection = dataclasses.field(default_factory=ToolCallingSection)
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)
    container: ContainerSection = dataclasses.field(default_factory=ContainerSection)

    @property
    def model_dir(self) -> Path:
        return resolved_once(self, self.model.dir, "_model_dir_resolved")

    @property
    def served_name(self) -> str:
        """model.name, else the directory's name as model.dir writes it: a link's own name (`models/coach`, a link to
        a content-hashed directory, was served as the hash); `.` or `..` the name of the directory they are."""
        if self.model.name:
            return self.model.name
        written = Path(os.path.normpath(Path(self.model.dir).expanduser())).name
        return written if written not in ("", ".", "..") else self.model_dir.name


# sections of a training config (gemma_tpu/core/config.py RunConfig) that a serving config never has
TRAINING_SECTIONS = {name: "a training config (python -m gemma_tpu.train --config FILE)"
                     for name in ("train", "data", "checkpoint", "mesh")}


def _names(arg: str, flag: str, known: frozenset[str]) -> bool:
    """Whether the extra_args word `arg` gives the option `flag` as vLLM's parser reads it: '-' or '_' between
    words, or an unambiguous abbreviation (vLLM's FlexibleArgumentParser keeps argparse's allow_abbrev, so
    `--lora-target-mod` is `--lora-target-modules`); not a JSON option's field (`--flag.key`)."""
    option = vllm_option(arg)
    return (option is not None and "." not in arg.partition("=")[0]
            and (option == flag or resolve_vllm_option(option, known) == flag))


def extra_arg(args: Sequence[str], flag: str) -> str | None:
    """The value server.extra_args gives `flag` (`--flag V` or `--flag=V`, '-' or '_' between words, abbreviated;
    vLLM keeps the last), or None."""
    args = vllm_words(args)
    known = vllm_serve_flags()
    value = None
    for i, arg in enumerate(args):
        if _names(arg, flag, known):
            _, eq, v = arg.partition("=")
            value = v if eq else (args[i + 1] if i + 1 < len(args) else "")
    return value


def extra_arg_values(args: Sequence[str], flag: str) -> list[str] | None:
    """The values server.extra_args gives a list option `flag` (`--flag A B ...` up to the next option, or
    `--flag=A`, abbreviated or not; vLLM keeps the last), or None."""
    args = vllm_words(args)
    known = vllm_serve_flags()
    values = None
    for i, arg in enumerate(args):
        if _names(arg, flag, known):
            _, eq, v = arg.partition("=")
            if eq:
                values = [v]
                continue
            values = []
            for word in args[i + 1:]:
                if vllm_option(word) is not None:
                    break
                values.append(word)
    return values


def bool_extra_arg(args: Sequence[str], flag: str, *aliases: str) -> bool:
    """Whether server.extra_args turns the boolean option `flag` on (`--flag` or one of its short `aliases`, spelt as
    vLLM's parser reads them; vLLM keeps the last of `--flag` and `--no-flag`)."""
    args = vllm_words(args)
    known = vllm_serve_flags()
    negated = "--no-" + flag.removeprefix("--")
    on = False
    for arg in args:
        option = vllm_option(arg)
        resolved = resolve_vllm_option(option, known) if option is not None else None
        if resolved in (flag, *aliases) or option in aliases:
            on = True
        elif resolved == negated:
            on = False
    return on


# vLLM's packed modules in Gemma 3 and 4 (packed_modules_mapping, vllm/model_executor/models/gemma3.py, gemma4.py):
# one LoRA layer wraps a group, so --lora-target-modules naming the group or any member of it applies all members
VLLM_PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def lora_modules_left_out(adapter_modules: Sequence[str], deployed: Sequence[str]) -> list[str]:
    """The adapter's modules that vLLM, given `--lora-target-modules deployed`, wraps in no LoRA layer
    (vllm/lora/utils.py is_in_target_modules): it loads the adapter without a word and serves it without their
    updates."""
    chosen = set(deployed)

    def applied(module: str) -> bool:
        return module in chosen or any(module in group and (parent in chosen or chosen & set(group))
                                       for parent, group in VLLM_PACKED_MODULES.items())

    return [m for m in adapter_modules if not applied(m)]


VLLM_FLAGS_FILE = Path(__file__).with_name("vllm_serve_flags.txt")  # made by scripts/vllm_serve_flags.py
SWITCH_MARK = ":switch"  # an option of that file that takes no value (argparse nargs=0)


def _vllm_serve_lines() -> dict[str, tuple[str, ...]]:
    """vllm_serve_flags.txt: each option string, with the words that follow it (its choices, its number type, or
    SWITCH_MARK)."""
    lines = VLLM_FLAGS_FILE.read_text(encoding="utf-8").splitlines()
    return {words[0]: tuple(words[1:]) for words in (line.split() for line in lines if not line.startswith("#"))
            if words}


def vllm_serve_choices() -> dict[str, tuple[str, ...]]:
    """Each option string `vllm serve` takes in the pinned release (VLLM_TPU_IMAGE), with the values its parser
    accepts where they are a fixed set (argparse choices), else ()."""
    return {flag: () if words[:1] and words[0].startswith(":") else words
            for flag, words in _vllm_serve_lines().items()}


def vllm_serve_number_types() -> dict[str, str]:
    """The options whose value the pinned `vllm serve`'s parser converts to a number, by the type it converts to:
    "int" or "float", "int?" / "float?" for one that takes "None" and "" too (vLLM's optional_type)."""
    return {flag: words[0][1:] for flag, words in _vllm_serve_lines().items()
            if len(words) == 1 and words[0].startswith(":") and words[0] != SWITCH_MARK}


def vllm_serve_flags() -> frozenset[str]:
    """The option strings `vllm serve` takes in the pinned release (VLLM_TPU_IMAGE)."""
    return frozenset(vllm_serve_choices())


def vllm_option_keys() -> dict[str, tuple[str, ...]]:
    """The `vllm serve` options the config has no key for, by the key a vLLM user writes for one (the server section
    mirrors its options: `server.gpu_memory_utilization` was an unknown key, its section's keys listed and nothing
    said that server.extra_args passes it), as `load_typed`'s `foreign` names: (our key, how, whose name)."""
    return {flag[2:].replace("-", "_"): ("server.extra_args", f"as [{flag}, VALUE], or [{flag}] for a switch",
                                         "vllm serve option's")
            for flag in vllm_serve_flags() if flag.startswith("--") and flag not in RENDERED_FLAGS}


def vllm_option(arg: str) -> str | None:
    """The option an extra_args word names as vLLM's parser reads it, or None for a value: '_' and '-' alike
    before any '.', `--x=V` and `--x.key V` (a JSON option's field) as `--x`, `-O3` as `-O` (its
    optimization-level shorthand); `-1` or `-` are values."""
    if not arg.startswith("-") or arg == "-" or re.fullmatch(r"-[\d.].*", arg):
        return None
    if arg.startswith("-O") and not arg.startswith("--"):
        return "-O"
    name = arg.split("=", 1)[0]
    return "--" + name[2:].split(".", 1)[0].replace("_", "-") if name.startswith("--") else name


def vllm_words(args: Sequence[str]) -> list[str]:
    """server.extra_args as vLLM's parser splits them: a one-letter option that takes a value with the value attached
    (`-n2`, `-r0`, `-qfp8`: argparse reads a short option's value written onto it) as `-n=2`, each other word as
    written. They were refused as options `vllm serve` lacks ("did you mean -n?"), where vLLM takes them."""
    known = vllm_serve_flags()
    takes_value = {f for f, words in _vllm_serve_lines().items() if len(f) == 2 and f[0] == "-" and f[1] != "-"
                   and words != (SWITCH_MARK,)}
    out = []
    for arg in args:
        # as argparse's _get_option_tuples: the one-letter option, unless the word is an option or begins one
        if arg[:2] in takes_value and len(arg) > 2 and arg[2] != "=" and not any(k.startswith(arg) for k in known):
            arg = f"{arg[:2]}={arg[2:]}"
        out.append(arg)
    return out


def abbreviated_options(option: str, known: frozenset[str]) -> list[str]:
    """The known options `option` is a prefix of, sorted (argparse's allow_abbrev: one is that option, several an
    ambiguous abbreviation argparse refuses). A single-dash word abbreviates the single-dash options (argparse's
    _get_option_tuples: `-t` is `-tp`, `-pc` is `-pcp`, `-p` could be `-pcp` or `-pp`); they were refused as options
    `vllm serve` lacks, where vLLM takes them."""
    if not option.startswith("-") or option in ("-", "--"):
        return []
    return sorted(k for k in known if k.startswith(option))


def resolve_vllm_option(option: str, known: frozenset[str]) -> str | None:
    """`option` as vLLM's argparse takes it: itself, or the one known long option it abbreviates; else None."""
    if option in known or option == "-O":
        return option
    longer = abbreviated_options(option, known)
    return longer[0] if len(longer) == 1 else None


def unknown_extra_args(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """Each server.extra_args word naming an option the pinned `vllm serve` does not take, with the closest option it
    does (None: nothing close): vLLM stops at such a word with a usage error only on the TPU VM, after the image
    pull."""
    args = vllm_words(args)
    known = vllm_serve_flags()
    out = []
    for arg in args:
        option = vllm_option(arg)
        if option is None or resolve_vllm_option(option, known) is not None:
            continue
        longer = abbreviated_options(option, known)
        # an abbreviation of several: argparse refuses it as ambiguous (named by the phrase), so it is never a warning
        close = longer[:1] or difflib.get_close_matches(option, sorted(known), n=1, cutoff=0.75)
        out.append((arg, close[0] if close else None))
    return out


def invalid_choices(args: Sequence[str]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(option, value, its choices) for each server.extra_args option given a value outside the fixed set the pinned
    `vllm serve` takes (`--kv-cache-dtype fp8_e4m3fn`, `--logprobs-mode=raw`): vLLM's parser stops at it with a
    usage error, on the TPU VM after the image pull."""
    args = vllm_words(args)
    choices = vllm_serve_choices()
    known = frozenset(choices)
    out = []
    for i, arg in enumerate(args):
        option = vllm_option(arg)
        flag = resolve_vllm_option(option, known) if option is not None else None
        name, eq, value = arg.partition("=")
        if not choices.get(flag) or "." in name:  # no fixed set, or a JSON option's field
            continue
        if not eq:
            if i + 1 >= len(args):
                continue
            value = args[i + 1]
        if value not in choices[flag]:
            out.append((flag, value, choices[flag]))
    return out


def invalid_number_types(args: Sequence[str]) -> list[tuple[str, str, str]]:
    """(option, value, what it must be) for each server.extra_args option the pinned `vllm serve`'s parser converts
    to a number, given a value that conversion refuses (`--seed x`, `--max-logprobs 2.5`) or none (value None: at the
    end, or before another option): its usage error, on the TPU VM after the image pull. Each occurrence, as argparse
    converts each."""
    args = vllm_words(args)
    types = vllm_serve_number_types()
    known = vllm_serve_flags()
    out = []
    for i, arg in enumerate(args):
        option = vllm_option(arg)
        flag = resolve_vllm_option(option, known) if option is not None else None
        name, eq, value = arg.partition("=")
        if flag not in types or "." in name:
            continue
        kind = types[flag]
        what = ("an integer" if kind.startswith("int") else "a number") + (" (or None)" if kind.endswith("?") else "")
        if not eq:
            if i + 1 >= len(args) or vllm_option(args[i + 1]) is not None:  # argparse: "expected one argument"
                out.append((flag, None, what))
                continue
            value = args[i + 1]
        if kind.endswith("?") and value in ("", "None"):
            continue
        try:
            (int if kind.startswith("int") else float)(value)
        except ValueError:
            out.append((flag, value, what))
    return out


# vLLM's short spellings of its switches (vllm/engine/arg_utils.py), which take no value as their long forms do
VLLM_SHORT_SWITCHES = {"-ep": "--enable-expert-parallel", "-dph": "--data-parallel-hybrid-lb",
                       "-dpe": "--data-parallel-external-lb"}


def vllm_switches() -> dict[str, tuple[str, str | None]]:
    """The option strings of the pinned `vllm serve` that take no value (marked `:switch` in vllm_serve_flags.txt),
    each with its (on, off) pair: vLLM's BooleanOptionalAction switches (`--x` / `--no-x`) and their short spellings,
    and the store_true ones, which have no off (None: left out, it is off). Its parser stops at `--x=true` ("ignored
    explicit argument"), and reads `--x true` as a second model."""
    known = {flag for flag, words in _vllm_serve_lines().items() if words == (SWITCH_MARK,)}
    pairs: dict[str, tuple[str, str | None]] = {}
    for f in known:
        if f.startswith("--no-") and "--" + f[5:] in known:
            pairs[f] = ("--" + f[5:], f)
        elif f.startswith("--"):
            pairs[f] = (f, "--no-" + f[2:] if "--no-" + f[2:] in known else None)
    for f in known - set(pairs):  # the short spellings: -ep is --enable-expert-parallel's
        long = VLLM_SHORT_SWITCHES.get(f)
        pairs[f] = (f, pairs[long][1] if long in pairs else None)
    return pairs


def switch_values(args: Sequence[str]) -> list[tuple[str, str, str | None]]:
    """(word, on, off) for each server.extra_args switch given a value (`--enable-prefix-caching=true`)."""
    args = vllm_words(args)
    switches = vllm_switches()
    known = vllm_serve_flags()
    out = []
    for arg in args:
        option = vllm_option(arg)
        name, eq, _ = arg.partition("=")
        flag = resolve_vllm_option(option, known) if option is not None else None
        if eq and "." not in name and flag in switches:
            out.append((arg, *switches[flag]))
    return out


def stray_words(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """Each server.extra_args word the pinned `vllm serve`'s parser reads as an argument of its own, with the option
    before it that took its value already (None: no option before it): `vllm serve` takes one such argument, the
    model, which the rendered command gives first, and stops at another ("unrecognized arguments") on the TPU VM,
    after the image pull. Those are a word before any option, one after an option given as `--x=V`, and one after
    the value of an option that takes exactly one (a number, or one of a fixed set), and one after a switch
    (`vllm_switches`: `--enable-prefix-caching true`); after any other option a word may be one of its values
    (`--lora-target-modules q_proj v_proj`), and is not judged. The option is named as written (`-n2`, which the
    parser reads as `-n=2`)."""
    written, args = list(args), vllm_words(args)
    known = vllm_serve_flags()
    single = {flag for flag, values in vllm_serve_choices().items() if values} | set(vllm_serve_number_types())
    switches = vllm_switches()
    out: list[tuple[str, str | None]] = []
    free, owed, last = True, 0, None  # a word now is an argument of its own / words the last option still takes
    for i, arg in enumerate(args):
        option = vllm_option(arg)
        if option is not None:
            name, eq, _ = arg.partition("=")
            whole = "." not in name  # `--x.field V`: a JSON option's field, read by vLLM's own rules
            flag = resolve_vllm_option(option, known)
            free = whole and bool(eq or flag in single or flag in switches)
            owed, last = int(whole and not eq and flag in single), written[i]
            continue
        if owed:
            owed -= 1
        elif free:
            out.append((arg, last))
    return out


# extra_args options whose number vLLM checks only as the engine starts (on the TPU VM, after the image pull):
# (what it must be, the test), vLLM's CacheConfig and ParallelConfig bounds (the options the server section sets
# are checked there; `--pipeline-parallel-size 0` passed, and `vllm serve` stopped at it once the container was up)
VLLM_NUMBER_BOUNDS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "--gpu-memory-utilization": ("a fraction of the accelerator's memory in (0, 1]", lambda x: 0 < x <= 1),
    "--pipeline-parallel-size": ("a number of pipeline stages (at least 1)", lambda x: x >= 1),
    "--data-parallel-size": ("a number of data-parallel replicas (at least 1)", lambda x: x >= 1),
    "--prefill-context-parallel-size": ("a number of context-parallel ranks (at least 1)", lambda x: x >= 1),
    "--decode-context-parallel-size": ("a number of context-parallel ranks (at least 1)", lambda x: x >= 1),
    "--max-parallel-loading-workers": ("a number of loading workers (at least 1, or None)", lambda x: x >= 1),
    "--nnodes": ("a number of nodes (at least 1)", lambda x: x >= 1),
    "--block-size": ("a number of tokens a KV cache block holds (at least 1)", lambda x: x >= 1),
}
# the short spellings `vllm serve` takes for the options above (vLLM's EngineArgs), which set the same value
VLLM_SHORT_OPTIONS = {"-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size", "-n": "--nnodes",
                      "-pcp": "--prefill-context-parallel-size", "-dcp": "--decode-context-parallel-size"}


def _last_value(args: Sequence[str], flag: str) -> str | None:
    """The value server.extra_args gives `flag` as `extra_arg` reads it, its short spellings (VLLM_SHORT_OPTIONS,
    `-pp 2`, `-pp=2`) included: vLLM keeps the last of them all."""
    args = vllm_words(args)
    value = None
    known = vllm_serve_flags()
    for i, arg in enumerate(args):
        name, eq, v = arg.partition("=")
        short = resolve_vllm_option(name, known) if name.startswith("-") and not name.startswith("--") else None
        if VLLM_SHORT_OPTIONS.get(short or name) == flag or extra_arg([arg], flag) is not None:
            value = v if eq else (args[i + 1] if i + 1 < len(args) else "")
    return value


def invalid_numbers(args: Sequence[str]) -> list[tuple[str, str, str]]:
    """(option, value, what it must be) for each server.extra_args option of VLLM_NUMBER_BOUNDS given a value vLLM
    refuses (`--gpu-memory-utilization 1.5`, `-pp 0`, a word for a number); the value vLLM keeps (`extra_arg`)."""
    out = []
    for flag, (what, ok) in VLLM_NUMBER_BOUNDS.items():
        value = _last_value(args, flag)
        if value is None or value in ("", "None") and vllm_serve_number_types().get(flag, "").endswith("?"):
            continue
        try:
            good = math.isfinite(float(value)) and ok(float(value))
        except ValueError:
            good = False
        if not good:
            out.append((flag, value, what))
    return out


def _unknown_phrase(unknown: list[tuple[str, str | None]]) -> str:
    known = vllm_serve_flags()

    def phrase(arg: str, close: str | None) -> str:
        longer = abbreviated_options(vllm_option(arg) or arg, known)
        if len(longer) > 1:
            more = f" and {len(longer) - 3} more" if len(longer) > 3 else ""
            return (f"{arg} abbreviates several options of `vllm serve` ({', '.join(longer[:3])}{more}), which its "
                    "parser refuses as ambiguous: give the option in full")
        return f"{arg} is not an option of `vllm serve`" + (f" (did you mean {close}?)" if close else "")

    return "; ".join(phrase(arg, close) for arg, close in unknown)


def pinned_image(cfg: ServeConfig) -> bool:
    """Whether the container runs the vLLM release vllm_serve_flags.txt lists (the pinned image, or ours from it)."""
    return cfg.container.image in (DEFAULT_IMAGE, VLLM_TPU_IMAGE)


def extra_args_warning(cfg: ServeConfig) -> str | None:
    """Options the pinned release lacks that are not refused: with another container.image (its list may differ),
    or with nothing close among the pinned options (a plugin's option, say); said once."""
    unknown = [(a, c) for a, c in unknown_extra_args(cfg.server.extra_args) if not pinned_image(cfg) or c is None]
    if not unknown:
        return None
    image = f"container.image {cfg.container.image} may take it" if not pinned_image(cfg) else "a plugin may add it"
    return (f"server.extra_args: {_unknown_phrase(unknown)} in {VLLM_TPU_IMAGE} (serving/vllm_serve_flags.txt); "
            f"{image}, else vLLM stops at it when the container starts")


def _takes(query: str, allowed: Sequence[str]) -> str:
    """'(did you mean X? it takes a, b, c)': the closest of `allowed` to `query`, if any is close, and the list."""
    close = difflib.get_close_matches(query, allowed, n=1, cutoff=0.6)
    return "(" + (f"did you mean {close[0]}? " if close else "") + f"it takes {', '.join(allowed)})"


def serves_jax_model(fam: Family, impl: str) -> bool:
    """Whether vLLM-TPU serves `fam` with tpu-inference's own JAX model under container.env.MODEL_IMPL_TYPE=`impl`
    (else vLLM's PyTorch model, through torchax)."""
    return fam.vllm_jax_native and impl in ("auto", "flax_nnx")


def model_impl_problem(cfg: ServeConfig, fam: Family | None = None, arch: str = "",
                       hf: dict | None = None) -> str | None:
    """What tpu-inference or vLLM would refuse, or quietly not do, of the implementation the config chooses; None if
    nothing. Without `fam` (no directory read yet) the values alone: container.env's MODEL_IMPL_TYPE and
    DRAFT_MODEL_IMPL_TYPE (tpu-inference refuses another at engine start, on the VM) and server.extra_args'
    --model-impl. With the family served: a --model-impl tpu-inference's JAX model ignores, a config.json (`hf`)
    without the text_config that model reads, and lora.adapters on it."""
    for key, allowed in IMPL_ENV.items():
        value = cfg.container.env.get(key)
        if value is not None and value not in allowed:
            return f"container.env.{key}={value!r} is not one tpu-inference takes {_takes(str(value).lower(), allowed)}"
    vllm_impl = extra_arg(cfg.server.extra_args, "--model-impl")
    if vllm_impl is not None and vllm_impl not in VLLM_MODEL_IMPLS:  # vLLM's ModelImpl refuses it at engine start
        return (f"server.extra_args: --model-impl {vllm_impl!r} is not a model implementation vLLM takes "
                + _takes(vllm_impl.lower(), VLLM_MODEL_IMPLS))
    impl = cfg.container.env.get("MODEL_IMPL_TYPE", "auto")
    if fam is None or not serves_jax_model(fam, impl):
        return None  # vLLM's PyTorch model through torchax, which takes --model-impl and LoRA adapters
    if vllm_impl not in (None, "auto"):
        # vLLM's option reads like the switch, and tpu-inference's JAX model would be served without a word
        return (f"server.extra_args: --model-impl {vllm_impl} chooses among vLLM's PyTorch models, which "
                f"tpu-inference does not use for {arch} under container.env.MODEL_IMPL_TYPE={impl} (it serves its "
                "JAX model): set container.env.MODEL_IMPL_TYPE=vllm to serve vLLM's model, or drop --model-impl")
    if fam.vllm_jax_needs_text_config and hf is not None and not isinstance(hf.get("text_config"), dict):
        return (f"model dir {cfg.model_dir}: config.json is a text-only {arch} (no text_config), which "
                f"tpu-inference's JAX model, serving it under container.env.MODEL_IMPL_TYPE={impl}, cannot load (it "
                "reads the decoder's config from text_config and its weights under model.language_model.): set "
                "container.env.MODEL_IMPL_TYPE=vllm to serve vLLM's own model")
    if cfg.lora.adapters:
        # refused, not switched to vllm here: that would serve another implementation of the model (torchax,
        # its own speed and memory) than the config says; the README's route for a fine-tune is its merge
        return (f"lora.adapters: vLLM-TPU serves {arch} with tpu-inference's JAX model under "
                f"container.env.MODEL_IMPL_TYPE={impl}, which applies no LoRA adapter (vLLM's LoRA is "
                "on its PyTorch model through torchax only): serve each adapter's merge "
                "(python -m convert.merge_orbax) as model.dir, or set container.env.MODEL_IMPL_TYPE=vllm")
    return None


def max_loras(cfg: ServeConfig) -> int:
    """--max-loras: lora.max_loras, else one slot for each adapter, so a batch can mix them all."""
    return cfg.lora.max_loras if cfg.lora.max_loras is not None else max(len(cfg.lora.adapters), 1)


def lora_warning(cfg: ServeConfig) -> str | None:
    """lora.max_loras below the number of adapters: vLLM takes it, and requests for the adapters past it wait for
    a batch of their own."""
    n = len(cfg.lora.adapters)
    unused = [f"lora.{k}={getattr(cfg.lora, k)}" for k in ("max_loras", "max_lora_rank") if getattr(cfg.lora, k)]
    if unused and not n:
        return f"{' and '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without lora.adapters"
    if cfg.lora.max_loras is not None and cfg.lora.max_loras < n:
        return (f"lora.max_loras={cfg.lora.max_loras} is below the {n} adapters configured: a batch holds at most "
                f"{cfg.lora.max_loras} of them, and requests for the others wait (unset it to serve all {n} at once)")
    return None


MODEL_DIR_HINT = "the merged model directory, e.g. model.dir=runs/x-merged"
DEFAULT_CONTEXT = 2048  # the context served where server.max_model_len is unset and the model's is not shorter
# the largest server.* count the launcher passes on (vLLM-TPU's JAX side counts tokens and positions in int32)
MAX_SERVER_INT = 2**31 - 1


def _host_paths(cfg: ServeConfig) -> list[tuple[Any, str, str]]:
    """(section, attribute, key) of each host path of `cfg`, the values that expand environment variables."""
    paths = [(cfg.model, "dir", "model.dir"), (cfg.container, "compile_cache", "container.compile_cache")]
    paths += [(a, "dir", f"lora.adapters.{a.name}.dir") for a in cfg.lora.adapters]
    if cfg.tool_calling.chat_template != "model":
        paths.append((cfg.tool_calling, "chat_template", "tool_calling.chat_template"))
    return paths


def as_written(cfg: ServeConfig) -> ServeConfig:
    """A copy of `cfg` as a config file writes it: each host path's `$` as `$$` (read back, `$x` is the variable
    x; a path holding a `$` was printed by --print-config as one `--config` then refused or read otherwise)."""
    cfg = copy.deepcopy(cfg)
    for section, attr, _ in _host_paths(cfg):
        if isinstance(getattr(section, attr), str):
            setattr(section, attr, getattr(section, attr).replace("$", "$$"))
    return cfg


def load_serve_config(path: str | Path | None, overrides: Sequence[str] = (), need_dir: bool = True) -> ServeConfig:
    """Read a serve-*.yaml, apply overrides, check the fields that need no filesystem; `need_dir=False` (for printing
    the config) lets model.dir be unset."""
    cfg = load_typed(ServeConfig, path, overrides, foreign=vllm_option_keys(), elsewhere=TRAINING_SECTIONS,
                     example="configs/serve-gemma3-270m-fitness.yaml")
    where = str(path) if path is not None else "config"

    def bad(msg: str) -> None:  # an error a command-line override caused names the override
        raise UserError(f"{blame(msg, where, overrides, key_lines(path))}: {msg}")

    # the host paths expand environment variables as a run config's do: `model.dir: $RUNS/x-merged` was read
    # literally (a directory named '$RUNS' in the working directory, said not to exist)
    if cfg.tool_calling.chat_template != "model" and not cfg.tool_calling.chat_template.strip():
        bad("tool_calling.chat_template is empty (give model, the directory's own template, or a .jinja file)")
    for section, attr, key in _host_paths(cfg):
        if isinstance(getattr(section, attr), str):
            try:
                setattr(section, attr, expand_env(getattr(section, attr), key))
            except UserError as e:
                bad(str(e))
            try:  # as the launcher resolves it (the served name, the mounts): a loop was a RuntimeError traceback
                Path(getattr(section, attr)).expanduser().resolve()
            except (RuntimeError, OSError) as e:
                bad(f"{key} {getattr(section, attr)}: cannot resolve the path ({e}; a symbolic link that leads back "
                    "to itself?)")
    if not cfg.model.dir and need_dir:
        bad(f"model.dir is not set ({MODEL_DIR_HINT})")
    if cfg.model.name is not None and not _NAME.fullmatch(cfg.model.name):
        bad(f"model.name {cfg.model.name!r}: use letters, digits, '.', '_' and '-'")
    if cfg.model.dir and not _NAME.fullmatch(cfg.served_name):
        bad(f"the directory name {cfg.served_name!r} cannot be a served model name; set model.name")
    s = cfg.server
    for key in ("tensor_parallel_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(s, key) is None:  # max_model_len unset: DEFAULT_CONTEXT, or the model's (`served_context`)
            continue
        if getattr(s, key) <= 0:
            bad(f"server.{key} must be positive, got {getattr(s, key)}")
        if getattr(s, key) > MAX_SERVER_INT:  # `max_model_len: 1e20` was rendered as --max-model-len 1000...0
            bad(f"server.{key}={getattr(s, key)} is past what vLLM's 32-bit token counts and positions hold "
                f"(at most {MAX_SERVER_INT})")
    if s.max_num_batched_tokens < s.max_num_seqs:  # vLLM's SchedulerConfig refuses it when the engine starts
        bad(f"server.max_num_batched_tokens={s.max_num_batched_tokens} is below server.max_num_seqs="
            f"{s.max_num_seqs}; vLLM needs at least one token a step for each sequence")
    known = vllm_serve_flags()
    if s.max_model_len is not None and (why := unchunked_prefill_refusal(s, s.max_model_len)):
        bad(why)  # left unset, the context may follow a shorter model: checked with it (`served_context`)
    for arg in s.extra_args:
        option = vllm_option(arg)
        flag = resolve_vllm_option(option, known) if option is not None else None  # `--max-model-l`: abbreviated
        if flag in RENDERED_FLAGS or option in RENDERED_FLAGS:
            bad(f"server.extra_args: {arg} is set from the config; set {RENDERED_FLAGS[flag or option]} instead")
        if flag in ("--help", "-h"):  # `--help=KEYWORD` too (vLLM's help search): it exits once it has printed
            bad(f"server.extra_args: {arg} makes `vllm serve` print its help and exit 0: the container stops before "
                f"serving anything; leave it out (the pinned release's options are in serving/vllm_serve_flags.txt)")
    # a misspelling of a pinned option is refused; a word like none of them is only warned of (extra_args_warning)
    typos = [(a, c) for a, c in unknown_extra_args(s.extra_args) if c is not None]
    if pinned_image(cfg) and typos:
        bad(f"server.extra_args: {_unknown_phrase(typos)} (the options of {VLLM_TPU_IMAGE} are listed in "
            "serving/vllm_serve_flags.txt); vLLM would stop at it on the TPU VM")
    for flag, value, allowed in invalid_choices(s.extra_args) if pinned_image(cfg) else ():
        bad(f"server.extra_args: {flag} {value!r} is not a value `vllm serve` takes in {VLLM_TPU_IMAGE} "
            f"{_takes(value, allowed)}; vLLM would stop at it on the TPU VM")
    for flag, value, what in invalid_number_types(s.extra_args) if pinned_image(cfg) else ():
        bad(f"server.extra_args: {flag} " + (f"needs a value ({what})" if value is None else f"{value!r} is not {what}")
            + f", which `vllm serve` takes in {VLLM_TPU_IMAGE}; vLLM would stop at it on the TPU VM")
    for word, on, off in switch_values(s.extra_args) if pinned_image(cfg) else ():
        bad(f"server.extra_args: {word} gives a value to a switch, which `vllm serve` stops at (ignored explicit "
            f"argument) on the TPU VM; write {on} to turn it on, or " + (f"{off} to turn it off" if off else
                                                                          "leave it out to keep it off"))
    switches = vllm_switches()
    for word, after in stray_words(s.extra_args) if pinned_image(cfg) else ():
        read = vllm_words([after])[0] if after else None  # `-n2` as the parser reads it, `-n=2`
        option = vllm_option(read) if read else None
        if option is not None and "=" not in read and resolve_vllm_option(option, known) in switches:
            took = f"{after} is a switch, which takes none"
        else:
            took = (f"{after} took its value" if "=" in read else f"{option} takes one") if read else \
                "no option before it"
        bad(f"server.extra_args: {word!r} is no option's value ({took}): `vllm serve` would read it as a second "
            f"model and stop at it on the TPU VM (unrecognized arguments); give each option and each value as a "
            f"word of its own")
    for flag, value, what in invalid_numbers(s.extra_args):
        bad(f"server.extra_args: {flag} {value!r} is not {what}; vLLM would stop at it on the TPU VM")
    if not 0 < s.port < 65536:
        bad(f"server.port must be in 1..65535, got {s.port}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.:-]*|\[[0-9A-Fa-f:.]+\]", s.host or ""):
        bad(f"server.host {s.host!r} is not a host name or address (127.0.0.1 keeps the API local; "
            "0.0.0.0 exposes it)")
    if s.host.startswith("["):  # an IPv6 address as a URL writes it: servers bind the address itself, and vLLM's
        s.host = s.host[1:-1]   # uvicorn (and --local's port check) took '[::1]' for a name that does not resolve
    c = cfg.container
    # docker's reference grammar, loosely: [registry[:port]/]path[:tag][@digest], no spaces
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:-]*(@sha256:[0-9a-f]{64})?", c.image or ""):
        bad(f"container.image {c.image!r} is not an image reference (e.g. {DEFAULT_IMAGE})")
    if c.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", c.name):
        bad(f"container.name {c.name!r}: docker names use letters, digits, '_', '.' and '-'")
    if not (c.compile_cache or "").strip():
        bad("container.compile_cache is empty (a host directory for vLLM's compile cache, e.g. ~/.cache/vllm)")
    for key, v in (("server.api_key_env", s.api_key_env), ("container.hf_token_env", cfg.container.hf_token_env)):
        if v is not None and _secret_like(v):  # passed as a name, it was printed in the docker command (and refused
            # as no name, echoed in the error): said without it
            bad(f"{key} names the environment variable that holds the secret (e.g. "
                f"{'VLLM_API_KEY' if key.startswith('server') else 'HF_TOKEN'}), and its value looks like a key or "
                f"token itself ({len(v)} characters, not shown here): export it under that name and give the name")
        if v is not None and not _ENV_NAME.fullmatch(v):
            bad(f"{key} must be an environment variable name, got {v!r}")
    for k in cfg.container.env:
        if not _ENV_NAME.fullmatch(k):
            bad(f"container.env: {k!r} is not an environment variable name")
        if k in SECRET_ENV:
            bad(f"container.env.{k}: secrets are passed by name (server.api_key_env, container.hf_token_env), "
                "not written into the config")
    problem = model_impl_problem(cfg)
    if problem:
        bad(problem)
    if not re.fullmatch(r"\d+[bkmg]?", cfg.container.shm_size.lower()):
        bad(f"container.shm_size {cfg.container.shm_size!r} is not a size like 16g")
    if not int(cfg.container.shm_size.rstrip("bkmgBKMG")):  # docker takes 0 as "its default" (64m), silently
        bad(f"container.shm_size {cfg.container.shm_size!r} is zero; give a positive size like 16g")
    elif cfg.container.shm_size.isdigit():  # docker reads it as bytes: a unit meant (16 -> 16 bytes of /dev/shm)
        bad(f"container.shm_size {cfg.container.shm_size!r} has no unit, and docker reads a bare number as bytes "
            f"({cfg.container.shm_size} bytes); give the unit, e.g. {cfg.container.shm_size}g ('b' for bytes)")
    names = [a.name for a in cfg.lora.adapters]
    for i, a in enumerate(cfg.lora.adapters):
        if not (a.name or "").strip():  # was "name '': use letters, ...", of a name never given
            bad(f"lora.adapters[{i}]: name is not set (give {{name: NAME, dir: DIR}}: clients send NAME as the model)")
        if not _NAME.fullmatch(a.name or ""):
            bad(f"lora.adapters: name {a.name!r}: use letters, digits, '.', '_' and '-'")
        if not a.dir:
            bad(f"lora.adapters.{a.name}: dir is not set")
        if a.name in names[:i]:  # the two cases said as one ("names must be unique and differ ..."), naming neither
            bad(f"lora.adapters: {a.name!r} is the name of two adapters (lora.adapters[{names.index(a.name)}] and "
                f"[{i}]); give each its own")
        if (cfg.model.dir or cfg.model.name) and a.name == cfg.served_name:
            key = "model.name" if cfg.model.name else f"the name of model.dir, {cfg.model.dir}"
            bad(f"lora.adapters[{i}]: {a.name!r} is the served model's name ({key}) too; give the adapter another")
    if cfg.lora.max_loras is not None and cfg.lora.max_loras < 1:  # vLLM's LoRAConfig: max_loras >= 1
        bad(f"lora.max_loras must be at least 1, got {cfg.lora.max_loras}")
    cpu = extra_arg(s.extra_args, "--max-cpu-loras")
    if cfg.lora.adapters and cpu is not None:  # vLLM's LoRAConfig refuses max_cpu_loras < max_loras at start
        if not cpu.isdigit() or int(cpu) < max_loras(cfg):
            bad(f"server.extra_args: --max-cpu-loras {cpu} must be an integer of at least lora.max_loras="
                f"{max_loras(cfg)} (vLLM refuses fewer)")
    if cfg.lora.max_lora_rank is not None and cfg.lora.max_lora_rank not in VLLM_LORA_RANKS:
        bad(f"lora.max_lora_rank must be one of {', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's choices), "
            f"got {cfg.lora.max_lora_rank}")
    return cfg


# ------------------------------------------------------------------------------ model checks


@dataclasses.dataclass
class ModelFacts:
    """What `inspect_model` learned, for rendering the command."""

    architecture: str
    family: str
    num_key_value_heads: int
    chat_template_file: str | None  # name of the .jinja template file in the model dir to pass vLLM, if any
    has_chat_template: bool  # a template anywhere vLLM/transformers look (file or tokenizer_config)
    lora_rank: int | None  # --max-lora-rank to pass
    unexpected_weights: list[str] = dataclasses.field(default_factory=list)  # see check_weight_names
    # `dir_identity` of the directory checked (taken before its config.json): the local server refuses another
    identity: tuple[int, int] | None = None
    adapter_warnings: list[str] = dataclasses.field(default_factory=list)  # see check_adapter_base
    max_model_len: int | None = None  # the context to serve (`served_context`): --max-model-len, --local's bound


def vllm_families() -> dict[str, Family]:
    """HF architecture -> model family, for every architecture vLLM-TPU serves (the registry's
    `Family.vllm_architectures`)."""
    return {arch: fam for fam in families().values() for arch in fam.vllm_architectures}


def check_weights(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """safetensors weights: one `model.safetensors`, or an index whose every shard is present (and no
    `model.safetensors` beside it naming other weights: `gemma_tpu.hf.safetensors_io.WeightsDir`); each file's
    header read and its tensors' byte ranges inside the file (a copy cut short, a file of something else:
    the server failed on it with a safetensors traceback after starting, vLLM minutes into its start).
    Returns each tensor's shape by name."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = read_json_object(index, f"{index}: cannot read")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: no weight_map")
        for shard in sorted(set(weight_map.values())):
            if not (model_dir / shard).is_file():
                raise UserError(f"model dir {model_dir}: shard {shard} listed in model.safetensors.index.json "
                                "is missing")
    if index.is_file() or (model_dir / "model.safetensors").is_file():
        # the files as the loader, inspect and verify read them: a stale model.safetensors beside an index naming
        # other shards was served, the one by transformers serve (--local) and the other by vLLM
        weights = WeightsDir(model_dir)
        return {name: weights[name].shape for name in weights.names()}
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if shards:
        raise UserError(f"model dir {model_dir}: sharded weights ({shards[0]}, ...) without "
                        "model.safetensors.index.json")
    raise UserError(f"model dir {model_dir}: no weights (model.safetensors or model.safetensors.index.json)")


def check_weight_names(model_dir: Path, family: Family, hf_config: dict, names: Sequence[str]) -> list[str]:
    """Every tensor config.json's model needs is in the weights (the registry's `Family.required_weights`, the
    table the loader and the merge use); returns the decoder tensors beyond them (a layer past num_hidden_layers,
    a leftover lm_head of a tied model, ...), which the servers ignore. A directory missing one tensor (a copy
    cut short, an edited checkpoint) passed here: vLLM refused it when the engine started, minutes into the
    container's start, and transformers serve filled the tensor with random values and answered."""
    try:
        prefix = family.text_prefix(names)
        want = family.required_weights(hf_config, prefix)
    except UserError as e:
        where = f"{model_dir}/config.json"
        raise UserError(f"model dir {model_dir}: {str(e).replace('config.json', where, 1)}") from None
    have, need = set(names), set(want)
    missing = [n for n in want if n not in have]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserError(f"model dir {model_dir}: {len(missing)} tensor{'s' if len(missing) > 1 else ''} of the "
                        f"model its config.json describes missing from the weights ({', '.join(missing[:3])}{more}): "
                        "vLLM refuses it when the engine starts, transformers fills them with random values "
                        "(merge it again, or copy the whole directory)")
    return [n for n in names if n not in need and (n.startswith(prefix) or n.startswith("lm_head."))]


def template_warning(cfg: "ServeConfig", facts: "ModelFacts") -> str | None:
    """A model without a chat template served with tool calling off and no tool_calling.chat_template: vLLM answers
    every /v1/chat/completions with an error (transformers has no default template), where `--local` writes our tool
    template and answers, so a client tried locally failed on the VM without a word here."""
    if cfg.tool_calling.enabled or cfg.tool_calling.chat_template != "model" or facts.has_chat_template:
        return None
    return (f"model.dir {cfg.model_dir} has no chat template (chat_template.jinja or tokenizer_config.json) and "
            f"tool calling is off: vLLM answers /v1/completions only, every chat completion an error (--local "
            f"answers them with the tool template it writes); set tool_calling.chat_template to a .jinja file")


def weights_warning(facts: "ModelFacts") -> str | None:
    """Decoder tensors the model's config.json has no place for (the servers load without them)."""
    extra = facts.unexpected_weights
    if not extra:
        return None
    more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
    return (f"model.dir: {len(extra)} tensor{'s' if len(extra) > 1 else ''} the model its config.json describes has "
            f"no place for ({', '.join(extra[:3])}{more}); the servers ignore {'them' if len(extra) > 1 else 'it'}")


def check_tokenizer(model_dir: Path) -> None:
    """The tokenizer files are there and their JSON reads (transformers, hence vLLM, fails on a broken
    tokenizer_config.json or tokenizer.json: a copy cut short, a hand edit)."""
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer.model").is_file():
        raise UserError(f"model dir {model_dir}: no tokenizer (tokenizer.json or tokenizer.model)")
    read_json_object(model_dir / "tokenizer_config.json", f"model dir {model_dir}: no tokenizer_config.json")
    if (model_dir / "tokenizer.json").is_file():
        read_json_object(model_dir / "tokenizer.json", f"model dir {model_dir}: no tokenizer.json")


def _tokenizer_config_value(model_dir: Path, key: str) -> Any:
    """A key of tokenizer_config.json, None where the file is absent or unreadable (`check_tokenizer` says so)."""
    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text()).get(key)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None


def _tokenizer_template(model_dir: Path) -> bool:
    """Whether tokenizer_config.json carries a chat template."""
    return bool(_tokenizer_config_value(model_dir, "chat_template"))


def _tokenizer_max_length(model_dir: Path) -> int | None:
    """tokenizer_config.json's model_max_length, when it is a length (not transformers' 1e30 "no limit")."""
    n = _tokenizer_config_value(model_dir, "model_max_length")
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 < n < 1 << 62 else None


def chat_template_in(model_dir: Path) -> tuple[str | None, bool]:
    """(template file name or None, whether the directory carries a chat template at all)."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (model_dir / name).is_file():
            return name, True
    return None, _tokenizer_template(model_dir)


def adapter_rank(adapter_dir: Path, name: str) -> int:
    """The adapter's largest rank (r, or a module's rank_pattern rank above it: vLLM's max_lora_rank must hold every
    module's lora_A, whatever its r says), adapter_config.json checked for what vLLM refuses at load
    (gemma_tpu.hf.adapter)."""
    return largest_rank(read_adapter_config(adapter_dir, f"lora.adapters.{name}"))


def check_adapter_fits(adapter_dir: Path, name: str, r: int, base: dict[str, tuple[int, ...]]) -> None:
    """Every decoder-layer LoRA pair of the adapter fits model.dir's weight at its module path, at rank `r` (its
    adapter_config.json's) or its rank_pattern rank, and is scaled by vLLM as by peft. An adapter of
    another model (a 270M adapter on a 1B base) or an unreadable adapter_model.safetensors failed in vLLM's start
    on the TPU VM, after the container had come up; one of another model class was quietly left unused; one with
    per-module ranks was refused as mis-shaped, and one whose patterns change a module's scale was served with
    vLLM's one scale."""
    where = f"lora.adapters.{name}"
    cfg = read_adapter_config(adapter_dir, where)
    prefixes = {p for fam in families().values() for p in fam.text_prefixes}
    check_adapter_sites(adapter_dir, where, r, base, prefixes, cfg.get("rank_pattern"))
    check_vllm_scaling(adapter_dir, where, cfg)


def _record(path: Path) -> dict:
    """One of our provenance records (a merge's, an adapter export's) as a dict; {} where absent or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def check_adapter_base(adapter_dir: Path, name: str, model_dir: Path) -> str | None:
    """The base model.dir is to the adapter, by the records convert.export_peft and convert.merge_orbax write: a
    model.dir that is the merge of the very run the adapter was exported from is refused (vLLM adds the adapter's
    update to weights that hold it already: the update twice, of the same shapes, without a word); one whose weights
    differ from the base fingerprinted at training is returned as a warning (another model of the same shapes, or
    the base re-saved, e.g. in another dtype). None where nothing is recorded or all agrees."""
    adapter = _record(adapter_dir / ADAPTER_RECORD)
    run = adapter.get("checkpoint")
    if not run:
        return None
    merge = _record(model_dir / MERGE_RECORD)
    if merge.get("kind") == "lora" and merge.get("checkpoint") == run:
        base = (merge.get("base") or {}).get("dir")
        raise UserError(f"lora.adapters.{name}: model.dir {model_dir} is a merge of {run}, the run this adapter was "
                        f"exported from: vLLM would add the adapter's update a second time; serve model.dir without "
                        f"the adapter, or the adapter on its base{f' {base}' if base else ''}")
    recorded = (adapter.get("base") or {}).get("fingerprint")
    diff = first_difference(recorded, model_dir) if isinstance(recorded, dict) else None
    if diff is None:
        return None
    return (f"lora.adapters.{name} was trained on another base than model.dir ({diff}): another model of the same "
            "shapes serves the adapter with other numbers than trained (fine if model.dir is that base re-saved)")


def check_adapter_tokenizer(adapter_dir: Path, name: str, model_dir: Path) -> None:
    """vLLM decodes every adapter's output with model.dir's tokenizer (it no longer loads an adapter's own). A
    tool-calling fine-tune of a base without FunctionGemma markers ships a tokenizer publishing them on the reserved
    ids it was trained on (convert.export_peft); served on that base its calls came out as `<unusedN>` tokens, which
    vLLM drops from the text as special tokens, and no tool-call parser saw a call."""
    missing = tokens_named(adapter_dir, FUNCTION_MARKERS) - tokens_named(model_dir, FUNCTION_MARKERS)
    lacking = [m for m in FUNCTION_MARKERS if m in missing]  # each tokenizer read once, not once a marker
    if lacking:
        raise UserError(f"lora.adapters.{name}: its tokenizer names the tool-call marker {lacking[0]}, which "
                        f"model.dir's tokenizer lacks; vLLM decodes adapters with model.dir's tokenizer, so this "
                        f"adapter's tool calls would be lost: serve its merge (python -m convert.merge_orbax) as "
                        f"model.dir instead")


def check_template_file(path: Path, key: str) -> None:
    """A chat template file the server is given: a file of UTF-8 text, not empty. One that is not text stopped --local
    with a UnicodeDecodeError traceback and vLLM when it read it, after the container had come up."""
    if not path.is_file():
        raise UserError(f"{key}: {path} is not a file")
    try:
        raw = path.read_bytes()
        form = other_unicode(raw[:6])
        if form:  # a UTF-16 export was 'not UTF-8 text (byte 0)', naming no encoding, as configs and data name it
            raise UserError(f"{key}: {path} is {form}; save it as UTF-8")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{key}: {path} is not UTF-8 text (byte {e.start}): not a Jinja chat template") from None
    except OSError as e:
        raise UserError(f"{key}: {path}: cannot read it ({e.strerror or e})") from None
    if not text.strip():
        raise UserError(f"{key}: {path} is empty: no chat template to render the messages with")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if path.suffix == ".json" or isinstance(obj, dict):
        # a chat_template.json (the template as a JSON string): vLLM's --chat-template (and --local, which writes it
        # as the served chat_template.jinja) took the file's text as the template, and the JSON was every prompt
        raise UserError(f"{key}: {path} holds JSON, and the server reads the file's text as the template (the JSON "
                        f"would be the prompt): save its \"chat_template\" as a .jinja file and give that")
    problem = jinja_syntax_error(text)
    if problem:
        raise UserError(f"{key}: {path} {problem}")


def jinja_syntax_error(text: str) -> str | None:
    """Where the Jinja template `text` cannot be parsed ("line 3: unexpected '}'"), or why it is no chat template (it
    never reads `messages`), or None. Parsed as transformers compiles chat templates (loop controls, the `{%
    generation %}` block of assistant masks): a template with a syntax error passed the launcher and failed in vLLM at
    the first request, the container up and the model loaded."""
    try:
        import jinja2
        import jinja2.ext
    except ImportError:  # no transformers (nor jinja2) here: the server's own load still says it
        return None

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    try:
        env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, Generation])
        ast = env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message} (not a Jinja template transformers and vLLM can compile)"
    import jinja2.meta

    if "messages" not in jinja2.meta.find_undeclared_variables(ast):  # every prompt would be the same text
        return "never reads `messages`: not a chat template (the conversation would not reach the prompt)"
    return None


def unchunked_prefill_refusal(s: ServerSection, context: int) -> str | None:
    """Why vLLM would refuse `context` with these server settings: with --no-enable-chunked-prefill last in
    server.extra_args a prompt is prefilled in one step, so vLLM's SchedulerConfig needs max_num_batched_tokens of
    at least the context when the engine starts."""
    known = vllm_serve_flags()
    chunked = [resolve_vllm_option(o, known) for o in map(vllm_option, s.extra_args) if o is not None]
    chunked = [o for o in chunked if o in ("--enable-chunked-prefill", "--no-enable-chunked-prefill")]
    if not (chunked and chunked[-1] == "--no-enable-chunked-prefill" and s.max_num_batched_tokens < context):
        return None
    return (f"server.max_num_batched_tokens={s.max_num_batched_tokens} is below server.max_model_len={context} with "
            "--no-enable-chunked-prefill in server.extra_args; vLLM refuses a prompt longer than a step without "
            "chunked prefill (raise it, or keep chunked prefill)")


def served_context(cfg: ServeConfig, d: Path, hf: dict, text: dict) -> int:
    """The context both servers are given: server.max_model_len, refused where it passes the model's
    max_position_embeddings or tokenizer_config.json's model_max_length (vLLM's max length is the smaller of them,
    vllm/config/model.py _get_and_verify_max_len, and it refuses a longer --max-model-len when the engine starts;
    --local quietly served the shorter one), unless container.env.VLLM_ALLOW_LONG_MAX_MODEL_LEN lets vLLM take it.
    Left unset, the default follows a model whose context is shorter."""
    given = cfg.server.max_model_len is not None
    want = cfg.server.max_model_len if given else DEFAULT_CONTEXT
    # vLLM takes a longer --max-model-len with this in its environment (vllm/envs.py reads "1" or "true")
    if str(cfg.container.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0")).strip().lower() in ("1", "true"):
        limits = []
    else:
        limits = []
        max_pos = text.get("max_position_embeddings", hf.get("max_position_embeddings"))
        if isinstance(max_pos, int) and not isinstance(max_pos, bool) and max_pos > 0:
            limits.append((max_pos, f"the model's max_position_embeddings={max_pos}"))
        tok_max = _tokenizer_max_length(d)
        if tok_max is not None and not (isinstance(hf.get("model_max_length"), int) and hf["model_max_length"] >= want):
            limits.append((tok_max, f"model_max_length={tok_max} in {d}/tokenizer_config.json, which vLLM also "
                                    f"bounds the context by"))
    for n, what in limits if given else ():
        if want > n:
            raise UserError(f"server.max_model_len={want} exceeds {what}: vLLM refuses it when the engine starts; set "
                            f"server.max_model_len to at most {n}, or leave it unset to follow the model")
    context = min([want, *(n for n, _ in limits)])
    if not given and (why := unchunked_prefill_refusal(cfg.server, context)):
        raise UserError(why)  # a given context was checked with the config (`validate`)
    return context


def inspect_model(cfg: ServeConfig, for_vllm: bool = True) -> ModelFacts:
    """Check the model directory (and adapters) against what vLLM-TPU needs; one-line errors.

    `for_vllm=False` (the local `transformers serve`) skips the TPU-only rules (architecture set,
    tensor parallelism, LoRA ranks) and the chat-template requirement, which the local server fills.
    """
    d = cfg.model_dir
    if not d.is_dir():
        raise UserError(f"model.dir {cfg.model.dir}: not a directory")
    # its files are read one by one: a merge's --overwrite publishing another model meanwhile is refused at the end
    identity = dir_identity(d)
    hf = read_json_object(d / "config.json", f"model dir {d}: no config.json ({training_run_hint(d)})")
    weights = check_weights(d)
    # both servers read their stop tokens from it (without it, Gemma's <end_of_turn> would not end an answer);
    # vLLM quietly does without one it cannot parse
    server = "vLLM" if for_vllm else "the local server"
    read_json_object(d / "generation_config.json",
                     f"model dir {d}: no generation_config.json ({server} reads its stop tokens from it)")
    check_tokenizer(d)
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1:
        raise UserError(f"model dir {d}: config.json must name exactly one architecture, got {archs!r}")
    arch = archs[0]
    served = vllm_families()
    fam = served.get(arch)
    family = fam.name if fam else None
    if family is None and for_vllm:
        raise UserError(f"model dir {d}: architecture {arch} is not one vLLM-TPU serves here "
                        f"(supported: {', '.join(sorted(served))})")
    text = fam.read_text_config(hf) if fam else text_config(hf)  # omitted keys at transformers' defaults
    unexpected = check_weight_names(d, fam, hf, list(weights)) if fam else []
    kv = text.get("num_key_value_heads", hf.get("num_key_value_heads"))
    if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0:
        raise UserError(f"model dir {d}: config.json has no num_key_value_heads")
    context = served_context(cfg, d, hf, text)
    tp = cfg.server.tensor_parallel_size
    template_file, has_template = chat_template_in(d)
    in_json = template_file == "chat_template.json"
    if in_json:  # vLLM's --chat-template takes a file's text as the template: JSON would be the prompt itself
        template_file = None
    rank = None
    base_warnings: list[str] = []  # adapters trained on another base than model.dir (check_adapter_base)
    if for_vllm:
        # vLLM (and tpu-inference's JAX models) split the KV heads over tp <= kv devices and copy each KV head
        # to tp / kv devices past that; the query heads are split in both cases
        kv_counts = [("num_key_value_heads", kv)]
        global_kv = text.get("num_global_key_value_heads")
        if (text.get("attention_k_eq_v") and isinstance(global_kv, int) and not isinstance(global_kv, bool)
                and global_kv > 0):
            # Gemma 4's K=V full-attention layers have their own KV-head count, which vLLM shares out alike
            # (vllm/model_executor/models/gemma4.py asserts it when the engine builds the model); there is always
            # one, the last layer, whatever layer_types says (transformers makes it full attention)
            kv_counts.append(("num_global_key_value_heads", global_kv))
        for key, n in kv_counts:
            if (n % tp) if tp <= n else (tp % n):
                raise UserError(f"server.tensor_parallel_size={tp} cannot share out {key}={n} "
                                f"({d}/config.json): use a divisor of {n} or a multiple of it")
        heads = text.get("num_attention_heads", hf.get("num_attention_heads"))
        if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 and heads % tp:
            raise UserError(f"server.tensor_parallel_size={tp} does not divide num_attention_heads={heads} "
                            f"({d}/config.json)")
        # with expert parallelism each expert stays whole on a chip: its width is not split
        experts_whole = bool_extra_arg(cfg.server.extra_args, "--enable-expert-parallel", "-ep")
        split = (*fam.vllm_tp_split_sizes, *(() if experts_whole else fam.vllm_tp_expert_split_sizes))
        for key in split:  # an AssertionError minutes into vLLM's start
            size = text.get(key)
            if isinstance(size, int) and not isinstance(size, bool) and size > 0 and size % tp:
                hint = (" (or spread whole experts over them: --enable-expert-parallel in server.extra_args)"
                        if key in fam.vllm_tp_expert_split_sizes else "")
                raise UserError(f"server.tensor_parallel_size={tp} does not divide {key}={size} ({d}/config.json): "
                                f"vLLM splits it evenly over the chips{hint}")
        impl = cfg.container.env.get("MODEL_IMPL_TYPE", "auto")
        if not serves_jax_model(fam, impl):
            for keys in fam.vllm_torch_tp_split_products:
                sizes = [text.get(key) for key in keys]
                if all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes) and math.prod(
                        sizes) % tp:
                    raise UserError(f"server.tensor_parallel_size={tp} does not divide {' x '.join(keys)} = "
                                    f"{' x '.join(map(str, sizes))} = {math.prod(sizes)} ({d}/config.json): vLLM's "
                                    f"own model (container.env.MODEL_IMPL_TYPE={impl}) splits it evenly over the "
                                    f"chips; tpu-inference's JAX model (MODEL_IMPL_TYPE=auto) keeps it whole")
            for key in fam.vllm_torch_reads_unused_keys:
                if text.get(key):  # null, 0 or absent: nothing applied
                    raise UserError(f"model dir {d}: config.json has {key}={text[key]!r}, which vLLM's own {arch} "
                                    f"(container.env.MODEL_IMPL_TYPE={impl}) applies and transformers (and training) "
                                    f"ignore: it would serve another model than the one trained; remove the key from "
                                    f"config.json, or serve tpu-inference's JAX model (MODEL_IMPL_TYPE=auto)")
        rope = fam.vllm_rope_problem(text, serves_jax_model(fam, impl)) if fam.vllm_rope_problem else None
        problem = rope or (fam.vllm_config_problem(hf) if fam.vllm_config_problem else None)
        if problem:
            raise UserError(f"model dir {d}: config.json has {problem}: vLLM would serve another model than the one "
                            f"trained and merged")
        tied = text.get("tie_word_embeddings", hf.get("tie_word_embeddings", True))
        if fam.vllm_tied_embeddings_only and tied is False:
            raise UserError(f"model dir {d}: vLLM serves {arch} only with tied embeddings "
                            "(config.json has tie_word_embeddings=false)")
        if cfg.tool_calling.enabled:
            want = fam.vllm_tool_parser
            if cfg.tool_calling.parser != want:
                raise UserError(f"tool_calling.parser={cfg.tool_calling.parser} does not read {arch}'s calls; "
                                f"use {want}")
            if cfg.tool_calling.chat_template == "model" and in_json and not _tokenizer_template(d):
                # with tools vLLM reads the tokenizer's template, not the processor's chat_template.json
                raise UserError(f"model dir {d}: the chat template is in chat_template.json, which vLLM neither "
                                "reads for tool calls nor takes as --chat-template (a .jinja file); write its "
                                "\"chat_template\" value to a .jinja file and set tool_calling.chat_template to it")
            if cfg.tool_calling.chat_template == "model" and not has_template:
                raise UserError(f"model dir {d}: no chat template (chat_template.jinja or tokenizer_config.json) "
                                "for tool calling; set tool_calling.chat_template to a .jinja file")
        problem = model_impl_problem(cfg, fam, arch, hf)
        if problem:
            raise UserError(problem)
        ranks = []
        for a in cfg.lora.adapters:
            adir = a.path
            if not adir.is_dir():
                raise UserError(f"lora.adapters.{a.name}: {a.dir} is not a directory")
            adapter_identity = dir_identity(adir)  # an export_peft --overwrite publishes it anew as a merge does
            adapter = read_adapter_config(adir, f"lora.adapters.{a.name}")
            ranks.append(largest_rank(adapter))
            check_adapter_fits(adir, a.name, adapter["r"], weights)
            deployed = extra_arg_values(cfg.server.extra_args, "--lora-target-modules")
            changed = adapter_modules(adir, adapter, f"lora.adapters.{a.name}")  # paths, as vLLM loads them
            lora_problem = fam.vllm_lora_problem(text, changed) if fam.vllm_lora_problem and changed else None
            if lora_problem:
                raise UserError(f"lora.adapters.{a.name}: {a.dir} {lora_problem}")
            targets = module_names(changed) if changed is not None else None
            left_out = lora_modules_left_out(targets, deployed) if deployed is not None and targets is not None else []
            if left_out:
                raise UserError(f"server.extra_args: --lora-target-modules {' '.join(deployed)} leaves out "
                                f"{', '.join(left_out)} of lora.adapters.{a.name}: vLLM would serve the adapter "
                                "without their updates (another model than the one trained); name them too (or "
                                "qkv_proj / gate_up_proj) or drop the option")
            check_adapter_tokenizer(adir, a.name, d)
            warning = check_adapter_base(adir, a.name, d)
            if warning:
                base_warnings.append(warning)
            check_same_directory(adir, adapter_identity)
        if ranks:
            need = max(ranks)
            if cfg.lora.max_lora_rank is not None:
                if cfg.lora.max_lora_rank < need:
                    raise UserError(f"lora.max_lora_rank={cfg.lora.max_lora_rank} is below an adapter's rank {need}")
                rank = cfg.lora.max_lora_rank
            else:
                fitting = [r for r in VLLM_LORA_RANKS if r >= need]
                if not fitting:
                    raise UserError(f"lora.adapters: rank {need} exceeds vLLM's largest max_lora_rank "
                                    f"{VLLM_LORA_RANKS[-1]}")
                rank = fitting[0]
    if cfg.tool_calling.chat_template != "model":  # passed with tool calling off too
        check_template_file(Path(cfg.tool_calling.chat_template).expanduser(), "tool_calling.chat_template")
    elif cfg.tool_calling.enabled and template_file:  # the model's own, passed as vLLM's --chat-template
        check_template_file(d / template_file, f"model dir {d}")
    check_same_directory(d, identity)
    return ModelFacts(arch, family or "other", kv, template_file, has_template, rank, unexpected, identity,
                      base_warnings, context)


def open_api_warning(cfg: ServeConfig) -> str | None:
    """A server listening beyond loopback with no API key answers anyone who can reach the port (the
    container runs with --net host: the VM's own network)."""
    if cfg.server.host in ("127.0.0.1", "localhost", "::1", "[::1]") or cfg.server.api_key_env:
        return None
    return (f"server.host {cfg.server.host} serves the API beyond this machine without an API key: anyone who "
            f"reaches port {cfg.server.port} can use it (set server.api_key_env, or keep server.host=127.0.0.1 and "
            "forward the port)")


def stop_token_warning(cfg: ServeConfig, facts: ModelFacts) -> str | None:
    """Chat models must stop on their family's end-of-turn token (Gemma 3: <end_of_turn>); a base
    generation_config that lists only <eos> makes every answer run to the length limit."""
    fam = families().get(facts.family)
    if fam is None or fam.end_of_turn_id is None:
        return None
    try:
        gen = json.loads((cfg.model_dir / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    eos = gen.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    if fam.end_of_turn_id not in eos:
        return (f"generation_config.json eos_token_id={gen.get('eos_token_id')!r} lacks {fam.end_of_turn_token} "
                f"({fam.end_of_turn_id}): chat answers will run to max_tokens")
    return None
