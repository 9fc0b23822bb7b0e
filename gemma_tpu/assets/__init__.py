"""gemma_tpu.assets."""
