"""config.json presets of known hub models, for offline planning (see registry.config_json_for)."""
