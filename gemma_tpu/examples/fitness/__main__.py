"""`python -m gemma_tpu.examples.fitness generate|stats ...`

    generate --out DIR [--seed S] [--train N --validation N --test N]
        write train.jsonl, validation.jsonl, test.jsonl (deterministic in the seed)
    stats --data DIR [--tokenizer HF_DIR]
        examples per tool and rendered token lengths (default tokenizer: the embedded Gemma 3 270M)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Sequence

from gemma_tpu.core import cli
from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.errors import UserError
from gemma_tpu.examples.fitness.dataset import SPLITS, generate, read_split, split_stats, write_splits
from gemma_tpu.hf.directory import resolve_path
from gemma_tpu.hf.tokenizer import load_tokenizer


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.parser("python -m gemma_tpu.examples.fitness", __doc__, overrides=False)
    sub = p.add_subparsers(dest="command", required=True)
    g = cli.subcommand(sub, "generate", "write the train/validation/test JSONL files")
    g.add_argument("--out", required=True, type=cli.output_path_of("output directory"), help="output directory")
    g.add_argument("--seed", type=int, default=0, help="the committed splits are seed 0")
    g.add_argument("--train", type=int, default=1200, help="training examples")
    g.add_argument("--validation", type=int, default=150, help="validation examples")
    g.add_argument("--test", type=int, default=200, help="test examples")
    s = cli.subcommand(sub, "stats", "examples per tool and token lengths of a generated directory")
    s.add_argument("--data", required=True, type=cli.input_path_of("data directory"),
                   help="directory with the split files")
    s.add_argument("--tokenizer", default="embedded:gemma3-270m", type=cli.input_path_of("tokenizer"),
                   help="HF dir, hub id or embedded:NAME")
    return p.parse_args(list(argv))


def _stats(data: Path, tokenizer_spec: str) -> None:
    paths = [data / f"{split}.jsonl" for split in SPLITS]
    if not any(p.exists() for p in paths):
        raise UserError(f"--data {data}: holds none of {', '.join(p.name for p in paths)} (give the --out of "
                        f"`generate`)")
    for path in paths:
        if path.exists() and not path.is_file():
            raise UserError(f"{path}: not a file")
    splits = {split: read_split(path) for split, path in zip(SPLITS, paths) if path.exists()}  # rows checked first
    tokenizer = load_tokenizer(resolve_path(tokenizer_spec))
    for split, conversations in splits.items():
        lengths, tools = split_stats(conversations, tokenizer)
        if not lengths:
            print(f"{split}: 0 examples")
            continue
        print(f"{split}: {len(lengths)} example{'s' if len(lengths) != 1 else ''}; tokens median "
              f"{statistics.median(lengths):.0f}, max {max(lengths)}, min {min(lengths)}; per tool: "
              + ", ".join(f"{k}={v}" for k, v in sorted(tools.items())))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv or [])
    if args.command == "generate":
        sizes = {"train": args.train, "validation": args.validation, "test": args.test}
        for split, n in sizes.items():
            if n < 0:
                raise UserError(f"--{split} {n}: split sizes must be non-negative")
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise UserError(f"--out {args.out}: exists and is not a directory")
        paths = write_splits(generate(args.seed, sizes), args.out)
        for split, path in paths.items():
            print(f"{split}: {sizes[split]} examples -> {path}")
        return 0
    data = Path(args.data)
    if not data.is_dir():
        raise UserError(f"--data {data}: not a directory")
    _stats(data, args.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
