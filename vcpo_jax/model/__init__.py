"""The policy model: Qwen2 transformer, LM head, sharding, HF interop, tokenizers, in-process generation."""
