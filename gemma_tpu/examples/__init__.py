"""Worked examples built on gemma-tpu (each a package with its own data generator and tools)."""
