"""Inference: batched greedy generation on a local model or checkpoint, the small OpenAI-compatible HTTP client,
and the tool-calling loop shared by the chat apps."""
