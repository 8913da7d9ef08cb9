"""Offline checks of deploy/overlays/vllm-pd: encode, prefill and decode apart, epd proxy in front.

Rendered with ``kubectl kustomize``, strict-validated like the other overlays, and cross-checked
with the code: the proxy's settings built from its pod's environment name the two pools by their
headless Services, the prefill pool runs our EC connector and vLLM's NixlConnector as KV
producer with its side channel on its pod address, and the decode pool runs NixlConnector as KV
consumer and nothing of ours.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.config import ProxyConfig, build, iter_settings
from tests.unit import deploy_helpers as dh
from tests.unit.test_deploy_vllm import DEPLOY, _arg, _port, _service_target, _workload

NIXL_SIDE_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default, set explicitly in both pools


@pytest.fixture(scope="module")
def rendered() -> dh.Rendered:
    kubectl = dh.kubectl()
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize overlays cannot be rendered offline")
    return dh.render(kubectl, DEPLOY / "overlays" / "vllm-pd")


def _kv(args: list[str]) -> dict[str, Any]:
    return dict(json.loads(_arg(args, "--kv-transfer-config")))


def test_core_objects_validate_strict(rendered: dh.Rendered) -> None:
    errors = dh.strict_errors(rendered.objects)
    assert not errors, "\n".join(errors)


def test_three_pools_and_the_proxy(rendered: dh.Rendered) -> None:
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects}
    assert ("StatefulSet", "epd-encoder") in names and ("Deployment", "epd-prefill") not in names
    for name in ("epd-vllm", "epd-vllm-decode", "epd-proxy"):
        assert {("Deployment", name), ("Service", name), ("PodDisruptionBudget", name)} <= names


def test_prefill_pulls_from_the_encoders_and_produces_kv(rendered: dh.Rendered) -> None:
    _, ctr, env = _workload(rendered, "Deployment", "epd-vllm", "vllm")
    args = ctr["args"]
    assert json.loads(_arg(args, "--ec-transfer-config"))["ec_role"] == "ec_consumer"
    assert _kv(args) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    # The decode is told this address in the prefill's answer: the pod's own, not localhost.
    assert env.values["VLLM_NIXL_SIDE_CHANNEL_HOST"] == env.values["POD_IP"] != "localhost"
    assert int(env.values["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == _port(ctr, "nixl-side") == NIXL_SIDE_PORT


def test_decode_consumes_kv_and_runs_nothing_of_ours(rendered: dh.Rendered) -> None:
    workload, ctr, env = _workload(rendered, "Deployment", "epd-vllm-decode", "vllm")
    args = [a.replace("$(EPD_MODEL_ID)", env.values["EPD_MODEL_ID"]) for a in ctr["args"]]
    assert args[:2] == ["vllm", "serve"] and "--ec-transfer-config" not in args
    assert _kv(args) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert not [n for n in env.names if n.startswith("EPD_") and n != "EPD_MODEL_ID"]
    _, prefill_ctr, prefill_env = _workload(rendered, "Deployment", "epd-vllm", "vllm")
    # The same model under the same name as the prefill pool, from the same checkpoint.
    assert _arg(args, "serve") == _arg(prefill_ctr["args"], "serve")
    assert env.values["EPD_MODEL_ID"] == prefill_env.values["EPD_MODEL_ID"]
    assert _arg(ctr["args"], "--served-model-name") == _arg(prefill_ctr["args"], "--served-model-name")
    assert env.values["VLLM_NIXL_SIDE_CHANNEL_HOST"] == env.values["POD_IP"]
    # NIXL over UCX as the encoders' pulls are (the transport list comes from the variant).
    assert "UCX_TLS" in env.values and "IPC_LOCK" in ctr["securityContext"]["capabilities"]["add"]
    assert dh.template_labels(workload)["app.kubernetes.io/component"] == "decode"


def test_proxy_sends_each_request_to_a_prefill_and_a_decode_pod(rendered: dh.Rendered) -> None:
    _, ctr, env = _workload(rendered, "Deployment", "epd-proxy", "proxy")
    assert "EPD_PROXY_BACKENDS" not in env.names
    cfg = build(ProxyConfig, None, env.values)
    assert cfg.disaggregated and cfg.backends == ()
    for (url,), deployment in ((cfg.prefill, "epd-vllm"), (cfg.decode, "epd-vllm-decode")):
        # By DNS, so the proxy sees every pod of the pool (its routing is per pod): a headless Service.
        host, port = url.removeprefix("dns:///").split(":")
        svc, target = _service_target(rendered, host.split(".")[0], int(port))
        assert url.startswith("dns:///") and svc["spec"].get("clusterIP") == "None"
        assert host == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
        _, pool_ctr, _ = _workload(rendered, "Deployment", deployment, "vllm")
        assert dh.selects(svc["spec"]["selector"], dh.template_labels(rendered.one("Deployment", deployment)))
        assert _port(pool_ctr, target) == int(_arg(pool_ctr["args"], "--port"))
    known = {i.env for i in iter_settings(ProxyConfig)}
    assert not {n for n in env.names if n.startswith("EPD_")} - known
