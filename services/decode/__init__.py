"""The decode service: reserves blocks, receives KV, decodes under continuous batching."""
