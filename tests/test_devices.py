"""Device visibility unification (rankmesh.devices), on CPU: environments in, changes out.

Expected changes are verl 0.9.1's rules (``Worker._setup_env_cuda_visible_devices``) written
out by hand per case.
"""

from __future__ import annotations

import pytest

from rankmesh.devices import unify_visible_devices
from rankmesh.errors import RendezvousError


def test_nothing_set_changes_nothing():
    change = unify_visible_devices({})
    assert change.set == {} and change.unset == () and change.device_index is None


def test_hip_becomes_cuda():
    change = unify_visible_devices({"HIP_VISIBLE_DEVICES": "2,3"})
    assert change.set == {"CUDA_VISIBLE_DEVICES": "2,3"} and change.unset == ("HIP_VISIBLE_DEVICES",)


def test_hip_equal_to_cuda_is_dropped():
    change = unify_visible_devices({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"})
    assert change.set == {"CUDA_VISIBLE_DEVICES": "1"} and change.unset == ("HIP_VISIBLE_DEVICES",)


def test_hip_and_cuda_that_differ_are_an_error_naming_both():
    with pytest.raises(RendezvousError, match="HIP_VISIBLE_DEVICES='0'.*CUDA_VISIBLE_DEVICES='1'"):
        unify_visible_devices({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"})


def test_rocr_becomes_cuda():
    change = unify_visible_devices({"ROCR_VISIBLE_DEVICES": "4"})
    assert change.set == {"CUDA_VISIBLE_DEVICES": "4"} and change.unset == ("ROCR_VISIBLE_DEVICES",)


@pytest.mark.parametrize("other", ["HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"])
def test_rocr_with_hip_or_cuda_is_an_error(other):
    with pytest.raises(RendezvousError, match="ROCR_VISIBLE_DEVICES"):
        unify_visible_devices({"ROCR_VISIBLE_DEVICES": "0", other: "0"})


def test_empty_values_count_as_unset():
    assert unify_visible_devices({"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "1"}).set == {}


@pytest.mark.parametrize(
    "flag", ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES"]
)
def test_ray_noset_flag_takes_local_rank_from_the_assigned_accelerator(flag):
    change = unify_visible_devices({flag: "1", "LOCAL_RANK": "0"}, {"GPU": ["5"]})
    assert change.set == {"LOCAL_RANK": "5"} and change.device_index == 5


def test_ray_noset_flag_without_an_assigned_accelerator_is_an_error():
    with pytest.raises(RendezvousError, match="no GPU"):
        unify_visible_devices({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, {"GPU": []})


def test_without_the_flag_ray_ids_are_ignored():
    assert unify_visible_devices({}, {"GPU": ["3"]}).device_index is None


def test_npu_flag_sets_local_rank_but_selects_no_cuda_device():
    change = unify_visible_devices({"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}, {"NPU": ["2"]})
    assert change.set == {"LOCAL_RANK": "2"} and change.device_index is None
