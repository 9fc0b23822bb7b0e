"""Kill a tiny training run at random instants, resume, and check the end is bit-identical.

    python benchmarks/kill_harness.py --kills 100 [--seed 1] [--max-steps 12] [--json benchmarks/results/kill_harness.json]

One uninterrupted reference run of the tiny Gemma 3 (`configs/tiny.yaml`, async checkpoints every step,
a small per-batch delay so instants land mid-step and mid-save). Then chains: the same command is started
on a fresh checkpoint dir, killed (SIGKILL, or SIGTERM: the preemption notice) at a seeded-random instant —
during start-up/restore/compile, mid-step, just after a step (inside its async save) — and restarted, up
to `--per-chain` times; the last restart runs to the end. A chain passes when every loss it ever logged
equals the reference's for that step and the final LoRA params are bit-identical. Prints a table, writes
JSON (after every chain, so an interrupted harness still leaves its tally).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
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


def command(model: Path, ckpt: Path, max_steps: int) -> list[str]:
    return [sys.executable, "-m", "gemma_tpu.train", "--config", str(REPO / "configs" / "tiny.yaml"),
            f"model.path={model}", f"checkpoint.dir={ckpt}", f"train.max_steps={max_steps}",
            "checkpoint.every_steps=1", "checkpoint.max_to_keep=3", "checkpoint.async_save=true",
            "data.eval_path=null"]


def environment(cache: Path, delay: float) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "GEMMA_TPU_STEP_DELAY": str(delay),
            "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def train_rows(ckpt: Path, offset: int = 0) -> list[dict]:
    path = ckpt / "metrics.jsonl"
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by SIGKILL
            continue
        if row.get("mode") == "train":
            rows.append(row)
    return rows


def same_params(a: Path, b: Path, step: int) -> bool:
    import numpy as np

    from gemma_tpu.checkpoint.metadata import read_params

    pa, pb = read_params(a, step), read_params(b, step)
    return sorted(pa) == sorted(pb) and all(pa[k].dtype == pb[k].dtype and np.array_equal(pa[k], pb[k]) for k in pa)


def run_chain(cmd, env, ckpt: Path, rng: random.Random, kills: int, max_steps: int, delay: float,
              start_s: list, log_dir: Path) -> list[dict]:
    """Kill the run `kills` times at random instants; returns one record per kill."""
    from gemma_tpu.checkpoint.metadata import list_steps
    from gemma_tpu.train.trainer import drop_records_after

    out = []
    for i in range(kills):
        resume_at = (list_steps(ckpt) or [0])[-1]
        if resume_at >= max_steps - 3:
            # too near the end: metrics rows lag a step behind, so a start-up wait ended by the first new row
            # could let the run finish before the signal (a kill of a finished process tests nothing)
            break
        k = 1 if not start_s else rng.choice([0, 1, 1, 2])
        if resume_at + k > max_steps - 3:
            k = 0
        sig = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM])
        # the resumed run drops the records after its step first (trainer.drop_records_after): done here before
        # the relaunch, the file only grows from this offset on
        drop_records_after(ckpt / "metrics.jsonl", resume_at)
        offset = (ckpt / "metrics.jsonl").stat().st_size if (ckpt / "metrics.jsonl").exists() else 0
        log = log_dir / f"kill-{i}.log"
        t0 = time.monotonic()
        with log.open("w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
            try:
                if k == 0:
                    phase = "start-up"
                    until = t0 + rng.uniform(0.05, 1.0) * (start_s[0] if start_s else 10.0)
                    # never past the first new step: a slow start must not let the segment run to the end
                    while time.monotonic() < until and not train_rows(ckpt, offset) and proc.poll() is None:
                        time.sleep(0.02)
                else:
                    deadline = t0 + 600
                    while (not any(r["step"] >= resume_at + k for r in train_rows(ckpt, offset))
                           and proc.poll() is None and time.monotonic() < deadline):
                        time.sleep(0.02)
                    if not start_s:
                        start_s.append(time.monotonic() - t0)
                    wait = rng.uniform(0.0, delay + 0.1)
                    phase = "after a step (saving)" if wait < 0.05 else "mid-step"
                    time.sleep(wait)
                alive = proc.poll() is None
                proc.send_signal(sig)
                rc = proc.wait(timeout=600)
            finally:
                if proc.poll() is None:
                    proc.kill()
        out.append({"signal": signal.Signals(sig).name, "phase": phase, "resumed_at": resume_at, "alive": alive,
                    "rc": rc, "complete_after": (list_steps(ckpt) or [0])[-1], "s": round(time.monotonic() - t0, 1)})
    return out


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=cli.integer(1), default=100)
    p.add_argument("--per-chain", type=cli.integer(1), default=8, help="kills before a chain runs to its end")
    p.add_argument("--max-steps", type=cli.integer(1), default=12)
    p.add_argument("--delay", type=cli.number(0.0, low_ok=True), default=0.3,
                   help="seconds slept per batch (GEMMA_TPU_STEP_DELAY)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", help="HF dir (default: a tiny Gemma 3 written to a temp dir)")
    p.add_argument("--work", type=cli.work_dir, help="work dir (default: a temp dir, removed at the end)")
    p.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "kill_harness.json"))
    args = p.parse_args(argv)
    check_json(args.json)
    if args.model:
        check_model(args.model, "--model")
    work = Path(args.work or tempfile.mkdtemp(prefix="kill-harness-"))
    try:
        return harness(args, work)
    finally:  # a failed reference run or Ctrl-C left the temp dir (the tiny model, the JAX cache) behind
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def harness(args, work: Path) -> int:
    """The reference run, then the chains of kills and resumes compared with it, in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else None
    if model is None:
        from gemma_tpu.assets.tiny import write_tiny_gemma3

        model = write_tiny_gemma3(work / "tiny", seed=0)
    cache = work / "jax-cache"
    ref = work / "reference"
    with (work / "reference.log").open("w") as err:
        proc = subprocess.run(command(model, ref, args.max_steps), cwd=REPO, env=environment(cache, 0.0),
                              stdout=subprocess.DEVNULL, stderr=err, timeout=1800)
    if proc.returncode:
        print((work / "reference.log").read_text()[-3000:], file=sys.stderr)
        return 1
    ref_losses = {r["step"]: r["loss"] for r in train_rows(ref)}

    rng = random.Random(args.seed)
    start_s: list = []
    chains, done = [], 0
    t_all = time.time()
    while done < args.kills:
        n = min(args.per_chain, args.kills - done)
        ckpt = work / f"chain-{len(chains)}"
        log_dir = work / f"chain-{len(chains)}-logs"
        log_dir.mkdir(exist_ok=True)
        cmd, env = command(model, ckpt, args.max_steps), environment(cache, args.delay)
        kills = run_chain(cmd, env, ckpt, rng, n, args.max_steps, args.delay, start_s, log_dir)
        with (log_dir / "final.log").open("w") as err:
            final = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, timeout=1800)
        rows = train_rows(ckpt)
        wrong = [r["step"] for r in rows if r["loss"] != ref_losses.get(r["step"])]
        identical = final.returncode == 0 and not wrong and same_params(ref, ckpt, args.max_steps)
        # SIGTERM ends a run with 143 (saved at the step boundary, or once the run's end is saved), with -15 before
        # the entry point installs its handler (interpreter start-up, imports: default termination), or with 0 when
        # it came after the run's summary was written (nothing left to stop)
        sigterm_ok = all(k["rc"] in (143, -signal.SIGTERM) or (k["rc"] == 0 and k["complete_after"] == args.max_steps)
                         for k in kills if k["signal"] == "SIGTERM" and k["alive"])
        chains.append({"chain": len(chains), "kills": kills, "final_rc": final.returncode, "wrong_loss_steps": wrong,
                       "bit_identical": identical, "sigterm_exit_143": sigterm_ok})
        done += len(kills)  # a chain that came near its end stops early; the next chain makes up the rest
        write(args, chains, time.time() - t_all)
        print(f"chain {len(chains) - 1}: {len(kills)} kills, bit-identical {identical}, SIGTERM exits 143 {sigterm_ok}",
              file=sys.stderr, flush=True)
        if not args.work:
            shutil.rmtree(ckpt, ignore_errors=True)
    doc = write(args, chains, time.time() - t_all)
    print(table(doc))
    return 0 if doc["all_bit_identical"] else 1


def tally(chains: list[dict]) -> dict:
    kills = [k for c in chains for k in c["kills"]]
    by = {}
    for k in kills:
        key = f"{k['signal']} {k['phase']}"
        by[key] = by.get(key, 0) + 1
    return {"kills": len(kills), "killed_while_alive": sum(k["alive"] for k in kills), "by_signal_and_phase": by,
            "chains": len(chains), "chains_bit_identical": sum(c["bit_identical"] for c in chains),
            "all_bit_identical": all(c["bit_identical"] and c["sigterm_exit_143"] for c in chains)}


def write(args, chains, wall_s: float) -> dict:
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": {**cpu_info(), "cpus": os.cpu_count()},
           "args": vars(args), "wall_s": round(wall_s, 1), **tally(chains),
           "chain_records": chains}
    write_json(args.json, doc)
    return doc


def table(doc: dict) -> str:
    lines = ["| kind of kill | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(doc["by_signal_and_phase"].items())]
    lines.append(f"| **total** (process alive when signalled: {doc['killed_while_alive']}) | **{doc['kills']}** |")
    lines.append(f"\nchains resumed bit-identical: {doc['chains_bit_identical']}/{doc['chains']}; "
                 f"wall {doc['wall_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(cli.cli_main(main))
