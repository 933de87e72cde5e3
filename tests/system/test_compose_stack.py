"""The docker-compose demo stack, checked without a Docker engine.

``docker-compose.yml`` is parsed (PyYAML) and every service is checked against the project
itself: each command is parsed by the program's own argument parser, each published port is the
port that command listens on, each volume source exists, the Prometheus targets are the compose
services, and the Grafana dashboard is valid provisioning JSON whose every query names only
metrics that the router or a backend really export (collected from live ``/metrics`` pages).
When ``docker compose`` or ``docker-compose`` is installed, ``config`` validates the file too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from backends.__main__ import parse_args as backend_args
from backends.app import create_app as create_backend_app
from backends.engine.config import EngineConfig
from bench.traffic import Stats, TrafficConfig
from bench.traffic import parse_args as traffic_args
from bench.traffic import run as traffic_run
from router import admin
from router.app import create_app as create_router_app
from router.config import BackendConfig, RouterConfig, build_config
from tests.support import free_port, router_config
from tests.router.test_metrics_sessions import parse_exposition

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
PROMETHEUS_CONFIG = REPO / "config" / "prometheus.yml"
GRAFANA = REPO / "config" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
PD_PROFILE = "pd"
TOKENS_PROFILE = "tokens"

@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands name the model folder relative to the image's working directory (/app, a copy of
    the repository), so they are parsed from the repository's root."""
    monkeypatch.chdir(REPO)


try:
    import yaml
except ImportError:  # pragma: no cover - PyYAML belongs in the test extras
    yaml = None


def load_yaml(path: Path) -> Any:
    if yaml is None:
        message = "PyYAML is needed to check the compose stack: pip install pyyaml (it belongs in the test extras)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


