"""What is read from a checkpoint on disk, torch-free: Hub, tokenizer, generation
defaults, the model's shape, the architecture registry, the GGUF reader."""
