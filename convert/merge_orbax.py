"""Merge a gemma-tpu checkpoint into its base model and write a Hugging Face safetensors directory.

    python -m convert.merge_orbax --checkpoint runs/x --out merged/x [--step N] [--base DIR_OR_ID]
        [--dtype float32|bfloat16|float16] [--max-shard-size 5GB] [--overwrite] [--verify]

LoRA checkpoints: every targeted HF weight becomes `W + (alpha/rank) * B_hf @ A_hf`, computed in
float32 in row chunks and cast to the output dtype (default: the base's). Full fine-tunes: the
decoder tensors come from the checkpoint (Tunix layout converted back through the registry); the
rest of the base (a vision tower, say) is copied. Keys and their order are the base's; a tied
`lm_head.weight` (`language_model.lm_head.weight` in a multimodal layout) is dropped. A QLoRA run's
factors are merged into the unquantized base, as usual.

Streaming: the LoRA factors are read one layer at a time from Orbax to host numpy (no model is
built, no accelerator memory is touched), base tensors are read in chunks by positioned reads and
written straight into the output shards, unchanged tensors are copied in the kernel
(`copy_file_range`), merged ones are computed in 16 MB row chunks a few at a time (see
`convert.merge_math`). Peak RSS on a Gemma 3 4B-shaped checkpoint: ~355 MB, most of it the
imports (numpy, JAX for Orbax); Tunix's model code is never imported.

Safety: everything is checked before writing (checkpoint, step, base files, every shape); the output
is built in a hidden temp dir beside `--out` and renamed into place at the end (see
`gemma_tpu.core.atomic`), so an interrupted merge leaves nothing at `--out`.

`--verify` checks each merged LoRA site against the checkpoint's factors (naming a tensor that is
off) and compares the JAX LoRA model with the merged output loaded by transformers before the
output is published. On failure nothing is published at `--out` (an older output there stays
untouched); the merged files are kept at `<out>.unverified` for inspection and the exit code is 3. So they are
when the verification cannot run (transformers cannot load the model, memory runs out).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    # Before numpy/scipy load OpenBLAS: its threads spin against each other on the skinny rank-r
    # products (much slower on a busy 2-core machine; see benchmarks/RESULTS.md); merge_math
    # parallelises over row chunks instead.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import dataclasses
import datetime
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from convert import merge_math
from convert.mapping import FullSite, LoraSite, full_sites
from convert.source import (
    CheckpointSource,
    FactorCache,
    check_base_layout,
    check_base_matches,
    check_base_model_type,
    check_base_shapes,
    check_base_tower_shapes,
    check_base_weights,
    check_finite_factors,
    checked_lora_sites,
    open_checkpoint,
    resolve_base,
)
from convert.tool_tokens import check_tool_token_files, install_tool_tokens
from convert.verify import verify_merge
from gemma_tpu.core import cli
from gemma_tpu.core.atomic import AtomicDir, check_space, check_target
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError
from gemma_tpu.core.progress import Progress, human
from gemma_tpu.hf import safetensors_io as sio
from gemma_tpu.hf.directory import MERGE_RECORD, check_same_directory, dir_identity, read_hf_config
from gemma_tpu.hf.files import generation_config, write_sidecar_files
from gemma_tpu.models.registry import described_family, output_projection_prefixes, tied_embeddings

PROVENANCE_FILE = MERGE_RECORD
SLOW_ENV = "GEMMA_TPU_MERGE_SLOW"  # tests only: seconds to sleep after each tensor


class VerificationFailed(UserError):
    exit_code = 3


@dataclasses.dataclass
class Op:
    """How one output tensor is produced."""

    name: str
    src: sio.TensorInfo
    kind: str  # copy | cast | lora | full
    site: LoraSite | FullSite | None = None


@dataclasses.dataclass
class MergePlan:
    source: CheckpointSource
    base_dir: Path
    base_config: dict
    weights: sio.WeightsDir
    prefix: str
    out: Path | None
    out_dtype: str  # safetensors name
    ops: list[Op]
    specs: list[sio.OutSpec]
    max_shard_bytes: int
    lora_sites: list | None
    dropped: list[str]
    base_ident: tuple[int, int] | None = None  # `dir_identity` of base_dir before its config.json was read

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def base_float_dtype(weights: sio.WeightsDir) -> str:
    """The base's dtype: the float dtype holding the most bytes (float64, which no --dtype names, as float32)."""
    by = {}
    for t in weights.tensors.values():
        if t.dtype in sio.WEIGHT_DTYPES:
            dtype = "F32" if t.dtype == "F64" else t.dtype
            by[dtype] = by.get(dtype, 0) + t.nbytes
    if not by:
        raise UserError(f"{weights.dir}: no floating-point tensors")
    return max(by, key=by.get)


