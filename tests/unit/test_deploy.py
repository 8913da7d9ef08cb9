"""Offline checks of deploy/: every overlay rendered, schema-validated and cross-checked with the code.

No cluster is involved. ``kubectl kustomize`` renders each overlay (the tests
that need it are skipped, with the reason, where kubectl is not installed),
``kubernetes-validate`` checks every core object in strict mode against
Kubernetes 1.31, and the rest compares the manifests with what the processes
will actually do: ports, health service names, settings and metric names are
imported from the code, never repeated here.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
import yamllint.config
import yamllint.linter

from common.cli import SUBCOMMANDS
from common.config import (
    EPD_MIN_HOLD_MS,
    LIVENESS_SERVICE,
    READINESS_SERVICE,
    CacheMode,
    EncoderServerConfig,
    PrefillConfig,
    TransportKind,
    describe,
)
from common.metrics import EncoderMetrics, PrefillMetrics, ProxyMetrics
from encoder_server.vision.config import VisionConfig
from prefill_client.reference.chat import load_requests
from prefill_client.reference.cli import MAX_LINGER_S
from tests.unit import deploy_helpers as dh

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = dh.K8S_VERSION

OVERLAYS = ("cpu", "efa", "rdma", "neuron")
# What each variant is for: the UCX transport it must select and the device
# resources both processes must request.
TRANSPORT = {"cpu": "tcp", "efa": "srd", "rdma": "rc", "neuron": "srd"}
DEVICES = {
    "cpu": set(),
    "efa": {"vpc.amazonaws.com/efa"},
    "rdma": {"rdma/ib"},
    "neuron": {"aws.amazon.com/neuron", "vpc.amazonaws.com/efa"},
}
PODMONITOR_SPEC_FIELDS = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
PODMONITOR_ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels",
                              "relabelings", "metricRelabelings"}
# The startup probe waits on liveness, which answers within seconds of the start (the buffer
# and the compiled graphs come after it, gated by readiness): it only covers a slow interpreter start.
MIN_STARTUP_BUDGET_S = 30
# Listen addresses another pod (and the kubelet) can reach.
REACHABLE_HOSTS = ("0.0.0.0", "[::]", "::")

Role = tuple[str, str, str, type]  # (workload kind, workload name, container name, config class)
ENCODER: Role = ("StatefulSet", "epd-encoder", "encoder", EncoderServerConfig)
PREFILL: Role = ("Deployment", "epd-prefill", "prefill", PrefillConfig)


@pytest.fixture(scope="module")
def rendered() -> dict[str, dh.Rendered]:
    kubectl = dh.kubectl()
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize overlays cannot be rendered offline")
    return {name: dh.render(kubectl, DEPLOY / "overlays" / name) for name in OVERLAYS}


def _process(r: dh.Rendered, role: Role) -> tuple[dict[str, Any], dict[str, Any], Any, dh.ContainerEnv]:
    """(workload, container, config, env) of one epd process in an overlay."""
    kind, name, ctr_name, cls = role
    workload = r.one(kind, name)
    ctr = dh.container(workload, ctr_name)
    env = dh.resolve_env(r, workload, ctr)
    return workload, ctr, dh.build_config(cls, ctr, env), env


def _port(ctr: dict[str, Any], name: str) -> int:
    ports = [p["containerPort"] for p in ctr["ports"] if p.get("name") == name]
    assert len(ports) == 1, f"{ctr['name']}: no single container port named {name!r}"
    return int(ports[0])


def test_overlay_directories_are_the_tested_ones() -> None:
    # vllm replaces the reference prefill workers: tests/unit/test_deploy_vllm.py checks it.
    # vllm-pd splits prefill and decode: tests/unit/test_deploy_vllm_pd.py.
    assert sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir()) == sorted(OVERLAYS + ("vllm", "vllm-pd"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_validate_strict(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    errors = dh.strict_errors(rendered[overlay].objects)
    assert not errors, "\n".join(errors)


def test_strict_validation_catches_what_it_should(rendered: dict[str, dh.Rendered]) -> None:
    """The validator really is strict: an unknown field and a named gRPC probe port both fail."""
    sts = rendered["cpu"].one("StatefulSet", "epd-encoder")
    kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    unknown = copy.deepcopy(sts)
    dh.container(unknown, "encoder")["livenessProbe"]["grpc"]["serviceName"] = LIVENESS_SERVICE
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, K8S_VERSION, strict=True)
    named = copy.deepcopy(sts)
    dh.container(named, "encoder")["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(named, K8S_VERSION, strict=True)


def test_yamllint_clean() -> None:
    conf = yamllint.config.YamlLintConfig(file=str(DEPLOY / ".yamllint"))
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml") or p.name == ".yamllint")
    assert len(files) > 10
    problems = [f"{p.relative_to(REPO)}:{problem.line}:{problem.column}: {problem.desc} ({problem.rule})"
                for p in files for problem in yamllint.linter.run(p.read_text(), conf, str(p))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_encoder_ports_probes_and_headless_service(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    r = rendered[overlay]
    sts, ctr, cfg, _ = _process(r, ENCODER)
    assert cfg.host in REACHABLE_HOSTS, f"EPD_HOST {cfg.host!r} is unreachable from other pods"
    assert _port(ctr, "grpc") == cfg.port > 0
    # Health is on the gRPC port unless a separate plaintext health port is configured.
    health_port = cfg.port if cfg.health_port < 0 else _port(ctr, "health")
    assert health_port == (cfg.port if cfg.health_port < 0 else cfg.health_port)
    probes = {kind: ctr[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    for kind, probe in probes.items():
        assert probe["grpc"]["port"] == health_port, (
            f"{kind} probes {probe['grpc']['port']}, health is on {health_port}")
    assert probes["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    assert probes["readinessProbe"]["grpc"]["service"] == READINESS_SERVICE
    # On readiness, the startup probe would have to cover a cold compile of every bucket graph.
    assert probes["startupProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_BUDGET_S

    svc = r.one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False
    assert dh.selects(svc["spec"]["selector"], dh.template_labels(sts))
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["appProtocol"] == "grpc"
    assert svc_port["port"] == cfg.port
    target = svc_port["targetPort"]
    assert (target if isinstance(target, int) else _port(ctr, target)) == cfg.port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_ports_and_podmonitor(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    r = rendered[overlay]
    (monitor,) = r.of_kind("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= PODMONITOR_SPEC_FIELDS
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    for role in (ENCODER, PREFILL):
        workload, ctr, cfg, _ = _process(r, role)
        assert monitor["metadata"]["namespace"] == workload["metadata"]["namespace"]
        assert dh.selects(monitor["spec"]["selector"]["matchLabels"], dh.template_labels(workload))
        assert cfg.metrics_port > 0, f"{ctr['name']} must serve /metrics on a fixed port"
        metrics_host = cfg.host if role is ENCODER else cfg.metrics_host
        assert metrics_host in REACHABLE_HOSTS, (
            f"{ctr['name']} serves /metrics on {metrics_host}, out of Prometheus' reach")
        for endpoint in endpoints:
            assert set(endpoint) <= PODMONITOR_ENDPOINT_FIELDS
            assert endpoint["path"] == "/metrics"
            assert _port(ctr, endpoint["port"]) == cfg.metrics_port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_names_are_settings_the_code_knows(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    for role in (ENCODER, PREFILL):
        _, ctr, _, env = _process(rendered[overlay], role)
        known = {info.env for info in describe(role[3])}
        unknown = sorted(n for n in env.names if n.startswith("EPD_") and n not in known)
        assert not unknown, f"{ctr['name']} sets {unknown}, which {role[3].__name__} does not read"
        assert len(env.names) == len(set(env.names)), f"{ctr['name']} sets a variable twice"
        for name, key in env.configmap_keys.items():
            if name.startswith("EPD_"):
                assert key == name, f"{ctr['name']}: {name} reads ConfigMap key {key}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_encoder_and_prefill_settings_agree(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    r = rendered[overlay]
    sts, _, enc, _ = _process(r, ENCODER)
    _, _, pre, _ = _process(r, PREFILL)
    assert enc.model_id == pre.model_id
    # auto would fall back to the shared-memory mock, which cannot cross pods.
    assert enc.transport is TransportKind.NIXL and pre.transport is TransportKind.NIXL
    assert enc.cache.mode is CacheMode.EPD
    assert enc.cache.effective_min_hold_ms >= EPD_MIN_HOLD_MS
    # Every encoder pod, by its stable name under the headless Service, and nothing else.
    service = f"{sts['spec']['serviceName']}.{sts['metadata']['namespace']}.svc.cluster.local"
    pods = [f"{sts['metadata']['name']}-{i}.{service}:{enc.port}" for i in range(sts["spec"]["replicas"])]
    assert sorted(pre.encoders) == pods, f"EPD_ENCODERS {pre.encoders} != encoder pods {pods}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prefill_workload_is_mounted_and_parses(rendered: dict[str, dh.Rendered], overlay: str, tmp_path: Path) -> None:
    """The requests file the worker is pointed at exists in the pod, with every image it names."""
    r = rendered[overlay]
    deploy, ctr, _, _ = _process(r, PREFILL)
    args = dh.parse_args(ctr)
    assert 0 <= args.linger_s <= MAX_LINGER_S
    volumes = {v["name"]: v for v in dh.pod_spec(deploy)["volumes"]}
    requests = Path(args.requests)
    (mount,) = [m for m in ctr["volumeMounts"] if Path(m["mountPath"]) == requests.parent]
    configmap = volumes[mount["name"]]["configMap"]["name"]
    for name, content in r.configmap_files[configmap].items():
        (tmp_path / name).write_bytes(content)
    loaded = load_requests(tmp_path / requests.name)
    assert loaded and any(request.media for request in loaded)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_exceeds_drain(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    sts, ctr, cfg, _ = _process(rendered[overlay], ENCODER)
    pre_stop = ctr.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = dh.pod_spec(sts)["terminationGracePeriodSeconds"]
    assert grace > pre_stop + cfg.drain_grace_s, (
        f"grace {grace}s must exceed preStop {pre_stop}s + drain {cfg.drain_grace_s}s")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_device_resources(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    for role in (ENCODER, PREFILL):
        workload, ctr, cfg, _ = _process(rendered[overlay], role)
        requests, limits = ctr["resources"].get("requests", {}), ctr["resources"].get("limits", {})
        pinned = {n for n in set(requests) | set(limits) if "/" in n or n.startswith("hugepages-")}
        for name in pinned:
            assert name in requests and name in limits, f"{ctr['name']}: {name} needs both request and limit"
            assert dh.quantity(requests[name]) == dh.quantity(limits[name]), f"{ctr['name']}: {name} request != limit"
        assert {n for n in pinned if "/" in n} == DEVICES[overlay], f"{ctr['name']} devices in {overlay}"
        volumes = {v["name"]: v for v in dh.pod_spec(workload)["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in ctr["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        if any(n.startswith("hugepages-") for n in pinned):
            assert mounts["/dev/hugepages"]["emptyDir"]["medium"].startswith("HugePages")
        if role is ENCODER and cfg.device == "cpu" and cfg.cache.cache_bytes is not None:
            shm = dh.quantity(mounts["/dev/shm"]["emptyDir"]["sizeLimit"])
            assert cfg.cache.cache_bytes + shm < dh.quantity(limits["memory"]), (
                "cache buffer and /dev/shm do not fit the memory limit")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_compiled_graphs_go_to_a_volume(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    """The root file system is read-only: the compile cache needs a volume, mounted where the setting points."""
    sts, ctr, cfg, _ = _process(rendered[overlay], ENCODER)
    assert cfg.compile_cache_dir is not None, "the encoder would compile every bucket on each start"
    volumes = {v["name"]: v for v in dh.pod_spec(sts)["volumes"]}
    (mount,) = [m for m in ctr["volumeMounts"] if m["mountPath"] == cfg.compile_cache_dir]
    assert not mount.get("readOnly", False)
    assert mount["name"] in volumes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pinning_security_and_pod_identity(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    for role in (ENCODER, PREFILL):
        workload, ctr, _, _ = _process(rendered[overlay], role)
        assert "IPC_LOCK" in ctr["securityContext"]["capabilities"]["add"]
        assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
        assert dh.pod_spec(workload)["securityContext"]["runAsNonRoot"] is True
        pod_ip = [v for v in ctr["env"]
                  if v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"]
        assert len(pod_ip) == 1 and not pod_ip[0]["name"].startswith("EPD_")
        assert "command" not in ctr, "the image's entrypoint (epd) must run"
        assert ctr["args"][0] == role[2] and ctr["args"][0] in SUBCOMMANDS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ucx_transport_per_variant(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    for role in (ENCODER, PREFILL):
        _, ctr, _, env = _process(rendered[overlay], role)
        lanes = env.values["UCX_TLS"].split(",")
        assert TRANSPORT[overlay] in lanes, f"{ctr['name']} UCX_TLS={env.values['UCX_TLS']}"
        if DEVICES[overlay]:
            # No silent fallback to the pod network on an RDMA variant.
            assert "tcp" not in lanes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_admits_only_prefill(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    r = rendered[overlay]
    sts, enc_ctr, enc, enc_env = _process(r, ENCODER)
    deploy, *_ = _process(r, PREFILL)
    enc_labels, pre_labels = dh.template_labels(sts), dh.template_labels(deploy)
    (policy,) = [p for p in r.of_kind("NetworkPolicy")
                 if dh.selects(p["spec"]["podSelector"]["matchLabels"], enc_labels)]
    assert "Ingress" in policy["spec"]["policyTypes"]
    low, high = map(int, enc_env.values["UCX_TCP_PORT_RANGE"].split("-"))
    ucx_ports = set(range(low, high + 1))
    every_port = set(range(1, 65536))
    to_prefill: set[int] = set()
    to_anyone_else: set[int] = set()
    for rule in policy["spec"]["ingress"]:
        ports: set[int] = set() if rule.get("ports") else every_port  # no ports: all of them
        for p in rule.get("ports", []):
            number = p["port"] if isinstance(p["port"], int) else _port(enc_ctr, p["port"])
            ports |= set(range(number, p.get("endPort", number) + 1))
        peers = rule.get("from", [{}])  # no from: every source
        prefill_only = all(
            set(peer) == {"podSelector"}
            and dh.selects(peer["podSelector"]["matchLabels"], pre_labels)
            and not dh.selects(peer["podSelector"]["matchLabels"], enc_labels)
            for peer in peers)
        (to_prefill if prefill_only else to_anyone_else).update(ports)
    assert to_prefill == {enc.port} | ucx_ports, "prefill must reach exactly the gRPC port and the UCX TCP range"
    assert not to_anyone_else & ({enc.port} | ucx_ports), "gRPC or NIXL ports are open beyond prefill pods"
    assert enc.metrics_port in to_anyone_else, "Prometheus cannot reach the encoder's /metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_images(rendered: dict[str, dh.Rendered], overlay: str) -> None:
    r = rendered[overlay]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    image = "epd-cache-neuron" if overlay == "neuron" else "epd-cache"
    for role in (ENCODER, PREFILL):
        workload, ctr, _, _ = _process(r, role)
        budgets = [b for b in r.of_kind("PodDisruptionBudget")
                   if dh.selects(b["spec"]["selector"]["matchLabels"], dh.template_labels(workload))]
        assert len(budgets) == 1 and budgets[0]["spec"]["maxUnavailable"] >= 1
        assert ctr["image"] == f"{image}:{version}"


def test_dockerfiles_match_the_manifests() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for name in (".venv", ".git", "tests"):
        assert dh.dockerignore_excludes(patterns, name), f".dockerignore lets {name} into the build context"
    # The image's USER is the uid the pods run as (runAsNonRoot needs a numeric one).
    manifests = [yaml.safe_load((DEPLOY / "base" / f).read_text())
                 for f in ("encoder-statefulset.yaml", "prefill-deployment.yaml")]
    (pod_uid,) = {dh.pod_spec(m)["securityContext"]["runAsUser"] for m in manifests}
    for dockerfile in ("Dockerfile", "Dockerfile.neuron"):
        steps = dh.dockerfile_instructions(DEPLOY / "docker" / dockerfile)
        final = steps[max(i for i, (k, _) in enumerate(steps) if k == "FROM"):]
        users = [args for k, args in final if k == "USER"]
        assert users and users[-1].split(":")[0] == str(pod_uid), f"{dockerfile}: USER {users} vs runAsUser {pod_uid}"
        assert json.loads(dict(final)["ENTRYPOINT"]) == ["epd"]
        assert any(k == "RUN" and '".[nixl]"' in args for k, args in steps), f"{dockerfile} must install .[nixl]"
        for keyword, args in steps:
            if keyword == "COPY" and not args.startswith("--from"):
                for src in args.split()[:-1]:
                    assert (REPO / src).exists(), f"{dockerfile} copies missing {src}"
                    assert not dh.dockerignore_excludes(patterns, src), (
                        f".dockerignore drops {src}, which {dockerfile} copies")
    args = {a.split("=", 1)[0]: a.split("=", 1)[1].strip('"') for k, a in dh.dockerfile_instructions(
        DEPLOY / "docker" / "Dockerfile") if k == "ARG" and "=" in a}
    assert args["TORCH_SPEC"] == "torch==2.13.0"
    neuron_args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in dh.dockerfile_instructions(
        DEPLOY / "docker" / "Dockerfile.neuron") if k == "ARG" and "=" in a}
    assert "/neuron/" in neuron_args["NEURON_BASE_IMAGE"]


def _exported_series() -> set[str]:
    """Every series name the processes export, as Prometheus sees it."""
    names: set[str] = set()
    for metrics in (EncoderMetrics(), PrefillMetrics(), ProxyMetrics()):
        for family in metrics.registry.collect():
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
            else:
                names.add(family.name)
    return names


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "epd-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = set().union(*(dh.promql_metrics(e) for e in exprs))
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            queried |= set(re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", query["query"]))
    exported = _exported_series()
    assert queried <= exported, f"dashboard queries unknown series {sorted(queried - exported)}"
    required = {
        "vllm:mm_cache_hits_total", "vllm:mm_cache_queries_total",
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
        "vllm_neuron:scheduler_encoder_cache_hits_total", "vllm_neuron:scheduler_encoder_cache_queries_total",
        "vllm_neuron:device_encoder_cache_queries_total", "vllm_neuron:device_encoder_cache_misses_total",
        "vllm_neuron:device_encoder_cache_active_blocks", "vllm_neuron:device_encoder_cache_active_real_tokens",
        "epd_pull_latency_seconds_bucket", "epd_ec_load_failures_total",
    }
    assert required <= queried, f"dashboard lacks {sorted(required - queried)}"
    assert any("by (reason)" in e and "epd_ec_load_failures_total" in e for e in exprs)


def test_promql_metric_extraction() -> None:
    expr = ('sum by (pod) (rate(a:b_total{namespace="$ns", x=~"y"}[$__rate_interval])) * $block_size'
            ' / clamp_min(histogram_quantile(0.99, sum by (le) (rate(c_bucket[5m]))), 1e-9)')
    assert dh.promql_metrics(expr) == {"a:b_total", "c_bucket"}


def test_dashboard_block_size_matches_config(rendered: dict[str, dh.Rendered]) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "epd-dashboard.json").read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "block_size"]
    tiny = VisionConfig()  # the deployments run the tiny encoder (no EPD_WEIGHTS): its width resolves the layout
    for overlay in OVERLAYS:
        _, _, cfg, _ = _process(rendered[overlay], ENCODER)
        layout = cfg.cache.layout(tiny.out_hidden_size, tiny.num_deepstack_levels)
        assert int(variable["current"]["value"]) == layout.block_size


def test_readme_covers_every_variant() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"deploy/overlays/{overlay}" in readme
    for topic in ("scale", "rollout", "memlock", "epd-dashboard.json"):
        assert topic in readme


def test_autoscaling_component_scales_the_encoders_on_an_exported_metric(tmp_path: Path) -> None:
    """The HPA example, applied on top of the cpu overlay: strict-valid, aimed at the encoder
    StatefulSet, on a series the encoder exports, scaling down one draining pod at a time."""
    kubectl = dh.kubectl()
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize overlays cannot be rendered offline")
    # An overlay of our own under deploy/ (kustomize loads components from below its root only).
    overlay = DEPLOY / "overlays" / ".autoscaling-test"
    overlay.mkdir()
    try:
        (overlay / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: epd\n"
            "resources:\n  - ../cpu\ncomponents:\n  - ../../components/autoscaling\n")
        r = dh.render(kubectl, overlay)
    finally:
        (overlay / "kustomization.yaml").unlink(missing_ok=True)
        overlay.rmdir()
    hpa = r.one("HorizontalPodAutoscaler", "epd-encoder")
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    target = hpa["spec"]["scaleTargetRef"]
    sts = r.one(target["kind"], target["name"])
    assert target["kind"] == "StatefulSet" and sts["metadata"]["namespace"] == hpa["metadata"]["namespace"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in _exported_series()
    down = hpa["spec"]["behavior"]["scaleDown"]
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}]
    assert down["stabilizationWindowSeconds"] >= 60
