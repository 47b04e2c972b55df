"""delta: byte-exact versions over fsspec URLs, unchanged tensors for free, keyframes and
catch-up, and the faults: a publisher killed between payloads and manifest, a corrupted
payload byte, a missing version, a wrong delta, two receivers at once, a late joiner.
The engine never applies a partial or wrong version, and errors name version and file."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import torch

from skyrl_weightsync._delta.codec import checksum as _checksum
from skyrl_weightsync._delta.receiver import DeltaReceiver
from skyrl_weightsync._delta.sender import DeltaSender
from skyrl_weightsync._delta.store import DeltaError


class Engine:
    """Records what update_weights hands it (an engine that keeps its own copy)."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}
        self.weight_version = 0
        self.updates = 0

    def update_weights(self, named, version):
        self.weights = {k: v.clone() for k, v in named}
        self.weight_version = version
        self.updates += 1


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.w": torch.randn(256, 128, generator=g),
        "layers.0.b": torch.randn(128, generator=g),
        "layers.1.w": torch.randn(128, 96, generator=g),
        "steps": torch.tensor([3], dtype=torch.int64),
    }


def perturb(w: dict[str, torch.Tensor], fraction: float, seed: int, names=("layers.0.w",)) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in names:
        flat = w[name].view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, int(fraction * flat.numel())),), generator=g)
        flat[idx] += 0.05 * flat[idx].abs() + 0.01


def same(engine: Engine, w: dict[str, torch.Tensor], dtype=torch.bfloat16) -> bool:
    return set(engine.weights) == set(w) and all(
        torch.equal(engine.weights[k], v.to(dtype) if v.is_floating_point() else v) for k, v in w.items()
    )


@pytest.fixture(params=["file", "memory"])
def uri(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path}/weights"
        return
    import fsspec

    path = f"/delta-{os.getpid()}-{uuid.uuid4().hex}"
    yield f"memory://{path}"
    fs = fsspec.filesystem("memory")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_versions_arrive_byte_exact_and_unchanged_tensors_cost_nothing(uri) -> None:
    w = weights()
    sender, receiver, engine = DeltaSender(uri, keyframe_every=0), DeltaReceiver(uri), Engine()
    first = sender.publish(1, w.items())
    receiver.sync(engine)
    assert first["sync_keyframe"] == 1 and engine.weight_version == 1 and same(engine, w)
    full = first["sync_full_bytes"]
    assert full == sum(v.numel() * (2 if v.is_floating_point() else 8) for v in w.values())  # bf16 on the wire
    perturb(w, 0.01, seed=1)  # 1% of one tensor's elements
    second = sender.publish(2, w.items())
    receiver.sync(engine)
    assert second["sync_keyframe"] == 0 and engine.weight_version == 2 and same(engine, w)
    manifest = json.loads(sender.store.read("e000/v00000002/manifest.json"))
    enc = {t["name"]: t["encoding"] for t in manifest["tensors"]}
    assert enc == {"layers.0.w": "sparse_xor", "layers.0.b": "unchanged", "layers.1.w": "unchanged", "steps": "unchanged"}
    assert [t["name"] for t in manifest["tensors"] if "payload" in t] == ["layers.0.w"]  # one payload file
    assert second["sync_bytes"] < 0.02 * full
    # Dense changes take the dense XOR.
    w["layers.1.w"] += 1.0
    sender.publish(3, w.items())
    receiver.sync(engine)
    assert same(engine, w)
    enc = {t["name"]: t["encoding"] for t in json.loads(sender.store.read("e000/v00000003/manifest.json"))["tensors"]}
    assert enc["layers.1.w"] == "xor" and enc["layers.0.w"] == "unchanged"
    # Nothing new: nothing to do.
    assert receiver.sync(engine) == {"sync_applied": 0.0, "sync_fetch_s": pytest.approx(0.0, abs=1.0)}
    assert engine.updates == 3


def test_float32_on_the_wire(uri) -> None:
    w = weights()
    sender, receiver, engine = DeltaSender(uri, dtype="float32"), DeltaReceiver(uri), Engine()
    sender.publish(1, w.items())
    perturb(w, 0.003, seed=2)
    sender.publish(2, w.items())
    receiver.sync(engine)
    assert same(engine, w, dtype=torch.float32)


