"""Router configuration: TOML loading, validation messages that name the key, flag overrides."""

from __future__ import annotations

import logging
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contract.errors import ConfigError
from router.config import (
    BackendConfig,
    FLAT_KEYS,
    SECTIONS,
    RouterConfig,
    build_config,
    config_from_mapping,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "router.toml"
ONE_BACKEND = '[[backends]]\nurl = "http://127.0.0.1:8100"\n'


def write(tmp_path: Path, text: str, name: str = "router.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_error(func: Any, *args: Any) -> str:
    with pytest.raises(ConfigError) as info:
        func(*args)
    return info.value.message


# ------------------------------------------------------------------ the example file


def test_example_file_is_the_defaults_plus_three_local_backends() -> None:
    config = load_config(str(EXAMPLE))
    urls = [f"http://127.0.0.1:{port}" for port in (8100, 8101, 8102)]
    assert config.backends == [BackendConfig(url=url) for url in urls]
    assert msgspec.structs.replace(config, backends=[]) == RouterConfig()


def test_example_file_lists_every_setting() -> None:
    text = EXAMPLE.read_text()
    for field in msgspec.structs.fields(RouterConfig):
        # a key line (`name = ...`), a table header (`[[name]]`) or a section (`[name]`), commented out or not
        pattern = rf"^\s*#?\s*(\[\[{field.name}\]\]|\[{field.name}\]|{field.name}\s*=)"
        assert re.search(pattern, text, re.MULTILINE), f"config/router.toml does not mention {field.name}"
    # and the uncommented keys are settings, nothing else; each section lists every key of its own
    data = tomllib.loads(text)
    assert set(data) <= {f.name for f in msgspec.structs.fields(RouterConfig)}
    for section, struct in SECTIONS.items():
        assert set(data[section]) == {f.name for f in msgspec.structs.fields(struct)}, section


def test_empty_file_with_a_backend_flag_is_the_defaults(tmp_path: Path) -> None:
    config = build_config(["--config", write(tmp_path, ""), "--backend", "http://127.0.0.1:8100"])
    assert msgspec.structs.replace(config, backends=[]) == RouterConfig()
    assert config.backends == [BackendConfig(url="http://127.0.0.1:8100")]


# ------------------------------------------------------------ decoding errors (types, keys)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("load_facter = 1.5\n", "unknown key 'load_facter' (did you mean 'load_factor'?)"),
        ("zzz = 1\n", "unknown key 'zzz'"),
        ('load_factor = "x"\n', "load_factor: expected float, got str"),
        ("port = 80.5\n", "port: expected int, got float"),
        ("port = true\n", "port: expected int, got bool"),
        ('pd_fallback = "yes"\n', "pd_fallback: expected bool, got str"),
        ("admin_token = 5\n", "admin_token: expected str, got int"),
        (
            '[[backends]]\nurl = "http://127.0.0.1:1"\n[[backends]]\nurl = 3\n',
            "backends[1].url: expected str, got int",
        ),
        ('[[backends]]\nname = "a"\n', "backends[0]: missing required key 'url'"),
        (
            '[[backends]]\nurl = "http://127.0.0.1:1"\nnmae = "a"\n',
            "backends[0]: unknown key 'nmae' (did you mean 'name'?)",
        ),
        ('[backends]\nurl = "http://127.0.0.1:1"\n', "backends: expected array, got object; write each backend"),
        ('[[decode]]\nurl = ["http://127.0.0.1:1"]\n', "decode[0].url: expected str, got array"),
    ],
)
def test_type_and_key_errors_name_the_key(tmp_path: Path, toml: str, message: str) -> None:
    assert config_error(load_config, write(tmp_path, toml)).startswith(message)


def test_msgspec_paths_never_leak(tmp_path: Path) -> None:
    text = config_error(load_config, write(tmp_path, '[[prefill]]\nurl = "http://127.0.0.1:1"\nname = 1\n'))
    assert text == "prefill[0].name: expected str, got int"
    assert "$" not in text and "`" not in text


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    assert config_error(load_config, missing) == f"config file {missing}: not found"
    bad = write(tmp_path, "port = \n")
    assert config_error(load_config, bad).startswith(f"config file {bad}: invalid TOML: ")
    assert "line 1" in config_error(load_config, bad)


