"""gemma_tpu.checkpoint."""
