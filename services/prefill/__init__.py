"""The prefill service: computes prompts' KV and writes it into decode workers' blocks."""
