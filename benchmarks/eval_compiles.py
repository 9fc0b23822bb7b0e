"""Compilations of an evaluation that compares two models, with and without shared jitted functions.

    python benchmarks/eval_compiles.py --a embedded:gemma3-270m --b runs/demo/merged
                                       [--data data/fitness/test.jsonl] [--limit 200] [--batch-size 32]
                                       [--max-new-tokens 64] [--json OUT]

`python -m gemma_tpu.evaluate --compare model:A model:B` (the main job's evaluation) runs once per side,
each side in its own process: *shared*, the generator as shipped (generators of one model structure share
their jitted decode and prefix forward, `gemma_tpu.infer.generate._jitted`), and *separate*, every
generator with its own (as before 2026-11-25). Per model: XLA backend compilations (count and seconds,
from `jax.monitoring`) and generation wall time. Both sides must predict the same; exits 1 otherwise.
Prints a table; writes JSON (default runs/benchmarks/eval_compiles.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.args import check_input, check_model  # noqa: E402
from benchmarks.machine import cpu_info  # noqa: E402
from benchmarks.results_file import check_json, write_json  # noqa: E402
from gemma_tpu.core import cli  # noqa: E402
from gemma_tpu.core.atomic import write_text_atomic  # noqa: E402
from gemma_tpu.core.errors import UserError  # noqa: E402

SIDES = ("separate", "shared")


def child(side: str, a: str, b: str, data: str, limit: int, batch: int, max_new: int, out: str) -> None:
    """One side: the evaluation's own code path, instrumented."""
    import jax

    from gemma_tpu.evaluate import run
    from gemma_tpu.infer import generate as g

    if side == "separate":
        g._jitted = g._jit_pair
    current = ["(loading)"]
    per: dict[str, dict] = {}

    def record(label: str) -> dict:
        return per.setdefault(label, {"compilations": 0, "compile_s": 0.0, "generate_s": 0.0})

    def on_duration(event: str, secs: float, **_kw) -> None:
        if "backend_compile" in event:
            rec = record(current[0])
            rec["compilations"] += 1
            rec["compile_s"] += secs

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    generate = g.Generator.generate

    labelled = [0]

    def timed(self, *args, **kwargs):
        if not hasattr(self, "_bench_label"):  # on the generator: an id() was reused once the first one was freed
            labelled[0] += 1
            self._bench_label = f"{labelled[0]}. {self.loaded.description}"
        current[0] = self._bench_label
        rec = record(current[0])
        t = time.perf_counter()
        result = generate(self, *args, **kwargs)
        rec["generate_s"] += time.perf_counter() - t
        return result

    g.Generator.generate = timed
    with tempfile.TemporaryDirectory() as tmp:
        preds = Path(tmp) / "eval.json"
        run.main(["--config", "configs/gemma3-270m-fitness.yaml", "--data", data, "--limit", str(limit),
                  "--batch-size", str(batch), "--max-new-tokens", str(max_new), "--no-loss",
                  "--compare", f"model:{a}", f"model:{b}", "--json", str(preds)],
                 compare_one_model=True)  # --a and --b may be one model: the second side compiles nothing
        examples = json.loads(preds.read_text())["examples"]
    raw = {label: [e["raw"] for e in rows] for label, rows in examples.items()}
    write_text_atomic(out, json.dumps({"models": per, "raw": raw}))  # never half a file for the parent to read


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default="embedded:gemma3-270m", help="first model (the base)")
    p.add_argument("--b", required=True, help="second model of the same structure (the merged model)")
    p.add_argument("--data", default="data/fitness/test.jsonl")
    p.add_argument("--limit", type=cli.integer(1), default=200)
    p.add_argument("--batch-size", type=cli.integer(1), default=32)
    p.add_argument("--max-new-tokens", type=cli.integer(1), default=64)
    p.add_argument("--json", default="runs/benchmarks/eval_compiles.json")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.a, args.b, args.data, args.limit, args.batch_size, args.max_new_tokens, args.out)
        return 0
    check_json(args.json, {"--data": args.data}, results_key="cpu")
    check_input(args.data, "--data")
    check_model(args.a, "--a")
    check_model(args.b, "--b")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in SIDES:
            out = Path(tmp) / f"{side}.json"
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child", side, "--a", args.a, "--b", args.b,
                                   "--data", args.data, "--limit", str(args.limit), "--batch-size",
                                   str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens), "--out",
                                   str(out)], cwd=REPO)
            if proc.returncode:  # was CalledProcessError's traceback below the child's own
                raise UserError(f"the {side} child failed (exit {proc.returncode}); its output is above")
            results[side] = {**json.loads(out.read_text()), "wall_s": round(time.perf_counter() - t, 1)}
    same = results["shared"]["raw"] == results["separate"]["raw"]
    print(f"\n{'side':<10} {'model':<50} {'compilations':>12} {'compile s':>10} {'generate s':>11}")
    for side in SIDES:
        for label, rec in results[side]["models"].items():
            if label == "(loading)":
                continue
            print(f"{side:<10} {label[-50:]:<50} {rec['compilations']:>12} {rec['compile_s']:>10.1f} "
                  f"{rec['generate_s']:>11.1f}")
        print(f"{side:<10} {'(whole evaluation, wall)':<50} {'':>12} {'':>10} {results[side]['wall_s']:>11.1f}")
    print(f"predictions identical: {same}")
    report = {"cpu": cpu_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "args": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
              "identical_predictions": same,
              "sides": {s: {"models": r["models"], "wall_s": r["wall_s"]} for s, r in results.items()}}
    write_json(args.json, report)
    print(f"wrote {args.json}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(cli.cli_main(main))
