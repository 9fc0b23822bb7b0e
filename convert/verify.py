"""Check converted models by their logits.

    python -m convert.verify A B [--prompt TEXT ...] [--max-abs-diff X] [--max-kl X] [--json]

compares any two HF directories with transformers (float32, eager attention): max |logit
difference|, KL(A || B) per position (mean and max), and how often the argmax agrees. Exit 0 unless
a threshold given on the command line is exceeded. A PEFT adapter directory (`convert.export_peft`)
is compared as PEFT loads it: on the base its adapter_config.json names (so an adapter can be checked
against the merge of the same step before it is served).

`verify_merge` (used by `merge_orbax --verify`) takes the reference from the JAX side: the checkpoint
restored by `gemma_tpu.checkpoint.restore` (the base loaded by our loader, LoRA applied with Qwix and
the checkpoint's factors put in, or the full fine-tune's params; a QLoRA base left dense, as the merge
uses it), run in float32 at 'highest' matmul precision (TPUs default to bf16 passes).
Tolerances:

* float32 output: max |diff| <= max(1e-4, 1e-5 * max |reference logit|). That is 1e-4 absolute
  for logits of order one (the tiny test models). Real models have logits of tens, and two correct
  fp32 implementations (different op order, GELU and rsqrt kernels) drift apart in proportion to
  the logit scale, so the bound grows with it. A network pushed far from its pretrained weights
  amplifies rounding more, even between two JAX computations (LoRA vs merged weights), while its
  KL stays tiny. So a max |diff| above the bound still passes when the mean KL is <= 1e-6: mapping
  errors (a transpose, a K/V swap, a wrong scale) move KL by orders of magnitude more than any
  rounding does (the measurements behind these bounds: benchmarks/RESULTS.md, "Measurements behind
  design choices").
* bfloat16 / float16 output: rounding the weights changes logits visibly; the bound is on the
  distribution instead, mean KL(reference || merged) <= 1e-3.

Before the logits, each LoRA site of the merged output is checked on its own (`check_lora_sites`): a
logit comparison averages over the whole model (a 1% error in one site's update moved a tiny
model's KL by 2e-7, under the drift bound) and cannot say which tensor is wrong; the site check
names it. It reads the factors through the merge's own mapping, so a mapping error is left to the
logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from convert.source import FactorCache, checked_lora_sites
from gemma_tpu.checkpoint.restore import restore_model
from gemma_tpu.core import cli, strict_json
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError, read_json_object
from gemma_tpu.formats import gemma_chat
from gemma_tpu.hf import safetensors_io as sio
from gemma_tpu.hf.adapter import check_adapter_fits, read_adapter_config
from gemma_tpu.hf.directory import read_hf_config
from gemma_tpu.models.loading import directory_family
from gemma_tpu.models.registry import families, text_config

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    gemma_chat.turn(gemma_chat.USER, "Write a haiku about the sea.") + gemma_chat.open_turn(gemma_chat.MODEL),
    "Once upon a time, in a land far away, there lived a",
)
FP32_ABS_TOL = 1e-4
FP32_REL_TOL = 1e-5
FP32_KL = 1e-6
LOW_PRECISION_KL = 1e-3
# The site check: |(M - W) x - s B A x| <= SITE_SIGMAS x the output dtype's rounding noise + SITE_REL_TOL x |s B A x|
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
SITE_SIGMAS = 8.0
SITE_REL_TOL = 1e-4
SITE_CHUNK_BYTES = 16 << 20


@dataclasses.dataclass
class Comparison:
    max_abs_diff: float
    ref_scale: float  # max |reference logit|
    kl_mean: float
    kl_max: float
    argmax_agreement: float
    positions: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (f"max |diff| {self.max_abs_diff:.3g} (logit scale {self.ref_scale:.3g}), KL mean "
                f"{self.kl_mean:.3g} max {self.kl_max:.3g}, argmax agreement {100 * self.argmax_agreement:.1f}% "
                f"over {self.positions} positions")


@dataclasses.dataclass
class Report:
    comparison: Comparison | None  # None: a LoRA site failed, the logits were not compared
    passed: bool
    reason: str

    def summary(self) -> str:
        compared = f"{self.comparison.summary()}; " if self.comparison is not None else ""
        return f"verify: {'PASS' if self.passed else 'FAIL'}: {compared}{self.reason}"


@dataclasses.dataclass
class SiteResult:
    name: str
    error: float  # |(M - W) x - s B A x|
    bound: float
    update: float  # |s B A x|
    problem: str | None = None  # the tensor is missing or of another shape

    @property
    def passed(self) -> bool:
        return self.problem is None and self.error <= self.bound

    def describe(self) -> str:
        if self.problem:
            return f"tensor {self.name}: {self.problem}"
        if not self.update:
            return f"tensor {self.name}: merged minus base is {self.error:.3g} where the checkpoint's LoRA update is 0"
        return (f"tensor {self.name}: merged minus base differs from the checkpoint's LoRA update by "
                f"{100 * self.error / self.update:.3g}% of it (at most {100 * self.bound / self.update:.2g}% allowed)")


def check_lora_sites(source, base_dir: Path, merged_dir: Path, dtype_name: str) -> list[SiteResult]:
    """Every LoRA site of a merge, probed with a random vector x: (merged - base) @ x must be
    scale * B @ (A @ x) up to the rounding of the output dtype (each element rounded by at most u|m|,
    so the noise is about u/sqrt(3) * |(m * m) @ (x * x)|^0.5; bounded at SITE_SIGMAS times that, so
    bf16 rounding never fails a site while fp32 catches a 1% error). Reads both tensors once, in chunks."""
    base, merged = sio.WeightsDir(base_dir), sio.WeightsDir(merged_dir)
    sites = checked_lora_sites(source, source.family.text_prefix(base.names()))
    factors = FactorCache(source, sites)
    u = UNIT_ROUNDOFF[dtype_name] + 2 * UNIT_ROUNDOFF["float32"]  # plus the merge's own fp32 add and product
    rng = np.random.default_rng(0)
    out = []
    for site, _ in sites:
        key = site.hf_key
        a, b = factors.peft(site)  # [r, in], [out, r]
        shape = base[key].shape
        if key not in merged or merged[key].shape != shape:
            have = f"of shape {merged[key].shape}" if key in merged else "missing"
            out.append(SiteResult(key, np.inf, 0.0, 0.0, f"{have} in {merged_dir}; the base's is {shape}"))
            continue
        x = rng.standard_normal(shape[1]).astype(np.float32)
        expect = float(source.scale) * (b.astype(np.float64) @ (a.astype(np.float64) @ x.astype(np.float64)))
        got = np.empty(shape[0], np.float64)
        noise2 = 0.0
        for start, stop in sio.row_chunks(shape, 4, SITE_CHUNK_BYTES):
            m = merged.read_rows(key, start, stop).astype(np.float32)
            delta = m - base.read_rows(key, start, stop).astype(np.float32)
            got[start:stop] = delta @ x
            noise2 += float((np.square(m) @ np.square(x)).sum())
        update = float(np.linalg.norm(expect))
        bound = SITE_SIGMAS * u / np.sqrt(3.0) * np.sqrt(noise2) + SITE_REL_TOL * update
        out.append(SiteResult(key, float(np.linalg.norm(got - expect)), float(bound), update))
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def compare(ref: list[np.ndarray], got: list[np.ndarray]) -> Comparison:
    """Logits per prompt, [L, V] each; KL is KL(ref || got) per position."""
    diffs, kls, agree, scale, n = [], [], 0, 0.0, 0
    for r, g in zip(ref, got, strict=True):
        if r.shape != g.shape:
            raise UserError(f"logit shapes differ: {r.shape} vs {g.shape} (different vocabularies?)")
        diffs.append(float(np.abs(r.astype(np.float64) - g).max()))
        scale = max(scale, float(np.abs(r).max()))
        lr, lg = _log_softmax(r), _log_softmax(g)
        kls.extend((np.exp(lr) * (lr - lg)).sum(-1).tolist())
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        n += r.shape[0]
    return Comparison(max(diffs), scale, float(np.mean(kls)), float(np.max(kls)), agree / n, n)


def prompt_ids(tokenizer_dir: Path, prompts: Sequence[str], vocab_size: int) -> list[list[int]]:
    """Token ids (with BOS) from the base's tokenizer; fixed pseudo-random ids if it has none (said on
    stderr: the prompts are then not what is compared)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        ids = [list(tok(p)["input_ids"]) for p in prompts]
        if all(len(i) > 1 for i in ids) and max(max(i) for i in ids) < vocab_size:
            return ids
        why = "its ids do not fit the model's vocabulary" if all(len(i) > 1 for i in ids) else "a prompt gave no tokens"
    except Exception as e:  # no or unusable tokenizer: the comparison still means something
        why = f"no usable tokenizer ({type(e).__name__})"
    print(f"verify: {tokenizer_dir}: {why}; comparing on fixed pseudo-random token ids instead of the prompts",
          file=sys.stderr)
    rng = np.random.default_rng(0)
    return [[2] + rng.integers(3, vocab_size, size=8 + 4 * i).tolist() for i in range(len(prompts))]


