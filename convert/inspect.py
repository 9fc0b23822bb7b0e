"""Describe a checkpoint or a model directory without loading any weights.

    python -m convert.inspect PATH [--step N] [--json] [--no-tensors]

PATH is a gemma-tpu checkpoint dir (has gemma_tpu_run.json): steps, the chosen step's tensors (from
Orbax's metadata), total bytes, LoRA rank/alpha/targets, the recorded base. Or an HF directory
(config.json and/or *.safetensors, PEFT adapters included): tensors, shapes, dtypes, total bytes,
architecture, shard count. Or one file: a `.safetensors` shard (its tensors and metadata) or a `.gguf`
(as `convert.export_gguf` or llama.cpp write it: architecture, metadata, tensors with their quantization
types; needs the `gguf` package). Only headers and metadata are read.

(Run as a module: this file is named after the standard library's `inspect` on purpose, which is
harmless under `python -m` but would shadow it if `convert/` itself were put on sys.path.)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Sequence

from gemma_tpu.checkpoint.metadata import (
    METADATA_FILE,
    list_steps,
    not_a_checkpoint,
    read_metadata,
    resolve_step,
    step_holding,
)
from gemma_tpu.checkpoint.params import CheckpointParams
from gemma_tpu.core import cli
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError, read_json_object
from gemma_tpu.core.progress import human
from gemma_tpu.hf import safetensors_io as sio


def describe_checkpoint(path: Path, step: int | None) -> dict:
    meta = read_metadata(path)
    steps = list_steps(path)
    info: dict = {
        "kind": "gemma-tpu checkpoint",
        "path": str(path),
        "steps": steps,
        "base_model": meta.get("base_model"),
        "dtype": meta.get("dtype"),
        "lora": meta.get("lora"),
    }
    if steps or step is not None:  # --step on a run with no completed step: said, not ignored
        chosen = resolve_step(path, step)
        params = CheckpointParams(path, chosen)
        info["step"] = chosen
        info["tensors"] = [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype)}
                           for s in params.specs.values()]
        info["num_tensors"] = len(params.specs)
        info["holds"] = "LoRA factors" if params.holds_lora_factors else "full parameters"
        info["total_bytes"] = params.total_bytes
        step_dir = path / str(chosen)
        info["items"] = sorted(p.name for p in step_dir.iterdir() if p.is_dir())
    return info


def describe_hf(path: Path) -> dict:
    info: dict = {"kind": "huggingface", "path": str(path)}
    cfg_path = path / "config.json"
    if cfg_path.is_file():
        cfg = read_json_object(cfg_path, f"{cfg_path}: missing")  # bad JSON or a list: named, not a traceback
        info["architectures"] = cfg.get("architectures")
        info["model_type"] = cfg.get("model_type")
        info["config_dtype"] = cfg.get("dtype") or cfg.get("torch_dtype")
    adapter = path / "adapter_config.json"
    if adapter.is_file():
        a = read_json_object(adapter, f"{adapter}: missing")
        info["kind"] = "peft adapter"
        info["adapter"] = {k: a.get(k) for k in ("peft_type", "r", "lora_alpha", "target_modules",
                                                 "base_model_name_or_path")}
    weights = sio.WeightsDir(path)
    info["shards"] = len(weights.files)
    info["files"] = [p.name for p in weights.files]
    info["num_tensors"] = len(weights.tensors)
    info["total_bytes"] = weights.total_bytes
    info["dtype_bytes"] = _dtype_bytes(weights.tensors.values())
    info["file_metadata"] = weights.file_metadata
    info["tensors"] = [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "file": t.file.name}
                       for t in weights.tensors.values()]
    return info


def _dtype_bytes(tensors) -> dict[str, int]:
    """Bytes per safetensors dtype."""
    out: collections.Counter = collections.Counter()
    for t in tensors:
        out[t.dtype] += t.nbytes
    return dict(out)


def _count(n: int, noun: str) -> str:
    """`1 tensor`, `2 tensors` (the summary said `1 tensors`)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _byte_totals(info: dict) -> str:
    """`N tensors, SIZE (DTYPE SIZE, ...)` for the rendered summary (no empty `()` for a file of no tensors)."""
    per = ", ".join(f"{k} {human(v)}" for k, v in info["dtype_bytes"].items())
    return f"{_count(info['num_tensors'], 'tensor')}, {human(info['total_bytes'])}" + (f" ({per})" if per else "")


