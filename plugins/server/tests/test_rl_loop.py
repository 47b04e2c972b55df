"""examples/tinker_rl_loop.py's step against an in-process ``skyrl serve``: after each
update the responses that scored above their group's mean are likelier and the ones below
it less likely (the importance_sampling loss with the sampler's logprobs moves the adapter
the right way)."""

from __future__ import annotations

import importlib.util
import pathlib
import statistics

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("torch")

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "tinker_rl_loop.py"
BASE = "skyrl/qwen-tiny-digits"
KEY = "tml-rl-loop-test"


def _example():
    spec = importlib.util.spec_from_file_location("tinker_rl_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from skyrl_server.testing import serving

    folder = tmp_path_factory.mktemp("serve")
    with serving(folder, f"""
[server]
api_keys = ["{KEY}"]
storage = "{folder / 'storage'}"
max_lora_rank = 16
poll_seconds = 5

[models."{BASE}"]
family = "qwen"
preset = "tiny"
alphabet = "0123456789:"
""") as served:
        client = tinker.ServiceClient(base_url=served.url, api_key=KEY)
        yield client
        client.close("completed")


def _score(data, dataset, codec, outputs=None):
    """Per datum: the summed logprob of its response tokens (the sampler's without
    ``outputs``, the training forward's with them) and whether its reward, scored again
    here from its tokens, is above (+1), at (0) or below (-1) its prompt's group mean."""
    from skyrl_host.interfaces import Task

    rows, groups = [], {}
    for i, d in enumerate(data):
        full = d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
        cut = full.index(codec.ids[":"]) + 1
        digits, completion = codec.decode(full[: cut - 1]), codec.decode(full[cut:])
        reward = dataset.reward(Task(prompt=digits + ":", answer=digits[::-1]), completion)
        groups.setdefault(digits, []).append(reward)
        lp = (outputs[i]["logprobs"] if outputs is not None else d.loss_fn_inputs["logprobs"]).to_numpy()
        rows.append((float(lp[cut - 1:].sum()), digits, reward))
    means = {k: statistics.fmean(v) for k, v in groups.items()}
    return [(lp, (r > means[k] + 1e-9) - (r < means[k] - 1e-9)) for lp, k, r in rows]


def test_each_step_raises_the_rewarded_responses_and_lowers_the_others(service) -> None:
    ex = _example()
    from skyrl_datasets.reverse_digits import ReverseDigits, ReverseDigitsConfig

    cfg = ex.LoopConfig(prompts=6, group=8, rank=16, learning_rate=1e-2)
    dataset = ReverseDigits(ReverseDigitsConfig(prefix=""), seed=cfg.seed)
    codec = ex.CharCodec(ex.ALPHABET)
    assert codec.decode(codec.encode("4071:") + [ex.EOS, 5]) == "4071:"
    training = service.create_lora_training_client(base_model=BASE, rank=cfg.rank, seed=cfg.seed).result()
    rises, falls = [], []
    for step in (1, 2, 3):
        metrics, data = ex.rl_step(training, dataset, codec, step, cfg)
        assert metrics["data"] == len(data) > 0 and 0.0 <= metrics["reward_mean"] <= 1.0
        after = training.forward(data, "importance_sampling").result().loss_fn_outputs
        for (lp0, side), (lp1, _) in zip(_score(data, dataset, codec), _score(data, dataset, codec, after)):
            if side:  # a response scored exactly at its group's mean has no gradient
                (rises if side > 0 else falls).append(lp1 - lp0)
    # Per response, in nats: a step at lr 1e-2 moves the logprobs by ~0.3 (measured 0.3-0.6);
    # the wrong sign of the loss or of the advantages, or samples from stale weights, fail here.
    # (rises: responses that scored above their group's mean, by the reward recomputed here)
    assert statistics.fmean(rises) > 0.1, statistics.fmean(rises)
    assert statistics.fmean(falls) < -0.1, statistics.fmean(falls)
    assert sum(r > 0 for r in rises) > 0.8 * len(rises)


def test_the_loops_advantages_give_the_quickstarts_grpo_gradient(service) -> None:
    """The loop's per-token advantages under the server's importance_sampling loss (summed
    over tokens and data) have the gradient of the quickstart's loss: the grpo plugin's
    group-normalised advantages under its seq-mean-token-mean aggregation over every
    sampled sequence; with entropy_coef, each token's advantage differs from that by
    -coef * (its sampling logprob - the batch's mean) over the same normaliser."""
    import types as pytypes

    import numpy as np
    import torch
    from skyrl_host.interfaces import LossInputs, Task
    from skyrl_host.plugins import build_host
    from skyrl_datasets.reverse_digits import ReverseDigits, ReverseDigitsConfig
    from skyrl_server._losses import loss_terms

    ex = _example()
    codec = ex.CharCodec(ex.ALPHABET)
    reg = build_host().get("algorithms", "grpo")
    grpo = reg.create(reg.config())  # the quickstart's [algorithm] (grpo, its defaults)
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    for coef in (0.0, 0.1):
        cfg = ex.LoopConfig(prompts=6, group=8, rank=8, learning_rate=0.0, entropy_coef=coef)
        dataset = ReverseDigits(ReverseDigitsConfig(prefix=""), seed=cfg.seed)
        metrics, data = ex.rl_step(training, dataset, codec, 1, cfg)
        n_seqs = cfg.prompts * cfg.group
        assert (len(data) == n_seqs) if coef else (len(data) == 8 * metrics["groups_with_signal"] > 0)
        keys, rewards, sampled, seq_ids = [], [], [], []
        for i, d in enumerate(data):
            full = d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
            cut = full.index(codec.ids[":"]) + 1
            digits = codec.decode(full[: cut - 1])
            keys.append(digits)
            rewards.append(dataset.reward(Task(prompt=digits + ":", answer=digits[::-1]), codec.decode(full[cut:])))
            lp = d.loss_fn_inputs["logprobs"].to_numpy()[cut - 1:]
            sampled.append(lp)
            seq_ids += [i] * len(lp)
        groups = {k: g for g, k in enumerate(dict.fromkeys(keys))}
        batch = pytypes.SimpleNamespace(group_ids=np.asarray([groups[k] for k in keys]))
        seq_adv = np.asarray(grpo.sequence_advantages(batch, np.asarray(rewards, dtype=np.float32)))
        old = torch.as_tensor(np.concatenate(sampled), dtype=torch.float32)
        ids = torch.as_tensor(seq_ids)
        lp = old.clone().requires_grad_(True)
        loss, _ = grpo.loss(LossInputs(
            logprobs=lp, old_logprobs=old, engine_logprobs=old, advantages=torch.as_tensor(seq_adv)[ids].float(),
            mask=torch.ones_like(old), seq_ids=ids, n_seqs=len(data), global_tokens=float(len(old)),
            global_seqs=float(n_seqs)))
        (expected,) = torch.autograd.grad(loss, lp)
        mean_lp = float(old.mean()) if coef else 0.0  # every sampled token is in the data when coef > 0
        lengths = torch.bincount(ids).float()[ids]
        expected = expected + coef * (old - mean_lp) / (lengths * n_seqs)
        got = []
        for d, lp_d in zip(data, sampled):
            inputs = {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}
            start = len(inputs["logprobs"]) - len(lp_d)
            x = torch.as_tensor(inputs["logprobs"], dtype=torch.float32).requires_grad_(True)
            _, total = loss_terms("importance_sampling", x, inputs, {}, "cpu")
            (g,) = torch.autograd.grad(total, x)
            assert not g[:start].any()  # the prompt's targets do not train
            got.append(g[start:])
        got = torch.cat(got)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-7), (got - expected).abs().max()
        assert expected.abs().max() > 1e-4
