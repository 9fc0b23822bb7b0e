"""`python -m gemma_tpu.assets prepare NAME | list`: the embedded-model cache (prepare prints the directory)."""

import sys

from gemma_tpu.assets.embedded import main

sys.exit(main())