# ---------------------------------------------------------------------- value validation


@pytest.mark.parametrize(
    ("settings_toml", "message"),
    [
        ('policy = "sticky"\n', "policy: must be one of kv_aware, session, round_robin, least_loaded, got 'sticky'"),
        ('stamp = "always"\n', "stamp: must be one of derive, mint, none, got 'always'"),
        ('log_level = "loud"\n', "log_level: must be one of debug, info, warning, error, critical"),
        ("load_factor = 0.99\n", "load_factor: must be at least 1"),
        ("load_factor = nan\n", "load_factor: must be a finite number, got nan"),
        ("load_factor = inf\n", "load_factor: must be a finite number, got inf"),
        ("reported_load_weight = -0.5\n", "reported_load_weight: must be >= 0"),
        ("sticky_headroom = -1\n", "sticky_headroom: must be an integer >= 0"),
        ("body_timeout_s = 0\n", "body_timeout_s: must be a positive number of seconds"),
        ("sticky_headroom = 1.5\n", "sticky_headroom: expected int, got float"),
        ("session_ttl_s = 0\n", "session_ttl_s: must be a positive number of seconds, got 0"),
        ("connect_timeout_s = 0\n", "connect_timeout_s: must be a positive number of seconds"),
        ("first_byte_timeout_s = -1\n", "first_byte_timeout_s: must be a positive number of seconds"),
        ("total_timeout_s = 0.0\n", "total_timeout_s: must be a positive number of seconds"),
        ("health_interval_s = 0\n", "health_interval_s: must be a positive number of seconds"),
        ("health_timeout_s = -0.1\n", "health_timeout_s: must be a positive number of seconds"),
        ("retry_backoff_s = -0.01\n", "retry_backoff_s: must be >= 0 seconds"),
        ("eject_s = -1\n", "eject_s: must be >= 0 seconds"),
        ("drain_timeout_s = -1\n", "drain_timeout_s: must be >= 0 seconds"),
        ("retries = -1\n", "retries: must be >= 0 (0 = no retries), got -1"),
        ("[upstream]\nmax_idle_per_host = -1\n", "upstream.max_idle_per_host: must be >= 0 (0 = no keep-alive), got -1"),
        ("max_sessions = 0\n", "max_sessions: must be at least 1, got 0"),
        ("max_body_bytes = 0\n", "max_body_bytes: must be at least 1, got 0"),
        ("eject_after_failures = 0\n", "eject_after_failures: must be at least 1"),
        ("workers = 0\n", "workers: must be at least 1"),
        ("max_response_ids = 0\n", "max_response_ids: must be at least 1"),
        ("session_metrics_top_k = -1\n", "session_metrics_top_k: must be >= 0"),
        ("port = 65536\n", "port: must be 0..65535"),
        ("port = -1\n", "port: must be 0..65535"),
        ("admin_port = 70000\n", "admin_port: must be 0..65535"),
        ("port = 8000\nadmin_port = 8000\n", "admin_port: must differ from port (8000)"),
        ('host = ""\n', "host: must not be empty"),
    ],
)
def test_value_errors_name_the_key(tmp_path: Path, settings_toml: str, message: str) -> None:
    assert config_error(load_config, write(tmp_path, settings_toml + ONE_BACKEND)).startswith(message)


def test_boundary_values_are_accepted(tmp_path: Path) -> None:
    text = (
        "load_factor = 1\nretries = 0\nsession_metrics_top_k = 0\nport = 0\ndrain_timeout_s = 0\n"
        'eject_s = 0\nretry_backoff_s = 0\nlog_level = "DEBUG"\n' + ONE_BACKEND
    )
    config = load_config(write(tmp_path, text))
    assert (config.placement.load_factor, config.upstream.retries, config.port, config.log_level) == (1.0, 0, 0, "debug")
    assert isinstance(config.placement.load_factor, float)


