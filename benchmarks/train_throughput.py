"""Training throughput side by side: our trainer vs PyTorch + PEFT + transformers, on the same data and model.

    python benchmarks/train_throughput.py [--model embedded:gemma3-270m|embedded:tiny-gemma3|shape:gemma3-1b|shape:gemma3-4b|DIR]
        [--config configs/gemma3-270m-fitness.yaml] [--steps 10] [--warmup 2] [--batch 4] [--seq-len 512]
        [--json OUT] [--sides ours,unshared,torch] [--baseline-set KEY=VALUE ...] [--device auto|cpu|cuda]
        [--dtype float32|bfloat16]

Sides:
  ours   `gemma_tpu.train.run.run(cfg)`, the code path of `python -m gemma_tpu.train` (Tunix PeftTrainer, Qwix
         LoRA, the sparse loss over loss-bearing positions only), with the config's LoRA targets, rank,
         alpha, dropout, learning rate, weight decay and clipping. No eval, no checkpoint until the end:
         checkpoint.every_steps lies past the run, so no step is saved while steps are timed (no step-1 save
         either: the trainer saves by that interval alone), and the save at the end follows the loop and its last
         record, outside every timed step. By design: the torch side saves nothing, and a save inside the
         window would time what only one side does; a real run's save time is its metrics.jsonl's and
         summary.json's `save_s`, given apart from the step times.
  unshared  the same trainer with `data.share_prefix=off` plus `--baseline-set` overrides: today's layout (one
         example a row, or packed) beside a shared-prefix one, e.g. `--seq-len 1024 --batch 2 --baseline-set
         data.seq_len=512 --baseline-set train.batch_size=4`; compare them by trained examples/s.
  torch  `AutoModelForCausalLM` + `peft` LoRA with the same targets/rank/alpha/dropout, `torch.optim.AdamW`
         with the same learning rate, weight decay and clipping, the standard recipe of TRL/PEFT users:
         every batch padded to `seq_len`, labels -100 outside the loss mask, full logits + cross-entropy
         inside the model. `torch.set_num_threads` = the CPUs this process may use (JAX uses them all).
Both read the fitness-coach training set rendered by OUR renderer and pipeline: a data child builds the
exact row stream `gemma_tpu.train.run.run` builds (same tokenizer, renderer, seed, shuffle) and hands the
torch side those token ids, attention masks and labels (built from `loss_idx`/`loss_targets`/`loss_weights`
of each row). With `--strategy pad` (the default) both sides therefore train on identical batches, and
their step-1 losses (computed before the first update, on the same model and tokens) must agree: the
script prints both and fails when they differ by more than `--loss-tol` (relative). With `--strategy pack`
our side packs rows (its real setting for the fitness run) while torch still pads one example per row;
the losses are then not comparable and only useful tokens/s is a fair comparison.

Each side runs in its own child process, one after the other (never at the same time), launched by this
script. Peak RSS is the child's VmHWM (Linux's high-water mark of the resident set, reset at exec), so it
is the memory of that side alone: one framework and one copy of the model, not the other side's nor this
launcher's. The steady state excludes the first `--warmup` steps (ours: the first step holds the one XLA
compilation; torch: allocator warm-up; our run also takes one step more, whose record, the final flush written
after the loop, is left out, see `child_ours`); s/step is the median over the `--steps` timed steps, and tokens/s
are the timed steps' mean tokens per step over that median (both sides see the same batches, so the
ratio of useful tokens/s is the ratio of step times). Trained examples/s (examples per step: the segments of
each row) is the fair rate when the layouts differ (packing, shared prefixes), where computed tokens/s would
flatter the denser layout. Three token counts: all (batch x seq_len), non-pad, and useful (loss-bearing).
TFLOP/s and MFU use `gemma_tpu.train.flops`' analytic model-FLOP count of the useful work for BOTH sides
(vocabulary projection at loss positions only), so MFU ranks the sides like throughput does; torch's
`tflops_executed` counts the full projection it actually computes. (Qwix gives K and V one shared A factor,
so our side trains hidden x rank fewer LoRA parameters per layer than PEFT.)

On a CUDA machine (`--device cuda`, or `auto` when torch sees CUDA and JAX sees a GPU) the defaults are
the Gemma 3 1B shape (`shape:gemma3-1b`: a random-weight checkpoint written by transformers from the 1B
config into the cache, for when the real weights are not at hand; or pass the real directory), seq 2048,
bf16 on both sides, and MFU against `gemma_tpu.core.accelerators.ACCELERATORS` (h100 / h200 from the device name, or
`--accelerator`).

Output: a table (side, s/step, examples/s, tokens/s, useful tokens/s, TFLOP/s, MFU, peak RSS, compiles, initial
loss), the ratio ours/torch of useful tokens/s, and with `--json` everything plus the machine (CPU model,
cores, load average, GPU), package versions, date and command. Results go in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.args import check_model  # noqa: E402
from benchmarks.machine import cpu_info  # noqa: E402
from benchmarks.results_file import check_json, write_json  # noqa: E402
from gemma_tpu.core import cli  # noqa: E402
from gemma_tpu.core.atomic import write_text_atomic  # noqa: E402
FITNESS_TRAIN = "data/fitness/train.jsonl"
SIDES = ("ours", "unshared", "torch")
SHAPE_PREFIX = "shape:"

# Gemma 3 1B (google/gemma-3-1b-pt config.json): the shape of the GPU comparison.
GEMMA3_1B = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=512, max_position_embeddings=32768)
# Gemma 3 4B's text tower (google/gemma-3-4b-pt text_config): a larger shape for peak memory against the dry-run plan.
# Its global layers' linear RoPE scaling is left out: it changes no FLOP and no byte.
GEMMA3_4B = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=1024, max_position_embeddings=131072)
SHAPES = {"gemma3-1b": GEMMA3_1B, "gemma3-4b": GEMMA3_4B}

PACKAGES = ("jax", "jaxlib", "flax", "google-tunix", "qwix", "optax", "torch", "transformers", "peft", "numpy")


# ---------------------------------------------------------------------------------------- helpers


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; it restarts at exec, unlike a child's ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info() -> dict:
    from importlib import metadata

    info: dict = {"platform": platform.platform(), "python": platform.python_version(),
                  "cpu_count": os.cpu_count(), "cpus_usable": cpu_count(), "hostname": platform.node()}
    info.update(cpu_info())
    try:
        mem = [l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal:")]
        info["mem_total_gb"] = round(int(mem[0].split()[1]) * 1024 / 1e9, 1) if mem else None
    except OSError:
        info["mem_total_gb"] = None
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info["versions"] = versions
    return info


def accelerator_key(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100' (a key of gemma_tpu.core.accelerators.ACCELERATORS), else ''."""
    from gemma_tpu.core.accelerators import ACCELERATORS

    low = device_name.lower().replace(" ", "")
    for key in ACCELERATORS:
        if key != "cpu" and key in low:
            return key
    return ""


