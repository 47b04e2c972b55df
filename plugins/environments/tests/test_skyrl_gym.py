"""skyrl_gym: SkyRL-Gym's own environments (the real skyrl-gym package), through the adapter."""

from __future__ import annotations

import json

import pytest
import skyrl_gym
from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

import skyrl_environments.skyrl_gym as adapter_module
from skyrl_datasets.jsonl import Jsonl, JsonlConfig
from skyrl_environments.skyrl_gym import SkyRLGym, SkyRLGymConfig
from skyrl_host.interfaces import Environment, Episode, EnvStep, Task
from skyrl_host.plugins import build_host

QUESTION = [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}]


def gsm8k_task(answer: str = "72") -> Task:
    return Task(prompt=QUESTION[0]["content"], answer=answer, messages=QUESTION)


def test_gsm8k_multi_turn_runs_and_scores_as_skyrl_gym_does():
    env = SkyRLGym(SkyRLGymConfig(env_id="gsm8k_multi_turn", extras={"max_turns": 3}))
    episode = env.episode(gsm8k_task(), seed=0)
    assert isinstance(env, Environment) and isinstance(episode, Episode)
    assert episode.reset() == QUESTION
    responses = ["48 + 24, so about 70. #### 70", "Let me recount: 48 + 24. #### 71", "#### 72"]
    steps = [episode.step(r) for r in responses]
    episode.close()
    assert all(isinstance(s, EnvStep) for s in steps)
    # the same environment driven directly, as SkyRL's generator does
    direct = skyrl_gym.make("gsm8k_multi_turn", env_config=None,
                            extras={"reward_spec": {"method": "rule", "ground_truth": "72"}, "extra_info": {},
                                    "max_turns": 3})
    assert isinstance(direct, GSM8kMultiTurnEnv)
    direct.init(QUESTION)
    for response, step in zip(responses, steps):
        out = direct.step(response)
        assert step.reward == float(out["reward"]) and step.done == out["done"]
        assert step.observation == (None if out["done"] else out["observations"])
    assert [s.reward for s in steps] == pytest.approx([0.2 / 3, 0.2 / 3, 1.0])
    assert [s.done for s in steps] == [False, False, True]
    assert steps[1].observation == [{"role": "user", "content": (
        "Now provide only the final numeric answer in the exact format: '#### ANSWER'.")}]
    assert steps[-1].metrics == {"steps": 3.0}


def test_a_correct_first_answer_ends_the_trajectory_and_a_wrong_one_runs_out_of_turns():
    env = SkyRLGym(SkyRLGymConfig(env_id="gsm8k_multi_turn", extras={"max_turns": 2}))
    right = env.episode(gsm8k_task(), seed=0)
    right.reset()
    step = right.step("48 + 24 = 72\n#### 72")
    assert step.done and step.reward == 1.0 and step.observation is None and step.metrics == {"steps": 1.0}
    wrong = env.episode(gsm8k_task(), seed=0)
    wrong.reset()
    assert [wrong.step("no idea").reward, wrong.step("still none").done] == [0.0, True]


