"""Evaluation: tool-call accuracy, argument accuracy, hallucinated tools, answer match (text references) and eval loss of a model, a checkpoint or
an OpenAI-compatible endpoint on held-out conversations. `python -m gemma_tpu.evaluate`."""