# ------------------------------------------------------------------------------ backends


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("", "give at least one backend with --backend or in the config file's [[backends]]"),
        (
            '[[backends]]\nurl = "http://127.0.0.1:1"\n[[backends]]\nurl = "ftp://127.0.0.1:2"\n',
            "backends[1].url: backend URL 'ftp://127.0.0.1:2': only http:// URLs are supported",
        ),
        ('[[backends]]\nurl = "http://127.0.0.1:1/v1"\n', "backends[0].url: backend URL 'http://127.0.0.1:1/v1': give only"),
        ('[[backends]]\nurl = "http://:1"\n', "backends[0].url: backend URL 'http://:1' has no host"),
        ('[[backends]]\nurl = "http://127.0.0.1:99999"\n', "backends[0].url: backend URL 'http://127.0.0.1:99999' has an invalid port"),
        (
            '[[backends]]\nurl = "http://127.0.0.1:1"\n[[backends]]\nurl = "http://127.0.0.1:1/"\n',
            "backends[1].url: http://127.0.0.1:1 is listed twice in backends (also entry 0)",
        ),
        (
            '[[backends]]\nurl = "http://127.0.0.1:1"\nname = "a"\n[[backends]]\nurl = "http://127.0.0.1:2"\nname = "a"\n',
            "backends[1].name: backend name 'a' is used twice in backends",
        ),
        (
            '[[backends]]\nurl = "http://127.0.0.1:1"\n[[decode]]\nurl = "http://127.0.0.1:2"\n',
            "backends: give either backends (aggregated mode) or prefill/decode (P/D mode), not both",
        ),
        ('[[prefill]]\nurl = "http://127.0.0.1:1"\n', "decode: P/D mode needs at least one decode backend"),
        (
            '[[prefill]]\nurl = "http://127.0.0.1:1"\n[[decode]]\nurl = "http://127.0.0.1:2"\n'
            '[[decode]]\nurl = "http://127.0.0.1:2"\n',
            "decode[1].url: http://127.0.0.1:2 is listed twice in decode",
        ),
    ],
)
def test_backend_errors(tmp_path: Path, toml: str, message: str) -> None:
    assert config_error(load_config, write(tmp_path, toml)).startswith(message)


def test_backend_urls_are_normalized_and_pools_are_separate(tmp_path: Path) -> None:
    text = (
        '[[prefill]]\nurl = "http://127.0.0.1:8200/"\n'
        '[[decode]]\nurl = "http://127.0.0.1:8200"\nname = "d0"\n'
        '[[decode]]\nurl = "http://localhost:8201"\n'
    )
    config = load_config(write(tmp_path, text))
    assert config.pd_mode
    assert config.prefill == [BackendConfig(url="http://127.0.0.1:8200")]
    assert config.decode == [
        BackendConfig(url="http://127.0.0.1:8200", name="d0"),
        BackendConfig(url="http://localhost:8201"),
    ]


def test_decode_only_is_p_d_mode(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '[[decode]]\nurl = "http://127.0.0.1:8201"\n'))
    assert config.pd_mode and config.prefill == [] and config.backends == []


def test_load_config_without_a_file_needs_a_backend() -> None:
    assert "give at least one backend" in config_error(load_config, None)


def test_config_from_mapping() -> None:
    config = config_from_mapping({"backends": [{"url": "http://127.0.0.1:1/"}], "policy": "round_robin"})
    assert config.backends == [BackendConfig(url="http://127.0.0.1:1")] and config.placement.policy == "round_robin"
    assert config_error(config_from_mapping, {"backends": "x"}).startswith("backends: expected array, got str")


