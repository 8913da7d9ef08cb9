"""vLLM integration: the encoder-cache connector vLLM loads (its scheduler and worker processes), and ``epd vllm``.

Reading path:

1. :mod:`.connector`: ``EpdCacheConnector``, what vLLM loads; translates vLLM's hooks and picks
   the pull strategy's pair by ``pull_on`` (``scheduler``: the scheduler pulls and ships rows;
   ``worker``: each tensor-parallel rank pulls into its own device).
2. :mod:`.scheduler` (what vLLM's scheduler process runs: ``SchedulerPulls``, ``WorkerPulls``)
   and :mod:`.worker` (what each vLLM worker runs: ``ShippedRows``, ``WorkerLoader``).
3. :mod:`.tracker`: ``PullTracker``, the bookkeeping both scheduler halves share.
4. :mod:`.channel`: the side channel between the scheduler and its workers; its messages are
   typed in :mod:`prefill_client.handoff`.
5. :mod:`.items`: what both processes share (a request's items, the checks on their rows, the
   failure ladder, the step's orders).

These import vLLM (or run inside it); :mod:`prefill_client.handoff` (the ``ec_transfer_params``
the proxy writes and the connector reads) and :mod:`.launch` do not, so the proxy runs without
vLLM installed.
"""
