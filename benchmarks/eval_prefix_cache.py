"""Evaluation with and without the prefix cache, side by side in one run (issue 15, point 5).

    python benchmarks/eval_prefix_cache.py [--model embedded:tiny-gemma3 | embedded:gemma3-270m | DIR]
                                           [--data data/fitness/test.jsonl] [--limit 40] [--batch-size 8]
                                           [--uncached-batch-size 8] [--max-new-tokens 64] [--json OUT]

The first N fitness test conversations are turned into prompts exactly as `python -m
gemma_tpu.evaluate` does (the conversation up to the first assistant turn, rendered by the model's
chat format); one loaded model runs them through the generator twice: once prefilling every prompt
whole, once with the prefix all prompts share (the developer turn with the tool declarations)
computed once and copied into every batch. Wall times include each side's compilations (each side compiles its
own, counted in the JSON), as a user of `gemma_tpu.evaluate` sees them; `--warm` also times a second pass of
each side (compiled, and for the cached side with the prefix already computed: what a long evaluation converges
to). The predictions (generated ids) must be identical; the script
exits non-zero otherwise. Prints a table; writes JSON (default runs/benchmarks/eval_prefix_cache.json).

The fitness developer turn is the same in every conversation (today's date opens the user turn), so
the ids all prompts share run through the tool declarations into the user turn's first words. `--fixed-date D`
rewrites the date of every user turn to D (both sides run the same, rewritten prompts).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_info  # noqa: E402
from benchmarks.results_file import check_json, write_json  # noqa: E402

from gemma_tpu.core.config import DataConfig  # noqa: E402
from gemma_tpu.core.errors import UserError  # noqa: E402
from gemma_tpu.data import load_conversations, make_renderer  # noqa: E402
from gemma_tpu.evaluate.run import build_cases, render_prompt, score  # noqa: E402
from gemma_tpu.formats.function_calling import parse_reply  # noqa: E402




def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded:tiny-gemma3")
    p.add_argument("--data", default=str(REPO / "data/fitness/test.jsonl"))
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--uncached-batch-size", type=int,
                   help="batch size of the uncached side (default: --batch-size); e.g. 8, what evaluation "
                        "used before the prefix cache, beside a larger cached batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fixed-date", metavar="YYYY-MM-DD",
                   help="write this date into every developer turn (default: the data as it is)")
    p.add_argument("--warm", action="store_true",
                   help="also time a second pass of each side (compiled, prefix already cached)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", default=str(REPO / "runs" / "benchmarks" / "eval_prefix_cache.json"))
    args = p.parse_args(argv)
    if args.limit <= 0 or args.batch_size <= 0 or args.max_new_tokens <= 0 or (args.uncached_batch_size or 1) <= 0:
        raise UserError("--limit, --batch-size and --max-new-tokens must be positive")
    check_json(args.json, {"--data": args.data})
    if args.fixed_date:  # checked before the model is loaded; '2024-13-45' passed the pattern and was written in
        try:
            date.fromisoformat(args.fixed_date)
        except ValueError:
            raise UserError(f"--fixed-date {args.fixed_date}: expected a date, YYYY-MM-DD") from None

    from gemma_tpu.infer.generate import Generator, common_prefix_len, load_hf_dir

    data_cfg = DataConfig()
    convs = load_conversations(args.data, data_cfg)[: args.limit]
    if args.fixed_date:
        for conv in convs:
            for m in conv["messages"]:
                if m["role"] in ("developer", "system", "user") and isinstance(m.get("content"), str):
                    m["content"] = re.sub(r"Today is \d{4}-\d{2}-\d{2}\.", f"Today is {args.fixed_date}.",
                                          m["content"])
    cases = build_cases(convs)
    loaded = load_hf_dir(args.model, args.dtype)
    renderer = make_renderer(loaded.tokenizer, data_cfg, loaded.chat_format, loaded.token_map)
    prompts = [render_prompt(renderer, c).ids for c in cases]  # as `gemma_tpu.evaluate` asks them
    lengths = sorted(len(x) for x in prompts)
    shared = common_prefix_len(prompts)
    print(f"{len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
          f"shared prefix {shared} tokens; model {args.model}", file=sys.stderr)

    import jax
    from gemma_tpu.infer import generate as g

    compiles = [0]

    def on_duration(event: str, _secs: float, **_kw) -> None:
        compiles[0] += "backend_compile" in event

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    sides = {}
    outputs = {}
    for name, cached in (("uncached", False), ("prefix cache", True)):
        # each side compiles its own functions, as an evaluation run alone does: generators of one model share
        # their jitted functions (`generate._jitted`), and the second side ran on the first side's compilations
        g._JIT_PAIRS.clear()
        jax.clear_caches()
        compiles[0] = 0
        batch = args.batch_size if cached else (args.uncached_batch_size or args.batch_size)
        gen = Generator(loaded, max_new_tokens=args.max_new_tokens, batch_size=batch, prefix_cache=cached)
        done = 0

        def progress(n, _name=name):
            nonlocal done
            done += n
            print(f"  {_name}: {done}/{len(prompts)}", file=sys.stderr, flush=True)

        t0 = time.perf_counter()
        outs = gen.generate(prompts, on_batch=progress)
        wall = time.perf_counter() - t0
        outputs[name] = outs
        metrics = score(cases, [parse_reply(o.text) for o in outs])
        warm = None
        if args.warm:
            t0 = time.perf_counter()
            again = gen.generate(prompts)
            warm = round(time.perf_counter() - t0, 2)
            if [o.ids for o in again] != [o.ids for o in outs]:
                raise SystemExit(f"{name}: the second pass differs from the first")
        sides[name] = {"wall_s": round(wall, 2), "examples_per_s": round(len(prompts) / wall, 4),
                       "warm_wall_s": warm,
                       "prefix_stats": gen.prefix_stats if cached else None,
                       "tool_accuracy": metrics.get("tool_accuracy"), "batch_size": batch,
                       "compilations": compiles[0]}  # XLA backend compilations of the side's first pass and warm one
    identical = [o.ids for o in outputs["uncached"]] == [o.ids for o in outputs["prefix cache"]]
    differ = sum(a.ids != b.ids for a, b in zip(outputs["uncached"], outputs["prefix cache"]))
    speedup = sides["uncached"]["wall_s"] / sides["prefix cache"]["wall_s"]

    print(f"\n{'side':<14}{'wall s':>10}{'examples/s':>12}{'speed-up':>10}"
          + (f"{'warm s':>10}{'warm ex/s':>11}{'warm speed-up':>15}" if args.warm else ""))
    for name, side in sides.items():
        ratio = sides["uncached"]["wall_s"] / side["wall_s"]
        line = f"{name:<14}{side['wall_s']:>10.1f}{side['examples_per_s']:>12.3f}{ratio:>9.2f}x"
        if args.warm:
            w = side["warm_wall_s"]
            line += f"{w:>10.1f}{len(prompts) / w:>11.3f}{sides['uncached']['warm_wall_s'] / w:>14.2f}x"
        print(line)
    print(f"predictions identical: {'yes' if identical else f'NO ({differ} of {len(prompts)} differ)'}")

    out = {"date": date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
           "machine": {**cpu_info(), "cpus": os.cpu_count(), "platform": platform.platform()},
           "settings": {"model": args.model, "data": args.data, "n": len(prompts), "batch_size": args.batch_size,
                        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                        "fixed_date": args.fixed_date,
                        "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2],
                                          "max": lengths[-1]}, "shared_prefix_tokens": shared},
           "sides": sides, "speedup": round(speedup, 3),
           "warm_speedup": (round(sides["uncached"]["warm_wall_s"] / sides["prefix cache"]["warm_wall_s"], 3)
                            if args.warm else None), "identical": identical, "differing": differ}
    write_json(args.json, out)
    print(f"wrote {args.json}", file=sys.stderr)
    return 0 if identical else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