def adapter_base(d: Path) -> Path | None:
    """The base a PEFT adapter directory (adapter_config.json, no config.json) names, which it is compared on;
    None for a model directory. It was refused as "config.json: missing"."""
    if (d / "config.json").is_file() or not (d / "adapter_config.json").is_file():
        return None
    cfg = read_json_object(d / "adapter_config.json", f"{d}/adapter_config.json: missing")
    base = cfg.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise UserError(f"{d}/adapter_config.json: no base_model_name_or_path to load the adapter on")
    if not Path(base).is_dir():
        raise UserError(f"{d}: its base_model_name_or_path {base} is not a directory here (verify compares local "
                        "directories; download the base and set it in adapter_config.json)")
    return Path(base)


def check_adapter_on(adapter_dir: Path, base: Path, base_config: dict) -> None:
    """An adapter of a base of another shape (layers it lacks, other widths) or with a bias (Gemma has none) is
    refused naming the key: peft only warned of "missing adapter keys" and went on, the logits compared were not
    the adapter's, and vLLM refuses it at load."""
    family = directory_family(base, base_config)  # not a family we know: every decoder prefix we do know
    prefixes = family.text_prefixes if family else {p for fam in families().values() for p in fam.text_prefixes}
    cfg = read_adapter_config(adapter_dir, str(adapter_dir), for_vllm=False)
    if not (base / sio.INDEX_FILE).is_file() and not any(base.glob("*.safetensors")):
        return  # pytorch_model.bin: its shapes are left to peft
    weights = sio.WeightsDir(base)
    shapes = {name: weights[name].shape for name in weights.names()}
    check_adapter_fits(adapter_dir, f"{adapter_dir} on {base}", cfg["r"], shapes, prefixes, cfg.get("rank_pattern"))


