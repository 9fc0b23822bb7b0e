"""`python -m gemma_tpu.train --config FILE [key=value ...]`: run a LoRA or full fine-tune."""

import sys

from gemma_tpu.core.cli import cli_main
from gemma_tpu.train.run import main

sys.exit(cli_main(main))
