"""The reference prefill worker (``epd prefill``): chat requests, cache layers, merge, a tiny LM (prefill process).

It proves the consumer library end to end without vLLM: :mod:`.worker` is the entry, :mod:`.cli`
its command line, :mod:`.monolithic` the encoder and this worker in one process.
"""
