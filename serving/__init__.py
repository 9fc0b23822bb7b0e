"""Serving: the vLLM-TPU container, a local OpenAI-compatible server for development, bench and chat clients."""
