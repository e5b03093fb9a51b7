"""Packaged TOML presets, loaded by :func:`llmtrain.config.load_config`."""