# --------------------------------------------------------------------------- compose model
class Service:
    """One compose service, with its command parsed by the program it runs."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        self.name = name
        self.spec = spec
        self.profiles: list[str] = list(spec.get("profiles") or [])
        command = spec.get("command")
        self.command: list[str] | None = command if isinstance(command, list) else None
        self.module = ""
        self.port: int | None = None
        self.parsed: Any = None
        if self.command is not None and self.command[:2] == ["python", "-m"]:
            self.module = self.command[2]
            args = self.command[3:]
            if self.module == "router":
                self.parsed = build_config(args)  # the router's own parser + validation
                self.port = self.parsed.port
            elif self.module == "backends":
                self.parsed = backend_args(args)
                self.port = self.parsed.port
            elif self.module == "bench.traffic":
                self.parsed = traffic_args(args)
            else:
                raise AssertionError(f"service {name} runs an unknown module {self.module!r}")

    @property
    def ours(self) -> bool:
        return "build" in self.spec

    def published(self) -> list[tuple[int, int]]:
        """(host port, container port) of every ``ports`` entry."""
        out = []
        for entry in self.spec.get("ports") or []:
            parts = str(entry).split(":")
            assert len(parts) == 2, f"{self.name}: write ports as HOST:CONTAINER, got {entry!r}"
            out.append((int(parts[0]), int(parts[1].split("/")[0])))
        return out


def services() -> dict[str, Service]:
    data = load_yaml(COMPOSE)
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), "docker-compose.yml has no services"
    return {name: Service(name, spec) for name, spec in data["services"].items()}


def by_module(all_services: dict[str, Service], module: str) -> list[Service]:
    return [s for s in all_services.values() if s.module == module]


# --------------------------------------------------------------------------- compose file
def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy is not None else None


@pytest.mark.parametrize("profiles", [[], [PD_PROFILE], [TOKENS_PROFILE]], ids=["default", "pd", "tokens"])
def test_compose_file_validates_with_docker_compose(profiles: list[str], tmp_path: Path) -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (Debian: apt-get install "
                    "docker-compose); the parse checks below still run")
    args = [*cli, "-f", str(COMPOSE)]
    for profile in profiles:
        args += ["--profile", profile]
    env = dict(os.environ, DOCKER_HOST="unix://" + str(tmp_path / "no-docker.sock"))  # never a daemon
    result = subprocess.run([*args, "config"], capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    listed = subprocess.run([*args, "config", "--services"], capture_output=True, text=True, cwd=REPO,
                            timeout=60, env=env)
    assert listed.returncode == 0, listed.stderr
    all_services = services()
    expected = {s.name for s in all_services.values() if not s.profiles or set(s.profiles) & set(profiles)}
    # compose v2 lists the active profiles' services; docker-compose 1.x lists every service
    assert expected <= set(listed.stdout.split()) <= set(all_services)


def test_services_of_the_demo_stack() -> None:
    all_services = services()
    default = {n for n, s in all_services.items() if not s.profiles}
    pd = {n for n, s in all_services.items() if PD_PROFILE in s.profiles}
    tokens = {n for n, s in all_services.items() if TOKENS_PROFILE in s.profiles}
    assert {"router", "backend-0", "backend-1", "backend-2", "traffic", "prometheus", "grafana"} <= default
    assert {"router-pd", "prefill-0", "decode-0", "decode-1"} <= pd
    assert {"router-tokens", "render-0", "engine-0", "engine-1", "traffic-tokens"} <= tokens
    for service in all_services.values():
        assert service.profiles in ([], [PD_PROFILE], [TOKENS_PROFILE]), (
            f"{service.name}: unexpected profiles {service.profiles}")
        if service.ours:
            assert service.spec["build"] == ".", service.name
            assert service.command is not None and service.module, f"{service.name}: needs a python -m command"
        else:
            assert ":" in service.spec.get("image", ""), f"{service.name}: pin the image's tag"
        for dep in service.spec.get("depends_on") or []:
            assert dep in all_services, f"{service.name} depends on unknown service {dep}"
            # a default service must not wait for a profile-only one
            assert set(all_services[dep].profiles) <= set(service.profiles), (service.name, dep)


def test_every_command_is_a_real_cli_of_the_project() -> None:
    all_services = services()
    routers = by_module(all_services, "router")
    backends = by_module(all_services, "backends")
    assert routers and backends and by_module(all_services, "bench.traffic")
    for service in routers + backends:
        # containers bind every interface of their own network namespace
        assert service.parsed.host == "0.0.0.0", service.name

    def role(backend: Service) -> str:
        """both / prefill / decode / render, and "tokens-only" for an engine that takes only token ids."""
        if getattr(backend.parsed, "tokens_only", False):
            return "tokens-only"
        return str(backend.parsed.role)

    for backend in backends:
        if TOKENS_PROFILE in backend.profiles:
            assert role(backend) in ("render", "tokens-only"), backend.name
            # every tokens-mode service serves the image's copy of the shipped model
            assert backend.parsed.model_dir == "models/tiny-llama" and (REPO / backend.parsed.model_dir).is_dir()
        else:
            assert role(backend) in ("both", "prefill", "decode")
            assert (role(backend) == "both") == (not backend.profiles), backend.name
    roles = {b.name: role(b) for b in backends}
    ports = {s.name: s.port for s in all_services.values() if s.port is not None}

    def check_url(url: str, who: str, want_role: str) -> None:
        parts = urlsplit(url)
        assert parts.hostname in roles, f"{who}: {url} names no backend service"
        assert parts.port == ports[parts.hostname], f"{who}: {url} but {parts.hostname} listens on {ports[parts.hostname]}"
        assert roles[parts.hostname] == want_role, f"{who}: {url} is a {roles[parts.hostname]} backend"

    for router in routers:
        config: RouterConfig = router.parsed
        if config.tokens.upstream_api == "tokens":
            assert router.profiles == [TOKENS_PROFILE]
            assert config.tokens.model_dir == "models/tiny-llama"
            assert len(config.backends) >= 2 and config.tokens.render_urls
            for b in config.backends:
                check_url(b.url, router.name, "tokens-only")
            for url in config.tokens.render_urls:
                check_url(url, router.name, "render")
        elif config.pd_mode:
            assert router.profiles == [PD_PROFILE]
            assert config.prefill and config.decode
            for b in config.prefill:
                check_url(b.url, router.name, "prefill")
            for b in config.decode:
                check_url(b.url, router.name, "decode")
        else:
            assert not router.profiles
            assert len(config.backends) >= 2
            for b in config.backends:
                check_url(b.url, router.name, "both")
    # every backend serves some router
    served = {urlsplit(b.url).hostname for r in routers for b in
              (*r.parsed.backends, *r.parsed.prefill, *r.parsed.decode)}
    served |= {urlsplit(url).hostname for r in routers for url in r.parsed.tokens.render_urls}
    assert served == set(roles)

    for traffic in by_module(all_services, "bench.traffic"):
        target = urlsplit(traffic.parsed.router)
        assert target.hostname in {r.name for r in routers}, f"{traffic.name}: {traffic.parsed.router}"
        assert target.port == ports[target.hostname], traffic.name
        assert traffic.profiles == all_services[target.hostname].profiles, traffic.name
        assert target.hostname in (traffic.spec.get("depends_on") or {}), f"{traffic.name} should wait for its router"
        tokens = all_services[target.hostname].parsed.tokens
        if tokens.upstream_api == "tokens":  # the model the router serves, by its folder's name
            assert traffic.parsed.model == (tokens.served_model_name or os.path.basename(tokens.model_dir)), traffic.name


def test_routers_take_the_admin_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``docker compose up`` works without a token (admin API off, never open on 0.0.0.0) and
    serves the admin API with ``SESSION_ROUTER_ADMIN_TOKEN`` set in the caller's environment."""
    routers = by_module(services(), "router")
    assert routers
    for router in routers:
        env = router.spec.get("environment") or {}
        assert env.get("SESSION_ROUTER_ADMIN_TOKEN") == "${SESSION_ROUTER_ADMIN_TOKEN:-}", router.name
        assert router.command is not None and "--admin-token" not in router.command  # not visible in `ps`
        monkeypatch.setenv("SESSION_ROUTER_ADMIN_TOKEN", "")  # what compose passes when it is unset
        config = build_config(router.command[3:])
        assert (config.admin.token, config.admin.port, admin.on_data_port(config)) == ("", 0, False), router.name
        monkeypatch.setenv("SESSION_ROUTER_ADMIN_TOKEN", "compose-t0ken")
        config = build_config(router.command[3:])
        assert config.admin.token == "compose-t0ken" and admin.on_data_port(config), router.name


