"""`python -m gemma_tpu.data.inspect --config FILE [section.key=value ...] [--split train|eval] [-n N]`

See the data exactly as training will: examples read / kept / truncated / dropped, evaluation examples that
are also training examples (when both splits are set), chats the tokenizer's own template renders otherwise and
answers whose first token also holds the prompt's end (as training warns of them), token-length percentiles, rows
and useful-token fractions for `pad` and `pack` (the configured strategy first), the shared prompt prefixes
(`data.share_prefix`: groups of examples starting with the same ids, prefix lengths, tokens computed per
example with and without computing each prefix once, loss-bearing fraction of each), the distinct batch
shapes one epoch of the stream produces (1 means one compilation; `--split eval`: the batches evaluation during
training runs, `loss_scale` and `data.eval_max_batches` included), and the first
N rendered examples with their loss-bearing tokens marked - green on a terminal, `[[...]]` otherwise
(`--color always|never` to choose). `--json OUT` writes the statistics. Nothing is written to the
run directory and no model weights are loaded; only the tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gemma_tpu.core import cli, strict_json
from gemma_tpu.core.atomic import check_results_file, write_text_atomic
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.config import validate_for_model
from gemma_tpu.core.errors import UserError
from gemma_tpu.data import batching
from gemma_tpu.data.pipeline import (
    TrainStream,
    check_data_file,
    check_one_batch,
    eval_batches,
    joined_warning,
    make_renderer,
    prepare_examples,
    prepare_split,
    render_error,
    shared_examples,
    template_skew_warning,
)
from gemma_tpu.data.records import load_conversations
from gemma_tpu.formats.function_calling import function_token_map
from gemma_tpu.hf.directory import resolve_path
from gemma_tpu.hf.tokenizer import load_tokenizer
from gemma_tpu.models import resolve_model

ANSI_ON, ANSI_OFF = "\x1b[1;32m", "\x1b[0m"
ANSI_DIM = "\x1b[2m"
PLAIN_ON, PLAIN_OFF = "[[", "]]"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.parser("python -m gemma_tpu.data.inspect", __doc__, config="YAML run config (data.*, model.path for the tokenizer)")
    p.add_argument("--split", choices=("train", "eval"), default="train", help="data.train_path or data.eval_path")
    p.add_argument("-n", type=int, default=1, help="rendered examples to show (default 1; 0: none)")
    p.add_argument("--tokenizer", type=cli.input_path_of("tokenizer"),
                   help="tokenizer directory, hub id or embedded:NAME (default: the config's model.path)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="mark loss-bearing text with ANSI colour (auto: when stdout is a terminal)")
    p.add_argument("--json", type=cli.output_path_of("JSON file"), help="also write the statistics to this JSON file")
    return p.parse_args(list(argv))


def tokenizer_for(spec: str | None, cfg) -> tuple[Any, str, str, int | None]:
    """(tokenizer, where it came from, the family's chat format, the model's vocab_size when known)."""
    family_format, vocab = "gemma", None
    if spec:  # a directory, hub id or embedded:NAME, as model.path (the spec alone was read as a hub id)
        where = str(resolve_path(spec, what="--tokenizer"))
    else:
        resolved = resolve_model(cfg.model.path, cfg.model.revision, cfg.model.family)
        # what training refuses of this model's config (data.seq_len past its context, a rank past a projection):
        # data.seq_len=10000000 laid out batches of ten million tokens the run refuses, and a larger one stopped
        # with a numpy MemoryError traceback
        validate_for_model(cfg, resolved.text_config, str(resolved.local_dir),
                           resolved.family.projection_shapes(resolved.text_config))
        where, family_format = str(resolved.local_dir), resolved.family.chat_format
        vocab = resolved.text_config.get("vocab_size")
    return load_tokenizer(where), where, family_format, vocab


def loss_spans(offsets: np.ndarray, mask: np.ndarray) -> list[tuple[int, int]]:
    """Merged character spans of the loss-bearing tokens (BOS, at (0, 0), never shows)."""
    spans: list[tuple[int, int]] = []
    for (s, e), m in zip(offsets.tolist(), mask.tolist()):
        if not m or e <= s:
            continue
        if spans and s <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], e))
        else:
            spans.append((s, e))
    return spans


# control characters but newline and tab: printed as they are, a '\r' hid the text before it and an escape sequence
# moved the cursor or changed the terminal's colours, and the example shown was not the text trained
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """`text` with its control characters (newline and tab aside) written as their escapes (`\\r`, `\\x1b`)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def mark(text: str, spans: list[tuple[int, int]], color: bool, cut: int | None = None) -> str:
    """`text` with the spans wrapped in markers; `cut`: character offset where truncation falls. Control characters
    show as their escapes (`visible`)."""
    on, off = (ANSI_ON, ANSI_OFF) if color else (PLAIN_ON, PLAIN_OFF)
    if cut is not None:  # nothing past the cut is trained
        spans = [(s, min(e, cut)) for s, e in spans if s < cut]
    points = sorted({0, len(text), *(p for sp in spans for p in sp), *([cut] if cut is not None else [])})
    out = []
    for a, b in zip(points, points[1:]):
        if a == cut:
            out.append(f"{ANSI_DIM if color else ''}<<truncated at data.seq_len: the rest is not trained>>"
                       f"{ANSI_OFF if color else ''}")
        piece = visible(text[a:b])
        out.append(f"{on}{piece}{off}" if any(s <= a and b <= e for s, e in spans) else piece)
    return "".join(out)


