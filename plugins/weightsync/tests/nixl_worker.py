"""One process of the nixl tests (run by test_nixl.py; they talk through files in DIR).

    python nixl_worker.py trainer RANK DIR      a torch-backend rank under FSDP2 (2 ranks, gloo):
                                               serves its own shards (backend.local_weights())
    python nixl_worker.py full DIR             an embedded engine (bf16) reading whole tensors
    python nixl_worker.py tp DIR               a tensor-parallel engine rank, shard (1, 2)
    python nixl_worker.py spinner DIR          publishes new versions back to back (plain tensors)

The trainers publish version 1, then 2 (weights moved), then 3, rank 0 pausing half way
through its copy until the full receiver has tried to read; each writes what the engine
must get (the gathered state) next to its endpoint. The receivers check what they get
against that, bit for bit, and write DIR/<role>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch


def model(seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=96, vocab_size=40, tie_word_embeddings=True)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def placed() -> dict:
    """Tensors for the placements FSDP2 does not make here: a column shard, a replicated
    vector, uneven row shards (5 rows over 2 ranks: 3 + 2)."""
    g = torch.Generator().manual_seed(7)
    return {"col": torch.randn(6, 10, generator=g), "rep": torch.randn(5, generator=g),
            "uneven": torch.randn(5, 3, generator=g)}


def wait(d: str, *names: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(d, n)) for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {names}")
        time.sleep(0.02)


def touch(d: str, name: str, data: bytes = b"") -> None:
    with open(os.path.join(d, name + ".tmp"), "wb") as f:
        f.write(data)
    os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name))


# -- a trainer rank -------------------------------------------------------------------


def trainer(rank: int, d: str) -> None:
    import torch.distributed as dist

    from skyrl_backends.torch import TorchBackendConfig, create
    from skyrl_host.interfaces import LoadedModel
    from skyrl_weightsync.nixl import Nixl, NixlConfig

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    backend = create(TorchBackendConfig(data_parallel="fsdp2"))
    backend.start(LoadedModel(model=model(0), tokenizer=None, stop_token_ids=[1]), seed=0, total_steps=4,
                  reference=False)
    sender = Nixl(NixlConfig()).sender(rank=rank, world=2)

    def expected(version: int) -> None:
        full = dict(backend.named_weights())  # a collective: the gathered state, on rank 0, to check against
        if rank == 0:
            torch.save({k: v.to(torch.bfloat16) for k, v in full.items()}, os.path.join(d, f"v{version}.tmp"))
            os.replace(os.path.join(d, f"v{version}.tmp"), os.path.join(d, f"v{version}.pt"))

    def move_weights(step: float) -> None:
        with torch.no_grad():
            for i, p in enumerate(backend.module.parameters()):
                p.to_local().add_(step * (i + 1))

    local = list(backend.local_weights())
    kinds = sorted({type(v).__name__ for _, v in local})
    stats = sender.publish(1, local)
    touch(d, f"ep{rank}", sender.endpoint())

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = placed()
    extra = Nixl(NixlConfig(dtype="float32")).sender(rank=rank, world=2)
    extra.publish(1, [("col", distribute_tensor(full["col"], mesh, [Shard(1)])),
                      ("rep", distribute_tensor(full["rep"], mesh, [Replicate()])),
                      ("uneven", distribute_tensor(full["uneven"], mesh, [Shard(0)]))])
    touch(d, f"xep{rank}", extra.endpoint())
    expected(1)
    touch(d, f"kinds{rank}", json.dumps({"kinds": kinds, "served": stats["sync_served_bytes"]}).encode())

    wait(d, "full_done1", "tp_done1")
    move_weights(0.01)
    sender.publish(2, backend.local_weights())
    expected(2)
    touch(d, f"pub2.{rank}")

    wait(d, "full_done2")
    move_weights(0.02)
    items = list(backend.local_weights())
    if rank == 0:
        def paused():  # a slow publish: half the tensors, then a stall until the receiver has tried
            for i, item in enumerate(items):
                if i == len(items) // 2:
                    touch(d, "pausing3")
                    wait(d, "race_seen")
                yield item

        sender.publish(3, paused())
    else:
        sender.publish(3, items)
    touch(d, f"pub3.{rank}")
    expected(3)
    wait(d, "stop", timeout=300)  # rank 1 is killed before this
    sender.close()
    os._exit(0)


def spinner(d: str) -> None:
    """Publishes version after version, as fast as it can with a pause of a few
    milliseconds; version v is every element equal to v."""
    from skyrl_weightsync.nixl import Nixl, NixlConfig

    sender = Nixl(NixlConfig(dtype="float32")).sender()
    tensors = [(f"t{i}", torch.zeros(1 << 20)) for i in range(4)]
    version = 1
    for _, t in tensors:
        t.fill_(version)
    sender.publish(version, tensors)
    touch(d, "spin_ep", sender.endpoint())
    while not os.path.exists(os.path.join(d, "spin_stop")):
        time.sleep(0.005)
        version += 1
        for _, t in tensors:
            t.fill_(version)
        sender.publish(version, tensors)
    touch(d, "spin_last", str(version).encode())
    sender.close()
    os._exit(0)


# -- receivers --------------------------------------------------------------------------


def check_engine(engine, version: int, d: str) -> bool:
    want = torch.load(os.path.join(d, f"v{version}.pt"))
    got = dict(engine.model.state_dict())
    return engine.weight_version == version and all(torch.equal(got[k], want[k]) for k in want)


def attempt(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return None


def full(d: str) -> dict:
    from skyrl_engines.embedded import Embedded, EmbeddedConfig
    from skyrl_host.interfaces import LoadedModel
    from skyrl_weightsync.nixl import Nixl, NixlConfig

    engine = Embedded(EmbeddedConfig(dtype="bfloat16"))
    engine.start(LoadedModel(model=model(1), tokenizer=None, stop_token_ids=[1]))
    # shard (0, 1): whole tensors; a dead peer is reported at once here (UCX sees the
    # connection close), the timeout bounds it where it is not
    receiver = Nixl(NixlConfig(timeout_s=10)).receiver()
    wait(d, "ep0", "ep1", "v1.pt")
    eps = [open(os.path.join(d, f"ep{r}"), "rb").read() for r in (0, 1)]
    receiver.connect(eps)
    out: dict = {"agents": [receiver._peers[r].agent for r in (0, 1)]}
    out["v1"] = receiver.sync(engine, target=1)
    out["v1_equal"] = check_engine(engine, 1, d)
    out["mismatch"] = attempt(lambda: receiver.sync(engine, target=2))
    out["after_mismatch_v1"] = check_engine(engine, 1, d)
    touch(d, "full_done1")

    wait(d, "pub2.0", "pub2.1", "v2.pt")
    out["v2"] = receiver.sync(engine, target=2)
    out["v2_equal"] = check_engine(engine, 2, d)
    touch(d, "full_done2")

    wait(d, "pausing3", "pub3.1")
    out["race"] = attempt(lambda: receiver.sync(engine, target=3))
    out["after_race_v2"] = check_engine(engine, 2, d)
    touch(d, "race_seen")
    wait(d, "pub3.0", "v3.pt")
    out["v3"] = receiver.sync(engine, target=3)
    out["v3_equal"] = check_engine(engine, 3, d)
    touch(d, "full_done3")

    wait(d, "killed")  # the test has killed trainer rank 1
    t0 = time.monotonic()
    out["dead"] = attempt(lambda: receiver.sync(engine, target=3))
    out["dead_s"] = time.monotonic() - t0
    out["after_dead_v3"] = check_engine(engine, 3, d)
    return out


def tp(d: str) -> dict:
    from skyrl_weightsync.nixl import Nixl, NixlConfig

    class Recording:
        """Keeps a copy of what it is handed (a tensor-parallel engine rank's slices)."""

        weight_version = 0

        def update_weights(self, named, version):
            self.weights = {k: v.clone() for k, v in named}
            self.weight_version = version

    engine = Recording()
    receiver = Nixl(NixlConfig()).receiver(shard=(1, 2))
    wait(d, "ep0", "ep1", "v1.pt")
    receiver.connect([open(os.path.join(d, f"ep{r}"), "rb").read() for r in (0, 1)])
    stats = receiver.sync(engine, target=1)
    want = torch.load(os.path.join(d, "v1.pt"))
    slices = {k: torch.tensor_split(v, 2)[1] if v.dim() >= 2 else v for k, v in want.items()}
    out = {
        "v1": stats, "version": engine.weight_version, "names_equal": sorted(engine.weights) == sorted(slices),
        "slices_equal": all(torch.equal(engine.weights[k], slices[k]) for k in slices),
        # lm_head is tied to the embedding: one tensor, read once
        "slice_bytes": sum(t.numel() * 2 for k, t in slices.items() if k != "lm_head.weight"),
        "full_bytes": sum(t.numel() * 2 for k, t in want.items() if k != "lm_head.weight"),
    }
    # Column shards, a replicated vector, uneven rows: whole, and a row slice of each.
    wait(d, "xep0", "xep1")
    eps = [open(os.path.join(d, f"xep{r}"), "rb").read() for r in (0, 1)]
    full = placed()
    for shard in ((0, 1), (1, 2)):
        engine = Recording()
        receiver = Nixl(NixlConfig()).receiver(shard=shard)
        receiver.connect(eps)
        stats = receiver.sync(engine, target=1)
        want = {k: torch.tensor_split(v, shard[1])[shard[0]] if v.dim() >= 2 else v for k, v in full.items()}
        out[f"placed{shard[1]}"] = {
            "equal": all(torch.equal(engine.weights[k], want[k]) for k in want) and len(engine.weights) == len(want),
            "bytes": stats["sync_bytes"], "want_bytes": sum(t.numel() * 4 for t in want.values()),
            "transfers": stats["sync_transfers"]}
        receiver.close()
    touch(d, "tp_done1")
    return out


def main() -> None:
    torch.set_num_threads(1)
    role = sys.argv[1]
    if role == "trainer":
        trainer(int(sys.argv[2]), sys.argv[3])
        return
    if role == "spinner":
        spinner(sys.argv[2])
        return
    d = sys.argv[2]
    try:
        out = {"full": full, "tp": tp}[role](d)
    except Exception:  # noqa: BLE001 - reported to the test
        out = {"error": traceback.format_exc()}
    touch(d, f"{role}.json", json.dumps(out).encode())
    os._exit(0)


if __name__ == "__main__":
    main()
