"""gemma_tpu.hf."""