def plan_merge(args: argparse.Namespace) -> MergePlan:
    """Validate everything and decide every output tensor; writes nothing."""
    return plan_tensors(args.checkpoint, args.step, args.base, out=Path(args.out), overwrite=args.overwrite,
                        dtype=args.dtype, max_shard_size=args.max_shard_size,
                        allow_base_mismatch=args.allow_base_mismatch)


def plan_tensors(checkpoint: str | Path, step: int | None = None, base: str | None = None, *,
                 out: Path | None = None, overwrite: bool = False, dtype: str | None = None,
                 max_shard_size: str = "5GB", allow_base_mismatch: bool = False) -> MergePlan:
    """Open the checkpoint and its base, check every shape, and decide how each merged tensor is
    produced. With `out`, also check the target and the free space for a safetensors output of
    `dtype`; other writers (the GGUF export) pass no `out` and do their own checks."""
    source = open_checkpoint(checkpoint, step)
    base_dir = resolve_base(source, base)
    base_ident = dir_identity(base_dir)
    base_config = read_hf_config(base_dir)
    check_base_matches(source, base_dir, allow_base_mismatch, "merge")
    # an architecture no family claims: trained as the model.family its metadata records
    base_family = described_family(base_config, str(base_dir / "config.json")) or source.family
    if base_family.name != source.family.name:
        raise UserError(f"base {base_dir} is a {base_family.name} model; the checkpoint is {source.family.name}")
    weights = sio.WeightsDir(base_dir)
    prefix = source.family.text_prefix(weights.names())
    # the decoder's weights are written as floats of the output dtype: integer or fp8 ones (a quantized base, with
    # --allow-base-mismatch or another --base) were merged without their scales or crashed the writer
    # (the output projection wherever the layout keeps it: `language_model.lm_head.` went unchecked)
    weights.require_float([n for n in weights.names() if n.startswith((prefix, *output_projection_prefixes(prefix)))],
                          "merge into the unquantized base (--base)")
    if out is not None:
        check_target(out, overwrite, protected=[base_dir, source.dir], marker=PROVENANCE_FILE)
        # the files written after the weights are read now, so that a broken one is refused before the merge
        generation_config(base_dir, base_config, source.family.stop_token_ids)
        check_tool_token_files(base_dir, source.meta.get("token_map") or {})
    out_dtype = sio.DTYPE_NAMES[dtype] if dtype else base_float_dtype(weights)
    shapes = {n: t.shape for n, t in weights.tensors.items()}

    lora_by_key: dict[str, LoraSite] = {}
    full_by_key: dict[str, FullSite] = {}
    sites = None
    if source.is_lora:
        sites = checked_lora_sites(source, prefix, shapes)
        check_finite_factors(source, sites)
        lora_by_key = {s.hf_key: s for s, _ in sites}
    else:
        full_by_key = check_full_sites(source, prefix, shapes)
    # after the tensors' own checks, which name a tensor of a base of another shape: here, a config.json that
    # is not its weights' (the merge publishes it beside them)
    check_base_layout(source, base_dir, base_config)
    check_base_weights(source, base_dir, base_config, prefix, weights.names())
    check_base_shapes(source, base_dir, base_config, prefix, shapes)
    if out is not None:  # the config.json and the vision/audio towers published beside the decoder (a GGUF export
        # writes neither)
        check_base_model_type(source, base_dir, base_config)
        check_base_tower_shapes(source, base_dir, base_config, shapes)

    dropped = []
    ops, specs = [], []
    # a tied model's stored copy of its embedding, wherever the layout keeps it: copied from the base beside a full
    # fine-tune's trained embedding, it differed, and transformers then projected with the stale copy (untied)
    heads = {p + s for p in output_projection_prefixes(prefix) for s in ("weight", "bias")}
    for name in weights.names():
        src = weights[name]
        if name in heads and tied_embeddings(base_config):
            dropped.append(name)
            continue
        dtype = out_dtype if src.dtype in sio.WEIGHT_DTYPES else src.dtype  # a buffer beside the decoder: as is
        if name in lora_by_key:
            op = Op(name, src, "lora", lora_by_key[name])
        elif name in full_by_key:
            op = Op(name, src, "full", full_by_key[name])
        else:
            op = Op(name, src, "copy" if dtype == src.dtype else "cast")
        ops.append(op)
        specs.append(sio.OutSpec(name, dtype, src.shape))
    if out is not None:
        check_space(out, sum(s.nbytes for s in specs))
    return MergePlan(source, base_dir, base_config, weights, prefix, out, out_dtype, ops, specs,
                     sio.parse_size(max_shard_size), sites, dropped, base_ident)


