"""Reward parts as a user meets them: a job's reward is the weighted sum of its parts
(the dataset's rule, a function, a reward model), each part's mean in the metrics, a
part that fails is an error naming it; a reward model trained here to prefer a property
scores responses in that order."""

from __future__ import annotations

import json

import pytest

from skyrl_host.errors import UserError
from skyrl_host.interfaces import Task
from skyrl_rewards.function_reward import FunctionReward, FunctionRewardConfig


def shortness(task, completion):
    """1 for an empty answer, falling with its length."""
    return 1.0 / (1.0 + len(completion.strip()))


def by_batch(tasks, completions):
    return [float(len(c)) for c in completions]


def not_a_number(task, completion):
    return float("nan")


def test_a_function_part_per_pair_and_batched() -> None:
    tasks = [Task(prompt="p")] * 3
    part = FunctionReward(FunctionRewardConfig(function=f"{__name__}:shortness", weight=0.5))
    assert part.weight == 0.5 and part.score(tasks, ["", "ab", " a "]) == [1.0, 1 / 3, 0.5]
    batched = FunctionReward(FunctionRewardConfig(function=f"{__name__}:by_batch", batched=True))
    assert batched.score(tasks, ["a", "bb", ""]) == [1.0, 2.0, 0.0]
    with pytest.raises(UserError, match="returned nan; expected a finite number"):
        FunctionReward(FunctionRewardConfig(function=f"{__name__}:not_a_number")).score(tasks[:1], ["x"])
    with pytest.raises(ValueError, match="cannot find module 'no_such_module'"):
        FunctionRewardConfig(function="no_such_module:f")


# -- a reward model, trained here --------------------------------------------------------


PROMPTS = ["Can you pass the salt?", "Open the window.", "Tell me a joke.", "Close the door.", "Help me move.",
           "Bring me water.", "Turn off the light.", "Sing a song."]


