"""`python -m gemma_tpu.plan`: the command name of the dry-run planner, which lives in `gemma_tpu.train.plan`."""

import sys

from gemma_tpu.core.cli import cli_main
from gemma_tpu.train.plan import main

if __name__ == "__main__":
    sys.exit(cli_main(main))