def check_hf_dir(model_dir: Path) -> dict:
    """config.json and the safetensors headers of a directory to compare (every tensor's byte range
    inside its file), read before any model loads; its config. A directory without safetensors is
    left to transformers (`pytorch_model.bin`)."""
    config = read_hf_config(model_dir)
    if (model_dir / sio.INDEX_FILE).is_file() or any(model_dir.glob("*.safetensors")):
        sio.WeightsDir(model_dir)
    elif not any(model_dir.glob("pytorch_model*.bin")):
        raise UserError(f"{model_dir}: no weights (*.safetensors or pytorch_model*.bin)")
    return config


def hf_logits(model_dir: Path, ids: list[list[int]], adapter: Path | None = None) -> list[np.ndarray]:
    """Logits of an HF directory with transformers in float32, eager attention and experts, one prompt at a time
    (with a PEFT `adapter` on it, as `PeftModel.from_pretrained` loads one).

    A weight whose shape is not the one config.json makes, or one missing (transformers would fill
    either with random values, or raise a RuntimeError that names neither), is refused by name."""
    import torch
    import transformers

    # eager experts too: transformers' default (torch grouped_mm) needs each expert matrix's rows 16-byte aligned and
    # raised "strides should be multiple of 16 bytes" for an moe_intermediate_size of 22 (88 bytes in float32)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
                  ignore_mismatched_sizes=True, output_loading_info=True)
    try:
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
        except ValueError:  # multimodal classes are not registered as causal LMs everywhere
            model, info = transformers.AutoModelForImageTextToText.from_pretrained(str(model_dir), **kwargs)
    except Exception as e:  # an architecture transformers does not know, weights it cannot read
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{model_dir}: transformers cannot load it ({first})") from None
    if info.get("mismatched_keys"):
        key, found, wanted = sorted(info["mismatched_keys"])[0]
        raise UserError(f"{model_dir}: weight {key} has shape {tuple(found)} but config.json makes it "
                        f"{tuple(wanted)}")
    if info.get("missing_keys"):
        key = sorted(info["missing_keys"])[0]
        raise UserError(f"{model_dir}: weight {key} is missing (transformers would fill it with random values)")
    if adapter is not None:
        try:
            from peft import PeftModel
        except ImportError:
            raise UserError(f"{adapter}: comparing a PEFT adapter needs the peft package (pip install peft)") from None
        try:
            model = PeftModel.from_pretrained(model, str(adapter))
        except Exception as e:  # an adapter of another model: shapes that do not fit, modules it lacks
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{adapter}: peft cannot load it on {model_dir} ({first:.300})") from None
    model.eval()
    out = []
    with torch.no_grad():
        for seq in ids:
            out.append(model(input_ids=torch.tensor([seq])).logits[0].float().numpy())
    del model
    return out


