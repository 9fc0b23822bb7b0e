"""Export a gemma-tpu LoRA checkpoint as a PEFT adapter (for `PeftModel.from_pretrained`, vLLM).

    python -m convert.export_peft --checkpoint runs/x --out adapters/x [--step N] [--overwrite]

Writes `adapter_config.json` and `adapter_model.safetensors` with keys
`base_model.model.<decoder>.layers.N.<module>.lora_{A,B}.weight`, A as [r, in] and B as [out, r]
(float32), converted from Qwix's layout through the registry's `Projection.lora_to_peft`. A fused
Tunix weight (`kv_einsum`, `qkv_einsum`) carries one A shared by K and V (and Q): each HF module gets
a copy of it and its own slice of B, which is exactly the same update. PEFT scales by
`lora_alpha / r`, as Qwix does. The directory is written atomically, like the merge.
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from convert.mapping import hf_shape
from convert.source import (
    CheckpointSource,
    FactorCache,
    check_base_matches,
    check_finite_factors,
    checked_lora_sites,
    open_checkpoint,
    resolve_base,
)
from convert.tool_tokens import check_tool_token_files, install_tool_tokens
from gemma_tpu.core import cli
from gemma_tpu.core.atomic import AtomicDir, check_space, check_target
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError
from gemma_tpu.hf import safetensors_io as sio
from gemma_tpu.hf.directory import ADAPTER_RECORD

ADAPTER_FILE = "adapter_model.safetensors"
PROVENANCE_FILE = ADAPTER_RECORD


def module_prefix(hf_config: dict) -> str:
    """Where the decoder layers live in the *module* tree of the class transformers builds (not in
    the checkpoint's key names): `model.` for *ForCausalLM, `model.language_model.` for the
    multimodal Gemma 3 class in transformers >= 4.52."""
    archs = hf_config.get("architectures") or []
    if any(a.endswith("ForConditionalGeneration") for a in archs) or hf_config.get("text_config"):
        return "model.language_model."
    return "model."


def adapter_config(source: CheckpointSource, prefix: str) -> dict:
    targets = list(source.lora["targets"])
    if prefix == "model.":
        target_modules: list[str] | str = targets
    else:  # keep PEFT out of the vision tower, whose attention also has q_proj/k_proj/v_proj
        escaped = re.escape(prefix)
        target_modules = escaped + r"layers\.\d+\.(?:self_attn|mlp)\.(?:" + "|".join(targets) + ")"
    base = source.meta.get("base_model") or {}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": peft_base_path(base),
        "revision": base.get("revision"),
        "r": int(source.lora["rank"]),
        "lora_alpha": source.lora["alpha"],
        "lora_dropout": source.lora_dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }


def peft_base_path(base: dict) -> str | None:
    """The base as PEFT (AutoPeftModel) and vLLM resolve it themselves: the hub id trained on, else the absolute
    directory trained on. The recorded `path` is what the run's config said: not only our `embedded:NAME`, but a
    local directory as written, often relative to where training ran (`models/gemma`), which from anywhere else
    named nothing, or another model of that name."""
    path, local = base.get("path"), base.get("local_dir")
    from_hub = local is not None and Path(local).parent.name == "snapshots"  # a hub id's copy in the HF cache
    return path if path and (from_hub or not local) else local or path


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m convert.export_peft", __doc__, overrides=False)
    p.add_argument("--checkpoint", required=True, type=cli.input_path_of("checkpoint directory"),
                   help="gemma-tpu checkpoint dir (with gemma_tpu_run.json)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, type=cli.output_path_of("adapter directory"),
                   help="output adapter directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (atomically)")
    p.add_argument("--base", type=cli.input_path_of("base model"),
                   help="the base's HF directory when the one recorded at training is not here, checked against "
                        "the fingerprint taken at training (a tool-calling run's adapter ships its tokenizer with the "
                        "tool-call markers)")
    p.add_argument("--allow-base-mismatch", action="store_true",
                   help="export even if the recorded base's weights differ from the fingerprint taken at training")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    source = open_checkpoint(args.checkpoint, args.step)
    if not source.is_lora:
        raise UserError(f"{source.dir}: a full fine-tune has no adapter to export; use convert.merge_orbax")
    out = Path(args.out)
    recorded_dir = (source.meta.get("base_model") or {}).get("local_dir")
    base_dir = [Path(recorded_dir)] if recorded_dir and Path(recorded_dir).is_dir() else []
    recorded_base = base_dir[0] if base_dir else None
    if args.base:
        base_dir.append(Path(args.base))
    check_target(out, args.overwrite, protected=[source.dir, *base_dir], marker=PROVENANCE_FILE)
    if recorded_dir and Path(recorded_dir).is_dir():  # the adapter's base_model_name_or_path points there
        check_base_matches(source, Path(recorded_dir), args.allow_base_mismatch, "export_peft")
    if args.base:  # the base the adapter is for, checked as the merge checks it, whether or not the run ships a
        # tokenizer from it: another model (a Gemma 4 for a Gemma 3 run, a missing path) was silently ignored
        given = resolve_base(source, args.base)
        if recorded_base is None or given.resolve() != recorded_base.resolve():
            check_base_matches(source, given, args.allow_base_mismatch, "export_peft")
    prefix = module_prefix(source.hf_config)
    sites = checked_lora_sites(source, prefix)
    check_finite_factors(source, sites)
    order: dict[str, int] = {}  # first place of each name: Gemma 4's k_proj is two projections (kv_einsum, k_einsum)
    for i, p in enumerate(source.family.projections(source.layout)):
        order.setdefault(p.hf_name, i)
    sites.sort(key=lambda s: (s[0].layer, order[s[0].proj.hf_name]))  # layer-major, as PEFT writes
    rank = int(source.lora["rank"])
    specs = []
    for site, sizes in sites:
        n_out, n_in = hf_shape(site.proj, sizes)
        stem = f"base_model.model.{prefix}layers.{site.layer}.{site.proj.hf_module}"
        specs += [sio.OutSpec(f"{stem}.lora_A.weight", "F32", (rank, n_in)),
                  sio.OutSpec(f"{stem}.lora_B.weight", "F32", (n_out, rank))]
    factors = FactorCache(source, sites)
    tokenizer_base = adapter_tokenizer_base(source, args.base)
    if tokenizer_base is not None:  # refuse tokenizer files the markers cannot be published in, before writing
        check_tool_token_files(tokenizer_base, source.meta.get("token_map") or {})
    tokenizer_bytes = sum((tokenizer_base / n).stat().st_size for n in TOKENIZER_FILES
                          if tokenizer_base is not None and (tokenizer_base / n).is_file())
    check_space(out, sum(4 * math.prod(s.shape) for s in specs) + tokenizer_bytes + (1 << 20))
    ad = AtomicDir(out, args.overwrite, marker=PROVENANCE_FILE)
    with ad as tmp:
        writer = sio.ShardedWriter(tmp, specs, max_shard_bytes=1 << 62, single_name=ADAPTER_FILE)
        try:
            for (site, _), sa, sb in zip(sites, specs[0::2], specs[1::2], strict=True):
                a_hf, b_hf = factors.peft(site)
                writer.write_tensor(sa.name, np.ascontiguousarray(a_hf, dtype=np.float32))
                writer.write_tensor(sb.name, np.ascontiguousarray(b_hf, dtype=np.float32))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        sio.write_json(tmp / "adapter_config.json", adapter_config(source, prefix))
        tokenizer_note = write_adapter_tokenizer(source, tokenizer_base, tmp)
        sio.write_json(tmp / PROVENANCE_FILE, {
            "tool": "convert.export_peft",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "checkpoint": str(source.dir.resolve()),
            "step": source.step,
            "base": source.meta.get("base_model"),
            "lora": {k: source.lora.get(k) for k in ("rank", "alpha", "targets", "base_quantization")},
        })
        ad.publish()
        # said in the block, so that a stop after the publish still finds it said (gemma_tpu.core.atomic)
        print(f"export_peft: wrote {out} ({len(specs)} tensors, r={source.lora['rank']}, "
              f"alpha={source.lora['alpha']}){tokenizer_note}", file=sys.stderr)
    return 0


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def adapter_tokenizer_base(source: CheckpointSource, override: str | None = None) -> Path | None:
    """The base whose tokenizer a tool-calling adapter ships (see `write_adapter_tokenizer`); None when the
    run has no token map. A base that cannot be found is refused, before anything is written: exported with only
    a warning, the adapter went out without its markers, and serving's launch check could no longer tell that it
    needs a base that has them."""
    if not source.meta.get("token_map"):
        return None
    try:
        return resolve_base(source, override, weights=False)
    except UserError as e:
        raise UserError(f"{source.dir}: a tool-calling run's adapter ships its base's tokenizer with the tool-call "
                        f"markers, and the base cannot be found ({str(e).removesuffix('; pass --base')}): pass "
                        "--base DIR") from None


def write_adapter_tokenizer(source: CheckpointSource, base: Path | None, out: Path) -> str:
    """A tool-calling adapter trained on a vocabulary without FunctionGemma markers ships the base's
    tokenizer with the markers published (see convert/tool_tokens.py), so that `AutoTokenizer` on the
    adapter dir and a server's tool parser see `<start_function_call>` rather than `<unusedN>`."""
    from gemma_tpu.hf.files import copy_file

    token_map = source.meta.get("token_map") or {}
    if not token_map or base is None:
        return ""
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            copy_file(base / name, out / name)
    install_tool_tokens(out, token_map)
    return "; tokenizer with tool-call markers and chat template"


if __name__ == "__main__":
    sys.exit(cli_main(main))
