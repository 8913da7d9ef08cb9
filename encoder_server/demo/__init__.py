"""``epd demo``: one encoder and two prefill workers on loopback, a generated workload, a verified report.

The orchestrator process runs none of the three roles itself: it starts
``epd encoder`` and two ``epd prefill`` workers as separate processes (as in a
cluster), feeds each worker a stream of chat requests, and checks what the
workers merged against its own reference encode of the same bytes.

Reading path: :mod:`.workload` (the media and conversations, generated on the
spot) -> :mod:`.procs` (starting, watching and stopping the processes) ->
:mod:`.verify` (reference encode and the per-item check) -> :mod:`.report`
(``/metrics`` scraped from all three processes, combined) -> :mod:`.cli`
(the command).

It lives beside the encoder because it needs the reference encoder; it talks
to the prefill workers only through their command line, their output lines
and their dump directory, never by import.
"""
