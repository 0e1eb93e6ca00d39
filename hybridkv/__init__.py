"""hybridkv: KV-cache management for hybrid sliding-window-attention LLMs."""