def find_file(name: str) -> Path:
    """A path as given (relative to the current directory), else relative to the repository."""
    p = Path(name).expanduser()
    if not p.exists() and (REPO / p).exists():
        p = REPO / p
    if not p.is_file():
        raise SystemExit(f"{name}: no such file")
    return p.resolve()


def cuda_available() -> tuple[bool, str]:
    """(torch sees CUDA and JAX sees a GPU, device name), probed in a child so this process stays small."""
    if not (shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists()):
        return False, ""
    probe = ("import json, torch, jax\n"
             "ok = torch.cuda.is_available() and any(d.platform == 'gpu' for d in jax.devices())\n"
             "print(json.dumps([bool(ok), torch.cuda.get_device_name(0) if ok else '']))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        return False, ""
    ok, name = json.loads(proc.stdout.strip().splitlines()[-1])
    return ok, name


def ours_overrides(spec: dict, side: str = "ours") -> list[str]:
    """The dotted overrides that turn the config into the benchmark run (see the module docstring);
    the `unshared` side adds `--baseline-set` (default: shared prefixes off) last."""
    run = Path(spec["workdir"]) / side
    total = spec["warmup"] + spec["steps"] + 1  # + 1: the last record, the final flush, is left out (see child_ours)
    out = [
        f"model.path={spec['model']}", f"model.dtype={spec['dtype']}",
        f"data.train_path={spec['data_path']}", "data.eval_path=null", f"data.seq_len={spec['seq_len']}",
        f"data.strategy={spec['strategy']}",
        f"train.batch_size={spec['batch']}", f"train.max_steps={total}", "train.grad_accum_steps=1",
        "train.schedule=constant", "train.warmup_steps=0", "train.eval_every_steps=0", "train.log_every_steps=1",
        f"train.run_dir={run}", f"checkpoint.dir={run / 'ckpt'}", f"checkpoint.every_steps={10 * total + 1000}",
        "checkpoint.async_save=false",
    ]
    if spec.get("accelerator"):
        out.append(f"mesh.accelerator={spec['accelerator']}")
    out += list(spec.get("set", []))
    if side == "unshared":
        out += ["data.share_prefix=off"] + list(spec.get("baseline_set", []))
    return out


def step_stats(times: list[float | None], counts: dict[str, list[int]], warmup: int) -> dict:
    """Median s/step over the timed steps (after warm-up) and tokens/s from their mean token counts."""
    timed = [t for t in times[warmup:] if t is not None]
    if not timed:
        return {"s_per_step": None}
    med = statistics.median(timed)
    out = {"s_per_step": round(med, 4), "s_per_step_mean": round(statistics.fmean(timed), 4),
           "s_per_step_min": round(min(timed), 4), "timed_steps": len(timed)}
    for key, per_step in counts.items():
        out[f"{key}_per_step"] = round(statistics.fmean(per_step[warmup:len(times)]), 2)
        out[f"{key}_per_s"] = round(out[f"{key}_per_step"] / med, 2)
    return out


# ---------------------------------------------------------------------------------------- children


def child_data(spec: dict) -> dict:
    """Render and batch exactly as `gemma_tpu.train.run.run` does; write the torch side's padded batches."""
    import numpy as np
    from transformers import AutoTokenizer

    from gemma_tpu import data
    from gemma_tpu.core.config import load_config
    from gemma_tpu.formats.function_calling import function_token_map
    from gemma_tpu.models import resolve_model
    from gemma_tpu.train import flops as flops_lib

    from gemma_tpu.train.trainer import examples_in

    cfg = load_config(spec["config"], ours_overrides(spec))
    base = load_config(spec["config"], ours_overrides(spec, "unshared"))
    resolved = resolve_model(cfg.model.path, cfg.model.revision, cfg.model.family)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.local_dir))
    tunix_cfg = resolved.tunix_config()
    token_map = function_token_map(tokenizer)
    renderer = data.make_renderer(tokenizer, cfg.data, resolved.family.chat_format, token_map)
    examples = data.render_examples(cfg.data.train_path, renderer, cfg.data)
    n = spec["warmup"] + spec["steps"] + 1  # our run's steps; torch runs all but the last

    def stream_of(c, strategy: str, share_prefix: str):
        dc = dataclasses.replace(c.data, share_prefix=share_prefix)
        prepared = data.prepare_examples(examples, c.data.train_path, dc, c.train.seed, strategy=strategy)
        stream = data.TrainStream(prepared, c.train.batch_size, c.train.seed, c.data.shuffle, c.data.num_epochs, 0, 1)
        return prepared, [next(stream) for _ in range(n)]

    ours_prepared, ours_batches = stream_of(cfg, cfg.data.strategy, cfg.data.share_prefix)
    base_prepared, base_batches = stream_of(base, base.data.strategy, base.data.share_prefix)
    # torch pads one whole example a row (the recipe it stands for)
    torch_prepared, torch_batches = stream_of(cfg, "pad", "off")

    def counts(batches):
        return {"useful_tokens": [int(b["loss_weights"].sum()) for b in batches],
                "examples": [examples_in(b) for b in batches],
                "nonpad_tokens": [int((b["segment_ids"] > 0).sum()) for b in batches],
                "tokens": [int(b["tokens"].size) for b in batches]}

    torch_batches = torch_batches[:n - 1]
    b, t = torch_batches[0]["tokens"].shape
    ids = np.zeros((n - 1, b, t), np.int64)
    mask = np.zeros((n - 1, b, t), np.int64)
    labels = np.full((n - 1, b, t), -100, np.int64)
    for k, batch in enumerate(torch_batches):
        if (batch["segment_ids"] > 1).any():
            raise SystemExit("torch batches must hold one example per row")
        ids[k] = batch["tokens"]
        mask[k] = batch["segment_ids"] > 0
        for r in range(b):
            w = batch["loss_weights"][r] > 0
            # our row predicts token t+1 from position t; transformers shifts labels by one itself
            labels[k, r, batch["loss_idx"][r][w] + 1] = batch["loss_targets"][r][w]
    np.savez(spec["batches"], input_ids=ids, attention_mask=mask, labels=labels)
    step = flops_lib.training_flops(tunix_cfg, cfg.data.seq_len, cfg.lora.rank if cfg.lora.enabled else None,
                                    len(cfg.lora.targets))
    return {
        "model_dir": str(resolved.local_dir),
        "model_shape": {k: resolved.hf_config.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                               "num_attention_heads", "num_key_value_heads",
                                                               "head_dim", "vocab_size")},
        "lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets),
                 "dropout": cfg.lora.dropout},
        "optim": {"learning_rate": cfg.train.learning_rate, "weight_decay": cfg.train.weight_decay,
                  "grad_clip": cfg.train.grad_clip, "optimizer": cfg.train.optimizer, "seed": cfg.train.seed},
        "flops": {"per_token": step.per_token, "per_loss_token": step.per_loss_token},
        "data_stats": {"ours": ours_prepared.stats(), "unshared": base_prepared.stats(),
                       "torch": torch_prepared.stats()},
        "counts": {"ours": counts(ours_batches), "unshared": counts(base_batches), "torch": counts(torch_batches)},
    }


