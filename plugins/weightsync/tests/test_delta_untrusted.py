"""A delta store from elsewhere: every manifest is checked before a payload is read or a
buffer allocated (issue 35, finding 8: on 82d5798 a payload named ``../dev/zero`` was
opened on a ``file://`` store and read without end, and a 49 KB payload's manifest made the
receiver allocate 1.5 GiB). Named cases, then hypothesis-mutated manifests: the receiver
raises DeltaError naming the manifest, never reads outside the version's folder, never
allocates more than ``max_bytes``, and the engine keeps its version."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_weightsync._delta.receiver import DeltaReceiver
from skyrl_weightsync._delta.sender import DeltaSender
from skyrl_weightsync._delta.store import DeltaError, manifest_problem

FUZZ_EXAMPLES = 150


class Engine:
    def __init__(self):
        self.weights, self.weight_version, self.updates = {}, 0, 0

    def update_weights(self, named, version):
        self.weights = {k: v.clone() for k, v in named}
        self.weight_version, self.updates = version, self.updates + 1


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.w": torch.randn(64, 32, generator=g), "a.b": torch.randn(32, generator=g),
            "big.w": torch.randn(512, 1200, generator=g)}  # 1.2 MB in bf16: an object of its own


@pytest.fixture
def store(tmp_path):
    """A store with versions 1 (keyframe) and 2 (delta), a receiver and engine at version 1."""
    uri = f"file://{tmp_path}/w"
    sender = DeltaSender(uri, keyframe_every=0)
    w = weights(0)
    sender.publish(1, w.items())
    receiver, engine = DeltaReceiver(uri, max_bytes=16 << 20), Engine()
    receiver.sync(engine)
    w["big.w"][0, :100] += 1.0
    sender.publish(2, w.items())
    manifest = pathlib.Path(f"{tmp_path}/w/e000/v00000002/manifest.json")
    return receiver, engine, manifest, json.loads(manifest.read_text())


def refused(receiver, engine, manifest, m, match: str) -> None:
    manifest.write_text(json.dumps(m))
    with pytest.raises(DeltaError, match=match) as info:
        receiver.sync(engine)
    assert str(manifest.parent.as_posix()).split("/w/")[1] in str(info.value)
    assert engine.weight_version == 1 and receiver.version == 1 and engine.updates == 1


def entry(m, name):
    return next(e for e in m["tensors"] if e["name"] == name)


def test_a_payload_name_outside_the_version_folder_is_never_opened(store, tmp_path) -> None:
    receiver, engine, manifest, m = store
    secret = tmp_path / "secret.zst"
    secret.write_bytes(b"not for the receiver")
    for name in ("../../secret.zst", "/etc/passwd", "../v00000001/t00002.zst", "t00002.zst/../../x.zst", "x"):
        bad = copy.deepcopy(m)
        part = next(e for e in bad["tensors"] if "payload" in e)
        part["payload"] = name
        refused(receiver, engine, manifest, bad, "not a payload's name")


def test_sizes_a_manifest_claims_must_match_shapes_and_stay_under_max_bytes(store) -> None:
    receiver, engine, manifest, m = store
    bad = copy.deepcopy(m)
    entry(bad, "big.w")["nbytes"] = 3 << 29  # 1.5 GiB claimed for a [512, 1200] bf16 tensor
    refused(receiver, engine, manifest, bad, "claims 1610612736 bytes, its shape and dtype make 1228800")
    bad = copy.deepcopy(m)
    e = entry(bad, "big.w")
    e["shape"], e["nbytes"] = [1 << 15, 1 << 15], 2 << 30  # consistent, but past max_bytes (16 MiB)
    refused(receiver, engine, manifest, bad, "more than the 16777216 bytes a version may have")
    bad = copy.deepcopy(m)
    e = entry(bad, "a.w")
    e.update(payload="t00000.zst", payload_bytes=10**9, payload_xxh3="0", encoding="xor")
    refused(receiver, engine, manifest, bad, "a payload of 1000000000 bytes for 4096")
    bad = copy.deepcopy(m)
    entry(bad, "a.b")["dtype"] = "load"  # torch.load is not a dtype
    refused(receiver, engine, manifest, bad, "has dtype 'load'")


def test_the_untouched_store_still_applies(store) -> None:
    receiver, engine, _, m = store
    assert manifest_problem(m, 16 << 20) is None
    receiver.sync(engine)
    assert engine.weight_version == 2


ODD = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=20),
                st.floats(allow_nan=True), st.lists(st.integers(min_value=-3, max_value=5000), max_size=4),
                st.just("../x.zst"), st.just({}))


def test_fuzzed_manifests_are_refused_or_applied_whole(store) -> None:
    """Each example replaces one field anywhere in version 2's manifest with an odd value
    (or drops it): the sync either applies the whole version (the field did not matter) or
    raises DeltaError, the engine then keeping version 1."""
    receiver, engine, manifest, m = store
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append(path + (k,))
                walk(v, path + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                paths.append(path + (i,))
                walk(v, path + (i,))

    walk(m, ())
    seen = {"examples": 0, "refused": 0, "applied": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(path=st.sampled_from(paths), value=ODD, drop=st.booleans())
    def one(path, value, drop) -> None:
        bad = copy.deepcopy(m)
        parent = bad
        for p in path[:-1]:
            parent = parent[p]
        if drop and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        manifest.write_text(json.dumps(bad))
        receiver.version, receiver.epoch = 1, 0  # as after version 1 (a sync that applied 2 moved it)
        version_before, bufs = engine.weight_version, {k: v.clone() for k, v in engine.weights.items()}
        try:
            receiver.sync(engine, 2)
            seen["applied"] += 1
            assert engine.weight_version == 2
        except DeltaError:
            seen["refused"] += 1
            assert engine.weight_version == version_before
            assert all(torch.equal(engine.weights[k], bufs[k]) for k in bufs)
        seen["examples"] += 1
        engine.weight_version = 1
        receiver._bufs = {k: v.copy() for k, v in state["bufs"].items()}
        receiver._meta = dict(state["meta"])

    state = {"bufs": {k: v.copy() for k, v in receiver._bufs.items()}, "meta": dict(receiver._meta)}
    one()
    print(f"manifest fuzzing: {seen}")
    assert seen["examples"] >= FUZZ_EXAMPLES // 2 and seen["refused"] > seen["examples"] // 4, seen
