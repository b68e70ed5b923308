"""The run's options (the CLI's help text) and their validation and derived values."""
