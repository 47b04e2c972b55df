"""The Ray launcher's GPU choices as pure functions: GPU bundles from the cluster's free
GPUs, one weight-group backend from every member's device, where the buckets live."""

from __future__ import annotations

import pytest

from skyrl_launchers._ray_actors import comm_device, gpu_bundles, group_backend


def test_gpu_bundles_count_the_free_gpus() -> None:
    assert gpu_bundles(2, {"CPU": 8, "GPU": 2}) == 1
    assert gpu_bundles(2, {"CPU": 8, "GPU": 1}) == 0  # total may be 2, but one is held by earlier actors
    assert gpu_bundles(1, {"CPU": 8}) == 0
    assert gpu_bundles(1, {"GPU": 0.5}) == 0
    assert gpu_bundles(0, {"GPU": 4}) == 0


def test_nccl_only_when_every_member_is_on_cuda() -> None:
    assert group_backend(["cuda:0", "cuda:0", "cuda:0"]) == "nccl"
    assert group_backend(["cuda:0", "cpu"]) == "gloo"
    assert group_backend(["cpu", "cuda:0"]) == "gloo"
    assert group_backend(["cpu", "cpu"]) == "gloo"
    assert group_backend([]) == "gloo"


def test_buckets_on_the_device_under_nccl_on_the_cpu_under_gloo() -> None:
    assert comm_device("cuda:0", "nccl") == "cuda:0"
    assert comm_device("cuda:0", "gloo") == "cpu"
    assert comm_device("cpu", "gloo") == "cpu"
