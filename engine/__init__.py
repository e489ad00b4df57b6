"""kvchat's inference engine: paged KV cache, prefix cache, background thread, CLI and local API."""
