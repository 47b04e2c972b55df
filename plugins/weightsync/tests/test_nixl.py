"""nixl across processes on CPU (DRAM over UCX): two torch-backend ranks under FSDP2 (gloo)
each serve their own shards, and engine processes read them; plus the one-process path
in a real RL job, and the user errors.

The cross-process scenario runs once for the module (nixl_worker.py has the script of
each process): versions 1, 2, 3 into an embedded engine, bit for bit; a tensor-parallel
engine rank reading only its row slices; a wrong version, a publish racing the read and
a killed trainer rank, each refused with the engine left on its last version."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import nixl_cu12  # noqa: F401 - NIXL comes with the test extra (skyrl-weightsync[test]): missing, the tests fail

WORKER = os.path.join(os.path.dirname(__file__), "nixl_worker.py")


def _wait_for(d: pathlib.Path, name: str, procs: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (d / name).exists():
        for role, p in procs.items():
            if p.poll() is not None and role != "trainer1" and not (d / f"{role}.json").exists():
                log = (d / f"{role}.log").read_text()[-3000:]
                raise AssertionError(f"{role} exited ({p.returncode}) early:\n{log}")
        for role in ("full", "tp"):
            f = d / f"{role}.json"
            if f.exists() and "error" in json.loads(f.read_text()):
                raise AssertionError(f"{role} failed:\n{json.loads(f.read_text())['error']}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {r}\n" + (d / f"{r}.log").read_text()[-1500:] for r in procs)
            raise AssertionError(f"waited {timeout:g} s for {name}\n{logs}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("nixl")
    cmds = {"trainer0": ["trainer", "0"], "trainer1": ["trainer", "1"], "full": ["full"], "tp": ["tp"]}
    procs = {}
    try:
        for role, args in cmds.items():
            with open(d / f"{role}.log", "w") as log:
                procs[role] = subprocess.Popen([sys.executable, WORKER, *args, str(d)], stdout=log,
                                               stderr=subprocess.STDOUT)
        _wait_for(d, "full_done3", procs, timeout=180)
        procs["trainer1"].send_signal(signal.SIGKILL)  # a trainer rank dies
        procs["trainer1"].wait(timeout=30)
        (d / "killed").touch()
        _wait_for(d, "full.json", procs, timeout=120)
        _wait_for(d, "tp.json", procs, timeout=60)
        (d / "stop").touch()
        procs["trainer0"].wait(timeout=60)
        out = {role: json.loads((d / f"{role}.json").read_text()) for role in ("full", "tp")}
        for r in (0, 1):
            out[f"trainer{r}"] = json.loads((d / f"kinds{r}").read_text())
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_every_version_reaches_the_engine_bit_for_bit_from_both_ranks(scenario) -> None:
    full, t0, t1 = scenario["full"], scenario["trainer0"], scenario["trainer1"]
    assert full["v1_equal"] and full["v2_equal"] and full["v3_equal"]
    # Each trainer rank served its own FSDP2 shards (DTensors), about half of the bytes each,
    # and the engine read exactly the model's bytes (bf16, the tied head once), nothing gathered.
    assert t0["kinds"] == t1["kinds"] == ["DTensor"]
    assert full["v1"]["sync_bytes"] == scenario["tp"]["full_bytes"] == t0["served"] + t1["served"]
    assert 0.3 < t0["served"] / (t0["served"] + t1["served"]) < 0.7
    assert [full[v]["sync_version"] for v in ("v1", "v2", "v3")] == [1, 2, 3]
    assert full["v1"]["sync_transfers"] == 2  # one batched READ per trainer rank, not one per tensor


def test_a_tensor_parallel_engine_rank_reads_only_its_slices(scenario) -> None:
    tp = scenario["tp"]
    assert tp["version"] == 1 and tp["names_equal"] and tp["slices_equal"]
    assert tp["v1"]["sync_bytes"] == tp["slice_bytes"] < tp["full_bytes"]


def test_column_shards_replicated_and_uneven_placements(scenario) -> None:
    """DTensors placed Shard(1), Replicate and Shard(0) over 5 rows, read whole and as a
    row slice: the right values, and each byte read once (the replicated one from one rank)."""
    for key in ("placed1", "placed2"):
        got = scenario["tp"][key]
        assert got["equal"], key
        assert got["bytes"] == got["want_bytes"], key
        assert got["transfers"] == 2, key  # both ranks hold a part: one batched READ each


def test_a_wrong_version_or_a_publish_racing_the_read_leaves_the_engine_alone(scenario) -> None:
    full = scenario["full"]
    rank0 = full["agents"][0]
    assert full["mismatch"] == (f"NixlError: version 2: peer {rank0} (trainer rank 0) serves version 1; "
                                "nothing was applied")
    assert full["after_mismatch_v1"]
    assert full["race"] == (f"NixlError: version 3: peer {rank0} (trainer rank 0) is publishing version 3 "
                            "(a publish racing the read); nothing was applied")
    assert full["after_race_v2"]


def test_a_dead_trainer_rank_is_named_and_the_engine_keeps_its_version(scenario) -> None:
    full = scenario["full"]
    assert full["dead"].startswith("NixlError: version 3: reading the version headers failed: "
                                   f"peer {full['agents'][1]} (trainer rank 1): ")
    assert full["dead"].endswith("; nothing was applied")
    assert full["dead_s"] < 30
    assert full["after_dead_v3"]


def test_a_publisher_racing_every_read_never_tears_a_version(tmp_path) -> None:
    """A trainer publishing back to back while the engine reads: each sync either applies
    one whole version or refuses; never a mix of two."""
    import torch

    from skyrl_weightsync._nixl.agent import NixlError
    from skyrl_weightsync._nixl.receiver import NixlReceiver

    with open(tmp_path / "spinner.log", "w") as log:
        proc = subprocess.Popen([sys.executable, WORKER, "spinner", str(tmp_path)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "spin_ep").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "spinner.log").read_text()
            time.sleep(0.02)

        class Checking:
            weight_version = 0
            applied: list[tuple[int, bool]] = []

            def update_weights(self, named, version):
                whole = all(bool((t == version).all()) for _, t in named)
                self.applied.append((version, whole))
                self.weight_version = version

        engine = Checking()
        receiver = NixlReceiver()
        receiver.connect([(tmp_path / "spin_ep").read_bytes()])
        refused = []
        for _ in range(60):
            try:
                receiver.sync(engine)
            except NixlError as exc:
                refused.append(str(exc))
            time.sleep(0.002)
        (tmp_path / "spin_stop").touch()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert engine.applied and all(whole for _, whole in engine.applied), engine.applied
    versions = [v for v, _ in engine.applied]
    assert versions == sorted(versions) and versions[-1] > 1  # it kept up with the publisher
    assert all("(a publish racing the read); nothing was applied" in r for r in refused), refused
    assert len(engine.applied) + len(refused) == 60


def test_byte_runs_of_any_box(tmp_path) -> None:
    """The receiver's box arithmetic: what it reads from a served shard (any dims) into its
    slice equals numpy slicing, for row, column and 3-D boxes."""
    import numpy as np

    from skyrl_weightsync._nixl.shards import box_runs as _runs, merge_runs as _merge

    rng = np.random.default_rng(0)
    full = rng.standard_normal((6, 10, 4)).astype(np.float32)
    cases = [  # (served box lo, shape), (needed box lo, shape)
        (((0, 0, 0), (3, 10, 4)), ((2, 0, 0), (3, 10, 4))),  # rows (Shard(0)) into a row slice
        (((0, 5, 0), (6, 5, 4)), ((3, 0, 0), (3, 10, 4))),  # Shard(1) into a row slice: one run per row
        (((1, 2, 1), (4, 7, 2)), ((0, 0, 0), (6, 10, 4))),  # an inner box into the whole tensor
    ]
    for (slo, sshape), (dlo, dshape) in cases:
        src = full[tuple(slice(a, a + n) for a, n in zip(slo, sshape))].copy().reshape(-1).view(np.uint8)
        dst = np.zeros(int(np.prod(dshape)) * 4, dtype=np.uint8)
        lo = [max(a, b) for a, b in zip(slo, dlo)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(slo, sshape, dlo, dshape)]
        for s, d, n in _merge(_runs(lo, hi, slo, sshape, dlo, dshape, 4)):
            dst[d : d + n] = src[s : s + n]
        got = dst.view(np.float32).reshape(dshape)
        box = tuple(slice(a - b, c - b) for a, b, c in zip(lo, dlo, hi))
        want = full[tuple(slice(a, c) for a, c in zip(lo, hi))]
        assert np.array_equal(got[box], want)
        untouched = np.ones(dshape, dtype=bool)
        untouched[box] = False
        assert not got[untouched].any()  # nothing outside the intersection was written


def test_a_receiver_reconnects_to_a_restarted_trainer() -> None:
    """Two agents in this process (UCX loopback): a restarted trainer (new agent, new
    buffers) is reached by calling connect again with its endpoint."""
    import torch

    from skyrl_weightsync._nixl.agent import NixlError
    from skyrl_weightsync._nixl.receiver import NixlReceiver
    from skyrl_weightsync._nixl.sender import NixlSender

    class Recording:
        weight_version = 0

        def update_weights(self, named, version):
            self.weights, self.weight_version = {k: v.clone() for k, v in named}, version

    w = {"a.weight": torch.randn(8, 4), "a.bias": torch.randn(8)}
    first = NixlSender(dtype="float32")
    first.publish(1, w.items())
    engine, receiver = Recording(), NixlReceiver()
    receiver.connect([first.endpoint()])
    receiver.sync(engine, target=1)
    first.close()
    again = NixlSender(dtype="float32")
    again.publish(2, [(k, v + 1) for k, v in w.items()])
    with pytest.raises(NixlError, match="version 2: peer skyrl-nixl-trainer0-.* serves version 1"):
        receiver.sync(engine, target=2)  # still connected to the first: its buffers say version 1
    receiver.connect([again.endpoint()])
    assert receiver.sync(engine, target=2)["sync_version"] == 2
    assert all(torch.equal(engine.weights[k], w[k] + 1) for k in w)
    receiver.close()
    again.close()


# -- one process: a real RL job ---------------------------------------------------------

def run_job(skyrl_cli, make_job, tmp_path: pathlib.Path, name: str, engine_dtype: str, weight_sync: dict) -> list[dict]:
    """Run the tiny RL job (``make_job``: the skyrl_tiny_rl_job fixture); its step rows."""
    job = make_job(tmp_path, name, engine={"dtype": engine_dtype}, weight_sync=weight_sync)
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    return job.rows()


def learning(rows: list[dict]) -> list[dict]:
    from skyrl_host.testing import learning_metrics  # every metric but timings and the transport's own

    return [learning_metrics(r) for r in rows]


def test_rl_job_in_one_process_learns_exactly_like_inproc(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    inproc = run_job(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "inproc", "auto", {"transport": "inproc"})
    nixl = run_job(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "nixl", "float32", {"transport": "nixl", "dtype": "float32"})
    assert [r["step"] for r in nixl] == [1, 2, 3]
    assert "reward_std" in learning(inproc)[0]
    assert learning(nixl) == learning(inproc)
    assert [r["sync_version"] for r in nixl] == [1, 2, 3]
    assert [r["weight_version"] for r in nixl] == [0, 1, 2]
    assert all(r["sync_bytes"] == r["sync_served_bytes"] > 0 for r in nixl)  # one rank serves all, read once


def test_nixl_refuses_bf16_into_the_trainers_own_tensors(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path = skyrl_tiny_rl_job(tmp_path, "o", engine={"dtype": "auto"}, weight_sync={"transport": "nixl"}).path
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert ("weight_sync: the nixl transport ships bfloat16 weights, but the engine serves the trainer's own float32 "
            "tensors (engine.dtype = 'auto')") in result.stderr


def test_nixl_not_installed_is_a_user_error(skyrl_cli, skyrl_tiny_rl_job, tmp_path, monkeypatch) -> None:
    for name in ("nixl", "nixl_cu12"):  # what Python does for a package that is not there
        monkeypatch.setitem(sys.modules, name, None)
    path = skyrl_tiny_rl_job(tmp_path, "o", engine={"dtype": "bfloat16"}, weight_sync={"transport": "nixl"}).path
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert ("weight_sync.transport: transport 'nixl' needs NIXL, which is not installed: "
            "pip install 'skyrl-weightsync[nixl]'") in result.stderr
