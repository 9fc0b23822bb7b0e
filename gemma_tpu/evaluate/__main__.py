"""`python -m gemma_tpu.evaluate`: score a model, checkpoint or endpoint on held-out conversations."""

import sys

from gemma_tpu.core.cli import cli_main
from gemma_tpu.evaluate.run import main

sys.exit(cli_main(main))