def test_records_in_skyrl_format_through_the_jsonl_dataset(tmp_path):
    records = [
        {"prompt": QUESTION, "answer": "72", "env_class": "gsm8k_multi_turn",
         "reward_spec": {"method": "rule", "ground_truth": "72"}, "extra_info": {"max_turns": 2}},
        {"prompt": [{"role": "user", "content": "What is 6 * 7?"}], "answer": "42", "env_class": "gsm8k",
         "reward_spec": {"method": "rule", "ground_truth": "42"}, "extra_info": {}},
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = Jsonl(JsonlConfig(path=str(path), messages_key="prompt", prompt_key="question", shuffle=False))
    tasks = dataset.batch(1, 2)
    env = SkyRLGym(SkyRLGymConfig(env_id=""), dataset=dataset)  # each record's env_class
    multi, single = (env.episode(t, seed=0) for t in tasks)
    assert multi.reset() == QUESTION and single.reset() == records[1]["prompt"]
    first = multi.step("#### 70")
    assert not first.done and first.reward == pytest.approx(0.1)  # its extra_info's max_turns = 2
    assert multi.step("#### 72").reward == 1.0
    answer = single.step("6 * 7 = 42 #### 42")
    assert answer.done and answer.reward == 1.0  # the single-turn gsm8k env: done after one step


def test_rows_of_skyrls_gsm8k_parquet_run_in_their_env_class(tmp_path):
    """SkyRL's examples/gsm8k/gsm8k_dataset.py rows, written by `datasets` as that script
    does, through the `files` dataset: each row runs in its env_class, SkyRL-Gym scoring
    it from reward_spec, and the dataset's own reward (by data_source) agrees."""
    import datasets

    from skyrl_datasets.files import Files, FilesConfig

    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{q} Let's think step by step and output the final answer after \"####\"."}],
             "env_class": env, "reward_spec": {"method": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": i, "max_turns": 2}}
            for i, (q, a, env) in enumerate([("What is 6 * 7?", "42", "gsm8k"),
                                             ("What is 48 + 24?", "72", "gsm8k_multi_turn")])]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    dataset = Files(FilesConfig(path=str(tmp_path / "train.parquet"), shuffle=False))
    single_task, multi_task = dataset.batch(1, 2)
    env = SkyRLGym(SkyRLGymConfig(env_id=""), dataset=dataset)
    single, multi = env.episode(single_task, seed=0), env.episode(multi_task, seed=0)
    assert single.reset() == rows[0]["prompt"] and multi.reset() == rows[1]["prompt"]
    answer = single.step("6 * 7 = 42 #### 42")
    assert answer.done and answer.reward == 1.0
    assert dataset.reward(single_task, "6 * 7 = 42 #### 42") == 1.0
    first = multi.step("#### 70")
    assert not first.done and first.reward == pytest.approx(0.1)  # max_turns = 2 from the row's extra_info
    assert multi.step("#### 72").reward == 1.0


def test_searchcode_python_tool_runs_in_the_sandbox(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("job data")
    task = Task(prompt="What is 6*7?", answer="42")
    env = SkyRLGym(SkyRLGymConfig(env_id="searchcode", extras={"max_turns": 4}))
    episode = env.episode(task, seed=0)
    assert episode.reset() == [{"role": "user", "content": "What is 6*7?"}]
    step = episode.step("<tool><python>print(6 * 7)</python></tool>")
    assert step.observation == [{"role": "user", "content": "42"}] and not step.done and step.reward == 0
    leak = episode.step(f"<tool><python>print(open({str(secret)!r}).read())</python></tool>")
    content = leak.observation[0]["content"]
    assert content.startswith("Error executing Python code: Traceback") and "FileNotFoundError" in content
    assert "job data" not in content
    final = episode.step("<solution>#### 42</solution>")
    assert final.done and final.reward == 1.0  # SkyRL-Gym's own rule on its chat history

    # as SkyRL-Gym ships it (sandbox_python = false), the same call reads the host's file
    plain = SkyRLGym(SkyRLGymConfig(env_id="searchcode", extras={"max_turns": 4}, sandbox_python=False))
    episode = plain.episode(task, seed=0)
    episode.reset()
    leak = episode.step(f"<tool><python>print(open({str(secret)!r}).read())</python></tool>")
    assert leak.observation == [{"role": "user", "content": "job data"}]


def test_the_sandboxed_tool_answers_in_skyrl_gyms_words():
    plain_cls, sandboxed_cls = adapter_module._sandboxed_group_class()
    plain, sandboxed = plain_cls(timeout=1.0), sandboxed_cls(timeout=1.0)
    assert sandboxed.name == plain.name == "PythonCodeExecutorToolGroup"
    assert sandboxed.get_tool_names() == plain.get_tool_names() == ["python"]
    for code in ("print('  hi  ')", "", "import sys; sys.stderr.write('warned\\n'); print(1)"):
        assert sandboxed.execute_tool("python", code) == plain.execute_tool("python", code)
    assert sandboxed.execute_tool("python", "while True: pass") == \
        "Error executing Python code: Execution timed out after 1.0 seconds."


def test_text_rendering_for_tokenizers_without_a_chat_template():
    env = SkyRLGym(SkyRLGymConfig(env_id="gsm8k_multi_turn", render="text", extras={"max_turns": 3}))
    episode = env.episode(Task(prompt="2+2?", answer="4"), seed=0)
    assert episode.reset() == "2+2?"
    assert episode.step("#### 5").observation.startswith("Please provide your step-by-step reasoning")


def test_unknown_env_id_is_a_user_error():
    with pytest.raises(ValueError, match="found 'gsm8k_multiturn' \\(did you mean 'gsm8k_multi_turn'\\?\\)"):
        SkyRLGymConfig(env_id="gsm8k_multiturn")
    env = SkyRLGym(SkyRLGymConfig(env_id=""))
    with pytest.raises(ValueError, match="no env_class field"):
        env.episode(Task(prompt="x", answer="1"), seed=0)


def test_the_hook_registers_skyrl_gym():
    host = build_host(entry_points=False)
    host.add_plugin(adapter_module, "skyrl_gym_under_test")
    reg = host.registry.get("environments", "skyrl_gym")
    assert reg.config is SkyRLGymConfig and reg.factory is SkyRLGym


@pytest.mark.slow
def test_an_rl_job_runs_gsm8k_multi_turn_on_a_real_shaped_checkpoint(skyrl_host, skyrl_plugin, skyrl_cli,
                                                                      skyrl_tiny_rl_job, skyrl_real_checkpoint,
                                                                      tmp_path):
    if "skyrl_gym" not in skyrl_host.registry.names("environments"):  # before its entry point is installed
        skyrl_plugin(adapter_module, "skyrl_gym")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": f"{q} Answer as '#### N'."}], "answer": a,
        "env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule", "ground_truth": a},
        "extra_info": {"max_turns": 3}}) + "\n" for q, a in [
            ("Natalia sold 48 clips in April and half as many in May. How many in all?", "72"),
            ("Julie read 12 pages yesterday and twice as many today. How many pages in all?", "36")]))
    job = skyrl_tiny_rl_job(
        tmp_path, "gsm8k", job={"steps": 2, "batch_size": 2, "n_samples": 2, "max_new_tokens": 8, "max_turns": 3,
                                "max_total_tokens": 512, "step_timeout": 60.0},
        model={"family": "qwen", "path": skyrl_real_checkpoint("qwen3"), "preset": None},
        dataset={"name": "jsonl", "path": data, "messages_key": "prompt", "prompt_key": "question",
                 "shuffle": False, "min_len": None, "max_len": None, "prefix": None},
        environment={"name": "skyrl_gym", "env_id": "gsm8k_multi_turn"},
        backend={"micro_batch_tokens": 512})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    rows = job.rows()
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["env_failures"] == 0.0
        # random weights never write '#### 72': every game runs its 3 turns, each scored 0 or the format score
        assert r["turns_mean"] == 3.0 and r["env/steps"] == 3.0
        assert 0.0 <= r["reward_mean"] <= 3 * 0.2 / 3 + 1e-9
        assert 0 < r["loss_tokens"] <= 2 * 2 * 3 * 8  # generated tokens only (observations masked)


def test_skyrl_validate_names_a_mistyped_env_id(skyrl_host, skyrl_plugin, skyrl_cli, tmp_path):
    if "skyrl_gym" not in skyrl_host.registry.names("environments"):  # before its entry point is installed
        skyrl_plugin(adapter_module, "skyrl_gym")
    job = tmp_path / "job.toml"
    job.write_text(
        '[job]\nkind = "rl"\nsteps = 1\n[model]\nfamily = "qwen"\npreset = "tiny"\n'
        '[dataset]\nname = "arithmetic"\n'
        '[environment]\nname = "skyrl_gym"\nenv_id = "gsm8k_multiturn"\nextras = { max_turns = 2 }\n')
    result = skyrl_cli("validate", str(job))
    assert result.exit_code == 2
    assert "environment.env_id: expected a registered SkyRL-Gym environment id, found 'gsm8k_multiturn' " \
           "(did you mean 'gsm8k_multi_turn'?)" in result.stderr
    assert "Traceback" not in result.stderr
    job.write_text(job.read_text().replace("gsm8k_multiturn", "gsm8k_multi_turn"))
    assert skyrl_cli("validate", str(job)).exit_code == 0