@pytest.mark.parametrize("module", ["router", "backends", "bench.traffic"])
def test_each_module_runs_as_a_program(module: str) -> None:
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--port" in result.stdout or "--router" in result.stdout


def test_ports_match_commands_and_the_documented_plan() -> None:
    all_services = services()
    host_ports: dict[int, str] = {}
    for service in all_services.values():
        for host, container in service.published():
            assert host not in host_ports, f"host port {host} published by {host_ports.get(host)} and {service.name}"
            host_ports[host] = service.name
            assert host == container, f"{service.name}: publish each port under the same number ({host}:{container})"
            if service.port is not None:
                assert container == service.port, f"{service.name}: publishes {container}, listens on {service.port}"
        if service.module in ("router", "backends"):
            assert [c for _, c in service.published()] == [service.port], f"{service.name} must publish its port"
            check = service.spec.get("healthcheck", {}).get("test", [])
            assert any(f":{service.port}/health" in str(part) for part in check), f"{service.name}: healthcheck port"
    assert host_ports[8000] == "router"
    assert all(p >= 8100 for s in by_module(all_services, "backends") for p, _ in s.published())
    assert host_ports[9090] == "prometheus"
    assert host_ports[3000] == "grafana"
    prom_cmd = " ".join(all_services["prometheus"].spec["command"])
    assert "--web.listen-address=0.0.0.0:9090" in prom_cmd


def test_volume_sources_exist_in_the_repository() -> None:
    mounted = 0
    for service in services().values():
        for volume in service.spec.get("volumes") or []:
            source = str(volume).split(":")[0]
            assert source.startswith("./"), f"{service.name}: mount a path of the repository, got {volume!r}"
            assert (REPO / source).exists(), f"{service.name}: {source} does not exist"
            mounted += 1
    assert mounted >= 3


def test_dockerfile_builds_the_project_image() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\s*$", dockerfile, re.M)
    assert re.search(r"^RUN pip install .*\.", dockerfile, re.M), "the image installs the project at build time"
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    for needed in ("router", "backends", "bench", "pyproject.toml"):
        assert needed not in ignored, f".dockerignore must keep {needed}: the commands need it"


# --------------------------------------------------------------------------- Prometheus
def mount_target(service: Service, source: str) -> str:
    for volume in service.spec.get("volumes") or []:
        parts = str(volume).split(":")
        if os.path.normpath(parts[0]) == os.path.normpath(source):
            return parts[1]
    raise AssertionError(f"{service.name} does not mount {source}")


def test_prometheus_scrapes_every_router_and_backend_service() -> None:
    all_services = services()
    config = load_yaml(PROMETHEUS_CONFIG)
    assert config["global"]["scrape_interval"] == "5s"
    jobs: dict[str, set[str]] = {}
    for job in config["scrape_configs"]:
        targets = jobs.setdefault(job["job_name"], set())
        interval = job.get("scrape_interval", config["global"]["scrape_interval"])
        assert interval == "5s", job["job_name"]
        for static in job["static_configs"]:
            targets.update(static["targets"])
    assert jobs["router"] == {f"{s.name}:{s.port}" for s in by_module(all_services, "router")}
    assert jobs["backends"] == {f"{s.name}:{s.port}" for s in by_module(all_services, "backends")}
    prometheus = all_services["prometheus"]
    target = mount_target(prometheus, "./config/prometheus.yml")
    assert f"--config.file={target}" in prometheus.spec["command"]


