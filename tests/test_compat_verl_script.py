"""A verl worker class defined in the script a user runs: pickled by value, it travels or is refused in one line.

A class in ``__main__`` cannot be imported by the workers, so cloudpickle sends it by value with
every global its methods read.  The common verl pattern (``self.config`` and ``dist`` in one
method) once failed with ``cannot pickle 'ConfigModuleInstance' object`` after the processes had
started; it now runs.  What really cannot travel is refused before any process starts, in one
line that names the part and the fixes.
"""

from __future__ import annotations

import sys
import types

import pytest
from ray import cloudpickle

import rankmesh.compat.verl as verl
from rankmesh import RankMesh
from rankmesh.errors import WorkerPickleError
from tests.verl_workers import LockedConfig, VerlStyleActor, script_actor_keeping_its_config, script_actor_reading_a_lock


def test_a_script_worker_keeping_self_config_and_reading_dist_runs(host_bank):
    cls = script_actor_keeping_its_config()
    # what made it fail: cloudpickle takes torch.distributed.config along, and refuses its type
    assert type(sys.modules["torch.distributed.config"]) is not types.ModuleType
    with pytest.raises(TypeError, match="ConfigModuleInstance"):
        cloudpickle.dumps(cls)
    group = host_bank.build(verl.RayClassWithInitArgs(cls, config=types.SimpleNamespace(lr=0.5)), RankMesh(dp=1))
    try:
        assert group.learning_rate() == [0.5]
    finally:
        host_bank.give_back(group)


def test_a_script_worker_reading_an_unpicklable_global_is_refused_in_one_line_before_any_process(ray_session):
    pool = verl.RayResourcePool([1], use_gpu=False)
    with pytest.raises(WorkerPickleError) as info:
        verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(script_actor_reading_a_lock()))
    message = str(info.value)
    assert "\n" not in message
    for words in (
        "LockingActor.step -> global SCRIPT_LOCK",  # the part that fails, from the class down
        "cannot pickle '_thread.lock' object",  # pickle's own words
        "LockingActor is defined in __main__, so it is pickled by value",  # why it travels at all
        "move LockingActor into a module the workers can import",  # fix one
        "stop reading SCRIPT_LOCK from the class",  # fix two
    ):
        assert words in message
    assert "not placed" in repr(pool)  # refused before anything was placed


def test_a_constructor_argument_that_cannot_be_pickled_is_named_with_its_attribute():
    with pytest.raises(WorkerPickleError) as info:
        verl.RayClassWithInitArgs(VerlStyleActor, scale=LockedConfig()).roles
    message = str(info.value)
    assert "\n" not in message
    assert "constructor arguments of VerlStyleActor" in message
    assert "argument scale.lock (a lock: TypeError: cannot pickle '_thread.lock' object)" in message
    assert "build the rest in VerlStyleActor.__init__" in message
