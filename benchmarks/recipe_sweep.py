"""Train and evaluate several fine-tuning recipes of one config side by side: which recipe reaches which
tool-calling accuracy for how much training. Each recipe is the config plus dotted overrides; it trains
with `python -m gemma_tpu.train` into its own checkpoint directory, then `python -m gemma_tpu.evaluate
--checkpoint` scores it greedily on the held-out sets (each set scored on its own). Recipes run N at a
time (`--parallel`; on one GPU they share it). Prints a table and writes JSON.

    python benchmarks/recipe_sweep.py --config configs/gemma3-270m-fitness.yaml --out runs/sweep \\
        --recipe "main:" --recipe "lr2e3_s32: train.max_steps=32 train.learning_rate=0.002" \\
        --eval data/fitness/test.jsonl --eval data/fitness/validation.jsonl --json runs/sweep/sweep.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import cpu_label  # noqa: E402

from gemma_tpu.core import cli  # noqa: E402
from gemma_tpu.core.atomic import check_results_file, write_text_atomic  # noqa: E402
from gemma_tpu.core.config import load_config  # noqa: E402
from gemma_tpu.core.errors import UserError  # noqa: E402
from gemma_tpu.data.records import iter_raw  # noqa: E402
from gemma_tpu.data import load_conversations  # noqa: E402
from gemma_tpu.evaluate.run import build_cases, recorded_reply, score  # noqa: E402


def parse_recipe(text: str) -> tuple[str, list[str]]:
    """'name: k=v k=v' -> (name, [k=v, ...])."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip() or any(c in name for c in "/ "):
        raise SystemExit(f"error: --recipe {text!r}: expected 'NAME: key=value ...' (NAME without spaces or '/')")
    overrides = rest.split()
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise SystemExit(f"error: --recipe {name}: {bad[0]!r} is not a key=value override")
    return name.strip(), overrides


def num(x, width: int, digits: int) -> str:
    return f"{x:>{width}.{digits}f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def run_logged(cmd: list[str], log: Path) -> int:
    with log.open("w") as fh:
        return subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT).returncode


def run_recipe(name: str, overrides: list[str], args, combined: Path, spans: list[tuple[str, int, int]]) -> dict:
    """Train, evaluate on every held-out set at once, score each set on its own."""
    rdir = Path(args.out) / name
    rdir.mkdir(parents=True, exist_ok=True)
    ckpt = rdir / "checkpoints"
    t0 = time.time()
    rc = run_logged([sys.executable, "-m", "gemma_tpu.train", "--config", args.config, f"checkpoint.dir={ckpt}",
                     *overrides], rdir / "train.log")
    train_s = time.time() - t0
    row: dict = {"recipe": name, "overrides": overrides, "train_wall_s": round(train_s, 1)}
    if rc != 0:
        return {**row, "error": f"training exit {rc}: see {rdir / 'train.log'}"}
    summary = json.loads((ckpt / "summary.json").read_text())
    row.update({k: summary.get(k) for k in ("steps", "median_step_time_s", "examples_per_s", "final_eval_loss",
                                             "first_eval_loss")})
    t1 = time.time()
    rc = run_logged([sys.executable, "-m", "gemma_tpu.evaluate", "--config", args.config, "--data", str(combined),
                     "--checkpoint", str(ckpt), "--no-loss", "--batch-size", str(args.batch_size),
                     "--json", str(rdir / "eval.json"), *overrides], rdir / "eval.log")
    row["eval_wall_s"] = round(time.time() - t1, 1)
    if rc != 0:
        return {**row, "error": f"evaluation exit {rc}: see {rdir / 'eval.log'}"}
    records = next(iter(json.loads((rdir / "eval.json").read_text())["examples"].values()))
    convs = load_conversations(combined, load_config(args.config, overrides).data)
    return {**row, **score_spans(convs, records, spans)}


