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