def batch_shapes(prepared, batch_size: int, split: str, seed: int,
                 eval_max_batches: int | None = None) -> tuple[int, list[str], int]:
    """Distinct (shape, dtype) signatures over one epoch of the batches training/eval would see, and their number.
    The eval batches are the ones evaluation during training runs: at most `data.eval_max_batches`, each with the
    `loss_scale` that weights its loss by its tokens (`eval_batches(token_weighted=True)`); without them the listing
    showed every row and a batch layout no evaluation uses."""

    if split == "train":
        batches = TrainStream(prepared, batch_size, seed, num_epochs=1)  # one at a time: an epoch may not fit
    else:
        batches = eval_batches(prepared, batch_size, eval_max_batches, token_weighted=True)
    sigs, n = set(), 0
    for b in batches:
        sigs.add(tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(b.items())))
        n += 1
    shown = [", ".join(f"{k} {list(s)} {d}" for k, s, d in sig) for sig in sorted(sigs)]
    return len(sigs), shown, n


def eval_in_train(cfg, renderer, prepared, split: str) -> dict | None:
    """Evaluation examples that are also training examples, as training reports them (None: no other split to
    compare with). The other split is read as training reads it; when it cannot be, the line says why."""
    other = cfg.data.eval_path if split == "train" else cfg.data.train_path
    if not cfg.data.eval_path or not other:
        return None
    try:
        counterpart = prepare_split(other, renderer, cfg.data, cfg.train.seed)
    except UserError as e:
        return {"count": None, "line": f"not compared ({e})"}
    train, evaluation = (prepared, counterpart) if split == "train" else (counterpart, prepared)
    shared = shared_examples(train, evaluation)
    if not shared:
        return {"count": 0, "line": f"none of the {evaluation.report.kept} evaluation examples is a training example"}
    return {"count": len(shared), "line": f"{len(shared)} of {evaluation.report.kept} evaluation examples "
            f"({evaluation.source}) are also training examples (the first: {shared[0].where}); the validation loss "
            f"measures how well they were memorised"}