def test_prometheus_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- Grafana
def dashboard_files() -> list[Path]:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files, f"no dashboard JSON under {DASHBOARDS}"
    return files


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target."""
    return [(p.get("title", ""), t["expr"]) for p in all_panels(dashboard) for t in p.get("targets", [])
            if "expr" in t]


def concrete(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced, ready for Prometheus."""
    return expr.replace("$topology", ".*").replace("$__rate_interval", "1m")


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER_BEFORE = re.compile(r"[0-9.]$")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "Inf", "NaN"}


def metric_names(expr: str) -> set[str]:
    """The metric identifiers of a PromQL expression (loosely: no full parser)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _GROUPING.sub("", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        if word in _KEYWORDS or text[match.end():].lstrip().startswith("("):
            continue  # an operator keyword or a function call
        if _NUMBER_BEFORE.search(text[:match.start()]):
            continue  # the exponent of a number such as 1e3
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, instance) (rate(vllm:e2e_request_latency_seconds_bucket'
            '{topology=~"$topology", job="x"}[1m]))) / on(instance) group_left(pool) bogus_metric offset 5m'
            ' > bool 1e3 and up')
    assert metric_names(expr) == {"vllm:e2e_request_latency_seconds_bucket", "bogus_metric", "up"}
    assert metric_names('sum without (kind) (rate(a_total{kind="x"}[5m])) or vector(0)') == {"a_total"}


async def exported_names(aiohttp_client: Any) -> set[str]:
    router = create_router_app(router_config(backends=[BackendConfig("http://127.0.0.1:9")], health_interval_s=3600.0))
    backend = create_backend_app(EngineConfig(speed=0.0))
    names: set[str] = set()
    for app in (router, backend):
        client = await aiohttp_client(app)
        resp = await client.get("/metrics")
        assert resp.status == 200
        names |= parse_exposition(await resp.text()).names
    return names


def test_grafana_provisioning_files() -> None:
    all_services = services()
    grafana = all_services["grafana"]
    datasources = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy" and source["uid"]
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus" and url.hostname in all_services
    assert (url.port, url.port) in all_services["prometheus"].published()

    providers = load_yaml(GRAFANA / "provisioning" / "dashboards" / "session-router.yml")
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == mount_target(grafana, "./config/grafana/dashboards")
    assert mount_target(grafana, "./config/grafana/provisioning") == "/etc/grafana/provisioning"
    home = grafana.spec.get("environment", {}).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home.startswith(provider["options"]["path"] + "/")
        assert (DASHBOARDS / home.rsplit("/", 1)[1]).is_file()

    for path in dashboard_files():
        dashboard = json.loads(path.read_text())
        check_dashboard_shape(dashboard, source["uid"], path.name)


def check_dashboard_shape(dashboard: dict[str, Any], datasource_uid: str, where: str) -> None:
    # provisioning format: the dashboard model itself, not an API envelope
    assert "dashboard" not in dashboard and "overwrite" not in dashboard, where
    assert dashboard.get("id") is None, f"{where}: provisioned dashboards carry no numeric id"
    assert isinstance(dashboard.get("uid"), str) and 0 < len(dashboard["uid"]) <= 40
    assert isinstance(dashboard.get("title"), str) and dashboard["title"]
    assert isinstance(dashboard.get("schemaVersion"), int) and dashboard["schemaVersion"] >= 30
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"{where}: panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{where}: panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": datasource_uid}, panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), panel["title"]
        for t in targets:
            assert t["expr"].strip() and t.get("datasource", panel["datasource"]) == panel["datasource"]


async def test_dashboard_queries_name_only_exported_metrics(aiohttp_client: Any) -> None:
    exported = exported_names(aiohttp_client)
    names = await exported
    assert "session_router_session_requests_total" in names and "vllm:prefix_cache_hits_total" in names
    synthetic = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}  # Prometheus adds these
    for path in dashboard_files():
        dashboard = json.loads(path.read_text())
        queries = dashboard_queries(dashboard)
        assert queries
        for title, expr in queries:
            used = metric_names(expr)
            assert used, f"{path.name}: panel {title!r} queries no metric: {expr}"
            unknown = used - names - synthetic
            assert not unknown, f"{path.name}: panel {title!r} uses metrics nobody exports: {sorted(unknown)}"
        for variable in dashboard.get("templating", {}).get("list", []):
            query = variable.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            for metric in re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,", text):
                assert metric in names | synthetic, f"variable {variable['name']}: unknown metric {metric}"


def test_dashboard_has_the_panels_the_demo_promises() -> None:
    dashboard = json.loads((DASHBOARDS / "session-router.json").read_text())
    panels = [p for p in all_panels(dashboard) if p["type"] != "row"]

    def has(predicate: Any, what: str) -> None:
        assert any(predicate(p, " ".join(t["expr"] for t in p["targets"])) for p in panels), f"no panel for {what}"

    has(lambda p, e: "session_router_requests_total" in e and "by (backend" in e, "requests by backend")
    has(lambda p, e: "latency" in p["title"].lower() and "by (le, instance)" in e, "latency by backend")
    has(lambda p, e: "session_router_placements_total" in e and "outcome" in e, "placement outcomes")
    has(lambda p, e: p["type"] == "table" and "session_router_session_requests_total" in e
        and "by (session" in e, "top sessions")
    has(lambda p, e: re.search(r"sum by \(instance\) \(rate\(vllm:prefix_cache_hits_total[^/]*/\s*sum by \(instance\)"
                                 r" \(rate\(vllm:prefix_cache_queries_total", e) is not None,
        "cache hit ratio by backend")
    has(lambda p, e: "session_router_pd_fallback_total" in e and "by (reason)" in e, "P/D fallbacks")


# --------------------------------------------------------------------------- the traffic service
async def test_traffic_runs_multi_turn_sessions_through_the_router(aiohttp_server: Any) -> None:
    """bench.traffic against a real backend app behind the router: header and derived sessions,
    streamed and plain turns, each session sticky with a growing prefix-cache hit count."""
    backend = await aiohttp_server(create_backend_app(EngineConfig(speed=0.0)), host="127.0.0.1")
    router_app = create_router_app(router_config(backends=[BackendConfig(f"http://127.0.0.1:{backend.port}")],
                                                health_interval_s=3600.0))
    router = await aiohttp_server(router_app, host="127.0.0.1")
    url = f"http://127.0.0.1:{router.port}"
    stats = await traffic_run(TrafficConfig(router=url, sessions=4, turns=3, conversations=1, think_s=0.0,
                                            header_share=0.5, stream_share=0.5, session_prefix="t", report_s=0))
    assert (stats.ok, stats.failed, stats.conversations) == (12, 0, 4), stats.last_error
    assert set(stats.session_turns.values()) == {3}
    header_ids = {f"t-{i}-0" for i in range(2)}
    derived = set(stats.session_turns) - header_ids
    assert header_ids <= set(stats.session_turns)
    assert len(derived) == 2 and all(sid.startswith("conv-") for sid in derived)
    assert 0 < stats.cached_tokens < stats.prompt_tokens
    async with aiohttp.ClientSession() as http:
        for sid in stats.session_turns:
            async with http.get(f"{url}/v1/sessions/{sid}") as resp:
                view = await resp.json()
            assert view["requests"] == 3 and view["cached_tokens"] > 0, view


async def test_traffic_waits_for_a_router_that_starts_late(aiohttp_server: Any) -> None:
    backend = await aiohttp_server(create_backend_app(EngineConfig(speed=0.0)), host="127.0.0.1")
    port = free_port()  # nothing listens here yet
    stats = Stats()
    task = asyncio.create_task(traffic_run(
        TrafficConfig(router=f"http://127.0.0.1:{port}", sessions=1, turns=2, conversations=1, think_s=0.0,
                      report_s=0), stats=stats))
    deadline = time.monotonic() + 10
    while stats.failed == 0:  # the first turn was refused
        assert time.monotonic() < deadline and not task.done(), "traffic never tried the router"
        await asyncio.sleep(0.01)
    router_app = create_router_app(router_config(backends=[BackendConfig(f"http://127.0.0.1:{backend.port}")],
                                                health_interval_s=3600.0))
    await aiohttp_server(router_app, host="127.0.0.1", port=port)
    result = await asyncio.wait_for(task, timeout=30)
    assert result.ok == 2 and result.failed >= 1 and "Connect" in result.last_error


def test_traffic_cli_rejects_bad_arguments() -> None:
    assert traffic_args(["--router", "http://router:8000"]).conversations is None  # forever by default
    for bad in (["--router", "router:8000"], ["--router", "http://r:1", "--sessions", "0"],
                ["--router", "http://r:1", "--stream-share", "2"]):
        with pytest.raises(SystemExit):
            traffic_args(bad)