def child_ours(spec: dict) -> dict:
    """`gemma_tpu.train.run.run` on the benchmark config; step times and losses from its metrics.jsonl."""
    t0 = time.perf_counter()
    from gemma_tpu.core.config import load_config
    from gemma_tpu.train import run as train

    cli.setup_logging()
    cfg = load_config(spec["config"], ours_overrides(spec, spec.get("side", "ours")))
    run_dir = Path(cfg.train.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    summary = train.run(cfg)
    wall = time.perf_counter() - t0
    import jax

    try:
        gpu_peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # CPU devices have no memory stats on some versions
        gpu_peak = None
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in recs if r["mode"] == "train"}
    # The trainer times record k from step k-1 being done to step k being done (ready to ready).
    # Record 1 holds the compilation (no time). The run has one step more than the benchmark times and
    # that last record (the final flush, written after the loop) is dropped: records 2..W+N are all
    # steady-state steps.
    total = spec["warmup"] + spec["steps"]
    return {
        "step_times": [by_step.get(k, {}).get("step_time_s") for k in range(1, total + 1)],
        "losses": [by_step.get(k, {}).get("loss") for k in range(1, total + 1)],
        "compiles": summary.get("train_step_compiles"),
        "eval_compiles": summary.get("eval_step_compiles"),
        "trainer_summary": summary,
        "peak_rss_bytes": peak_rss_bytes(),
        "wall_s": round(wall, 1),
        "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind} x{jax.device_count()}",
        **({"peak_gpu_bytes": int(gpu_peak)} if gpu_peak and jax.devices()[0].platform == "gpu" else {}),
    }