def fmt_row(cells: Sequence[Any], widths: Sequence[int]) -> str:
    return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def run(args: argparse.Namespace) -> dict:
    cfg = cli.run_config(args)
    if cfg is None:
        return 0
    if args.n < 0:
        raise UserError("-n must be 0 or more")
    path = cfg.data.train_path if args.split == "train" else cfg.data.eval_path
    if not path:
        key = f"data.{args.split}_path"  # unset in the file, or emptied by an override
        raise UserError(f"{key} is not set (in {args.config} or as {key}=FILE)")
    check_data_file(cfg.data, f"{args.split}_path")  # named by its key, before the tokenizer loads
    check_results_file(args.json, {"data": path, "--config": args.config}, results_key="examples_read")
    tok, tok_where, family_format, vocab = tokenizer_for(args.tokenizer, cfg)
    token_map = function_token_map(tok)
    renderer = make_renderer(tok, cfg.data, family_format, token_map, vocab_size=vocab)
    convs = load_conversations(path, cfg.data, renderer.markup)  # the control tokens are the tokenizer's
    skew = template_skew_warning(convs, renderer, path)  # as training warns it
    rendered, examples, tails, joined = [], [], 0, []
    for i, conv in enumerate(convs):
        try:
            r = renderer.render(conv, max_tokens=cfg.data.seq_len)
        except UserError as e:  # named with the example's line, as training names it
            raise render_error(e, conv, path) from None
        if i < args.n:
            rendered.append((conv, r))
        tails += r.untrained_tail
        if r.joined is not None:
            joined.append((conv.get("where") or path, r.joined))
        examples.append(batching.Example(r.ids, r.loss_mask, conv.get("where", ""), r.partial))
    joined_line = joined_warning(joined, len(examples), path) if joined else None  # as training warns it
    chosen = cfg.data.strategy
    prepared = {}
    for strategy in (chosen, "pack" if chosen == "pad" else "pad"):
        # the other strategy is laid out only to compare: what it warns of (rows past the loss buffer) is not what
        # training will do, and it was a second warning with other counts
        quiet = logging.getLogger("gemma_tpu.data.pipeline")
        was, quiet.disabled = quiet.disabled, strategy != chosen
        try:
            prepared[strategy] = prepare_examples(examples, path, cfg.data, cfg.train.seed, strategy=strategy)
        finally:
            quiet.disabled = was
    main = prepared[chosen]
    if args.split == "train":  # training (and its dry run) refuse it: no batch to show either
        check_one_batch(main, cfg.train.batch_size)
    stats = main.stats()
    partial = sum(ex.partial for ex in examples)  # very long texts are cut before tokenizing (`Renderer.render`)
    n_shapes, shapes, n_batches = batch_shapes(main, cfg.train.batch_size, args.split, cfg.train.seed,
                                               cfg.data.eval_max_batches)
    overlap = eval_in_train(cfg, renderer, main, args.split)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))

    out = sys.stdout
    rep = main.report
    texts = sum("text" in c for c in convs)  # language-modeling rows: every token is a target, whatever loss_on says
    loss_on = ("every token (text rows)" if texts == len(convs) else
               f"{renderer.loss_on} (chats), every token (text rows)" if texts else renderer.loss_on)
    print(f"data       {path} ({args.split}): format {cfg.data.format}, chat format {renderer.chat_format}, "
          f"loss on {loss_on}", file=out)
    print(f"tokenizer  {tok_where}", file=out)
    if token_map:
        print("token map  " + ", ".join(f"{k} -> {v}" for k, v in token_map.items()), file=out)
    print(f"examples   read {rep.read}, kept {rep.kept}, truncated {rep.truncated}, dropped {rep.dropped} "
          f"({rep.overlength} over data.seq_len={cfg.data.seq_len}, policy {cfg.data.overlength}; "
          f"{rep.no_loss} with no loss-bearing token left)"
          + (f"; {tails} end in turns that train nothing, left out of their rows" if tails else ""), file=out)
    if skew:
        print(f"template   {skew}", file=out)
    if joined_line:
        print(f"joined     {joined_line}", file=out)
    if rep.duplicates:
        print(f"duplicates {rep.duplicates} examples train exactly what an earlier one trains, as often as they "
              f"appear (the first: {rep.first_duplicate})", file=out)
    if overlap is not None:
        print(f"eval/train {overlap['line']}", file=out)
    print(f"tokens     per example: min {stats['length_min']}, p50 {stats['p50']}, p90 {stats['p90']}, "
          f"p95 {stats['p95']}, p99 {stats['p99']}, max {stats['length_max']}, mean {stats['length_mean']}; "
          f"{stats['tokens']} in rows, {stats['loss_tokens']} loss-bearing"
          + (f"; {partial} tokenized only as far as data.seq_len reaches (their lengths are lower bounds)"
             if partial else ""), file=out)
    print("", file=out)
    header = ["strategy", "seq_len", "rows", "examples/row", "non-pad", "useful (loss-bearing)", "loss buffer"]
    widths = [10, 7, 6, 12, 7, 21, 11]
    print(fmt_row(header, widths), file=out)
    for strategy, p in prepared.items():
        s = p.stats()
        name = strategy + (" *" if strategy == chosen else "")
        print(fmt_row([name, p.seq_len, s["rows"], f"{s['examples_per_row']:.2f}", f"{s['nonpad_fraction']:.3f}",
                       f"{s['useful_fraction']:.3f}", s["max_loss"]], widths), file=out)
    print("(* data.strategy; useful = loss-bearing tokens / all row tokens, non-pad = real tokens / all row tokens)",
          file=out)
    sp = stats.get("shared_prefixes")
    if sp is None:
        print("shared prefixes: not analysed (data.share_prefix: off)", file=out)
    else:
        print(f"shared prefixes (data.share_prefix_min_tokens={sp['min_tokens']}): {sp['groups']} groups holding "
              f"{sp['examples_in_groups']} of {sp['examples']} examples (largest {sp['group_size_max']}, "
              f"mean {sp['group_size_mean']}); prefix tokens min {sp['prefix_len_min']}, "
              f"median {sp['prefix_len_median']}, max {sp['prefix_len_max']}", file=out)
        print(f"  computed tokens per example: {sp['computed_tokens_per_example']} one by one, "
              f"{sp['computed_tokens_per_example_shared']} with each prefix computed once "
              f"({sp['computed_ratio']:.3f}x); loss-bearing fraction {sp['loss_fraction']:.3f} -> "
              f"{sp['loss_fraction_shared']:.3f} (the bound)", file=out)
        print(f"  as trained ({chosen}, seq_len {cfg.data.seq_len}): {stats['trees']} trees [P | S1 | S2 ...], "
              f"{stats['computed_tokens_per_example']} computed tokens per example "
              f"({stats['computed_tokens_per_example'] / max(sp['computed_tokens_per_example'], 1e-9):.3f}x)",
              file=out)
    what = f"one epoch, batch {cfg.train.batch_size}" if args.split == "train" else f"eval, batch {cfg.train.batch_size}"
    every = -(-len(main.rows) // cfg.train.batch_size)
    if args.split == "eval":
        what += f", {n_batches} batches" + (
            f" of {every} (data.eval_max_batches={cfg.data.eval_max_batches}: evaluation uses the first "
            f"{min(len(main.rows), n_batches * cfg.train.batch_size)} of {len(main.rows)} rows)"
            if n_batches < every else "")
    print(f"batch shapes: {n_shapes} distinct ({what})", file=out)
    for s in shapes:
        print(f"  {s}", file=out)
    for i, (conv, r) in enumerate(rendered):
        n_loss = int(r.loss_mask[1:].sum())
        status = ""
        cut = None
        if len(r.ids) > cfg.data.seq_len:
            status = {"truncate": ", truncated", "drop": ", dropped (over-length)", "error": ", over-length"}[
                cfg.data.overlength]
            if cfg.data.overlength == "truncate":
                cut = int(r.offsets[cfg.data.seq_len][0])
                if not r.loss_mask[1:cfg.data.seq_len].any():  # as batching.fit_length drops it
                    status = ", dropped (no loss-bearing token within data.seq_len)"
        print(f"\n--- example {i + 1} ({conv.get('where', '?')}): {'at least ' if r.partial else ''}{len(r.ids)} "
              f"tokens, {n_loss} loss-bearing{status} "
              f"---", file=out)
        print(mark(r.text, loss_spans(r.offsets, r.loss_mask), color, cut), file=out)
    result = {**stats, "untrained_tails": tails, "tokenized_in_part": partial, "split": args.split,
              "chat_format": renderer.chat_format, "template_skew": skew, "joined_answers": joined_line,
              "loss_on": renderer.loss_on,
              "distinct_batch_shapes": n_shapes, "batch_shapes": shapes, "batches": n_batches,
              "eval_in_train": overlap and overlap["count"],
              "other_strategy": {k: v.stats() for k, v in prepared.items() if k != chosen}}
    if args.json:
        write_text_atomic(Path(args.json), strict_json.dumps(result, indent=2) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    cli.setup_logging(logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    run(parse_args(argv or []))
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
