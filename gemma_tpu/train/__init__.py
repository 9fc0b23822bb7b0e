"""gemma_tpu.train."""
