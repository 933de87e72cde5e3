"""nginx as a plain round-robin reverse proxy in front of the same backends (the benchmark's yardstick).

``write_conf`` renders an nginx.conf for loopback only: an upstream block with keep-alive
connections to the backends, ``proxy_buffering off`` (SSE chunks go out as they arrive), no
access log, the error log and every temp path inside the run's directory. ``start_nginx`` runs
``nginx -p DIR -c DIR/nginx.conf -g 'daemon off;'`` in the foreground as our child, waits until a
proxied ``GET /health`` answers, and returns a handle that stops it by PID.

    python -m bench.nginx --backend http://127.0.0.1:8100 --backend http://127.0.0.1:8101 [--port N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from bench.procs import LOOPBACK, Proc, free_port, http_status, wait_until

NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


def find_nginx() -> str | None:
    """The nginx binary, or None when it is not installed."""
    return shutil.which("nginx") or next((p for p in NGINX_CANDIDATES if os.access(p, os.X_OK)), None)


def nginx_version(binary: str) -> str:
    out = subprocess.run([binary, "-v"], check=False, capture_output=True, text=True, timeout=10)
    text = (out.stderr or out.stdout).strip()
    return text.split(":", 1)[-1].strip() if text else "unknown"


def _upstream_addr(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in (LOOPBACK, "localhost") or parts.port is None:
        raise ValueError(f"backend {url!r}: expected http://127.0.0.1:PORT (the benchmark stays on loopback)")
    return f"{LOOPBACK}:{parts.port}"


def write_conf(directory: str, port: int, backends: Sequence[str], *, worker_processes: int = 1,
               keepalive: int = 256) -> str:
    """Write ``directory/nginx.conf`` and return its path."""
    if port in (0, 80) or not 1024 <= port <= 65535:
        raise ValueError(f"port {port}: use an unprivileged ephemeral port (never 80)")
    if not backends:
        raise ValueError("at least one backend is needed")
    servers = "\n".join(f"        server {_upstream_addr(url)};" for url in backends)
    conf = f"""# written by bench/nginx.py: a plain reverse proxy for the router benchmark (loopback only)
worker_processes {worker_processes};
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;

events {{
    worker_connections 8192;
}}

http {{
    access_log off;
    client_body_temp_path {directory}/client_body;
    proxy_temp_path {directory}/proxy;
    fastcgi_temp_path {directory}/fastcgi;
    uwsgi_temp_path {directory}/uwsgi;
    scgi_temp_path {directory}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    tcp_nodelay on;
    client_max_body_size 8m;
    client_body_buffer_size 1m;  # bodies stay in memory (the temp dirs may not be readable by the workers)

    upstream backends {{
{servers}
        keepalive {keepalive};
        keepalive_requests 1000000;
    }}

    server {{
        listen {LOOPBACK}:{port} backlog=1024;
        location / {{
            proxy_pass http://backends;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""
    path = os.path.join(directory, "nginx.conf")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(conf)
    return path


@dataclass
class Nginx(Proc):
    """A foreground nginx master started by us (its workers are its children); stopped gracefully."""

    directory: str = ""

    def error_log(self) -> str:
        try:
            with open(os.path.join(self.directory, "error.log"), encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGQUIT, timeout: float = 10.0) -> int:
        """SIGQUIT (nginx's graceful stop) to the master, by PID; SIGKILL when it does not exit in time."""
        return super().stop(sig, timeout)


def start_nginx(directory: str, backends: Sequence[str], *, port: int | None = None, binary: str | None = None,
                worker_processes: int = 1, timeout: float = 15.0) -> Nginx:
    """Write the conf into ``directory`` and run nginx in the foreground; wait until it proxies."""
    binary = binary or find_nginx()
    if binary is None:
        raise FileNotFoundError("nginx is not installed")
    port = port or free_port()
    os.makedirs(directory, exist_ok=True)
    conf = write_conf(directory, port, backends, worker_processes=worker_processes)
    log_path = os.path.join(directory, "stderr.log")
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            # -e: the start-up error log before the conf is read (nginx >= 1.19.5)
            [binary, "-p", directory, "-c", conf, "-e", os.path.join(directory, "error.log"), "-g", "daemon off;"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    proc = Nginx(popen.args, port, popen, log_path, directory=directory)
    try:
        wait_until(lambda: not proc.alive() or http_status(proc.url + "/health") == 200,
                   timeout=timeout, what=f"nginx on port {port}")
    except AssertionError:
        proc.stop()
        raise AssertionError(f"nginx did not start:\n{proc.error_log()}") from None
    if not proc.alive():
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            raise AssertionError(f"nginx exited with {popen.returncode}:\n{fh.read()}\n{proc.error_log()}")
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nginx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", required=True, help="backend URL (repeatable)")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--workers", type=int, default=1, help="nginx worker_processes (default 1)")
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="bench-nginx-")
    proc = start_nginx(directory, args.backend, port=args.port, worker_processes=args.workers)
    print(f"nginx listening on {proc.url} (conf {directory}/nginx.conf); Ctrl-C stops it", flush=True)
    try:
        proc.popen.wait()
    except KeyboardInterrupt:
        pass
    finally:
        proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
