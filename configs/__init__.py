"""Model presets: `--model NAME` finds NAME.toml here from any install, because this folder
ships inside the wheel as package data (the package `tahnode.configs`)."""
