"""An injected hang is caught within the watchdog period, with every thread's stack and the hang
exit code; a process that keeps beating is left alone."""

import subprocess
import sys
import time

from reinforge.errors import ExitCode

HANGING = """
import sys, time
from pathlib import Path
from reinforge.watchdog import Watchdog
saved = []
def on_hang(phase):
    Path(sys.argv[1], "saved").write_text(phase)
    return f"saved in {phase}"
wd = Watchdog(timeout_s=1.0, run_dir=Path(sys.argv[1]), on_hang=on_hang).start()
for _ in range(3):
    wd.beat("training"); time.sleep(0.2)
def score_reward_that_hangs():
    with wd.phase("reward"):
        time.sleep(60)
score_reward_that_hangs()
"""


def test_hang_is_caught_with_stacks_and_exit_code(tmp_path):
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", HANGING, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    elapsed = time.perf_counter() - start
    print(f"hang caught {elapsed:.1f}s after start (0.6s of beats, 1.0s limit)")
    assert out.returncode == ExitCode.HANG, out.stderr
    assert elapsed < 10
    assert "phase 'reward'" in out.stderr and "score_reward_that_hangs" in out.stderr
    assert "score_reward_that_hangs" in (tmp_path / "hang.txt").read_text()
    assert (tmp_path / "saved").read_text() == "reward"
    assert (
        "saved in reward" in out.stderr and "saved in reward" in (tmp_path / "hang.txt").read_text()
    )


def test_beating_process_is_not_killed():
    code = (
        "import time\nfrom reinforge.watchdog import Watchdog\nwd = Watchdog(timeout_s=0.5).start()\n"
        "for _ in range(15):\n    wd.beat('generation'); time.sleep(0.1)\nwd.stop()\nprint('done')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
