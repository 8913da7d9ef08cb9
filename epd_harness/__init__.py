"""Launch helpers shared by ``bench/`` and ``tests/``: start, wait for and stop real processes (dev tooling).

Imported by the bench scripts (run as ``python bench/NAME.py`` from a checkout, which puts the
checkout on ``sys.path``) and by the test suite; it ships in neither the wheel nor the images.
It sits above ``common/``, ``encoder_server/`` and ``prefill_client/`` and imports from them,
never the other way round.

- :mod:`.waits`: waiting for a started process by following its progress (log, CPU time), not a fixed time;
- :mod:`.procs`: ``epd encoder`` processes (start, wait, stop, a restartable one for soaks);
- :mod:`.vllm`: ``vllm serve`` (plain and with EpdCacheConnector), ``epd proxy``, the tower stack of one family;
- :mod:`.ports`: fixed ports below the kernel's ephemeral range;
- :mod:`.media`: seeded images and videos, as bytes or data URLs;
- :mod:`.qwen3vl`, :mod:`.families`: tiny random checkpoints that transformers and vLLM load offline.
"""
