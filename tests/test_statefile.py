"""State files (``skyrl_host.statefile``): what a checkpoint's random, backend and rollout
state become on disk. They round-trip every value a state holds, and nothing in one runs
code: a checkpoint folder from elsewhere with a planted pickle or a crafted state file is
refused with one message, and nothing of the attacker's runs."""

from __future__ import annotations

import json
import math
import pathlib
import random
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from skyrl_host.checkpoints import load_backend_state, read_state
from skyrl_host.errors import UserError
from skyrl_host.rollout import CSR, RolloutBatch
from skyrl_host.statefile import MAX_DEPTH, load_state, save_state

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def a_batch() -> RolloutBatch:
    batch = RolloutBatch.from_sequences(
        prompts=[[1, 2, 3], [1, 2, 3]], responses=[[4, 5], [6]], response_logprobs=[[-0.5, -1.0], [-0.25]],
        group_ids=[0, 0], versions=[3, 3], truncated=[False, True])
    batch.side_channels["routed_experts"] = np.arange(batch.n_tokens * 4, dtype=np.uint8).reshape(-1, 2, 2)
    batch.side_channels["sample_support"] = CSR.from_rows([[4, 9], [5], [6, 7, 8]])
    return batch


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, RolloutBatch):
        x, y = a.to_arrays(), b.to_arrays()
        return set(x) == set(y) and all(same(x[k], y[k]) for k in x)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def test_every_value_a_state_holds_comes_back_equal(tmp_path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    weight = model.weight.detach()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),  # int keys, tuples (betas), None, bools, step tensors
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "bf16": torch.randn(5).bfloat16(),
        "views": [weight, weight[1:]],  # share memory: stored as two tensors
        "empty": torch.zeros(0, 3),
        "floats": [1.5, float("inf"), float("-inf"), float("nan"), -0.0],
        "ints": [0, -1, 2**62, 10**30],
        "keys": {1: "one", (2, "b"): "tuple", None: "none", 1.5: "float", True: "bool"},
        "numpy": {"u32": np.arange(5, dtype=np.uint32), "scalar": np.float32(2.5), "i64": np.int64(-3)},
        "bytes": b"\x00\xffabc",
        "rollouts": {5: a_batch(), 6: a_batch()},
    }
    save_state(state, tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.safetensors")
    assert same(state, back)
    # What it restores is usable: the optimizer, the random states.
    opt2 = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    assert isinstance(back["rollouts"][5].side_channels["sample_support"], CSR)


@pytest.mark.parametrize("value, where", [
    ({"a": [1, object()]}, "state['a'][1]: a value of type builtins.object cannot be stored"),
    ({"f": lambda: 0}, "state['f']: a value of type builtins.function cannot be stored"),
    ({"a": np.array([object()])}, "state['a']: a numpy array of Python objects cannot be stored"),
    ({frozenset(): 1}, "state: a dict key of type frozenset cannot be stored"),
])
def test_values_it_cannot_hold_are_refused_at_save_naming_where(tmp_path, value, where) -> None:
    with pytest.raises(TypeError) as info:
        save_state(value, tmp_path / "s.safetensors")
    assert str(info.value).startswith(where)
    assert not (tmp_path / "s.safetensors").exists()


def crafted(path: pathlib.Path, tree, tensors=None, fmt="skyrl-state/1") -> pathlib.Path:
    from safetensors.torch import save_file

    save_file(tensors or {"0": torch.zeros(2)}, str(path), metadata={"format": fmt, "tree": json.dumps(tree)})
    return path


@pytest.mark.parametrize("tree, message", [
    ({"o": "os:system", "a": "touch /tmp/x"}, "a node the format does not have"),
    ({"T": "7"}, "the tree names an entry the file does not hold ('7')"),
    ({"d": [[{"x": 1}, 2]]}, "a dict key the format does not have"),
    ({"s": "O", "v": 1}, "numpy object scalars are not stored"),
    ({"s": "not-a-dtype", "v": 1}, "unknown numpy dtype"),
    ({"R": {"tokens": "0"}}, ""),  # a rollout batch missing its arrays
    ({"f": "1e400"}, "a node the format does not have"),
])
def test_crafted_state_files_are_refused_naming_the_file(tmp_path, tree, message) -> None:
    path = crafted(tmp_path / "s.safetensors", tree)
    with pytest.raises(ValueError) as info:
        load_state(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)


def test_deep_nesting_other_formats_and_garbage_are_refused(tmp_path) -> None:
    deep: object = 1
    for _ in range(MAX_DEPTH + 5):
        deep = {"l": [deep]}
    with pytest.raises(ValueError, match="nests deeper than"):
        load_state(crafted(tmp_path / "deep.safetensors", deep))
    very_deep = "[" * 100_000 + "]" * 100_000  # Python's JSON parser recurses: no traceback, a message
    from safetensors.torch import save_file

    save_file({"0": torch.zeros(1)}, str(tmp_path / "json.safetensors"), metadata={"format": "skyrl-state/1",
                                                                                    "tree": very_deep})
    with pytest.raises(ValueError, match="not JSON"):
        load_state(tmp_path / "json.safetensors")
    with pytest.raises(ValueError, match="format 'other'"):
        load_state(crafted(tmp_path / "other.safetensors", 1, fmt="other"))
    (tmp_path / "garbage.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")  # a header size it lies about
    with pytest.raises(ValueError, match="is not a state file"):
        load_state(tmp_path / "garbage.safetensors")
    with pytest.raises(FileNotFoundError):
        load_state(tmp_path / "missing.safetensors")


class Evil:
    """Pickled, it asks to run ``touch <marker>`` when loaded."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, (["touch", str(self.marker)],))


def test_a_planted_pickle_in_an_old_style_checkpoint_never_runs(tmp_path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"model": {}, "x": Evil(marker)}, tmp_path / "backend.pt")  # what 82d5798 loaded with pickle
    torch.save({"torch_rng": Evil(marker)}, tmp_path / "rng.pt")

    class Backend:
        def load_state_dict(self, state):
            raise AssertionError("never reached")

    with pytest.raises(UserError) as info:
        load_backend_state(tmp_path, Backend())
    assert info.value.render().startswith(f"error: --resume: cannot read {tmp_path / 'backend.pt'} (a checkpoint of "
                                          "an older skyrl-host, read with torch's weights-only loader")
    with pytest.raises(UserError):
        read_state(tmp_path, "rng")
    assert not marker.exists()
    # An old checkpoint of plain tensors and values still resumes.
    torch.save({"model": {"w": torch.ones(2)}, "steps": 3}, tmp_path / "backend.pt")
    assert read_state(tmp_path, "backend")["steps"] == 3


def test_resume_from_a_checkpoint_with_a_planted_backend_state_exits_2_and_runs_nothing(tmp_path,
                                                                                       skyrl_tiny_rl_job) -> None:
    """The whole path a user takes: ``skyrl run --resume`` on a checkpoint folder someone
    else handed over, its backend state replaced by a pickle that writes a file."""
    job = skyrl_tiny_rl_job(tmp_path, "planted", job={"steps": 2, "checkpoint_every": 2})
    first = subprocess.run([SKYRL, "run", str(job.path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    (ckpt,) = (job.out / "checkpoints").iterdir()
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix in (".safetensors", ".pt")) == [
        "backend.safetensors", "rng.safetensors"]
    marker = tmp_path / "pwned"
    (ckpt / "backend.safetensors").unlink()
    torch.save({"model": Evil(marker)}, ckpt / "backend.pt")
    resumed = subprocess.run([SKYRL, "run", str(job.path), "--resume", "--set", "job.steps=4"], capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
    assert resumed.returncode == 2, resumed.stderr
    assert "Traceback" not in resumed.stderr and "weights-only loader" in resumed.stderr
    assert not marker.exists()


def test_a_planted_distributed_checkpoint_metadata_is_refused_before_torch_reads_it(tmp_path) -> None:
    """A sharded backend's checkpoint (megatron-core's distributed checkpoint) keeps
    torch.distributed.checkpoint's ``.metadata``, which torch reads with plain pickle:
    resume checks it names only what such metadata holds, and refuses it otherwise before
    the backend is asked to load anything."""
    import torch.distributed.checkpoint as dcp

    shards = tmp_path / "backend"
    dcp.save({"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, checkpoint_id=str(shards),
             no_dist=True)

    class Sharded:
        def __init__(self):
            self.loaded = []

        def save_checkpoint(self, folder):
            raise AssertionError("not called")

        def load_checkpoint(self, folder):
            self.loaded.append(folder)

        def state_dict(self):
            raise AssertionError("not called")

        def load_state_dict(self, state):
            raise AssertionError("not called")

    ok = Sharded()
    load_backend_state(tmp_path, ok)  # the real metadata passes
    assert ok.loaded == [str(shards)]
    marker = tmp_path / "pwned"
    (shards / ".metadata").write_bytes(__import__("pickle").dumps(Evil(marker)))
    planted = Sharded()
    with pytest.raises(UserError) as info:
        load_backend_state(tmp_path, planted)
    assert info.value.render() == (f"error: --resume: {shards / '.metadata'} is not a distributed checkpoint's "
                                   "metadata: it names subprocess.call")
    assert not marker.exists() and planted.loaded == []
