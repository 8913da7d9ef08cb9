"""Offline checks of deploy/overlays/vllm: vLLM pods with EpdCacheConnector and epd proxy in front.

Rendered with ``kubectl kustomize``, strict-validated like the other overlays, and cross-checked
with the code: the connector named in ``--ec-transfer-config`` exists, the settings it and the
proxy would build from their pods' environment agree with the encoders', and every port the
pieces use to reach each other is the one the other side listens on.
"""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from common.config import (
    EncoderServerConfig,
    PrefillConfig,
    ProxyConfig,
    build,
    build_from_mapping,
    iter_settings,
)
from prefill_client.vllm.prefetch import MIDDLEWARE as PREFETCH_MIDDLEWARE
from tests.unit import deploy_helpers as dh

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


@pytest.fixture(scope="module")
def rendered() -> dh.Rendered:
    kubectl = dh.kubectl()
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize overlays cannot be rendered offline")
    return dh.render(kubectl, DEPLOY / "overlays" / "vllm")


def _workload(r: dh.Rendered, kind: str, name: str, ctr_name: str) -> tuple[dict[str, Any], dict[str, Any],
                                                                           dh.ContainerEnv]:
    workload = r.one(kind, name)
    ctr = dh.container(workload, ctr_name)
    return workload, ctr, dh.resolve_env(r, workload, ctr)


