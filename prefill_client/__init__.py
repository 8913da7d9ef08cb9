"""The consumer side of epd-cache, by the process that runs each part.

- :mod:`.consumer`: the library every consumer process uses (``EncoderCacheClient``): find
  items on encoders, pull them over NIXL, verify them. Read ``consumer/client.py`` first.
- :mod:`.handoff`: what one process hands another about placed items (``Placement``, the
  ``ec_transfer_params`` codec, the connector's side-channel messages).
- :mod:`.proxy`: ``epd proxy``, the OpenAI-compatible front (proxy process).
- :mod:`.vllm`: ``EpdCacheConnector``, loaded by vLLM (its scheduler and worker processes).
- :mod:`.reference`: ``epd prefill``, the reference prefill worker (prefill process).
"""
