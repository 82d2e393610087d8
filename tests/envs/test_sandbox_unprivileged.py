"""test_sandbox_attacks.py (and test_sandbox.py's older attacks) again, as an ordinary user: CI runs as root, and the sandbox's worst
gaps were found without root. As root this test makes a system user and runs that file as it
(`runuser`) in a private mount namespace where the interpreter is reachable (pyenv under /root,
0700, is covered with an empty tmpfs and bound back, for this process tree only). It skips,
saying why, where the machine cannot do that; run as an ordinary user, the attack file itself
already runs unprivileged.
"""

import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from reinforge.envs.sandbox_isolation import _python_dirs

USER = "reinforge-sandbox-test"
REPO = Path(__file__).resolve().parents[2]
# attacks that held before issue 24, in test_sandbox.py: again as the ordinary user
REGRESSIONS = (
    "test_network_is_unreachable_when_isolated",
    "test_parent_secrets_are_not_visible",
    "test_huge_output_is_truncated_and_stopped",
    "test_fork_bomb_is_limited_and_every_child_dies",
    "test_writes_outside_the_workdir_do_not_land",
)


def _ensure_user() -> None:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
            check=True,
        )


def _expose_interpreter(stage: Path) -> list[str]:
    """Shell lines that, in a private mount namespace, cover each folder on the way to the
    interpreter that others cannot enter, and bind the interpreter's folders back."""
    lines = []
    for i, path in enumerate(_python_dirs(sys.executable)):
        parent = os.path.dirname(path)
        closed = None
        while parent != "/":
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                closed = parent
            parent = os.path.dirname(parent)
        if closed is None:
            continue
        hold = stage / str(i)
        hold.mkdir()
        p, h, c = (shlex.quote(str(x)) for x in (path, hold, closed))
        lines += [
            f"mount --bind {p} {h}",
            f"mountpoint -q {c} || mount -t tmpfs -o mode=0755 tmpfs {c}",
            f"mkdir -p {p}",
            f"mount --move {h} {p}",
        ]
    return lines


def test_attacks_as_an_unprivileged_user(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("already unprivileged: test_sandbox_attacks.py runs as this user")
    for tool in ("useradd", "runuser", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not on PATH: cannot run the attacks as another user")
    _ensure_user()
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-rs"]
    argv += [str(REPO / "tests" / "envs" / "test_sandbox_attacks.py")]
    argv += [f"{REPO / 'tests' / 'envs' / 'test_sandbox.py'}::{name}" for name in REGRESSIONS]
    env = f"env PYTHONPATH={shlex.quote(str(REPO / 'src'))} PYTHONDONTWRITEBYTECODE=1 HOME=/nonexistent"
    script = [
        *_expose_interpreter(tmp_path),
        f"cd {shlex.quote(str(REPO))}",
        f"exec runuser -u {USER} -- {env} {shlex.join(argv)}",
    ]
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-ec", "\n".join(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = out.stdout + out.stderr
    if out.returncode != 0 and "passed" not in report and "skipped" not in report:
        pytest.skip(f"could not run the attacks as {USER} here:\n{report[-2000:]}")
    print(report)  # the skip reasons: what rlimit without root leaves open
    assert out.returncode == 0, report
    assert " passed" in report  # bwrap without root ran them (not everything skipped)
