"""Serving: the vLLM-TPU container, a local OpenAI-compatible server for development, bench and chat clients.

    python -m serving.launch --config configs/serve-*.yaml [--print | --local]   (config.py, launch.py, local.py)
    python -m serving.bench --base-url URL ...                                   (bench.py)
    python -m serving.chat --base-url URL ...                                    (chat.py, openai_client.py)
"""
