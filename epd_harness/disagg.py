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
from epd_harness.vllm import Server, connector_config, launch_vllm

NIXL_ALIAS = Path(__file__).resolve().parent / "nixl_alias"


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
                       "--ec-transfer-config", connector_config(encoders, model, **connector),
                       "--kv-transfer-config", kv_transfer_config("kv_producer"), cpu_core=cpu_core,
                       extra_env={**nixl_env(), **(extra_env or {})})


def launch_decode(checkpoint: Path, log_path: Path, model: str, *, cpu_core: int, log_stats: bool = False,
                  extra_env: Mapping[str, str] | None = None) -> Server:
    """A decode vLLM of ``checkpoint`` served as ``model``: NixlConnector as KV consumer, no encoder
    cache connector (it takes the prompt's KV, never its media); not waited for."""
    return launch_vllm(checkpoint, log_path, "--served-model-name", model,
                       "--kv-transfer-config", kv_transfer_config("kv_consumer"), cpu_core=cpu_core,
                       log_stats=log_stats, extra_env={**nixl_env(), **(extra_env or {})})


def split_args(prefill: Sequence[Server], decode: Sequence[Server]) -> list[str]:
    """``epd proxy``'s flags for the two pools."""
    return ["--prefill", ",".join(s.url for s in prefill), "--decode", ",".join(s.url for s in decode)]
