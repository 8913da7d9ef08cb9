"""Prefill and decode vLLM servers of an E + P + D split for test and bench runs: launch, configure (that run's process).

The KV moves from the prefill vLLM to the decode vLLM through vLLM's ``NixlConnector`` with a
host buffer (``kv_buffer_device: cpu``), the production choice; the prefill vLLM also runs
EpdCacheConnector (``--ec-transfer-config``), beside it. vLLM imports NIXL as ``nixl``; this
project installs the ``nixl_cu12`` wheel (the ``nixl`` meta package pulls the CUDA stack), so
the vLLM processes get ``epd_harness/nixl_alias`` on ``PYTHONPATH``: a ``nixl`` package that
is ``nixl_cu12`` under vLLM's name. Each engine's NIXL side channel (where a decode asks a
prefill for its agent metadata) gets its own port: two engines on one host would both take
vLLM's default 5600.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epd_harness.ports import free_port
from epd_harness.vllm import Server, connector_config, consumer_args, launch_vllm

NIXL_ALIAS = Path(__file__).resolve().parent / "nixl_alias"


# The KV cache of each engine of the split: 64 MiB, 131,072 tokens of the tiny test model (its 8
# sequences of 4,096 need a quarter). vLLM's NixlConnector prepares a NIXL descriptor for every
# block of a peer's cache on a decode's first request from each prefill (and for its own cache at
# start): at the 1 GiB the other test engines get (``VLLM_ENV``) that took minutes on two cores.
KV_CACHE_BYTES = 64 << 20


def kv_transfer_config(role: str) -> str:
    """``--kv-transfer-config`` of NixlConnector as ``role`` (``kv_producer``: prefill,
    ``kv_consumer``: decode), the KV staged in host memory."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


def nixl_env() -> dict[str, str]:
    """The variables a NixlConnector vLLM needs here: ``nixl`` importable, its own side-channel port."""
    path = os.pathsep.join(p for p in (str(NIXL_ALIAS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}


def launch_prefill(checkpoint: Path, log_path: Path, model: str, encoders: Sequence[str], *, cpu_core: int,
                   extra_env: Mapping[str, str] | None = None, **connector: Any) -> Server:
    """A prefill vLLM of ``checkpoint`` served as ``model``: EpdCacheConnector pulling from ``encoders``
    (``connector``: the rest of its extra config) and NixlConnector as KV producer; not waited for.
    ``extra_env``: more variables for it."""
    return launch_vllm(checkpoint, log_path, "--served-model-name", model,
                       *consumer_args(connector_config(encoders, model, **connector)),
                       "--kv-transfer-config", kv_transfer_config("kv_producer"), cpu_core=cpu_core,
                       extra_env={**nixl_env(), **(extra_env or {})}, kv_cache_bytes=KV_CACHE_BYTES)


def launch_decode(checkpoint: Path, log_path: Path, model: str, *, cpu_core: int,
                  extra_env: Mapping[str, str] | None = None) -> Server:
    """A decode vLLM of ``checkpoint`` served as ``model``: NixlConnector as KV consumer, no encoder
    cache connector (it takes the prompt's KV, never its media); not waited for."""
    return launch_vllm(checkpoint, log_path, "--served-model-name", model,
                       "--kv-transfer-config", kv_transfer_config("kv_consumer"), cpu_core=cpu_core,
                       extra_env={**nixl_env(), **(extra_env or {})}, kv_cache_bytes=KV_CACHE_BYTES)


def split_args(prefill: Sequence[Server], decode: Sequence[Server]) -> list[str]:
    """``epd proxy``'s flags for the two pools."""
    return ["--prefill", ",".join(s.url for s in prefill), "--decode", ",".join(s.url for s in decode)]
