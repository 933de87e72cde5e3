"""Router configuration: TOML decoded into msgspec Structs; CLI flags override the file.

``schema``: the Structs (one per section) with defaults and bounds, and the flat keys of before;
``load``: reading a file, moving flat keys into sections, decoding and validation; ``flags``:
the command-line flag table and ``build_config``. This module names the package's public API.
"""

from router.config.flags import build_config
from router.config.load import (
    ADMIN_TOKEN_ENV,
    config_from_mapping,
    is_loopback_host,
    load_config,
    sectioned,
    validate_config,
    warn_flat_keys,
)
from router.config.schema import (
    DEFAULT_PROXY_DENY,
    FLAT_KEYS,
    SECTIONS,
    AdminConfig,
    BackendConfig,
    FrontConfig,
    HealthConfig,
    KiB,
    MiB,
    PDConfig,
    PlacementConfig,
    RouterConfig,
    SessionsConfig,
    TokensConfig,
    UpstreamConfig,
)

__all__ = [
    "ADMIN_TOKEN_ENV",
    "DEFAULT_PROXY_DENY",
    "FLAT_KEYS",
    "SECTIONS",
    "AdminConfig",
    "BackendConfig",
    "FrontConfig",
    "HealthConfig",
    "KiB",
    "MiB",
    "PDConfig",
    "PlacementConfig",
    "RouterConfig",
    "SessionsConfig",
    "TokensConfig",
    "UpstreamConfig",
    "build_config",
    "config_from_mapping",
    "is_loopback_host",
    "load_config",
    "sectioned",
    "validate_config",
    "warn_flat_keys",
]