def train_reward_model(folder, tokenizer_folder):
    """A tiny Qwen3 sequence classifier that scores a polite answer (holding "please")
    above a curt one, trained from scratch on the chat-rendered pairs."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1,
                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    model = Qwen3ForSequenceClassification(config)
    polite = ["Sure, please wait a moment.", "Yes, please, here it is.", "Of course, please enjoy.", "Please, right away."]
    curt = ["No.", "Do it yourself.", "Whatever.", "Not now, go away."]

    def texts(prompts, answers):
        return [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": a}],
                                        tokenize=False) for p in prompts for a in answers]

    train_prompts = PROMPTS[:5]
    x = texts(train_prompts, polite) + texts(train_prompts, curt)
    y = torch.tensor([1.0] * (len(x) // 2) + [0.0] * (len(x) // 2))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(x, padding=True, return_tensors="pt")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        logits = model(**enc).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return float(loss.detach())


@pytest.fixture(scope="module")
def reward_model_folder(tmp_path_factory, skyrl_real_checkpoint):
    folder = tmp_path_factory.mktemp("rm") / "polite"
    loss = train_reward_model(folder, skyrl_real_checkpoint("qwen3"))
    assert loss < 0.1, loss
    return folder


def test_a_trained_reward_model_orders_responses_as_it_was_trained(reward_model_folder) -> None:
    from skyrl_rewards.reward_model import RewardModel, RewardModelConfig

    part = RewardModel(RewardModelConfig(path=str(reward_model_folder), batch_size=3))
    held_out = [Task(prompt=p, messages=({"role": "user", "content": p},)) for p in PROMPTS[5:]]
    polite, curt = "Please, here you go.", "Go away."
    scores = part.score(held_out * 2, [polite] * 3 + [curt] * 3)
    assert all(p > c for p, c in zip(scores[:3], scores[3:])), scores
    sig = RewardModel(RewardModelConfig(path=str(reward_model_folder), sigmoid=True)).score(held_out[:1], [polite])
    assert 0.5 < sig[0] < 1.0
    with pytest.raises(UserError, match="label 1: the model has 1 output"):
        RewardModel(RewardModelConfig(path=str(reward_model_folder), label=1))


def test_reward_model_options_are_checked_at_validate(tmp_path) -> None:
    from skyrl_rewards.reward_model import RewardModelConfig

    with pytest.raises(ValueError, match="expected a local folder holding a sequence-classification model"):
        RewardModelConfig(path=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="holds no config.json"):
        RewardModelConfig(path=str(tmp_path))


# -- jobs --------------------------------------------------------------------------------------


def _tiny(skyrl_tiny_rl_job, tmp_path, name, **sections):
    return skyrl_tiny_rl_job(tmp_path, name, job={"steps": 2}, **sections)


@pytest.mark.slow
def test_a_job_rewards_the_weighted_sum_of_its_parts(skyrl_cli, skyrl_tiny_rl_job, skyrl_real_checkpoint,
                                                    reward_model_folder, tmp_path) -> None:
    plain = _tiny(skyrl_tiny_rl_job, tmp_path, "plain")
    assert skyrl_cli("run", str(plain.path)).exit_code == 0
    default = _tiny(skyrl_tiny_rl_job, tmp_path, "default", reward={"parts": ["dataset"]})
    assert skyrl_cli("run", str(default.path)).exit_code == 0
    assert [r["reward_mean"] for r in default.rows()] == [r["reward_mean"] for r in plain.rows()]
    assert not any(k.startswith("reward/") for r in default.rows() for k in r)  # as jobs always reported

    job = _tiny(skyrl_tiny_rl_job, tmp_path, "mixed", reward={
        "parts": ["dataset", "function"], "dataset": {"weight": 1.0},
        "function": {"function": f"{__name__}:shortness", "weight": -0.5}})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    for r in job.rows():
        assert r["reward_mean"] == pytest.approx(r["reward/dataset_mean"] - 0.5 * r["reward/function_mean"], abs=1e-5)
        assert 0 < r["reward/function_mean"] <= 1.0
    recorded = json.loads((job.out / "job.json").read_text())
    assert [p["name"] for p in recorded["plugins"]["reward"]] == ["dataset", "function"]

    # A reward model beside the rule, on a real-shaped checkpoint sharing its tokenizer.
    rm = skyrl_tiny_rl_job(
        tmp_path, "rm", job={"steps": 1, "batch_size": 2, "n_samples": 2, "max_new_tokens": 6},
        model={"family": "qwen", "path": skyrl_real_checkpoint("qwen3"), "preset": None},
        dataset={"name": "chat_arithmetic", "tasks": ["add"], "max_value": 9, "min_len": None, "max_len": None,
                 "prefix": None},
        reward={"parts": ["dataset", "reward_model"], "reward_model": {"path": str(reward_model_folder), "weight": 0.1}},
        backend={"micro_batch_tokens": 512})
    result = skyrl_cli("run", str(rm.path))
    assert result.exit_code == 0, result.stderr
    (row,) = rm.rows()
    assert row["reward_mean"] == pytest.approx(row["reward/dataset_mean"] + 0.1 * row["reward/reward_model_mean"], abs=1e-5)

    failing = _tiny(skyrl_tiny_rl_job, tmp_path, "nan", reward={"parts": ["function"],
                                                                "function": {"function": f"{__name__}:not_a_number"}})
    result = skyrl_cli("run", str(failing.path))
    assert result.exit_code == 2 and "reward.function.function: " in result.stderr and "returned nan" in result.stderr


def test_parts_a_multi_turn_job_cannot_use_are_refused(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    job = _tiny(skyrl_tiny_rl_job, tmp_path, "mt", environment={"name": "guess_number"},
                reward={"parts": ["dataset", "function"], "function": {"function": f"{__name__}:shortness"}})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2
    assert "reward.parts: [reward] parts score single-turn responses; environment 'guess_number'" in result.stderr
    mistyped = skyrl_cli("validate", str(job.path), "--set", 'reward.parts=["datset"]', "--set", "environment=1")
    assert mistyped.exit_code == 2 and "unknown reward part 'datset' (did you mean 'dataset'?)" in mistyped.stderr
