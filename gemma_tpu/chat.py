"""`python -m gemma_tpu.chat`: the command name of the fitness coach chat (`gemma_tpu.examples.fitness.chat`)."""

import sys

from gemma_tpu.core.cli import cli_main
from gemma_tpu.examples.fitness.chat import main

if __name__ == "__main__":
    sys.exit(cli_main(main))
