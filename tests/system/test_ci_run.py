"""`.ci/run` stops nothing it did not start, and keeps Debian's packages from starting their services.

The script runs for real with stand-ins for `apt-get`, `make` and `id` on PATH (the real tools are
not touched): it must install under a temporary policy-rc.d that answers 101 ("action forbidden"),
remove that file afterwards (also when the install fails), and leave an existing one alone.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO

SCRIPT = Path(REPO) / ".ci" / "run"

FAKE_APT = """#!/bin/bash
echo "apt-get $*" >>"$CI_TEST_LOG"
if [ "$1" = install ]; then
    if [ -x "$CI_POLICY_RC_D" ]; then
        "$CI_POLICY_RC_D" nginx start
        echo "policy-rc.d exit $?" >>"$CI_TEST_LOG"
    else
        echo "policy-rc.d missing" >>"$CI_TEST_LOG"
    fi
    exit "${CI_TEST_APT_EXIT:-0}"
fi
"""
FAKE_MAKE = """#!/bin/bash
if [ -e "$CI_POLICY_RC_D" ]; then p=present; else p=absent; fi
echo "make $* (policy-rc.d $p)" >>"$CI_TEST_LOG"
"""


def _shims(tmp: Path) -> Path:
    """A PATH with only what the script needs: the fakes and a few real coreutils."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name in ("bash", "dirname", "rm", "chmod"):
        real = shutil.which(name)
        assert real is not None, name
        (bin_dir / name).symlink_to(real)
    for name, text in (("apt-get", FAKE_APT), ("make", FAKE_MAKE), ("id", "#!/bin/bash\necho 0\n")):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return bin_dir


def _run(tmp: Path, policy: Path, apt_exit: int = 0) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = tmp / "calls.log"
    env = {"PATH": str(_shims(tmp)), "CI_POLICY_RC_D": str(policy), "CI_TEST_LOG": str(log),
           "CI_TEST_APT_EXIT": str(apt_exit), "HOME": str(tmp)}
    out = subprocess.run(["/usr/bin/env", "bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return out, calls


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_install_runs_under_a_temporary_policy_that_forbids_starting_services(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    out, calls = _run(tmp_path, policy)
    assert out.returncode == 0, out.stderr
    install = [c for c in calls if c.startswith("apt-get install")]
    assert install and all(pkg in install[0] for pkg in ("prometheus", "nginx", "docker-compose", "redis-server")), calls
    # during the install the policy existed and forbade every action; afterwards it is gone
    assert "policy-rc.d exit 101" in calls, calls
    assert calls[-1] == "make test (policy-rc.d absent)", calls
    assert not policy.exists()


def test_an_existing_policy_is_left_alone(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\n# the machine's own\nexit 101\n")
    policy.chmod(0o700)
    before = policy.read_bytes(), stat.S_IMODE(policy.stat().st_mode)
    out, calls = _run(tmp_path, policy)
    assert out.returncode == 0, out.stderr
    assert "policy-rc.d exit 101" in calls and calls[-1] == "make test (policy-rc.d present)", calls
    assert (policy.read_bytes(), stat.S_IMODE(policy.stat().st_mode)) == before


def test_a_failed_install_still_removes_the_temporary_policy(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    out, calls = _run(tmp_path, policy, apt_exit=100)
    assert out.returncode != 0
    assert "policy-rc.d exit 101" in calls and not any(c.startswith("make") for c in calls), calls
    assert not policy.exists()


def test_the_script_stops_no_process_by_name() -> None:
    text = SCRIPT.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(pkill|killall|kill)\b|systemctl\s+stop|service\s+\S+\s+stop", code), code
    assert os.access(SCRIPT, os.X_OK) or text.startswith("#!")
