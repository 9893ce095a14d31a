"""The presets (`--preset NAME` → NAME.yaml here), shipped as package data."""
