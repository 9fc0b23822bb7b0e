"""gemma_tpu.infer."""
