"""vLLM integration: the encoder-cache connector vLLM loads, and what it shares with ``epd proxy``.

:mod:`.connector` imports vLLM; :mod:`.params` (the ``ec_transfer_params`` the proxy writes and
the connector reads) and :mod:`.launch` do not, so the proxy runs without vLLM installed.
"""
