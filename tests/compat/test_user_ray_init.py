"""A verl driver calls ``ray.init(num_cpus=...)`` itself: rankmesh uses that Ray as it is
(no second Ray, no resizing) and leaves it usable after a call that fails.

Runs its own driver process (tests/compat/user_ray_init_driver.py, through tests/drivers.py): one
Ray per process.
"""

from __future__ import annotations

from tests.drivers import run_module


def test_users_own_ray_init_is_used_and_survives_a_failed_pool():
    seen = run_module("tests.compat.user_ray_init_driver", timeout=240)
    assert seen["cpus_before"] == 3.0 and seen["cpus_after"] == 3.0  # the user's Ray, not resized
    assert seen["too_big"].startswith("ResourcePoolError") and "process_on_nodes=[8]" in seen["too_big"]
    assert seen["initialized_after_failure"] is True
    assert seen["failed_call"] == "WorkerError"
    assert seen["ranks"] == ["0", "1"]  # and the same Ray and group still run calls afterwards
    assert seen["initialized_at_end"] is True
