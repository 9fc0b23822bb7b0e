"""gemma-tpu: LoRA fine-tuning of Gemma on TPU with JAX, Tunix and Qwix, from JSONL chats to a served model."""

__version__ = "0.1.0"
