"""python_tool: tool calls run in the real sandbox, the final answer is scored by a real dataset."""

from __future__ import annotations

import attrs
import pytest

import skyrl_environments.python_tool as python_tool
from skyrl_datasets.arithmetic import Arithmetic, ArithmeticConfig
from skyrl_host.errors import UserError
from skyrl_host.interfaces import Environment, Episode, EnvStep
from skyrl_host.plugins import build_host
from skyrl_environments.python_tool import PythonTool, PythonToolConfig


@pytest.fixture(scope="module")
def dataset():
    return Arithmetic(ArithmeticConfig(operations=["*"], min_digits=3, max_digits=3), seed=5)


@pytest.fixture(scope="module")
def env(dataset):
    return PythonTool(PythonToolConfig(wall_seconds=2.0, output_chars=200, max_tool_calls=10), dataset=dataset, seed=1)


def test_a_tool_call_then_the_answer(env, dataset):
    task = dataset.batch(1, 1)[0]
    a, b = task.meta["a"], task.meta["b"]
    episode = env.episode(task, seed=0)
    assert isinstance(env, Environment) and isinstance(episode, Episode)
    assert episode.reset() == task.prompt  # a plain-text task: the prompt as it is
    step = episode.step(f"let me compute <python>print({a} * {b})</python>")
    assert isinstance(step, EnvStep) and not step.done and step.reward == 0.0
    assert step.observation == f"\n<output>\n{a * b}\n</output>\n"
    assert step.metrics["tool_errors"] == 0.0 and step.metrics["tool_timeouts"] == 0.0
    final = episode.step(str(a * b))
    assert final.done and final.observation is None
    assert final.reward == 1.0 == dataset.reward(task, task.answer)
    assert final.metrics["tool_calls"] == 1.0
    episode.close()


def test_a_wrong_final_answer_gets_the_datasets_partial_reward(env, dataset):
    task = dataset.batch(2, 1)[0]
    episode = env.episode(task, seed=0)
    episode.reset()
    final = episode.step("7")
    assert final.done and final.reward == dataset.reward(task, "7") < 1.0
    assert final.metrics["tool_calls"] == 0.0


def test_chat_tasks_get_instructions_and_messages(env, dataset):
    task = attrs.evolve(dataset.batch(3, 1)[0], messages=[{"role": "user", "content": "What is 6*7?"}])
    episode = env.episode(task, seed=0)
    first = episode.reset()
    assert first == [{"role": "system", "content": python_tool.DEFAULT_INSTRUCTIONS},
                     {"role": "user", "content": "What is 6*7?"}]
    assert task.messages == [{"role": "user", "content": "What is 6*7?"}]  # not changed in place
    step = episode.step("<python>print(6*7)</python>")
    assert step.observation == [{"role": "user", "content": "<output>\n42\n</output>"}]
    with_system = attrs.evolve(task, messages=[{"role": "system", "content": "Be brief."}, *task.messages])
    assert env.episode(with_system, seed=0).reset()[0] == {
        "role": "system", "content": "Be brief.\n\n" + python_tool.DEFAULT_INSTRUCTIONS}


def test_errors_timeouts_and_long_output_reach_the_model(env, dataset):
    episode = env.episode(dataset.batch(4, 1)[0], seed=0)
    episode.reset()
    error = episode.step("<python>1 / 0</python>")
    assert error.observation.startswith("\n<output>\nTraceback (most recent call last):\n")
    assert error.observation.endswith("ZeroDivisionError: division by zero\n[exit status 1]\n</output>\n")
    assert error.metrics["tool_errors"] == 1.0
    deep = episode.step("<python>\nimport json\njson.loads('{')\n</python>")  # a long traceback: its tail
    assert "json.decoder.JSONDecodeError: Expecting property name" in deep.observation
    assert deep.observation.endswith("[output cut]\n[exit status 1]\n</output>\n")
    hang = episode.step("<python>while True: pass</python>")
    assert hang.observation == "\n<output>\n[stopped: ran past its time limit of 2 s]\n</output>\n"
    assert hang.metrics["tool_timeouts"] == 1.0 and not hang.done
    long = episode.step("<python>print('z' * 5000)</python>")
    assert long.observation == "\n<output>\n" + "z" * 200 + "\n[output cut]\n</output>\n"
    both = episode.step("<python>print('o' * 300)\nraise KeyError('the last line')</python>")
    assert both.observation.startswith("\n<output>\nooo")
    assert "KeyError: 'the last line'\n[output cut]\n[exit status 1]\n</output>\n" in both.observation
    assert 200 <= len(both.observation) - len("\n<output>\n\n[output cut]\n[exit status 1]\n</output>\n") <= 201
    # an open tag at the end (the engine stopped at the closing tag) is a call too
    open_tag = episode.step("first <python>print(1)</python> then <python>print(2)")
    assert open_tag.observation == "\n<output>\n2\n</output>\n"


def test_escapes_fail_inside_the_tool(env, dataset, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the job's data")
    episode = env.episode(dataset.batch(5, 1)[0], seed=0)
    episode.reset()
    step = episode.step(f"<python>print(open({str(secret)!r}).read())</python>")
    assert "FileNotFoundError" in step.observation and "the job's data" not in step.observation


def test_tool_calls_are_limited(dataset):
    env = PythonTool(PythonToolConfig(max_tool_calls=1, tag="code"), dataset=dataset)
    task = dataset.batch(6, 1)[0]
    episode = env.episode(task, seed=0)
    episode.reset()
    assert episode.step("<python>print(1)</python>").done  # not its tag: an answer
    episode = env.episode(task, seed=0)
    assert not episode.step("<code>print(1)</code>").done
    last = episode.step(f"<code>print(2)</code> {task.answer}")
    assert last.done and last.metrics["tool_calls"] == 1.0
    assert last.reward == dataset.reward(task, f"<code>print(2)</code> {task.answer}")


def test_bad_options_and_no_dataset_are_user_errors(dataset):
    with pytest.raises(ValueError, match="expected a tag name"):
        PythonToolConfig(tag="<python>")
    with pytest.raises(ValueError, match="'user', 'tool', 'system'"):
        PythonToolConfig(observation_role="assistant")
    with pytest.raises(UserError, match="needs a \\[dataset\\] with a reward"):
        PythonTool(PythonToolConfig(), dataset=None)


def test_the_hook_registers_python_tool():
    host = build_host(entry_points=False)
    host.add_plugin(python_tool, "python_tool_under_test")
    reg = host.registry.get("environments", "python_tool")
    assert reg.config is PythonToolConfig and reg.factory is PythonTool


def test_skyrl_validate_reports_bad_options(skyrl_host, skyrl_plugin, skyrl_cli, tmp_path):
    if "python_tool" not in skyrl_host.registry.names("environments"):  # before its entry point is installed
        skyrl_plugin(python_tool, "python_tool")
    job = tmp_path / "job.toml"
    job.write_text('[job]\nkind = "rl"\nsteps = 1\n[model]\nfamily = "qwen"\npreset = "tiny"\n'
                   '[dataset]\nname = "arithmetic"\n[environment]\nname = "python_tool"\nmax_tool_calls = -1\n')
    result = skyrl_cli("validate", str(job))
    assert result.exit_code == 2 and "environment.max_tool_calls" in result.stderr
    assert "Traceback" not in result.stderr
    job.write_text(job.read_text().replace("max_tool_calls = -1", "max_tool_calls = 2"))
    assert skyrl_cli("validate", str(job)).exit_code == 0