def _arg(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def _port(ctr: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in ctr["ports"] if p["name"] == name]
    return int(port)


def _service_target(r: dh.Rendered, name: str, port: int) -> tuple[dict[str, Any], str]:
    svc = r.one("Service", name)
    (entry,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    return svc, str(entry["targetPort"])


def test_core_objects_validate_strict(rendered: dh.Rendered) -> None:
    errors = dh.strict_errors(rendered.objects)
    assert not errors, "\n".join(errors)


def test_vllm_replaces_the_reference_workers(rendered: dh.Rendered) -> None:
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects}
    assert ("Deployment", "epd-prefill") not in names and ("PodDisruptionBudget", "epd-prefill") not in names
    for name in ("epd-vllm", "epd-proxy"):
        assert {("Deployment", name), ("Service", name), ("PodDisruptionBudget", name)} <= names


def test_vllm_runs_the_connector_with_settings_that_match_the_encoders(rendered: dh.Rendered) -> None:
    _, ctr, env = _workload(rendered, "Deployment", "epd-vllm", "vllm")
    args = [a.replace("$(EPD_MODEL_ID)", env.values["EPD_MODEL_ID"]) for a in ctr["args"]]
    assert args[:2] == ["vllm", "serve"]
    ec = json.loads(_arg(args, "--ec-transfer-config"))
    assert ec["ec_role"] == "ec_consumer"
    source = (REPO / Path(*ec["ec_connector_module_path"].split("."))).with_suffix(".py")
    assert f"class {ec['ec_connector']}(ECConnectorBase)" in source.read_text()
    # vLLM's API server runs the middleware that hands the proxy's prefetch hints to the workers.
    module, name = _arg(args, "--middleware").rsplit(".", 1)
    assert _arg(args, "--middleware") == PREFETCH_MIDDLEWARE and callable(getattr(importlib.import_module(module), name))
    # What the connector builds: its extra config, else the pod's EPD_* variables.
    cfg = build_from_mapping(PrefillConfig, ec.get("ec_connector_extra_config", {}), "test", env.values)
    sts, enc_ctr, enc_env = _workload(rendered, "StatefulSet", "epd-encoder", "encoder")
    enc = dh.build_config(EncoderServerConfig, enc_ctr, enc_env)
    assert cfg.model_id == enc.model_id == _arg(args, "--served-model-name")
    assert cfg.transport == enc.transport and cfg.transport.value == "nixl"
    replicas = sts["spec"]["replicas"]
    assert [t.rsplit(":", 1)[1] for t in cfg.encoders] == [str(enc.port)] * replicas
    assert [t.split(".")[0] for t in cfg.encoders] == [f"epd-encoder-{i}" for i in range(replicas)]
    assert cfg.metrics_host == "0.0.0.0" and _port(ctr, "metrics") == cfg.metrics_port
    assert _port(ctr, "http") == int(_arg(args, "--port")) and _arg(args, "--host") == "0.0.0.0"
    # The encoders serve the vision tower of the checkpoint vLLM serves.
    assert enc.weights is not None and Path(_arg(args, "serve")) == Path(enc.weights)
    vllm_mounts = {m["mountPath"]: m["name"] for m in ctr["volumeMounts"]}
    enc_mounts = {m["mountPath"]: m["name"] for m in enc_ctr["volumeMounts"]}
    assert vllm_mounts["/models"] == enc_mounts["/models"] == "models"
    claims = {dh.pod_spec(w)["volumes"][i]["persistentVolumeClaim"]["claimName"]
              for w in (rendered.one("Deployment", "epd-vllm"), sts)
              for i, v in enumerate(dh.pod_spec(w)["volumes"]) if v["name"] == "models"}
    assert claims == {"epd-models"}


def test_proxy_reaches_the_encoders_and_the_vllm_service(rendered: dh.Rendered) -> None:
    _, ctr, env = _workload(rendered, "Deployment", "epd-proxy", "proxy")
    assert ctr["args"] == ["proxy"]
    cfg = build(ProxyConfig, None, env.values)
    _, vllm_ctr, vllm_env = _workload(rendered, "Deployment", "epd-vllm", "vllm")
    vllm_cfg = build_from_mapping(PrefillConfig, {}, "test", vllm_env.values)
    assert cfg.encoders == vllm_cfg.encoders and cfg.model_id == vllm_cfg.model_id
    assert cfg.host == "0.0.0.0" and _port(ctr, "http") == cfg.port
    (backend,) = cfg.backends
    # By DNS, so the proxy sees every vLLM pod (its routing is per pod): a headless Service.
    host, port = backend.removeprefix("dns:///").split(":")
    svc, target = _service_target(rendered, host.split(".")[0], int(port))
    assert host == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert backend.startswith("dns:///") and svc["spec"].get("clusterIP") == "None"
    assert dh.selects(svc["spec"]["selector"], dh.template_labels(rendered.one("Deployment", "epd-vllm")))
    assert _port(vllm_ctr, target) == int(_arg(vllm_ctr["args"], "--port"))
    _, proxy_target = _service_target(rendered, "epd-proxy", 8000)
    assert _port(ctr, proxy_target) == cfg.port


def test_proxy_probes_and_scrape(rendered: dh.Rendered) -> None:
    """Ready once it can serve (/ready: an encoder ready, a backend healthy), alive on /health, scraped
    on its http port; its API keys come from an optional Secret."""
    workload, ctr, env = _workload(rendered, "Deployment", "epd-proxy", "proxy")
    assert ctr["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    (keys,) = [e for e in ctr["env"] if e["name"] == "EPD_PROXY_API_KEY"]
    assert keys["valueFrom"]["secretKeyRef"]["optional"] is True
    (monitor,) = rendered.of_kind("PodMonitor")
    assert dh.selects(monitor["spec"]["selector"]["matchLabels"], dh.template_labels(workload))
    (endpoint,) = [e for e in monitor["spec"]["podMetricsEndpoints"] if e["port"] == "http"]
    assert endpoint["path"] == "/metrics" and _port(ctr, "http") == build(ProxyConfig, None, env.values).port
    (keep,) = endpoint["relabelings"]
    assert keep["action"] == "keep" and keep["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
    assert keep["regex"] == dh.template_labels(workload)["app.kubernetes.io/name"] == "epd-proxy"


def test_proxy_grace_period_covers_the_pause_and_the_drain(rendered: dh.Rendered) -> None:
    """Deleted, the proxy serves on through its preStop pause, then drains: the pod's grace covers both."""
    workload, ctr, env = _workload(rendered, "Deployment", "epd-proxy", "proxy")
    pre_stop = ctr["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = build(ProxyConfig, None, env.values).drain_grace_s
    grace = dh.pod_spec(workload)["terminationGracePeriodSeconds"]
    assert pre_stop > 0 and grace > pre_stop + drain, f"grace {grace}s must exceed preStop {pre_stop}s + drain {drain}s"


def test_env_names_are_settings_the_code_knows(rendered: dh.Rendered) -> None:
    known = {"vllm": {i.env for i in iter_settings(PrefillConfig)}, "proxy": {i.env for i in iter_settings(ProxyConfig)}}
    for name, ctr_name in (("epd-vllm", "vllm"), ("epd-proxy", "proxy")):
        _, _, env = _workload(rendered, "Deployment", name, ctr_name)
        unknown = {n for n in env.names if n.startswith("EPD_")} - known[ctr_name]
        assert not unknown, f"{name}: {sorted(unknown)} are not settings of the code"


def test_network_policy_admits_vllm_for_pulls_and_the_proxy_for_grpc(rendered: dh.Rendered) -> None:
    sts, enc_ctr, enc_env = _workload(rendered, "StatefulSet", "epd-encoder", "encoder")
    (policy,) = [p for p in rendered.of_kind("NetworkPolicy")
                 if dh.selects(p["spec"]["podSelector"]["matchLabels"], dh.template_labels(sts))]
    low, high = map(int, enc_env.values["UCX_TCP_PORT_RANGE"].split("-"))
    grpc_port = _port(enc_ctr, "grpc")
    reach: dict[str, set[int]] = {"epd-vllm": set(), "epd-proxy": set()}
    for rule in policy["spec"]["ingress"]:
        ports: set[int] = set()
        for p in rule.get("ports", []):
            number = p["port"] if isinstance(p["port"], int) else _port(enc_ctr, p["port"])
            ports |= set(range(number, p.get("endPort", number) + 1))
        for peer in rule.get("from", []):
            for name in reach:
                labels = dh.template_labels(rendered.one("Deployment", name))
                if "podSelector" in peer and dh.selects(peer["podSelector"]["matchLabels"], labels):
                    reach[name] |= ports
    assert reach["epd-vllm"] == {grpc_port} | set(range(low, high + 1))
    assert reach["epd-proxy"] == {grpc_port}


def test_images_and_dockerfile(rendered: dh.Rendered) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert dh.container(rendered.one("Deployment", "epd-vllm"), "vllm")["image"] == f"epd-cache-vllm:{version}"
    assert dh.container(rendered.one("Deployment", "epd-proxy"), "proxy")["image"] == f"epd-cache:{version}"
    steps = dh.dockerfile_instructions(DEPLOY / "docker" / "Dockerfile.vllm")
    final = steps[max(i for i, (k, _) in enumerate(steps) if k == "FROM"):]
    users = [a for k, a in final if k == "USER"]
    run_as = dh.pod_spec(rendered.one("Deployment", "epd-vllm"))["securityContext"]["runAsUser"]
    assert users and users[-1].split(":")[0] == str(run_as)
    assert json.loads(dict(final)["ENTRYPOINT"]) == ["epd"]
    assert any(k == "RUN" and '".[nixl]"' in a for k, a in steps)
    for keyword, args in steps:
        if keyword == "COPY" and not args.startswith("--from"):
            for src in args.split()[:-1]:
                assert (REPO / src).exists(), f"Dockerfile.vllm copies missing {src}"
