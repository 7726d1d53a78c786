"""The policy model: Qwen2 transformer with logical axis names, LM head, HF interop, tokenizers, in-process sampling."""