def test_late_and_lagging_receivers_catch_up_through_keyframes(uri) -> None:
    w = weights()
    sender = DeltaSender(uri, keyframe_every=3)
    lagging, engine_lag = DeltaReceiver(uri), Engine()
    for v in range(1, 9):
        if v > 1:
            perturb(w, 0.01, seed=v)
        stats = sender.publish(v, w.items())
        assert stats["sync_keyframe"] == float(v in (1, 4, 7))
        if v == 2:
            lagging.sync(engine_lag)
    # Lagging receiver at version 2: applies 7 (a keyframe) then 8; a new one does the same.
    lagging.sync(engine_lag)
    late, engine_late = DeltaReceiver(uri), Engine()
    late.sync(engine_late)
    for e in (engine_lag, engine_late):
        assert e.weight_version == 8 and same(e, w)
    # A receiver at version 5 applies 6, 7, 8 (or from the keyframe): same bytes.
    mid, engine_mid = DeltaReceiver(uri), Engine()
    mid.sync(engine_mid, target=5)
    mid.sync(engine_mid)
    assert same(engine_mid, w)


def test_corrupted_payload_byte_changes_nothing_and_names_the_file(tmp_path) -> None:
    uri = f"file://{tmp_path}/w"
    w = weights()
    sender, receiver, engine = DeltaSender(uri, keyframe_every=0), DeltaReceiver(uri), Engine()
    sender.publish(1, w.items())
    receiver.sync(engine)
    before = {k: v.clone() for k, v in engine.weights.items()}
    perturb(w, 0.01, seed=3)
    sender.publish(2, w.items())
    payload = glob.glob(f"{tmp_path}/w/e000/v00000002/*.zst")[0]
    data = bytearray(open(payload, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(payload, "wb").write(bytes(data))
    # The one changed tensor's payload is small: it went in the version's pack object.
    with pytest.raises(DeltaError, match=rf"version 2: payload file://{tmp_path}/w/e000/v00000002/pack0000\.zst "
                                         rf"bytes 0-{len(data)} \(tensor 'layers\.0\.w'\) fails its checksum"):
        receiver.sync(engine)
    assert engine.weight_version == 1 and receiver.version == 1 and engine.updates == 1
    assert all(torch.equal(engine.weights[k], before[k]) for k in before)


def test_small_payloads_share_pack_objects_and_each_is_checked_on_its_own(tmp_path, monkeypatch) -> None:
    """Payloads under PACK_BELOW go end to end into pack objects of about PACK_BYTES (one
    write and one read each); larger ones keep an object of their own. A flipped byte in
    the second payload of a pack names that tensor and its byte range; a version written
    without packs (formats 1 and 2) still applies; a pack cut short fails its checksum."""
    from skyrl_weightsync._delta import sender as sender_module
    from skyrl_weightsync._delta import store

    uri = f"file://{tmp_path}/w"
    w = weights()
    monkeypatch.setattr(sender_module, "PACK_BELOW", 20_000)  # layers.0.w's keyframe (~60 kB) goes alone
    monkeypatch.setattr(store, "PACK_BYTES", 1)  # a pack per payload: they still share nothing
    sender, receiver, engine = DeltaSender(uri, keyframe_every=0), DeltaReceiver(uri), Engine()
    sender.publish(1, w.items())
    v1 = sorted(os.listdir(f"{tmp_path}/w/e000/v00000001"))
    assert v1 == ["manifest.json", "pack0000.zst", "pack0001.zst", "pack0002.zst", "t00000.zst"]
    receiver.sync(engine)
    assert same(engine, w)
    monkeypatch.setattr(store, "PACK_BYTES", 8 << 20)
    for name in ("layers.0.w", "layers.0.b", "layers.1.w"):
        w[name] += 0.5  # every float tensor changes
    sender.publish(2, w.items())
    files = sorted(os.listdir(f"{tmp_path}/w/e000/v00000002"))
    manifest = json.loads((tmp_path / "w/e000/v00000002/manifest.json").read_text())
    assert manifest["format"] == 3
    packed = [e for e in manifest["tensors"] if e.get("payload") == "pack0000.zst"]
    assert [e["name"] for e in packed] == ["layers.0.b", "layers.1.w"] and "t00000.zst" in files
    assert [e["payload_offset"] for e in packed] == [0, packed[0]["payload_bytes"]]
    second = packed[1]
    path = tmp_path / "w/e000/v00000002/pack0000.zst"
    good = path.read_bytes()
    assert len(good) == sum(e["payload_bytes"] for e in packed)
    bad = bytearray(good)
    bad[second["payload_offset"] + 3] ^= 0x01
    path.write_bytes(bytes(bad))
    a, b = second["payload_offset"], second["payload_offset"] + second["payload_bytes"]
    with pytest.raises(DeltaError, match=rf"version 2: payload {uri}/e000/v00000002/pack0000\.zst bytes {a}-{b} "
                                         r"\(tensor 'layers\.1\.w'\) fails its checksum"):
        receiver.sync(engine)
    path.write_bytes(good[:-1])  # cut short: the last payload's slice is one byte short
    with pytest.raises(DeltaError, match=r"pack0000\.zst bytes .* \(tensor 'layers\.1\.w'\) fails its checksum"):
        receiver.sync(engine)
    assert engine.weight_version == 1 and receiver.version == 1
    path.write_bytes(good)
    receiver.sync(engine)
    assert engine.weight_version == 2 and same(engine, w)
    # Without packs (every payload an object of its own, as formats 1 and 2 wrote): the same bytes.
    monkeypatch.setattr(sender_module, "PACK_BELOW", 0)
    w["layers.0.b"] -= 0.25
    sender.publish(3, w.items())
    manifest = json.loads((tmp_path / "w/e000/v00000003/manifest.json").read_text())
    assert all("payload_offset" not in e for e in manifest["tensors"])
    assert sorted(os.listdir(f"{tmp_path}/w/e000/v00000003")) == ["manifest.json", "t00001.zst"]
    receiver.sync(engine)
    assert engine.weight_version == 3 and same(engine, w)


def test_a_wrong_delta_is_undone(tmp_path) -> None:
    """A payload with a valid checksum that does not give the published bytes (a bug or
    a forged file): the applied part is rolled back, the engine is untouched, and the
    receiver then applies a correct version exactly."""
    uri = f"file://{tmp_path}/w"
    w = weights()
    sender, receiver, engine = DeltaSender(uri, keyframe_every=0), DeltaReceiver(uri), Engine()
    sender.publish(1, w.items())
    receiver.sync(engine)
    perturb(w, 0.01, seed=4, names=("layers.0.w", "layers.1.w"))
    sender.publish(2, w.items())
    manifest_path = f"{tmp_path}/w/e000/v00000002/manifest.json"
    manifest = json.loads(open(manifest_path).read())
    manifest["tensors"][2]["result_xxh3"] = "0" * 16  # layers.1.w: applied after layers.0.w
    open(manifest_path, "w").write(json.dumps(manifest))
    with pytest.raises(DeltaError, match=r"version 2: tensor 'layers\.1\.w' from .*e000/v00000002/pack0000\.zst does not give the published bytes"):
        receiver.sync(engine)
    assert receiver.version == 1 and engine.weight_version == 1
    # Buffers were restored: a fresh, correct version 3 (a delta on 2) cannot apply, a keyframe can.
    sender.keyframe_every = 1
    sender.publish(3, w.items())
    receiver.sync(engine)
    assert engine.weight_version == 3 and same(engine, w)


def test_missing_version_names_it(tmp_path) -> None:
    uri = f"file://{tmp_path}/w"
    w = weights()
    sender, receiver, engine = DeltaSender(uri, keyframe_every=0), DeltaReceiver(uri), Engine()
    sender.publish(1, w.items())
    receiver.sync(engine)
    for v in (2, 3):
        perturb(w, 0.01, seed=v)
        sender.publish(v, w.items())
    os.remove(f"{tmp_path}/w/e000/v00000002/manifest.json")
    with pytest.raises(DeltaError, match=rf"version 2: manifest file://{tmp_path}/w/e000/v00000002/manifest\.json is missing"):
        receiver.sync(engine)
    assert engine.weight_version == 1 and receiver.version == 1


KILLED_PUBLISHER = r"""
import os, sys, signal, torch
sys.path.insert(0, {tests!r})
from test_delta import weights, perturb
from skyrl_weightsync._delta.sender import DeltaSender
sender = DeltaSender({uri!r}, keyframe_every=0)
w = weights()
sender.publish(1, w.items())
perturb(w, 0.01, seed=7)
write = sender.store.write
def write_then_die(rel, data):
    if rel.endswith("manifest.json") and "v00000002" in rel:
        os.kill(os.getpid(), signal.SIGKILL)  # killed between the payloads and the manifest
    write(rel, data)
sender.store.write = write_then_die
sender.publish(2, w.items())
"""


def test_publisher_killed_between_payloads_and_manifest(tmp_path) -> None:
    uri = f"file://{tmp_path}/w"
    script = KILLED_PUBLISHER.format(tests=os.path.dirname(__file__), uri=uri)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert glob.glob(f"{tmp_path}/w/e000/v00000002/*.zst") and not os.path.exists(f"{tmp_path}/w/e000/v00000002/manifest.json")
    receiver, engine = DeltaReceiver(uri), Engine()
    receiver.sync(engine)
    assert engine.weight_version == 1 and same(engine, weights())  # the torn version 2 is invisible
    # A restarted publisher has no previous bytes: its next version is a keyframe.
    w = weights()
    perturb(w, 0.01, seed=7)
    stats = DeltaSender(uri, keyframe_every=0).publish(2, w.items())
    assert stats["sync_keyframe"] == 1 and stats["sync_epoch"] == 1  # a new publisher opens the next epoch
    receiver.sync(engine)
    assert engine.weight_version == 2 and same(engine, w)


def test_a_resumed_run_republishes_older_versions_in_a_new_epoch(uri) -> None:
    """A run resumed from its step-2 checkpoint publishes version 2 again after version 4
    was out: a new epoch, so receivers (at 4) move to it instead of refusing or mixing."""
    w = weights()
    first = DeltaSender(uri, keyframe_every=0)
    receiver, engine = DeltaReceiver(uri), Engine()
    for v in range(1, 5):
        perturb(w, 0.01, seed=20 + v)
        first.publish(v, w.items())
    receiver.sync(engine)
    assert (receiver.epoch, receiver.version) == (0, 4)
    resumed = DeltaSender(uri, keyframe_every=0)
    w2 = weights(seed=5)
    resumed.publish(2, w2.items())
    perturb(w2, 0.01, seed=30)
    resumed.publish(3, w2.items())
    receiver.sync(engine)
    assert (receiver.epoch, receiver.version) == (1, 3) and engine.weight_version == 3 and same(engine, w2)


def test_two_receivers_pull_at_once(uri) -> None:
    w = weights()
    sender = DeltaSender(uri, keyframe_every=0)
    sender.publish(1, w.items())
    for v in range(2, 5):
        perturb(w, 0.02, seed=v)
        sender.publish(v, w.items())
    pairs = [(DeltaReceiver(uri), Engine()) for _ in range(2)]
    errors: list[BaseException] = []

    def pull(r, e):
        try:
            r.sync(e)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=p) for p in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for _, e in pairs:
        assert e.weight_version == 4 and same(e, w)


def test_prefetch_while_generating_then_apply(uri) -> None:
    w = weights()
    sender, receiver, engine = DeltaSender(uri), DeltaReceiver(uri), Engine()
    sender.publish(1, w.items())
    receiver.sync(engine)
    perturb(w, 0.01, seed=9)
    sender.publish(2, w.items())
    receiver.prefetch()
    assert engine.weight_version == 1  # nothing applied until the safe point
    receiver.apply(engine)
    assert engine.weight_version == 2 and same(engine, w)


def test_publisher_refuses_old_versions_and_changed_tensor_sets(uri) -> None:
    w = weights()
    sender = DeltaSender(uri, keyframe_every=0)
    sender.publish(3, w.items())
    with pytest.raises(ValueError, match="version 3 is not newer than the published version 3"):
        sender.publish(3, w.items())
    with pytest.raises(ValueError, match="tensor 'layers.1.w' of version 3 is missing from version 4"):
        sender.publish(4, [(k, v) for k, v in w.items() if k != "layers.1.w"])


def test_engine_failure_leaves_receiver_on_its_version(uri) -> None:
    class Refusing(Engine):
        def update_weights(self, named, version):
            raise ValueError("update_weights: unknown weight name 'x'; nothing was changed")

    w = weights()
    sender, receiver, engine = DeltaSender(uri, keyframe_every=0), DeltaReceiver(uri), Engine()
    sender.publish(1, w.items())
    receiver.sync(engine)
    snapshot = {k: v.copy() for k, v in receiver._bufs.items()}
    perturb(w, 0.01, seed=11)
    sender.publish(2, w.items())
    with pytest.raises(ValueError, match="unknown weight name"):
        receiver.sync(Refusing())
    assert receiver.version == 1
    assert all(np.array_equal(receiver._bufs[k], snapshot[k]) for k in snapshot)
    receiver.sync(engine)
    assert same(engine, w)


def test_checksum_is_xxhash() -> None:
    import xxhash

    assert _checksum(b"abc") == xxhash.xxh3_64_hexdigest(b"abc")


def test_a_sample_skips_the_sparse_scan_only_where_it_could_not_win(monkeypatch, uri) -> None:
    """``surely_dense`` looks at 2048 words spread over a tensor before ``scan`` compares
    them all: an optimizer step's dense change skips the scan, while changes that line
    up with rows or columns (one column of a 64-wide matrix, every 8th row) or a random
    15% still get the full scan and the sparse payload, byte-exact either way."""
    from skyrl_weightsync._delta import codec
    from skyrl_weightsync._delta import sender as sender_mod

    g = torch.Generator().manual_seed(0)
    base = torch.randn(512, 64, generator=g)

    def raw(t: torch.Tensor) -> np.ndarray:
        return t.contiguous().view(-1).view(torch.uint8).numpy()

    dense = base + 1e-3 * torch.randn(512, 64, generator=g)
    column = base.clone()
    column[:, 5] += 1.0
    rows = base.clone()
    rows[::8] += 1.0
    spots = base.clone().view(-1)
    pick = torch.randperm(spots.numel(), generator=g)[: int(0.15 * spots.numel())]
    spots[pick] += 1.0
    assert codec.surely_dense(raw(dense), raw(base))
    for sparse in (column, rows, spots.view(512, 64)):
        assert not codec.surely_dense(raw(sparse), raw(base))

    scans = []
    real_scan = sender_mod.scan
    monkeypatch.setattr(sender_mod, "scan", lambda *a: scans.append(1) or real_scan(*a))
    w = {"w": base.clone()}
    sender, receiver, engine = DeltaSender(uri, dtype="float32", keyframe_every=0), DeltaReceiver(uri), Engine()
    sender.publish(1, w.items())
    receiver.sync(engine)
    # Each version against the one before: the dense step, then a column, then every 8th row.
    steps = [(dense, "xor", 0), (dense + (column - base), "sparse_xor", 1),
             (dense + (column - base) + (rows - base), "sparse_xor", 1)]
    for version, (changed, encoding, scanned) in enumerate(steps, start=2):
        w["w"] = changed.clone()
        scans.clear()
        sender.publish(version, w.items())
        receiver.sync(engine)
        manifest = json.loads(sender.store.read(f"e000/v{version:08d}/manifest.json"))
        assert manifest["tensors"][0]["encoding"] == encoding and len(scans) == scanned
        assert torch.equal(engine.weights["w"], changed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_publishing_in_the_background_sends_the_weights_of_the_call(uri, dtype) -> None:
    """publish_in_background takes its snapshot before it returns: the trainer may change
    the tensors at once (the next optimizer step) and the version is still the weights
    as they were at the call, byte for byte; versions are written in the order called,
    and a failed write is the future's error (the next version is whole again)."""
    w = weights()
    sender, receiver, engine = DeltaSender(uri, dtype=dtype, keyframe_every=0), DeltaReceiver(uri), Engine()
    wire = getattr(torch, dtype)
    expected = []
    futures = []
    for version in range(1, 4):
        futures.append(sender.publish_in_background(version, w.items()))
        expected.append({k: v.clone() for k, v in w.items()})
        perturb(w, 0.5, seed=version, names=("layers.0.w", "layers.1.w"))  # at once, while it encodes
        for t in w.values():
            if t.is_floating_point():
                t.mul_(1.001)
    stats = [f.result(timeout=60) for f in futures]
    assert [s["sync_version"] for s in stats] == [1.0, 2.0, 3.0] and all(s["sync_snapshot_s"] >= 0 for s in stats)
    for version, want in enumerate(expected, start=1):
        receiver.sync(engine, version)
        assert same(engine, want, dtype=wire), version

    # A version older than the last: refused by publish, raised by the future.
    with pytest.raises(ValueError, match="not newer"):
        sender.publish_in_background(2, w.items()).result(timeout=60)
    sender.publish_in_background(4, w.items()).result(timeout=60)
    receiver.sync(engine, 4)
    assert same(engine, w, dtype=wire)
