"""gemma_tpu.core."""
