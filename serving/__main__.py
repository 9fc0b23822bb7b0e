"""`python -m serving`: the serving commands, one line each."""

import sys

from gemma_tpu.core.cli import cli_main
from gemma_tpu.core.commands import print_commands

COMMANDS = {
    "serving.launch": "the vLLM-TPU container's docker command from a serve config (--print; --local on loopback)",
    "serving.local": "a local OpenAI-compatible server on a merged directory, for development",
    "serving.chat": "the fitness coach against any OpenAI-compatible server (its tool calls run here)",
    "serving.bench": "throughput and latency of an OpenAI-compatible server",
}

if __name__ == "__main__":
    sys.exit(cli_main(lambda argv: print_commands("serving", COMMANDS, argv=argv)))