def child_torch(spec: dict) -> dict:
    """The PyTorch + PEFT + transformers loop of the seed recipe on the data child's batches."""
    t0 = time.perf_counter()
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    d = spec["prep"]
    threads = cpu_count()
    torch.set_num_threads(threads)
    torch.manual_seed(d["optim"]["seed"])
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    kwargs = {"attn_implementation": spec["torch_attn"]} if spec.get("torch_attn") else {}
    model = AutoModelForCausalLM.from_pretrained(d["model_dir"], dtype=dtype, **kwargs).to(device)
    model.config.use_cache = False
    lora = d["lora"]
    model = get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                             target_modules=lora["targets"], bias="none", task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = d["optim"]
    if opt["optimizer"] != "adamw":
        raise SystemExit(f"the torch side implements adamw only, the config asks for {opt['optimizer']}")
    optimizer = torch.optim.AdamW(params, lr=opt["learning_rate"], betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=opt["weight_decay"])
    arrays = np.load(spec["batches"])
    ids, mask, labels = (torch.from_numpy(arrays[k]) for k in ("input_ids", "attention_mask", "labels"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ready = time.perf_counter() - t0
    times, losses, error = [], [], None
    try:
        for k in range(ids.shape[0]):
            sync()
            t = time.perf_counter()
            out = model(input_ids=ids[k].to(device), attention_mask=mask[k].to(device), labels=labels[k].to(device))
            out.loss.backward()
            if opt["grad_clip"]:
                torch.nn.utils.clip_grad_norm_(params, opt["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = float(out.loss.detach().float().item())
            sync()
            times.append(time.perf_counter() - t)
            losses.append(loss)
            print(f"torch step {k + 1}/{ids.shape[0]}: loss {loss:.4f}, {times[-1]:.2f} s", file=sys.stderr,
                  flush=True)
    except torch.OutOfMemoryError as e:  # a result in itself (full logits at every position): report it
        error = f"out of memory at step {len(times) + 1}: {str(e).splitlines()[0][:300]}"
        print(f"torch: {error}", file=sys.stderr, flush=True)
    result = {
        "step_times": times, "losses": losses, "error": error, "compiles": None, "threads": threads,
        "trainable_params": sum(p.numel() for p in params),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "peak_rss_bytes": peak_rss_bytes(), "load_s": round(ready, 1), "wall_s": round(time.perf_counter() - t0, 1),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else f"cpu x{threads} threads",
    }
    if device.type == "cuda":
        result["peak_gpu_bytes"] = int(torch.cuda.max_memory_allocated())
    return result


def child_write_shape(spec: dict) -> dict:
    """A random-weight HF checkpoint of a named shape, written by transformers (once; cached)."""
    from gemma_tpu.assets import embedded as assets
    from gemma_tpu.assets.tiny import write_tiny_gemma3

    name = spec["shape"]
    target = Path(spec["shape_dir"])
    if (target / ".complete").is_file():
        return {"model_dir": str(target), "cached": True}
    real = assets.target_dir("gemma3-270m")
    tok = real if assets.is_complete(real) else None
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shape = {**SHAPES[name], **spec.get("shape_overrides", {})}
    write_tiny_gemma3(tmp, seed=0, tokenizer_from=tok, dtype="bfloat16", **shape)
    (tmp / ".complete").write_text(json.dumps({"shape": name, "tokenizer": str(tok) if tok else "small word-level"}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return {"model_dir": str(target), "cached": False, "tokenizer": str(tok) if tok else "small word-level"}


CHILDREN = {"data": child_data, "ours": child_ours, "unshared": child_ours, "torch": child_torch,
            "write-shape": child_write_shape}


def run_child(kind: str, spec: dict) -> dict:
    """Run one child (this script with --child) to completion; its result JSON."""
    work = Path(spec["workdir"])
    spec_path, out_path = work / f"{kind}.spec.json", work / f"{kind}.result.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    t = time.perf_counter()
    print(f"[{kind}] starting", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", kind, "--spec", str(spec_path),
                           "--out", str(out_path)], cwd=REPO, env=env)
    if proc.returncode != 0 or not out_path.is_file():
        raise SystemExit(f"the {kind} child failed (exit {proc.returncode}); its output is above")
    print(f"[{kind}] done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return json.loads(out_path.read_text())


# ---------------------------------------------------------------------------------------- parent


def parse_args(argv):
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="embedded:NAME, shape:gemma3-1b|gemma3-4b or an HF directory (default: "
                                   "embedded:gemma3-270m on CPU, shape:gemma3-1b on CUDA)")
    p.add_argument("--config", default="configs/gemma3-270m-fitness.yaml",
                   help="run config: LoRA targets/rank/alpha/dropout, optimizer, seed (default: %(default)s)")
    p.add_argument("--data", default=FITNESS_TRAIN, help="training set (default: %(default)s)")
    p.add_argument("--steps", type=cli.integer(1), default=10, help="timed steps per side (default: %(default)s)")
    p.add_argument("--warmup", type=cli.integer(1), default=2,
                   help="untimed first steps per side, at least 1: the first holds the compilation (default: 2)")
    p.add_argument("--batch", type=cli.integer(1), help="rows per step (default: 4)")
    p.add_argument("--seq-len", type=cli.integer(1), help="tokens per row (default: 512 on CPU, 2048 on CUDA)")
    p.add_argument("--strategy", choices=("pad", "pack"), default="pad",
                   help="our side's rows (torch always pads one example per row; pack makes losses incomparable)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="both sides (default: float32 CPU, bfloat16 CUDA)")
    p.add_argument("--sides", default="ours,torch", help="comma-separated subset of ours,torch (default: both)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--accelerator",
                   help="key of gemma_tpu.core.accelerators.ACCELERATORS for MFU (default: from the GPU name)")
    p.add_argument("--torch-attn", help="transformers attn_implementation for the torch side (default: its default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra dotted override for OUR side only (e.g. model.remat=block); repeatable")
    p.add_argument("--baseline-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for the unshared side only, after data.share_prefix=off (e.g. data.seq_len=512 "
                        "train.batch_size=4: today's layout beside a shared-prefix one)")
    p.add_argument("--loss-tol", type=cli.number(0.0, low_ok=True),
                   help="max relative step-1 loss difference (default 1e-3 fp32, 3e-2 bf16)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--workdir", type=cli.work_dir,
                   help="keep batches, run dir and child results here (default: a temp dir, deleted)")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def side_row(name: str, res: dict, d: dict, warmup: int, peak: float, is_torch: bool) -> dict:
    counts = d["counts"][name]
    times = res["step_times"] if not res.get("error") else []  # a failed side has no steady state
    row = {**res, **step_stats(times, counts, warmup)}
    row["initial_loss"] = res["losses"][0] if res["losses"] else None
    row["peak_rss_gb"] = round(res["peak_rss_bytes"] / 1e9, 2)
    med = row.get("s_per_step")
    if med:
        f = d["flops"]
        timed = range(warmup, len(times))
        useful = [f["per_token"] * counts["tokens"][k] + f["per_loss_token"] * counts["useful_tokens"][k]
                  for k in timed]
        row["tflops_per_s"] = round(statistics.fmean(useful) / med / 1e12, 4)
        if is_torch:  # what it computes: the vocabulary projection at every position
            done = [f["per_token"] * counts["tokens"][k] + f["per_loss_token"] * counts["tokens"][k] for k in timed]
            row["tflops_executed_per_s"] = round(statistics.fmean(done) / med / 1e12, 4)
        if peak:
            row["mfu"] = round(row["tflops_per_s"] * 1e12 / peak, 4)
            if is_torch:
                row["mfu_executed"] = round(row["tflops_executed_per_s"] * 1e12 / peak, 4)
    return row


def print_table(rows: dict) -> None:
    head = ("side", "s/step", "examples/s", "tokens/s", "useful tok/s", "TFLOP/s", "MFU", "peak RSS GB", "compiles",
            "initial loss")
    lines = [head]
    for name, r in rows.items():
        def fmt(key, spec):
            v = r.get(key)
            return "-" if v is None else format(v, spec)

        lines.append((name, fmt("s_per_step", ".3f"), fmt("examples_per_s", ".3f"), fmt("tokens_per_s", ".1f"),
                      fmt("useful_tokens_per_s", ".1f"), fmt("tflops_per_s", ".4f"), fmt("mfu", ".1%"),
                      fmt("peak_rss_gb", ".2f"), fmt("compiles", "d"), fmt("initial_loss", ".5f")))
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    for l in lines:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(l, widths))))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        result = CHILDREN[args.child](spec)
        # whole or not at all: a child killed or out of disk mid-write left half a file the parent read
        write_text_atomic(args.out, json.dumps(result))
        return 0

    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides):
        raise SystemExit(f"--sides: choose from {', '.join(SIDES)}")
    check_json(args.json, {"--data": args.data, "--config": args.config})
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    gpu_name = ""
    if args.device == "auto":
        ok, gpu_name = cuda_available()
        device = "cuda" if ok else "cpu"
    else:
        device = args.device
        if device == "cuda":
            ok, gpu_name = cuda_available()
            if not ok:
                raise SystemExit("--device cuda: torch does not see CUDA or JAX sees no GPU")
    on_gpu = device == "cuda"
    model = args.model or ("shape:gemma3-1b" if on_gpu else "embedded:gemma3-270m")
    check_model(model, "--model")
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    accelerator = args.accelerator or (accelerator_key(gpu_name) if on_gpu else "")
    from gemma_tpu.train.flops import peak_flops

    peak = peak_flops(accelerator, 1) if accelerator else 0.0
    config, data_path = find_file(args.config), find_file(args.data)  # before the temp dir, which they left behind
    work = Path(args.workdir or tempfile.mkdtemp(prefix="train-throughput-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "workdir": str(work), "config": str(config), "data_path": str(data_path),
        "model": model, "dtype": dtype, "device": device, "accelerator": accelerator,
        "batch": args.batch or 4, "seq_len": args.seq_len or (2048 if on_gpu else 512),
        "steps": args.steps, "warmup": args.warmup, "strategy": args.strategy, "set": args.set,
        "baseline_set": args.baseline_set,
        "batches": str(work / "batches.npz"), "torch_attn": args.torch_attn,
    }
    try:
        from gemma_tpu.core.config import load_config

        for side in ("ours", "unshared"):  # a bad --set/--baseline-set/--accelerator: one line before any child runs
            load_config(spec["config"], ours_overrides(spec, side))
        if model.startswith(SHAPE_PREFIX):
            shape = model[len(SHAPE_PREFIX):]
            if shape not in SHAPES:
                raise SystemExit(f"--model {model}: known shapes: {', '.join(SHAPES)}")
            from gemma_tpu.assets import embedded as assets
            shape_dir = assets.default_cache_dir() / "bench" / f"{shape}-random"
            spec["model"] = run_child("write-shape", {**spec, "shape": shape, "shape_dir": str(shape_dir)})["model_dir"]
        d = run_child("data", spec)
        results = {}
        for side in sides:
            results[side] = run_child(side, {**spec, "prep": d} if side == "torch" else {**spec, "side": side})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    rows = {s: side_row(s, results[s], d, args.warmup, peak, s == "torch") for s in sides}
    print_table(rows)
    out: dict = {
        "benchmark": "train_throughput", "date": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**machine_info(), "device": device, "gpu": gpu_name or None, "accelerator": accelerator or None,
                    "peak_flops": peak or None, "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "settings": {"model": model, "model_dir": d["model_dir"], "model_shape": d["model_shape"],
                     "config": args.config, "data": args.data, "dtype": dtype, "batch": spec["batch"],
                     "seq_len": spec["seq_len"], "steps": args.steps, "warmup": args.warmup,
                     "strategy_ours": args.strategy, "strategy_torch": "pad", "ours_overrides": ours_overrides(spec),
                     "lora": d["lora"], "optim": d["optim"], "flops_per_token": d["flops"]},
        "data_stats": d["data_stats"],
        "sides": rows,
    }
    status = 0
    if "ours" in rows and "unshared" in rows:
        o, t = rows["ours"].get("examples_per_s"), rows["unshared"].get("examples_per_s")
        out["ratio_examples_per_s_vs_unshared"] = round(o / t, 3) if o and t else None
        print(f"ours/unshared trained examples/s: {out['ratio_examples_per_s_vs_unshared']}x")
        o, t = rows["ours"].get("peak_rss_gb"), rows["unshared"].get("peak_rss_gb")
        print(f"peak RSS ours {o} GB, unshared {t} GB")
    if "ours" in rows and "torch" in rows:
        o, t = rows["ours"].get("useful_tokens_per_s"), rows["torch"].get("useful_tokens_per_s")
        out["ratio_useful_tokens_per_s"] = round(o / t, 3) if o and t else None
        print(f"ours/torch useful tokens/s: {out['ratio_useful_tokens_per_s']}x")
        o, t = rows["ours"].get("examples_per_s"), rows["torch"].get("examples_per_s")
        out["ratio_examples_per_s"] = round(o / t, 3) if o and t else None
        print(f"ours/torch trained examples/s: {out['ratio_examples_per_s']}x")
        if rows["torch"].get("error"):
            print(f"torch side: {rows['torch']['error']}")
        lo, lt = rows["ours"]["initial_loss"], rows["torch"]["initial_loss"]
        tol = args.loss_tol if args.loss_tol is not None else (1e-3 if dtype == "float32" else 3e-2)
        comparable = args.strategy == "pad" and lo is not None and lt is not None
        diff = abs(lo - lt) if lo is not None and lt is not None else math.inf
        match = bool(math.isfinite(diff) and diff <= tol * max(1.0, abs(lt)))
        out["initial_loss"] = {"ours": lo, "torch": lt, "abs_diff": diff if math.isfinite(diff) else None,
                               "rel_tol": tol, "comparable": comparable, "match": match}
        verdict = (("OK" if match else "MISMATCH") if comparable else
                   "not comparable (--strategy pack)" if args.strategy == "pack" else "not comparable (a side failed)")
        print(f"step-1 loss (before any update): ours {lo}, torch {lt}, |diff| {diff:.2e}: {verdict}")
        if comparable and not match:
            status = 1
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(cli.cli_main(main))