def check_full_sites(source: CheckpointSource, prefix: str, shapes: dict[str, tuple]) -> dict[str, FullSite]:
    """A full fine-tune: every decoder tensor of the base comes from the checkpoint, shapes agree,
    and no checkpoint tensor is left over."""
    specs = source.params.specs
    sites = full_sites(source.family, source.layout, prefix)
    used = set()
    for key, site in sites.items():
        if site.tunix_name not in specs:
            raise UserError(f"checkpoint step {source.step}: tensor {site.tunix_name} (for {key}) is missing")
        if key not in shapes:
            raise UserError(f"base has no tensor {key} (for checkpoint tensor {site.tunix_name})")
        want = site.hf_shape(specs[site.tunix_name].shape)
        if want != tuple(shapes[key]):
            raise UserError(f"shape mismatch for {key}: the checkpoint's {site.tunix_name} gives {want}, "
                            f"the base has {tuple(shapes[key])}")
        used.add(site.tunix_name)
    extra = [n for n in specs if n not in used]
    if extra:
        raise UserError(f"checkpoint tensor {extra[0]} has no counterpart in the base")
    return sites


class MergedTensors:
    """The merged model's tensors, produced one at a time in plan order as row chunks (arrays
    split along the first axis): base tensors read in chunks, LoRA sites merged in float32 row
    chunks a few ahead by a thread pool, full fine-tunes converted one fused Tunix tensor at a
    time. Peak memory is a few chunks plus one layer's LoRA factors. Used as a context manager
    (the pool is shut down on exit); shared by the safetensors merge and the GGUF export."""

    def __init__(self, plan: MergePlan):
        self.plan = plan
        self.factors = FactorCache(plan.source, plan.lora_sites) if plan.lora_sites is not None else None
        self.fused: dict[str, np.ndarray] = {}  # full fine-tune: kv/qkv einsum serve 2-3 HF tensors
        self.pool = merge_math.make_pool()

    def __enter__(self) -> "MergedTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def chunks(self, op: Op, out_np: np.dtype, budget: int = sio.CHUNK_BYTES) -> Iterator[np.ndarray]:
        """Op's merged tensor in `out_np`, as consecutive row chunks."""
        plan = self.plan
        if op.kind in ("copy", "cast"):
            for start, stop in sio.row_chunks(op.src.shape, max(4, op.src.np_dtype.itemsize), budget):
                raw = plan.weights.read_rows(op.name, start, stop)
                yield raw if raw.dtype == out_np else _narrow(raw, out_np)
        elif op.kind == "lora":
            a_hf, b_hf = self.factors.peft(op.site)
            yield from merge_math.lora_chunks(self.pool, plan.weights, op.name, a_hf, b_hf, plan.source.scale, out_np)
        else:  # full
            if op.site.tunix_name not in self.fused:
                if len(self.fused) >= 2:
                    self.fused.pop(next(iter(self.fused)))
                self.fused[op.site.tunix_name] = plan.source.params.read_one(op.site.tunix_name)
            value = op.site.to_hf(self.fused[op.site.tunix_name])
            yield np.ascontiguousarray(_narrow(value, out_np))


def _narrow(value: np.ndarray, out_np: np.dtype) -> np.ndarray:
    """`value` in `out_np` through float32; values past float16's range are refused by name after it
    (merge_math.check_float16_range), not warned about by numpy."""
    with np.errstate(over="ignore"):
        return value.astype(np.float32).astype(out_np)


def write_weights(plan: MergePlan, tmp: Path, fsync: bool = True) -> sio.ShardedWriter:
    """Produce every output tensor in plan order: unchanged ones copied in the kernel, the others
    streamed from `MergedTensors`."""
    writer = sio.ShardedWriter(tmp, plan.specs, plan.max_shard_bytes, fsync=fsync)
    slow = float(os.environ.get(SLOW_ENV) or 0)
    out_np = sio.DTYPES[plan.out_dtype]
    progress = Progress("merge", plan.total_bytes)
    try:
        with MergedTensors(plan) as merged:
            for op, spec in zip(plan.ops, plan.specs, strict=True):
                writer.begin(op.name)
                if op.kind == "copy":
                    writer.copy_from(op.src)
                else:
                    for chunk in merged.chunks(op, out_np):
                        merge_math.check_float16_range(chunk, op.name, "use --dtype bfloat16 or float32")
                        writer.write(chunk)
                progress.update(spec.nbytes)
                if slow:
                    time.sleep(slow)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    progress.finish()
    return writer