def combine_heldout(paths: list[str]) -> tuple[list[str], list[tuple[str, int, int]]]:
    """The held-out sets' examples as JSON lines, each set's (label, first, end) span among them. Read by the one
    reader training uses: their text lines were copied, so a JSON array, gzip or Parquet set trained every recipe
    and then failed each evaluation; two sets of one file name were one column of the table."""
    lines: list[str] = []
    spans: list[tuple[str, int, int]] = []
    for path in paths:
        label = Path(path).stem
        if label in (s[0] for s in spans):
            raise UserError(f"--eval {path}: another held-out set is also named {label!r}; give the files other names")
        rows = [json.dumps(obj, ensure_ascii=False) for _, obj in iter_raw(path)]
        spans.append((label, len(lines), len(lines) + len(rows)))
        lines += rows
    return lines, spans


def score_spans(convs: list[dict], records: list[dict], spans: list[tuple[str, int, int]]) -> dict[str, dict]:
    """Each held-out set's metrics from one evaluation of all of them (records hold the replies as scored)."""
    if len(convs) != len(records):
        raise ValueError(f"{len(convs)} conversations but {len(records)} evaluated replies")
    out = {}
    for label, lo, hi in spans:
        metrics = score(build_cases(convs[lo:hi]), [recorded_reply(r) for r in records[lo:hi]])
        out[label] = {k: metrics[k] for k in ("n", "tool_accuracy", "argument_accuracy", "hallucinated_tool_rate",
                                              "format_error_rate", "per_tool")}
    return out


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--recipe", action="append", required=True, help="'NAME: key=value ...' (repeatable)")
    p.add_argument("--eval", action="append", required=True, help="held-out JSONL (repeatable)")
    p.add_argument("--out", type=cli.work_dir, required=True, help="run directory: one folder a recipe")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json")
    args = p.parse_args(argv)
    recipes = [parse_recipe(r) for r in args.recipe]
    names = [n for n, _ in recipes]
    if len(set(names)) != len(names):
        raise SystemExit("error: --recipe names must differ")
    if args.parallel < 1 or args.batch_size < 1:
        raise SystemExit("error: --parallel and --batch-size must be at least 1")
    for path in (args.config, *args.eval):
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such file")
    try:
        check_results_file(args.json, {"--config": args.config, **{f"--eval {e}": e for e in args.eval}})
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    for name, overrides in recipes:  # a bad override failed that recipe's training, after the others had run
        try:
            load_config(args.config, overrides)
        except UserError as e:
            raise SystemExit(f"error: --recipe {name}: {e}") from None
    try:
        lines, spans = combine_heldout(args.eval)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    combined = out / "heldout.jsonl"
    combined.write_text("".join(line + "\n" for line in lines))
    t0 = time.time()
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda r: run_recipe(r[0], r[1], args, combined, spans), recipes))
    labels = [s[0] for s in spans]
    print(f"\n{'recipe':<22} {'steps':>5} {'s/step':>7} {'train s':>8} {'val loss':>8} "
          + " ".join(f"{lab + ' tool/args':>22}" for lab in labels))
    for r in rows:
        if "error" in r:
            print(f"{r['recipe']:<22} {r['error']}")
            continue
        cells = " ".join(f"{r[lab]['tool_accuracy']:>13.3f} / {r[lab]['argument_accuracy']:.3f}" for lab in labels)
        print(f"{r['recipe']:<22} {r['steps']:>5} {num(r['median_step_time_s'], 7, 3)} {r['train_wall_s']:>8.1f} "
              f"{num(r['final_eval_loss'], 8, 3)} {cells}")
    result = {"config": args.config, "machine": cpu_label(), "wall_s": round(time.time() - t0, 1),
              "date": time.strftime("%Y-%m-%d"), "results": rows}
    try:
        import jax
        result["devices"] = [str(d) for d in jax.devices()]
    except Exception:  # noqa: BLE001 - informational only
        pass
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