# ------------------------------------------------------------------------ flag overrides


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'host = "127.0.0.1"\nport = 9000\npolicy = "round_robin"\nlog_level = "info"\nstamp = "mint"\n'
        'load_factor = 2.0\nadmin_token = "file"\nworkers = 1\nretries = 7\n' + ONE_BACKEND,
    )
    config = build_config(
        [
            "--config", path,
            "--host", "0.0.0.0",
            "--port", "9100",
            "--policy", "least_loaded",
            "--log-level", "DEBUG",
            "--stamp", "none",
            "--load-factor", "1.5",
            "--admin-token", "flag",
            "--workers", "3",
        ]
    )  # fmt: skip
    assert (config.host, config.port, config.placement.policy, config.log_level, config.sessions.stamp) == (
        "0.0.0.0", 9100, "least_loaded", "debug", "none",
    )  # fmt: skip
    assert (config.placement.load_factor, config.admin.token, config.workers) == (1.5, "flag", 3)
    assert config.upstream.retries == 7  # not overridden: the file's value stays
    assert config.backends == [BackendConfig(url="http://127.0.0.1:8100")]


def test_file_values_stay_without_flags(tmp_path: Path) -> None:
    config = build_config(["--config", write(tmp_path, 'port = 9000\npolicy = "round_robin"\n' + ONE_BACKEND)])
    assert (config.port, config.placement.policy) == (9000, "round_robin")


