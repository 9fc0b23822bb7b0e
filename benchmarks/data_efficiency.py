"""Useful-token fraction and rows for `pad` vs `pack` at several seq_len, and data-pipeline throughput.

    python benchmarks/data_efficiency.py [--tokenizer DIR] [--seq-lens 256,512,1024,2048,4096] [--batch-size 8]
                                         [--instructions 3000] [--json OUT]

Datasets: the fitness-coach tool-calling chats (`data/fitness/train.jsonl`) and a synthetic
instruction set in Databricks Dolly columns (instruction / context / response; seeded, with
log-normal lengths: median instruction 12 words, 30 % of rows with a context of median 110 words,
median response 55 words, long tails), rendered by the same pipeline training uses.

Per dataset, seq_len and strategy: examples kept / truncated / dropped (over-length policy
`truncate`: an example whose answer is cut off entirely has no target left and is dropped), rows,
examples per row, the non-pad fraction (real tokens / row tokens), the loss-bearing fraction
(trained tokens / row tokens) and `bound`, the best non-pad fraction any packing of whole examples
can reach (rows >= total tokens / seq_len, and every example longer than seq_len/2 needs a row of its
own); rows are laid out as training lays them out, examples sharing a prompt prefix as trees
`[P | S1 | S2 ...]` (data.share_prefix auto, min 32 tokens). `tok/ex`: tokens a forward computes per kept
example one at a time; `trained/ex`: what the rows compute per example (each tree's prefix once per row);
`shared/ex`: the bound, each shared prefix computed once in all (`gemma_tpu.data.prefixes`);
`groups`: how many prefix groups. Throughput: examples/s through read + validate + render (tokenize once, mask by offsets), through
length policy + rows (pad or first-fit pack), and through one epoch of the grain stream into
`[batch, seq_len]` arrays.

Tokenizer: the real Gemma 3 one (`embedded:gemma3-270m`, prepared by `python -m gemma_tpu.assets`) by
default; `--tokenizer DIR` for another. Prints tables; writes JSON (default
runs/benchmarks/data_efficiency.json).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.args import check_model  # noqa: E402
from benchmarks.machine import cpu_info  # noqa: E402
from benchmarks.results_file import check_json, write_json  # noqa: E402
from gemma_tpu.core import cli  # noqa: E402

from gemma_tpu.core.config import DataConfig  # noqa: E402
from gemma_tpu.core.errors import UserError  # noqa: E402
from gemma_tpu.data import Renderer, TrainStream, prepare_examples, render_examples  # noqa: E402
from gemma_tpu.data.batching import row_examples  # noqa: E402
from gemma_tpu.formats.function_calling import function_token_map  # noqa: E402

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will can more other its who "
         "time about up out them into only some could what then these two may first new like any now my such over "
         "very our after most also made did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see men work "
         "long get here between both life being under never day same another know while last might us great old "
         "year off come since against go came right used take three water energy light city river music number "
         "table garden history science market language country system question answer example summary").split()


def synthetic_instructions(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)

    def text(median_words: float, sigma: float, lo: int) -> str:
        k = max(lo, int(round(math.exp(rng.normal(math.log(median_words), sigma)))))
        words = rng.choice(WORDS, size=k)
        out, start = [], 0
        while start < k:  # sentences of 6-20 words
            end = min(k, start + int(rng.integers(6, 21)))
            s = " ".join(words[start:end])
            out.append(s[0].upper() + s[1:] + ".")
            start = end
        return " ".join(out)

    rows = []
    for _ in range(n):
        ctx = text(110, 0.9, 8) if rng.random() < 0.3 else ""
        rows.append({"instruction": text(12, 0.6, 3), "context": ctx, "response": text(55, 1.0, 2),
                     "category": "synthetic"})
    return rows


def load_tokenizer(spec: str | None):
    from transformers import AutoTokenizer

    if spec is None:
        from gemma_tpu.assets import embedded as assets
        path = assets.target_dir("gemma3-270m")
        if not assets.is_complete(path):
            raise SystemExit("the embedded Gemma 3 270M is not prepared: run `python -m gemma_tpu.assets prepare "
                             "gemma3-270m` or pass --tokenizer DIR")
        spec = str(path)
    else:
        check_model(spec, "--tokenizer")
    return AutoTokenizer.from_pretrained(spec), spec


def bound(lengths: list[int], seq_len: int) -> float:
    """Upper bound on the non-pad fraction of any packing of these (fitting) examples into rows.

    Rows needed >= each of: total tokens / seq_len; the examples longer than seq_len / 2 (one row
    each); examples / k, where k is the most examples a row can hold (the k shortest fit).
    """
    if not lengths:
        return 0.0
    total, srt = sum(lengths), sorted(lengths)
    k = int(np.searchsorted(np.cumsum(srt), seq_len, side="right"))
    rows = max(math.ceil(total / seq_len), sum(1 for n in lengths if n > seq_len / 2), math.ceil(len(lengths) / k))
    return total / (rows * seq_len)


def _warm_up(renderer: Renderer) -> None:
    """Pay one-time costs (grain's lazy imports and thread pool: ~1 s) outside the timings."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "warm.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_instructions(16, seed=1)))
        prepared = prepare_examples(render_examples(str(path), renderer, DataConfig()), str(path), DataConfig(), 0)
        for _ in TrainStream(prepared, 8, 0, num_epochs=1):
            pass


def run_dataset(name: str, path: str, renderer: Renderer, cfg: DataConfig, seq_lens: list[int], batch_size: int,
                seed: int = 0) -> tuple[list[dict], dict]:
    t = time.perf_counter()
    examples = render_examples(path, renderer, cfg)
    render_s = time.perf_counter() - t
    lengths = [len(e.ids) for e in examples]
    rows_out = []
    timing = {"dataset": name, "examples": len(examples), "render_s": render_s,
              "render_examples_per_s": len(examples) / render_s,
              "tokens_per_example_mean": float(np.mean(lengths)), "tokens_per_example_p50": float(np.median(lengths)),
              "tokens_per_example_max": int(max(lengths))}
    for seq_len in seq_lens:
        c = DataConfig(**{**cfg.__dict__, "seq_len": seq_len})
        for strategy in ("pad", "pack"):
            rec = {"dataset": name, "seq_len": seq_len, "strategy": strategy}
            t = time.perf_counter()
            try:
                prepared = prepare_examples(examples, path, c, seed, strategy=strategy)
            except UserError as e:
                rec.update(error=str(e).split(": ", 1)[-1])
                rows_out.append(rec)
                continue
            prep_s = time.perf_counter() - t
            st = prepared.stats()
            kept_lengths = [len(ex.ids) for row in prepared.rows for ex in row_examples(row)]
            rec.update({k: st[k] for k in ("examples_read", "examples_kept", "truncated", "dropped", "rows",
                                           "examples_per_row", "nonpad_fraction", "useful_fraction", "max_loss")})
            rec["bound"] = round(bound(kept_lengths, seq_len), 4)
            sp = st["shared_prefixes"]  # tokens a forward computes per example, one by one / each prefix once
            rec.update({"computed_tokens_per_example": sp["computed_tokens_per_example"],
                        "computed_tokens_per_example_trained": st["computed_tokens_per_example"], "trees": st["trees"],
                        "computed_tokens_per_example_shared": sp["computed_tokens_per_example_shared"],
                        "computed_ratio": sp["computed_ratio"], "prefix_groups": sp["groups"],
                        "prefix_len_median": sp["prefix_len_median"]})
            rec["rows_examples_per_s"] = round(len(examples) / prep_s, 1)
            if len(prepared.rows) >= batch_size:
                t = time.perf_counter()
                n_batches = sum(1 for _ in TrainStream(prepared, batch_size, seed, num_epochs=1))
                stream_s = time.perf_counter() - t
                rec["batches_per_epoch"] = n_batches
                rec["stream_rows_per_s"] = round(n_batches * batch_size / stream_s, 1)
                rec["end_to_end_examples_per_s"] = round(
                    len(examples) / (render_s + prep_s + stream_s * len(prepared.rows) / (n_batches * batch_size)), 1)
            rows_out.append(rec)
    return rows_out, timing


def print_tables(results: list[dict], timings: list[dict]) -> None:
    cols = [("dataset", 12), ("seq_len", 7), ("strategy", 8), ("kept", 5), ("trunc", 5), ("drop", 5), ("rows", 5),
            ("ex/row", 6), ("non-pad", 7), ("loss-bearing", 12), ("bound", 5), ("tok/ex", 6), ("trained/ex", 10),
            ("shared/ex", 9),
            ("groups", 6)]
    print("  ".join(n.ljust(w) if i < 3 else n.rjust(w) for i, (n, w) in enumerate(cols)))
    for r in results:
        head = [r["dataset"].ljust(12), str(r["seq_len"]).ljust(7), r["strategy"].ljust(8)]
        if "error" in r:
            print("  ".join(head) + "  " + r["error"])
            continue
        vals = [r["examples_kept"], r["truncated"], r["dropped"], r["rows"], f"{r['examples_per_row']:.2f}",
                f"{r['nonpad_fraction']:.3f}", f"{r['useful_fraction']:.3f}", f"{r['bound']:.3f}",
                f"{r['computed_tokens_per_example']:.0f}", f"{r['computed_tokens_per_example_trained']:.0f}",
                f"{r['computed_tokens_per_example_shared']:.0f}",
                r["prefix_groups"]]
        print("  ".join(head + [str(v).rjust(w) for v, (_, w) in zip(vals, cols[3:])]))
    print()
    print("throughput (examples/s; stream: rows/s into [batch, seq_len] arrays)")
    print(f"{'dataset':12}  {'examples':>8}  {'tokens/ex':>9}  {'render':>8}  {'seq_len':>7}  {'strategy':>8}  "
          f"{'rows':>9}  {'stream':>8}  {'end-to-end':>10}")
    for tm in timings:
        for r in results:
            if r["dataset"] != tm["dataset"] or "stream_rows_per_s" not in r:
                continue
            print(f"{tm['dataset']:12}  {tm['examples']:>8}  {tm['tokens_per_example_mean']:>9.0f}  "
                  f"{tm['render_examples_per_s']:>8.0f}  {r['seq_len']:>7}  {r['strategy']:>8}  "
                  f"{r['rows_examples_per_s']:>9.0f}  {r['stream_rows_per_s']:>8.0f}  "
                  f"{r['end_to_end_examples_per_s']:>10.0f}")


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="tokenizer dir, or a hub id already downloaded here "
                   "(default: the embedded Gemma 3 270M's)")
    p.add_argument("--seq-lens", type=cli.integers(1), default="256,512,1024,2048,4096")
    p.add_argument("--batch-size", type=cli.integer(1), default=8)
    p.add_argument("--instructions", type=cli.integer(1), default=3000, help="rows of the synthetic instruction set")
    p.add_argument("--json", default=str(REPO / "runs" / "benchmarks" / "data_efficiency.json"))
    args = p.parse_args(argv)
    seq_lens = args.seq_lens
    check_json(args.json)
    tok, tok_where = load_tokenizer(args.tokenizer)
    renderer = Renderer(tok, "gemma", token_map=function_token_map(tok))
    results, timings = [], []
    _warm_up(renderer)
    with tempfile.TemporaryDirectory() as tmp:
        inst = Path(tmp) / "instructions.jsonl"
        inst.write_text("".join(json.dumps(r) + "\n" for r in synthetic_instructions(args.instructions)))
        for name, path in (("fitness", str(REPO / "data/fitness/train.jsonl")), ("instructions", str(inst))):
            rows, timing = run_dataset(name, path, renderer, DataConfig(), seq_lens, args.batch_size)
            results += rows
            timings.append(timing)
    print_tables(results, timings)
    out = {"date": date.today().isoformat(), "machine": {**cpu_info(), "cpus": os.cpu_count()},
           "command": "python " + " ".join([os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
           "tokenizer": tok_where, "batch_size": args.batch_size, "overlength": "truncate",
           "results": results, "datasets": timings}
    write_json(args.json, out)
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli.cli_main(main))
