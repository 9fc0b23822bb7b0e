"""What a command pays before its first step: imports and the tokenizer, each in a fresh process.

    python benchmarks/startup.py [--model embedded:gemma3-270m] [--repeats 3] [--json OUT]

Every `python -m gemma_tpu.train` / `evaluate` / `chat` / `data.inspect` starts by importing JAX, the
tokenizer (transformers' tokenizer module), Tunix (whose package __init__ imports its RL and distillation trainers,
and tensorboardX) and then builds the model's tokenizer. On a small model that is most of a short run; this
measures each part, in the order the trainer meets them, in fresh processes (`--repeats` of them; the median is
shown), within `deferred_imports` as `cli_main` runs every entry point: torch, which transformers' GGUF reader and
tensorboardX import at module level, stays out (`gemma_tpu.core.lean_imports`; the column says so). Then, side
by side in fresh processes, a tokenizer loaded the project's way (`hf.tokenizer.load_tokenizer`: the class
tokenizer_config.json names) against `AutoTokenizer.from_pretrained` (whose import pulls transformers' auto-model
machinery and torch._dynamo).
Prints tables; writes JSON (default runs/benchmarks/startup.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.args import check_model  # noqa: E402
from benchmarks.machine import cpu_info  # noqa: E402
from benchmarks.results_file import check_json, write_json  # noqa: E402
from gemma_tpu.core import cli  # noqa: E402

# (part, statement run after the parts before it, in one process)
PARTS = [
    ("python + gemma_tpu CLI modules", "import gemma_tpu.train.run"),
    ("jax", "import jax; jax.devices()"),
    ("transformers + tokenizer build (load_tokenizer)",
     "from gemma_tpu.hf.tokenizer import load_tokenizer; load_tokenizer(MODEL_DIR)"),
    ("tunix (trainer, Gemma models)", "import tunix.sft.peft_trainer, tunix.models.gemma3.model"),
]

# the same tokenizer from a fresh process, two ways (each a process of its own, alternating)
LOADERS = [
    ("load_tokenizer (the class the directory names)",
     "from gemma_tpu.hf.tokenizer import load_tokenizer; load_tokenizer(MODEL_DIR)"),
    ("AutoTokenizer.from_pretrained",
     "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(MODEL_DIR)"),
]

CHILD = """
import sys, time, json
from gemma_tpu.core.lean_imports import deferred_imports
t0 = time.perf_counter()
MODEL_DIR = sys.argv[1]
out = []
with deferred_imports():  # as cli_main runs every entry point
    for name, stmt in json.loads(sys.argv[2]):
        t = time.perf_counter()
        exec(stmt)
        out.append({"part": name, "s": time.perf_counter() - t, "torch_loaded": "torch" in sys.modules,
                    "dynamo_loaded": "torch._dynamo" in sys.modules})
print("RESULT " + json.dumps(out))
"""


def one_process(model_dir: str, parts: list[tuple[str, str]]) -> list[dict]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model_dir, json.dumps(parts)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"child failed:\n{proc.stderr[-3000:]}")
    parts = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    return parts + [{"part": "process wall (incl. interpreter start and exit)", "s": wall, "torch_loaded": None}]


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:gemma3-270m",
                   help="model whose tokenizer is built (dir or embedded:NAME)")
    p.add_argument("--repeats", type=cli.integer(1), default=3)
    p.add_argument("--json", default=str(REPO / "runs/benchmarks/startup.json"))
    args = p.parse_args(argv)
    check_json(args.json)
    check_model(args.model, "--model")
    from gemma_tpu.models import resolve_model

    model_dir = str(resolve_model(args.model).local_dir)
    runs = [one_process(model_dir, PARTS) for _ in range(args.repeats)]
    rows = []
    for i, first in enumerate(runs[0]):
        times = [r[i]["s"] for r in runs]
        rows.append({"part": first["part"], "median_s": statistics.median(times), "runs_s": times,
                     "torch_loaded_after": first["torch_loaded"]})
    print(f"{'part':52}{'median s':>10}  torch loaded after")
    for r in rows:
        torch_after = "" if r["torch_loaded_after"] is None else r["torch_loaded_after"]
        print(f"{r['part']:52}{r['median_s']:10.2f}  {torch_after}")

    loads = {name: [] for name, _ in LOADERS}
    for _ in range(args.repeats):
        for name, stmt in LOADERS:
            loads[name].append(one_process(model_dir, [(name, stmt)]))
    loaders = []
    print(f"\n{'the tokenizer from a fresh process':52}{'median s':>10}  process s  torch._dynamo loaded")
    for name, runs_of in loads.items():
        row = {"loader": name, "median_s": statistics.median(r[0]["s"] for r in runs_of),
               "process_median_s": statistics.median(r[-1]["s"] for r in runs_of),
               "runs_s": [r[0]["s"] for r in runs_of], "dynamo_loaded": runs_of[0][0]["dynamo_loaded"]}
        loaders.append(row)
        print(f"{name:52}{row['median_s']:10.2f}{row['process_median_s']:11.2f}  {row['dynamo_loaded']}")
    ratio = loaders[1]["process_median_s"] / loaders[0]["process_median_s"]
    print(f"AutoTokenizer / load_tokenizer, whole process: {ratio:.2f}x")
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
           "machine": cpu_info(), "model": args.model, "model_dir": model_dir, "repeats": args.repeats, "parts": rows,
           "tokenizer_loaders": loaders, "auto_over_project_process_ratio": round(ratio, 3)}
    out = write_json(args.json, doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.cli_main(main))
