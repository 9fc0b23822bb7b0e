"""gemma_tpu.evaluate."""
