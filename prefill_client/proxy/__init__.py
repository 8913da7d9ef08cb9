"""``epd proxy``: the OpenAI-compatible front that encodes media on the encoders, then forwards to vLLM (proxy process).

For ``/v1/chat/completions`` (streaming or not), every ``image_url`` part is read (a ``data:`` URL;
a ``file://`` URL only under ``--allow-local-media``; an ``http(s)://`` URL only for a host in
``--allow-remote-media``), and so is every ``video_url`` part in vLLM's frame-sequence form
(``data:video/jpeg;base64,FRAME,FRAME,...``, at ``media_io_kwargs.video.fps``, default 1). All of
the request's media are sent in one ``Encode`` per encoder (rendezvous routing over the encoder
pool, fail-over included). Each part is then rewritten into vLLM's embeddings form without a
tensor, from the placeholder metadata the encoder answered for the item (whatever fields the
model declares; Qwen-VL's grid here)::

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h, w]}, "uuid": MM_HASH}
    {"type": "video_embeds", "video_embeds": {"video_grid_thw": [t, h, w], "timestamps": [...]},
     "uuid": MM_HASH}

A model that sizes its placeholders from the media itself (no metadata: LLaVA, Gemma 3, ...)
gets the media the encoder encoded, as a data URL, with ``"uuid": MM_HASH``: vLLM's processor
counts the placeholders, and the rows still come from the encoder.

and the leased locations go in the request's ``ec_transfer_params``
(:mod:`prefill_client.handoff`), where the backend's ``EpdCacheConnector`` finds them and
pulls the rows, verified. The request then goes to a backend (by default the one its
conversation's leading messages hash to, while that one is not overloaded; the next one when
one is unreachable: :mod:`.routing`) and its answer comes back as it is, streamed when it streams.

The model id sent in the encoder handshake is ``--model-id`` when given; else the request's
``model``, else the one model the backends' ``/v1/models`` lists (asked once): one
``EncoderCacheClient`` per model id, made on first use, at most ``MAX_MODELS`` at once.
A request without media needs no encoder, and no model id; nor does a text completion
(``/v1/completions``), which goes on as the caller wrote it.

Errors: bad media or a bad ``model`` 400 (naming the part or the model), cache full 429 with
``Retry-After``, no encoder reachable 503, the encoders refuse the model id 502 (naming both
ids), no backend reachable 502. When a backend fails a request that carried items
(vLLM answers 500 when its connector could not get them), the proxy asks the encoders what
became of the items and says so in the error. The proxy keeps no state a restart would lose:
leases it handed on end when the connector releases them, or at the encoder's lease ttl.

Before any of that, the front door (:mod:`.front`): without a valid ``--api-key`` a request
is 401, over ``--max-inflight`` it is 429 with ``Retry-After``, both before its body is read.
``/health`` (liveness), ``/ready`` (an encoder ready and a backend healthy) and ``/metrics``
are open.

Reading path: ``app.py`` first (the routes and the chat handler, step by step), then the step
you care about:

- ``media.py``: reading a request's media parts (URLs, files, remote hosts, video frames, fps);
- ``clients.py``: the encoder client of a model id (made on first use, bounded, dropped when refused);
- ``errors.py``: ``HttpError``, and the one table from the error tree to HTTP status and kind;
- ``rewrite.py``: a part in vLLM's embeddings or data-URL form, and ``ec_transfer_params``;
- ``backends.py``: the backends (resolved again while it runs), which are down, and the models they serve;
- ``disagg.py``: with ``--prefill``/``--decode``, each request prefilled on one vLLM (one token, its KV
  kept), then decoded on another with the prefill's ``kv_transfer_params``;
- ``routing.py``: which backend gets a request (affinity with bounded load, least outstanding, round robin);
- ``front.py``: API keys, the in-flight bound, and what each request and backend call counts as;
- ``readiness.py``: ``/ready``, from the encoder pool's readiness probe and the backends' ``/health``;
- ``cli.py``: ``epd proxy``'s arguments; ``serve.py``: serving until a signal; ``workers.py``:
  ``--workers N`` processes on one port, and their parent.
"""