def describe_safetensors_file(path: Path) -> dict:
    tensors, meta = sio.file_tensors(path)
    return {"kind": "safetensors file", "path": str(path), "num_tensors": len(tensors),
            "total_bytes": sum(t.nbytes for t in tensors), "dtype_bytes": _dtype_bytes(tensors), "file_metadata": meta,
            "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in tensors]}


GGUF_ARRAY_SHOWN = 8  # longer metadata arrays (the vocabulary, its scores) are described by their length


def describe_gguf_file(path: Path) -> dict:
    """A GGUF's metadata and tensor table (shapes in row-major order, as numpy and safetensors give them;
    GGUF stores them innermost first)."""
    try:
        from gguf import GGUFReader, GGUFValueType  # deferred: optional (the embedded/test/edge extras)
    except ImportError:
        raise UserError(f"{path}: reading a .gguf needs the gguf package (pip install gguf)") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError/IndexError/struct errors on bad bytes
        raise UserError(f"{path}: not a readable GGUF file, truncated or damaged ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160] if str(e) else 'no detail'})") from None
    metadata: dict = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > GGUF_ARRAY_SHOWN:
            metadata[name] = f"[{len(field.data)} items]"
        else:
            value = field.contents()
            metadata[name] = f"[{len(value)} characters]" if isinstance(value, str) and len(value) > 200 else value
    types = collections.Counter()
    tensors = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        types[kind] += int(t.n_bytes)
        tensors.append({"name": t.name, "shape": [int(x) for x in reversed(t.shape)], "dtype": kind})
    return {"kind": "gguf file", "path": str(path), "architecture": metadata.get("general.architecture"),
            "name": metadata.get("general.name"), "num_tensors": len(tensors),
            "total_bytes": sum(types.values()), "dtype_bytes": dict(types), "metadata": metadata, "tensors": tensors}


def describe_file(path: Path, step: int | None) -> dict:
    if step is not None:
        raise UserError(f"--step {step}: {path} is a single file, not a gemma-tpu checkpoint; "
                        f"--step applies to checkpoints only")
    if path.suffix == ".safetensors":
        return describe_safetensors_file(path)
    if path.suffix == ".gguf":
        return describe_gguf_file(path)
    if path.name in ("config.json", "adapter_config.json", METADATA_FILE):  # a file that describes its directory
        raise UserError(f"{path}: give the directory it describes: python -m convert.inspect {path.parent}")
    raise UserError(f"{path}: a file, but neither .safetensors nor .gguf; give a checkpoint dir, an HF directory, "
                    f"a .safetensors or a .gguf file")


def describe(path: str | Path, step: int | None = None) -> dict:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if not path.is_dir():
        return describe_file(path, step)

    if (path / METADATA_FILE).is_file():
        return describe_checkpoint(path, step)
    if (path / "config.json").is_file() or any(path.glob("*.safetensors")):
        if step is not None:  # an HF directory has no steps: --step would be ignored silently
            raise UserError(f"--step {step}: {path} is a Hugging Face directory, not a gemma-tpu checkpoint "
                            f"(no {METADATA_FILE}); --step applies to checkpoints only")
        return describe_hf(path)
    if step_holding(path) is not None:  # a step, or a directory inside one: say whose
        raise UserError(not_a_checkpoint(path))
    raise UserError(f"{path}: neither a gemma-tpu checkpoint ({METADATA_FILE}) nor an HF directory")


def render(info: dict, tensors: bool = True) -> str:
    lines = [f"{info['path']}: {info['kind']}"]
    if info["kind"] == "gemma-tpu checkpoint":
        base = info.get("base_model") or {}
        # what is recorded: a local base has no revision ('revision None'), older files lack other keys
        known = ", ".join(f"{what} {base[key]}" for what, key in (("family", "family"), ("local", "local_dir"),
                                                                   ("revision", "revision")) if base.get(key))
        lines.append(f"  base: {base.get('path') or 'not recorded'}" + (f" ({known})" if known else ""))
        lora = info.get("lora")
        if not lora:  # null or absent: the trainer always writes one (the converters go by what the step holds)
            lines.append(f"  LoRA or full fine-tune: not recorded ({METADATA_FILE} has no lora settings)"
                         + (f"; step {info['step']} holds {info['holds']}" if "holds" in info else ""))
        elif lora.get("enabled", True):
            def said(key: str) -> str:
                value = lora.get(key)
                return "not recorded" if value in (None, "", []) else \
                    ", ".join(value) if isinstance(value, list) else str(value)

            lines.append(f"  LoRA: rank {said('rank')}, alpha {said('alpha')}, targets {said('targets')}"
                         + (f", base quantization {lora['base_quantization']}"
                            if lora.get("base_quantization") else ""))
        else:
            lines.append("  full fine-tune")
        lines.append(f"  training dtype: {info.get('dtype') or 'not recorded'}")
        lines.append(f"  steps: {', '.join(map(str, info['steps'])) or 'none completed'}")
        if "step" in info:
            lines.append(f"  step {info['step']}: {_count(info['num_tensors'], 'tensor')}, {human(info['total_bytes'])}"
                         + (f" (items: {', '.join(info['items'])})" if info["items"] else ""))
    elif info["kind"] == "gguf file":
        name = f" (name {info['name']!r})" if info.get("name") else ""
        lines.append(f"  architecture: {info.get('architecture')}{name}")
        for key, value in info["metadata"].items():
            if key not in ("general.architecture", "general.name"):
                lines.append(f"  {key} = {value}")
        lines.append(f"  {_byte_totals(info)}")
    elif info["kind"] == "safetensors file":
        lines.append(f"  {_byte_totals(info)}"
                     + (f"; metadata {json.dumps(info['file_metadata'])}" if info["file_metadata"] else ""))
    else:
        if info.get("architectures"):
            archs = info["architectures"]  # a hand-edited config.json's one string was printed a letter at a time
            lines.append(f"  architecture: {archs if isinstance(archs, str) else ', '.join(map(str, archs))}"
                         + (f" (config dtype {info['config_dtype']})" if info.get("config_dtype") else ""))
        if info.get("adapter"):
            a = info["adapter"]
            targets = a["target_modules"]  # a list of names, or one regular expression
            targets = ",".join(map(str, targets)) if isinstance(targets, list) else targets
            lines.append(f"  adapter: {a['peft_type']} r={a['r']} alpha={a['lora_alpha']} on {targets} "
                         f"(base {a['base_model_name_or_path'] or 'not recorded'})")
        lines.append(f"  {_byte_totals(info)} in {_count(info['shards'], 'file')}")
    if tensors and info.get("tensors"):
        width = max(len(t["name"]) for t in info["tensors"])
        for t in info["tensors"]:
            lines.append(f"    {t['name']:<{width}}  {str(tuple(t['shape'])):<22} {t['dtype']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m convert.inspect", __doc__, overrides=False)
    p.add_argument("path", type=cli.input_path_of("checkpoint, model directory or file"),
                   help="checkpoint dir, HF directory, .safetensors or .gguf file")
    p.add_argument("--step", type=int, help="checkpoint step to list (default: the latest)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-tensors", action="store_true", help="summary only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    info = describe(args.path, args.step)
    if args.no_tensors:
        info.pop("tensors", None)
    cli.write_stdout(json.dumps(info, indent=2, default=str) if args.json else render(info, not args.no_tensors))
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
