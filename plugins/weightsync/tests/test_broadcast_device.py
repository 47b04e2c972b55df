"""The broadcast transport's halves keep their buckets where they are told."""

from __future__ import annotations

import torch

from skyrl_weightsync.broadcast import Broadcast, BroadcastConfig


def test_sender_buckets_default_to_the_weights_device_and_follow_device() -> None:
    transport = Broadcast(BroadcastConfig(bucket_mb=1))
    assert transport.sender().device is None
    assert transport.sender(device="cpu").device == torch.device("cpu")


def test_receiver_takes_the_engines_device() -> None:
    transport = Broadcast(BroadcastConfig(bucket_mb=1))
    assert transport.receiver().device == torch.device("cpu")
    assert transport.receiver(device="cpu").device == torch.device("cpu")
