"""gemma_tpu.formats."""