def provenance(plan: MergePlan, writer: sio.ShardedWriter) -> dict:
    s = plan.source
    base = s.meta.get("base_model") or {}
    out = {
        "tool": "convert.merge_orbax",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "checkpoint": str(s.dir.resolve()),
        "step": s.step,
        "base": {"dir": str(plan.base_dir.resolve()), "path": base.get("path"), "revision": base.get("revision"),
                 "family": s.family.name},
        "kind": "lora" if s.is_lora else "full",
        "dtype": sio.DTYPE_NAMES_INV[plan.out_dtype],
        "shards": len(writer.files),
        "total_size": writer.total_bytes,
        "dropped": plan.dropped,
    }
    if s.is_lora:
        out["lora"] = {"rank": s.lora["rank"], "alpha": s.lora["alpha"], "targets": list(s.lora["targets"]),
                       "base_quantization": s.lora.get("base_quantization")}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m convert.merge_orbax", __doc__, overrides=False)
    p.add_argument("--checkpoint", required=True, type=cli.input_path_of("checkpoint directory"),
                   help="gemma-tpu checkpoint dir (with gemma_tpu_run.json)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, type=cli.output_path_of("output directory"), help="output HF directory")
    p.add_argument("--base", type=cli.input_path_of("base model"),
                   help="base HF dir or hub id (default: the one recorded in the checkpoint)")
    p.add_argument("--dtype", choices=sorted(sio.DTYPE_NAMES), help="output dtype (default: the base's)")
    p.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (atomically)")
    p.add_argument("--allow-base-mismatch", action="store_true",
                   help="merge even if the base's weights differ from the fingerprint recorded at training time")
    p.add_argument("--verify", action="store_true", help="compare logits with the JAX LoRA model before publishing")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync of the shards (faster, less crash-safe)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sio.parse_size(args.max_shard_size)
    except UserError as e:
        raise UserError(f"--max-shard-size: {e}") from None
    plan = plan_merge(args)
    s = plan.source
    what = (f"LoRA r={s.lora['rank']} alpha={s.lora['alpha']} on {','.join(s.lora['targets'])}"
            if s.is_lora else "full fine-tune")
    n_shards = len(sio.plan_shards(plan.specs, plan.max_shard_bytes))
    print(f"merge: {s.dir} step {s.step} ({what}) + base {plan.base_dir} -> {plan.out} "
          f"({sio.DTYPE_NAMES_INV[plan.out_dtype]}, {len(plan.specs)} tensors, {human(plan.total_bytes)}, "
          f"{n_shards} shard{'s' if n_shards > 1 else ''})", file=sys.stderr)
    if plan.out_dtype == "F16" and s.family.float16_problem:
        print(f"merge: warning: float16 for a {s.family.name} model: {s.family.float16_problem}; serving.launch "
              "serves it as bfloat16 (vLLM) or float32 (--local); --dtype bfloat16 is what vLLM serves",
              file=sys.stderr)
    ad = AtomicDir(plan.out, args.overwrite, marker=PROVENANCE_FILE)
    with ad as tmp:
        writer = write_weights(plan, tmp, fsync=not args.no_fsync)
        stop_ids = s.family.stop_token_ids
        write_sidecar_files(plan.base_dir, tmp, plan.base_config, sio.DTYPE_NAMES_INV[plan.out_dtype], stop_ids)
        marker_ids = install_tool_tokens(tmp, s.meta.get("token_map") or {})
        if marker_ids:
            print(f"merge: tokenizer publishes {len(marker_ids)} tool-call markers "
                  f"(ids {min(marker_ids.values())}-{max(marker_ids.values())}) and a tool-calling chat template",
                  file=sys.stderr)
        sio.write_json(tmp / PROVENANCE_FILE, provenance(plan, writer))
        # config.json, weights and tokenizer of one base: another merge publishing over it meanwhile mixed two
        check_same_directory(plan.base_dir, plan.base_ident)
        if args.verify:
            unverified = plan.out.parent / f"{plan.out.name}.unverified"
            try:
                report = verify_merge(s, plan.base_dir, tmp, sio.DTYPE_NAMES_INV[plan.out_dtype])
            except Exception as e:  # transformers cannot load it, out of memory...: the merge itself is kept too
                kept = ad.move_to(unverified)
                if not isinstance(e, UserError):
                    print(f"merge: verification did not run; nothing published at {plan.out}; the merged files are "
                          f"kept at {kept}", file=sys.stderr)
                    raise
                raise VerificationFailed(f"verification did not run ({e}); nothing published at {plan.out}; the "
                                         f"merged files are kept at {kept}") from None
            print(report.summary(), file=sys.stderr)
            if not report.passed:
                kept = ad.move_to(unverified)
                raise VerificationFailed(f"verification failed ({report.reason}); nothing published at "
                                         f"{plan.out}; the merged files are kept at {kept}")
        ad.publish()
        # said in the block, so that a stop after the publish still finds it said (gemma_tpu.core.atomic)
        print(f"merge: wrote {plan.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
