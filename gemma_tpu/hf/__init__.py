"""Hugging Face directories: the one place that finds a model directory (local, hub id, embedded:NAME), reads its
config.json and weight index, loads its tokenizer, streams safetensors and writes an output directory's sidecar files."""
