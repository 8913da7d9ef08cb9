"""Helpers for the offline deployment checks (test process only).

Render a kustomize overlay, resolve a container's environment the way the
kubelet does, rebuild the process config from it with the project's own
parser, and read the small bits of PromQL, Dockerfile and .dockerignore
syntax the tests need. Nothing here talks to a cluster.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import importlib
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from common.cli import SUBCOMMANDS
from common.config import build

RENDER_TIMEOUT_S = 60
K8S_VERSION = "1.31"
# Kinds outside the core API: no schema ships with kubernetes-validate, so test_deploy checks
# them field by field. Anything else without a schema fails.
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}

# Downward API values that matter to later $(VAR) expansions; the others get a
# placeholder so an expansion that uses them is still visible.
_FIELD_PLACEHOLDERS = {"status.podIP": "10.0.0.10", "metadata.name": "pod-0"}


@dataclass(slots=True)
class Rendered:
    """One overlay's output of ``kubectl kustomize``."""

    overlay: str
    objects: list[dict[str, Any]]
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)  # text data: what env can read
    configmap_files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # what a volume shows

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind}/{name}, found {len(found)}"
        return found[0]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(kubectl_path: str, overlay_dir: Path) -> Rendered:
    """``kubectl kustomize`` (client-side, offline) parsed into objects."""
    result = subprocess.run(
        [kubectl_path, "kustomize", str(overlay_dir)],
        capture_output=True, text=True, timeout=RENDER_TIMEOUT_S, check=False)
    assert result.returncode == 0, f"kubectl kustomize {overlay_dir.name} failed:\n{result.stderr}"
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    rendered = Rendered(overlay_dir.name, objects)
    for cm in rendered.of_kind("ConfigMap"):
        name = cm["metadata"]["name"]
        rendered.configmaps[name] = dict(cm.get("data", {}))
        files = {k: v.encode() for k, v in cm.get("data", {}).items()}
        files.update({k: base64.b64decode(v) for k, v in cm.get("binaryData", {}).items()})
        rendered.configmap_files[name] = files
    return rendered


def strict_errors(objects: list[dict[str, Any]]) -> list[str]:
    """What strict validation against Kubernetes ``K8S_VERSION`` finds in every core object."""
    errors = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message}")
    return errors


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def template_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']}: no single container {name!r}"
    return found[0]


def selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


@dataclass(slots=True)
class ContainerEnv:
    """Environment variable names in a container and the values that can be known offline."""

    names: list[str]
    values: dict[str, str]
    configmap_keys: dict[str, str]  # variable name -> ConfigMap key it reads


def resolve_env(rendered: Rendered, workload: dict[str, Any], ctr: dict[str, Any]) -> ContainerEnv:
    """Resolve envFrom, env, ConfigMap references and $(VAR) expansion like the kubelet.

    envFrom comes first and ``env`` overrides it; a value may refer to a
    variable defined earlier as ``$(NAME)``. Secret-backed variables have no
    offline value: their names are listed, their values are not.
    """
    names: list[str] = []
    values: dict[str, str] = {}
    keys: dict[str, str] = {}
    namespace = workload["metadata"].get("namespace", "default")
    for source in ctr.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref is not None, f"{ctr['name']}: only configMapRef envFrom is expected, got {source}"
        assert ref["name"] in rendered.configmaps, f"{ctr['name']}: envFrom names unknown ConfigMap {ref['name']}"
        for key, value in rendered.configmaps[ref["name"]].items():
            name = source.get("prefix", "") + key
            names.append(name)
            values[name] = value
    for var in ctr.get("env", []):
        name = var["name"]
        names.append(name)
        if "value" in var:
            values[name] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: values.get(m.group(1), m.group(0)), str(var["value"]))
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = rendered.configmaps.get(ref["name"])
            if data is None or ref["key"] not in data:
                assert ref.get("optional", False), f"{ctr['name']}: {name} reads missing {ref['name']}/{ref['key']}"
                continue
            values[name] = data[ref["key"]]
            keys[name] = ref["key"]
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            values[name] = namespace if path == "metadata.namespace" else _FIELD_PLACEHOLDERS.get(path, path)
    return ContainerEnv(names, values, keys)


def cli_parser(subcommand: str) -> argparse.ArgumentParser:
    """The argument parser of ``epd SUBCOMMAND`` itself, found the way ``epd`` finds it."""
    module = importlib.import_module(SUBCOMMANDS[subcommand][0])
    parser: argparse.ArgumentParser = module._parser()
    return parser


def parse_args(ctr: dict[str, Any]) -> argparse.Namespace:
    """The container's args as its subcommand parses them (SystemExit on a bad flag)."""
    return cli_parser(ctr["args"][0]).parse_args(ctr["args"][1:])


def build_config(cls: type, ctr: dict[str, Any], env: ContainerEnv) -> Any:
    """The config the process would build from this container's args and environment."""
    return build(cls, parse_args(ctr), env.values)


_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "m": Fraction(1, 1000), "": 1,
}


def quantity(value: str | int) -> Fraction:
    """A Kubernetes resource quantity as an exact number ("5120Mi", "2", "500m")."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T|m)?", str(value))
    if match is None:
        raise ValueError(f"not a resource quantity: {value!r}")
    return Fraction(match.group(1)) * _SUFFIXES[match.group(2) or ""]


_PROMQL_WORDS = frozenset({
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "rate", "irate", "increase", "delta",
    "histogram_quantile", "clamp_min", "clamp_max", "abs", "vector", "scalar", "time",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset",
})


def promql_metrics(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label names, functions, variables dropped)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{[^}]*\}|\$\w+", "", text)
    text = re.sub(r"(?<![A-Za-z0-9_:])[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?", "", text)
    return {t for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text) if t not in _PROMQL_WORDS}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name}: dangling line continuation"
    return instructions


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether .dockerignore patterns exclude a top-level path (last match wins)."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.rstrip("/")
        candidates = {body, body[3:]} if body.startswith("**/") else {body}
        if any(fnmatch.fnmatchcase(path, c) for c in candidates):
            excluded = not negate
    return excluded
