"""config.json presets of known hub models, for offline planning (see gemma_tpu.hf.directory.config_json_for)."""
