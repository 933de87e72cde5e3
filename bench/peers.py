"""Peer routers for the routing benchmarks: install from PyPI into a separate venv, start, stop.

The peers are vLLM's Rust router (``vllm-router``, consistent hashing keyed on ``X-Session-ID``)
and SGLang's (``sglang-router``, cache-aware routing on the request text). They are never
installed into the project's environment: ``prepare`` makes a venv of its own (default
``/tmp/session-router-peers``), downloads each wheel with ``pip download --no-deps`` and installs
it there with its dependencies. A peer that does not download, install or start is skipped
with the reason, which the caller prints; that is expected on machines without network access.

    python -m bench.peers            # prepare the venv and print what is available
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.procs import LOOPBACK, Proc, free_ports, launch

DEFAULT_VENV = "/tmp/session-router-peers"
INSTALL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class PeerSpec:
    #: row label in the results
    label: str
    #: PyPI package
    package: str
    #: console script in the venv's bin/
    executable: str
    #: command-line arguments after the executable: (port, metrics port, backend URLs) -> args
    args: Callable[[int, int, Sequence[str]], list[str]]


def _vllm_router_args(port: int, metrics_port: int, urls: Sequence[str]) -> list[str]:
    return ["--host", LOOPBACK, "--port", str(port), "--worker-urls", *urls, "--policy", "consistent_hash",
            "--log-level", "warning", "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)]


def _sglang_router_args(port: int, metrics_port: int, urls: Sequence[str]) -> list[str]:
    return ["launch", "--host", LOOPBACK, "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware",
            "--log-level", "warn", "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)]


PEERS: dict[str, PeerSpec] = {
    "vllm-router": PeerSpec("vllm-router (consistent_hash)", "vllm-router", "vllm-router", _vllm_router_args),
    "sglang-router": PeerSpec("sglang-router (cache_aware)", "sglang-router", "sglang-router", _sglang_router_args),
}


@dataclass(frozen=True)
class PeerInstall:
    name: str
    #: path of the executable, or None when unavailable
    executable: str | None
    version: str = ""
    #: why it is unavailable
    reason: str = ""


def _run(cmd: Sequence[str], timeout: float) -> tuple[bool, str]:
    try:
        done = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f}s: {' '.join(cmd)}"
    except OSError as exc:
        return False, f"cannot run {cmd[0]}: {exc}"
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        lines = [line for line in output.splitlines() if "WARNING" not in line]
        return False, f"exit {done.returncode}: " + " | ".join(lines[-3:])
    return True, output


def _version(venv: str, package: str) -> str:
    ok, out = _run([os.path.join(venv, "bin", "python"), "-m", "pip", "show", package], 60)
    if ok:
        for line in out.splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return ""


def prepare(names: Sequence[str], venv: str = DEFAULT_VENV, timeout: float = INSTALL_TIMEOUT_S) -> list[PeerInstall]:
    """Make sure each named peer is installed in ``venv``; one ``PeerInstall`` per name."""
    results: list[PeerInstall] = []
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        ok, out = _run([sys.executable, "-m", "venv", venv], timeout)
        if not ok:
            return [PeerInstall(n, None, reason=f"cannot create the venv {venv}: {out}") for n in names]
    wheels = os.path.join(venv, "wheels")
    for name in names:
        spec = PEERS.get(name)
        if spec is None:
            results.append(PeerInstall(name, None, reason=f"unknown peer (known: {', '.join(PEERS)})"))
            continue
        exe = os.path.join(venv, "bin", spec.executable)
        if not os.path.exists(exe):
            ok, out = _run([python, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels, spec.package], timeout)
            if not ok:
                results.append(PeerInstall(name, None, reason=f"pip download {spec.package} failed ({out})"))
                continue
            pattern = os.path.join(wheels, spec.package.replace("-", "_") + "-*.whl")
            found = sorted(glob.glob(pattern))
            if not found:
                results.append(PeerInstall(name, None, reason=f"pip download {spec.package} gave no wheel"))
                continue
            ok, out = _run([python, "-m", "pip", "install", "-q", found[-1]], timeout)
            if not ok or not os.path.exists(exe):
                results.append(PeerInstall(name, None, reason=f"pip install {os.path.basename(found[-1])} failed ({out})"))
                continue
        results.append(PeerInstall(name, exe, _version(venv, spec.package)))
    return results


def start_peer(install: PeerInstall, backend_urls: Sequence[str], log_dir: str, timeout: float = 60.0) -> Proc:
    """Start an installed peer against ``backend_urls``; ready when its ``/health`` answers 200.

    Raises ``AssertionError`` with the log's tail when it exits or is not ready in time.
    """
    if install.executable is None:
        raise AssertionError(f"{install.name} is not installed: {install.reason}")
    spec = PEERS[install.name]
    port, metrics_port = free_ports(2)
    cmd = [install.executable, *spec.args(port, metrics_port, backend_urls)]
    return launch(install.name, cmd, port, log_dir, ready_statuses=(200,), timeout=timeout, interval=0.1,
                  env={"NO_COLOR": "1"}, log_tail=2000)


def main() -> int:
    for result in prepare(list(PEERS)):
        if result.executable:
            print(f"{result.name} {result.version}: {result.executable}")
        else:
            print(f"{result.name}: unavailable ({result.reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
