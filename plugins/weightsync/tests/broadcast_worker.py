"""One rank of the broadcast test: rank 0 is the trainer (sender), rank 1 an engine
process (an embedded engine in bf16 with its own copy). test_broadcast.py runs ``run``
in two gloo processes (skyrl_host.testing.run_gloo_ranks)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers


def model(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=40, tie_word_embeddings=True)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def trainer_weights(version: int):
    m = model(0)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.add_(0.01 * version * (i + 1))
    return m


def run(rank: int, world: int, mode: str) -> dict:
    """This rank's part; mode "ok" (versions 1 and 2) or "die" (then the trainer dies
    one bucket into version 3: rank 0 exits without returning)."""
    from skyrl_weightsync._broadcast import BroadcastReceiver, BroadcastSender

    bucket = 4096 + 7  # small and odd: many buckets, tensors spanning them
    result: dict = {}
    if rank == 0:
        sender = BroadcastSender(bucket_bytes=bucket)
        for v in (1, 2):
            m = trainer_weights(v)
            stats = sender.publish(v, m.state_dict().items())
            result[f"v{v}"] = stats
        if mode == "die":
            m = trainer_weights(3)
            tensors = list(m.state_dict().items())
            header = {"version": 3, "layout": None, "total": sum(t.numel() * 2 for _, t in tensors)}
            dist.broadcast_object_list([header], src=0)
            dist.broadcast(torch.zeros(bucket, dtype=torch.uint8), src=0)  # one bucket, then the trainer dies
            os._exit(0)
    else:
        from skyrl_engines.embedded import Embedded, EmbeddedConfig
        from skyrl_host.interfaces import LoadedModel

        engine = Embedded(EmbeddedConfig(dtype="bfloat16"))
        engine.start(LoadedModel(model=model(1), tokenizer=None, stop_token_ids=[1]))
        receiver = BroadcastReceiver(bucket_bytes=bucket)
        for v in (1, 2):
            receiver.sync(engine)
            want = {k: t.to(torch.bfloat16) for k, t in trainer_weights(v).state_dict().items()}
            got = dict(engine.model.state_dict())
            result[f"v{v}"] = {"version": engine.weight_version,
                               "equal": all(torch.equal(got[k], want[k]) for k in want)}
        if mode == "die":
            try:
                receiver.sync(engine)
                result["die"] = "no error"
            except Exception as exc:  # noqa: BLE001
                want = {k: t.to(torch.bfloat16) for k, t in trainer_weights(2).state_dict().items()}
                got = dict(engine.model.state_dict())
                result["die"] = {"error": type(exc).__name__, "version": engine.weight_version,
                                 "still_v2": all(torch.equal(got[k], want[k]) for k in want)}
    return result
