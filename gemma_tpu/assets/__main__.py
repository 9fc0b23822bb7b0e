"""`python -m gemma_tpu.assets prepare|list|path NAME`: the embedded-model cache."""

import sys

from gemma_tpu.assets.embedded import main

sys.exit(main())
