"""Engine, model, KV-transfer and speculative configs, and the CLI's engine arguments."""
