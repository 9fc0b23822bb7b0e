"""The commands a package offers, printed by `python -m gemma_tpu` (and `convert`, `serving`): typing the package's
name answered only Python's "'gemma_tpu' is a package and cannot be directly executed"."""

from __future__ import annotations

import sys
from typing import Sequence

from gemma_tpu.core import cli


def print_commands(package: str, commands: dict[str, str], more: str = "", argv: Sequence[str] | None = None) -> int:
    """`python -m PACKAGE [--help]`: list `commands` (module: what it does) as `python -m MODULE`, then `more`.
    Run under `cli.cli_main`, which makes a usage mistake one line."""
    width = max(len(name) for name in commands) + len("python -m ")
    lines = [f"{package}'s commands (each takes --help; README.md tells the whole story):", ""]
    lines += [f"  {'python -m ' + name:<{width}}  {what}" for name, what in commands.items()]
    lines += ["", more] if more else []
    parser = cli.parser(f"python -m {package}", "\n".join(lines), overrides=False)
    parser.usage = f"python -m {package}.COMMAND [--help] ..."
    args = list(sys.argv[1:] if argv is None else argv)
    sub = f"{package}.{args[0]}" if args else ""
    if sub in commands:  # `python -m convert merge_orbax ...`, as git or docker take a subcommand
        parser.error(f"{args[0]!r}: the command is its own module: python -m {sub} {' '.join(args[1:])}".rstrip())
    parser.parse_args(args)  # --help prints the same; anything else is refused in one line
    cli.write_stdout(parser.format_help(), end="")  # `python -m gemma_tpu | head -3`: the reader may be gone
    return 0
