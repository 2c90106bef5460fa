"""Weight loading: HF safetensors folders and GGUF files (converted once, then cached)."""
