"""``epd proxy``: the OpenAI-compatible front that encodes media on the encoders, then forwards to vLLM (proxy process)."""