def test_backend_flags_replace_the_file_list(tmp_path: Path) -> None:
    path = write(tmp_path, ONE_BACKEND + '[[backends]]\nurl = "http://127.0.0.1:8101"\n')
    config = build_config(["--config", path, "--backend", "http://127.0.0.1:9001", "--backend", "http://127.0.0.1:9002/"])
    assert [b.url for b in config.backends] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def test_pd_flags_replace_the_files_topology(tmp_path: Path) -> None:
    aggregated = write(tmp_path, ONE_BACKEND, "agg.toml")
    config = build_config(["--config", aggregated, "--prefill", "http://127.0.0.1:8200", "--decode", "http://127.0.0.1:8201"])
    assert config.backends == [] and config.pd_mode
    assert [b.url for b in config.prefill] == ["http://127.0.0.1:8200"]
    assert [b.url for b in config.decode] == ["http://127.0.0.1:8201"]

    pd = write(tmp_path, '[[prefill]]\nurl = "http://127.0.0.1:8200"\n[[decode]]\nurl = "http://127.0.0.1:8201"\n', "pd.toml")
    only_decode = build_config(["--config", pd, "--decode", "http://127.0.0.1:8301"])
    assert [b.url for b in only_decode.prefill] == ["http://127.0.0.1:8200"]  # the file's prefill stays
    assert [b.url for b in only_decode.decode] == ["http://127.0.0.1:8301"]
    back_to_aggregated = build_config(["--config", pd, "--backend", "http://127.0.0.1:8100"])
    assert back_to_aggregated.prefill == [] and back_to_aggregated.decode == [] and not back_to_aggregated.pd_mode


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give at least one backend with --backend or in the config file's [[backends]]"),
        (["--backend", "ftp://127.0.0.1:1"], "--backend: backend URL 'ftp://127.0.0.1:1': only http:// URLs are supported"),
        (["--backend", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:1/"], "--backend: http://127.0.0.1:1 is listed twice"),
        (["--prefill", "http://127.0.0.1:1"], "decode: P/D mode needs at least one decode backend"),
        (["--backend", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "--backend (aggregated mode) cannot be combined"),
        (["--backend", "http://127.0.0.1:1", "--load-factor", "0.5"], "--load-factor: must be at least 1"),
        (["--backend", "http://127.0.0.1:1", "--workers", "0"], "--workers: must be at least 1, got 0"),
        (["--backend", "http://127.0.0.1:1", "--port", "70000"], "--port: must be 0..65535"),
        (["--backend", "http://127.0.0.1:1", "--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
        (["--backend", "http://127.0.0.1:1", "--load-factor", "x"], "argument --load-factor: invalid float value: 'x'"),
        (["--backend", "http://127.0.0.1:1", "--policy", "random"], "argument --policy: invalid choice: 'random'"),
        (["--backend", "http://127.0.0.1:1", "--stamp", "x"], "argument --stamp: invalid choice: 'x'"),
        (["--backend", "http://127.0.0.1:1", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--backend", "http://127.0.0.1:1", "--bogus"], "unrecognized arguments: --bogus"),
        (["--config"], "argument --config: expected one argument"),
    ],
)
def test_flag_errors(argv: list[str], message: str) -> None:
    assert config_error(build_config, argv).startswith(message)


def test_file_errors_surface_through_build_config(tmp_path: Path) -> None:
    path = write(tmp_path, "load_facter = 2\n")
    assert config_error(build_config, ["--config", path, "--backend", "http://127.0.0.1:1"]).startswith(
        "unknown key 'load_facter'"
    )


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_config(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--host", "--port", "--backend", "--prefill", "--decode", "--policy", "--log-level",
                 "--stamp", "--load-factor", "--admin-token", "--workers"):  # fmt: skip
        assert flag in out


# ------------------------------------------------------------------ robustness (property)

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=20)
)
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_keys = st.sampled_from([f.name for f in msgspec.structs.fields(RouterConfig)] + list(FLAT_KEYS) + ["unknown_key"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=4))
@example({"upstream": {"$": float("inf")}})  # once said "upstream.$: must be a finite number"
def test_any_input_is_a_config_or_a_config_error(data: dict[str, Any]) -> None:
    try:
        config = config_from_mapping(data)
    except ConfigError as exc:
        assert exc.message and "$" not in exc.message
    else:
        assert isinstance(config, RouterConfig)
        assert config.backends or config.decode


def test_config_files_in_the_repo_load() -> None:
    """Every router config the project ships is valid (the P/D example joins when it lands)."""
    paths = sorted((REPO / "config").glob("router*.toml"))
    assert EXAMPLE in paths
    for path in paths:
        assert isinstance(load_config(os.fspath(path)), RouterConfig)


# ------------------------------------------------------ sections, and the flat layout of before

#: a non-default value for every key of the flat layout
FLAT_VALUES: dict[str, Any] = {
    "connect_timeout_s": 1.5, "first_byte_timeout_s": 2.5, "total_timeout_s": 3.5, "retries": 4,
    "retry_backoff_s": 0.5, "max_upstream_head_bytes": 4096, "max_upstream_body_bytes": 8192,
    "front": "aiohttp", "max_body_bytes": 1000, "body_timeout_s": 7.0, "max_connections": 9,
    "proxy_deny": ["/x"], "access_log": "json", "access_log_file": "/tmp/a.log",
    "policy": "least_loaded", "load_factor": 1.5, "sticky_headroom": 0, "reported_load_weight": 0.5,
    "stamp": "mint", "session_header": "X-Conv", "session_ttl_s": 60.0, "max_sessions": 5,
    "max_response_ids": 6, "session_metrics_top_k": 7, "session_label": "id",
    "health_interval_s": 0.5, "health_timeout_s": 0.25, "eject_after_failures": 8, "eject_s": 9.0,
    "pd_fallback": False, "trust_client_kv_params": True,
    "admin_token": "t0ken", "admin_port": 9001, "admin_host": "127.0.0.2", "admin_backend_allow": ["10.0.0.0/8"],
}  # fmt: skip
BACKENDS = [{"url": "http://127.0.0.1:8100"}]


def test_every_flat_key_is_its_section_key() -> None:
    assert set(FLAT_VALUES) == set(FLAT_KEYS)
    sectioned_data: dict[str, Any] = {}
    for flat, value in FLAT_VALUES.items():
        section, key = FLAT_KEYS[flat]
        sectioned_data.setdefault(section, {})[key] = value
    flat_config = config_from_mapping({**FLAT_VALUES, "backends": BACKENDS})
    assert flat_config == config_from_mapping({**sectioned_data, "backends": BACKENDS})
    assert flat_config != config_from_mapping({"backends": BACKENDS})  # every value above is not a default
    assert (flat_config.placement.load_factor, flat_config.front.kind, flat_config.sessions.header,
            flat_config.admin.port, flat_config.upstream.max_head_bytes) == (1.5, "aiohttp", "X-Conv", 9001, 4096)


def test_a_flat_key_logs_where_it_goes_now(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="router.config")
    load_config(write(tmp_path, "load_factor = 1.5\nsession_ttl_s = 60\n" + ONE_BACKEND))
    assert sorted(r.getMessage().split(" (")[0] for r in caplog.records) == [
        "load_factor is deprecated at top level; write it as [placement] load_factor",
        "session_ttl_s is deprecated at top level; write it as [sessions] ttl_s",
    ]
    caplog.clear()
    build_config(["--config", write(tmp_path, "[placement]\nload_factor = 1.5\n" + ONE_BACKEND)])
    assert caplog.records == []  # the sectioned layout: no warning


def test_a_key_set_flat_and_in_its_section_is_refused(tmp_path: Path) -> None:
    text = "load_factor = 1.5\n[placement]\nload_factor = 2.0\n" + ONE_BACKEND
    message = config_error(load_config, write(tmp_path, text))
    assert message.startswith("load_factor and [placement] load_factor are both set; keep only [placement] load_factor")
    flat_front = 'front = "raw"\nmax_body_bytes = 10\n'  # `front` at the top: the old key, not the section
    assert load_config(write(tmp_path, flat_front + ONE_BACKEND)).front.max_body_bytes == 10


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[placement]\nload_factor = 0.5\n", "placement.load_factor: must be at least 1 (1 = perfectly even load"),
        ('[placement]\npolicy = "sticky"\n', "placement.policy: must be one of kv_aware, session, round_robin, least_loaded"),
        ('[front]\nkind = "nginx"\n', "front.kind: must be one of raw, aiohttp, got 'nginx'"),
        ('[front]\naccess_log = "xml"\n', "front.access_log: must be one of off, text, json"),
        ('[sessions]\nlabel = "name"\n', "sessions.label: must be one of hash, id, none"),
        ("[sessions]\nttl_s = 0\n", "sessions.ttl_s: must be a positive number of seconds, got 0"),
        ("[upstream]\nmax_head_bytes = 10\n", "upstream.max_head_bytes: must be at least 1024 bytes, got 10"),
        ("[health]\neject_after_failures = 0\n", "health.eject_after_failures: must be at least 1, got 0"),
        ("[admin]\nport = 70000\n", "admin.port: must be 0..65535 (0 = no admin listener of its own), got 70000"),
        ("[placement]\nlod_factor = 2\n", "placement: unknown key 'lod_factor' (did you mean 'load_factor'?)"),
        ("placement = 2\n", "placement: expected object, got int; write it as a [placement] table"),
        ("[upstream]\nretries = inf\n", "upstream.retries: must be a finite number, got inf"),
        ('[sessions]\nheader = "Host"\n', "sessions.header: Host is a header the router reads or sets itself"),
        ('[admin]\nport = 9000\nhost = "0.0.0.0"\n', "admin.host: the admin API on 0.0.0.0:9000 would be open"),
    ],
)
def test_sectioned_errors_name_the_section_key(tmp_path: Path, toml: str, message: str) -> None:
    assert config_error(load_config, write(tmp_path, toml + ONE_BACKEND)).startswith(message)


def test_a_flag_is_named_for_the_section_key_it_sets(tmp_path: Path) -> None:
    path = write(tmp_path, "[placement]\nload_factor = 1.5\n" + ONE_BACKEND)
    assert build_config(["--config", path, "--load-factor", "2"]).placement.load_factor == 2.0
    assert config_error(build_config, ["--config", path, "--load-factor", "0.5"]).startswith("--load-factor: must be")


def test_the_bounds_live_in_the_schema() -> None:
    """msgspec checks ranges and closed sets while decoding: no code of ours needed (placement's own
    re-checks are gone)."""
    for bad in ({"placement": {"load_factor": 0.5}}, {"placement": {"sticky_headroom": -1}},
                {"placement": {"policy": "x"}}, {"log_level": "loud"}, {"port": -1}, {"workers": 0}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, RouterConfig)