def jax_logits(source, base_dir: Path, ids: list[list[int]]) -> list[np.ndarray]:
    """Reference logits: the Tunix model of the checkpoint (base + LoRA via Qwix, or full params) in
    float32, restored by `gemma_tpu.checkpoint.restore` from the base the merge read.

    Base quantization is *not* applied: a QLoRA run's factors are merged into the dense base (see
    merge_orbax), so the merged model is dense W + BA. The reference that checks the merge (key
    mapping, transposes, scale) is therefore the dense base with the same factors; the quantized
    model differs from any dense merge by the quantization error (NF4: far above every bound here),
    which would fail every QLoRA merge and hide the mapping errors the check is for. How much
    quantization itself changes the model is a question for `evaluate`, which restores it as trained.
    """
    model = restore_model(source.dir, source.step, "float32", apply_base_quantization=False,
                          base=base_dir).model
    return model_logits(model, ids)


def model_logits(model, ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Full-sequence float32 logits of a Tunix model for each prompt, at 'highest' matmul precision."""
    import jax
    import jax.numpy as jnp
    from tunix.sft import utils as su

    out = []
    with jax.default_matmul_precision("highest"):
        for seq in ids:
            tokens = jnp.asarray([seq], dtype=jnp.int32)
            mask = jnp.ones(tokens.shape, dtype=jnp.bool_)
            logits, _ = model(tokens, su.build_positions_from_mask(mask), None, su.make_causal_attn_mask(mask))
            out.append(np.asarray(logits[0], dtype=np.float32))
    return out


def judge(c: Comparison, dtype_name: str) -> Report:
    if dtype_name == "float32":
        tol = max(FP32_ABS_TOL, FP32_REL_TOL * c.ref_scale)
        if c.max_abs_diff <= tol:
            return Report(c, True, f"float32 bound: max |diff| <= {tol:.3g}")
        if c.kl_mean <= FP32_KL:
            return Report(c, True, f"max |diff| above {tol:.3g} but KL mean <= {FP32_KL:g}: fp32 rounding drift")
        return Report(c, False, f"float32 bound: max |diff| <= {tol:.3g} or KL mean <= {FP32_KL:g}")
    ok = c.kl_mean <= LOW_PRECISION_KL
    return Report(c, ok, f"{dtype_name} bound: KL mean <= {LOW_PRECISION_KL:g}")


def verify_merge(source, base_dir: Path, merged_dir: Path, dtype_name: str,
                 prompts: Sequence[str] = DEFAULT_PROMPTS) -> Report:
    sites = check_lora_sites(source, base_dir, merged_dir, dtype_name) if source.is_lora else []
    bad = [r for r in sites if not r.passed]
    if bad:
        more = f" (and {len(bad) - 1} other tensor{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
        return Report(None, False, f"{bad[0].describe()}{more}")
    vocab = int(source.family.read_text_config(source.hf_config)["vocab_size"])
    ids = prompt_ids(base_dir, prompts, vocab)
    ref = jax_logits(source, base_dir, ids)
    got = hf_logits(merged_dir, ids)
    report = judge(compare(ref, got), dtype_name)
    if sites:
        report.reason += f"; {len(sites)} LoRA sites match the checkpoint's updates"
    return report


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m convert.verify", __doc__, overrides=False)
    p.add_argument("a", type=cli.input_path_of("model directory"),
                   help="reference HF directory (or PEFT adapter directory)")
    p.add_argument("b", type=cli.input_path_of("model directory"),
                   help="HF directory (or PEFT adapter directory) to compare")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: a fixed set)")
    p.add_argument("--max-abs-diff", type=cli.number(0.0, low_ok=True),
                   help="fail (exit 1) above this max |logit diff|")
    p.add_argument("--max-kl", type=cli.number(0.0, low_ok=True), help="fail (exit 1) above this mean KL(A||B)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.prompt and not all(p.strip() for p in args.prompt):
        raise UserError("--prompt: an empty prompt gives no tokens to compare")
    dirs = [Path(args.a), Path(args.b)]
    bases = [adapter_base(d) for d in dirs]
    models = [b or d for d, b in zip(dirs, bases)]  # an adapter is loaded on its base
    adapters = [d if b else None for d, b in zip(dirs, bases)]
    configs = [check_hf_dir(d) for d in models]  # both, before the first model loads
    for adapter_dir, model_dir, config in zip(adapters, models, configs):
        if adapter_dir is not None:
            check_adapter_on(adapter_dir, model_dir, config)
    # keys config.json omits at transformers' defaults, for the families we know (each directory's family as the
    # loader takes it: its merge's record, else its config.json; a record config.json contradicts is refused)
    families_ = [directory_family(m, c) for m, c in zip(models, configs)]
    text = families_[0].read_text_config(configs[0]) if families_[0] else text_config(configs[0])
    vocab = int(text["vocab_size"])
    ids = prompt_ids(models[0], args.prompt or DEFAULT_PROMPTS, vocab)
    context = text.get("max_position_embeddings")
    longest = max(range(len(ids)), key=lambda k: len(ids[k]))
    if isinstance(context, int) and len(ids[longest]) > context:  # compared past the context the model was built for
        raise UserError(f"--prompt {longest + 1}: {len(ids[longest])} tokens, past the model's context of {context} "
                        f"(max_position_embeddings); give a shorter prompt")
    c = compare(*(hf_logits(m, ids, a) for m, a in zip(models, adapters)))
    failed = []  # `not x <= bound`: a NaN (a weight holding one) fails, where `x > bound` let it pass
    if args.max_abs_diff is not None and not c.max_abs_diff <= args.max_abs_diff:
        failed.append(f"max |diff| {c.max_abs_diff:.3g} > {args.max_abs_diff:g}")
    if args.max_kl is not None and not c.kl_mean <= args.max_kl:
        failed.append(f"KL mean {c.kl_mean:.3g} > {args.max_kl:g}")
    # (cli.write_stdout: `... --json | head` ended in "error: Broken pipe", exit 2)
    cli.write_stdout(strict_json.dumps({**c.as_dict(), "passed": not failed, "failures": failed}, indent=2)
                     if args.json else c.summary())
    if failed:
        print(f"error: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
