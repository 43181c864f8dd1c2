"""A verl driver calls ``ray.init(num_cpus=...)`` itself: rankmesh uses that Ray as it is
(no second Ray, no resizing) and leaves it usable after a call that fails.

Runs its own driver process (tests/compat/user_ray_init_driver.py): one Ray per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_users_own_ray_init_is_used_and_survives_a_failed_pool():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("user_ray_init_driver.py"))],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["cpus_before"] == 3.0 and seen["cpus_after"] == 3.0  # the user's Ray, not resized
    assert seen["too_big"].startswith("ResourcePoolError") and "process_on_nodes=[8]" in seen["too_big"]
    assert seen["initialized_after_failure"] is True
    assert seen["failed_call"] == "WorkerError"
    assert seen["ranks"] == ["0", "1"]  # and the same Ray and group still run calls afterwards
    assert seen["initialized_at_end"] is True
