"""skyrl_gym: SkyRL-Gym environments, run unchanged, as skyrl environments.

SkyRL-Gym (the ``skyrl-gym`` package) environments are ``BaseTextEnv`` classes
registered under an id (``gsm8k``, ``gsm8k_multi_turn``, ``searchcode``, ``lcb``,
``aime``, ... or a third party's, once its module called ``skyrl_gym.register``).
This adapter makes one with ``skyrl_gym.make(env_id, env_config=..., extras=...)``
per trajectory and maps its calls onto the :class:`skyrl_host.interfaces.Episode`
protocol:

- ``reset`` -> ``env.init(prompt)``: the prompt is the task's chat (``Task.messages``),
  or its prompt text as one user message; the messages ``init`` returns are the first
  observation;
- ``step(response)`` -> ``env.step(response)``: its ``observations`` (OpenAI-style
  messages) are the next observation, its ``reward`` this turn's reward, its ``done``
  the end; at the end, the numbers of ``env.get_metrics()`` are the turn's metrics;
- ``close`` -> ``env.close()``.

``extras`` (what SkyRL-Gym environments read their task from) are the record's own
fields when it has SkyRL's ``reward_spec`` (a jsonl record in SkyRL's dataset format:
every field but the prompt is in ``Task.meta``), else ``{"reward_spec": {"method":
"rule", "ground_truth": Task.answer}, "extra_info": {}}``; ``[environment].extras``
adds to them (the record's fields win). ``env_id = ""`` takes each record's
``env_class`` field.

A step's ``postprocessed_action`` is not used: the trajectory keeps the tokens the
engine generated (the token contract), whatever text the environment would put in
their place.

Tools: SkyRL-Gym's ``PythonCodeExecutorToolGroup`` runs model code with a plain
``python -c`` on the host. With ``sandbox_python = true`` (the default) the adapter
hands the environment, through its public ``init_tool_groups``, the same tool group
whose ``python`` tool runs the code in our sandbox instead
(:mod:`skyrl_environments.sandbox`) and answers in the same words. Other tools (the
search tool's HTTP calls, SQL) run as SkyRL-Gym ships them.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import UserError, did_you_mean
from skyrl_host.interfaces import EnvStep, Task
from skyrl_host.options import gt, option


def _check_env_id(_inst: Any, _attr: Any, value: str) -> None:
    # imports skyrl_gym (~0.5 s: pandas), so that `skyrl validate` catches a mistyped id
    registry = _registry() if value else {}
    if value and value not in registry:
        raise ValueError(f"expected a registered SkyRL-Gym environment id, found {value!r}"
                         f"{did_you_mean(value, registry)}; registered: {', '.join(sorted(registry))}")


@attrs.frozen
class SkyRLGymConfig:
    """Options of ``[environment]`` when ``name = "skyrl_gym"``."""

    env_id: str = option("", help="a registered SkyRL-Gym environment id, e.g. 'gsm8k_multi_turn' "
                                  "('' : each record's env_class field)", validator=_check_env_id)
    env_config: dict = option(factory=dict, help="the environment's env_config table (an OmegaConf config for it)")
    extras: dict = option(factory=dict, help="extras every episode gets (e.g. max_turns = 3); a record's own fields win")
    render: Literal["chat", "text"] = option(
        "chat", help="'chat': observations are messages (for chat templates); 'text': their contents as plain "
                     "text (for tokenizers without a chat template)")
    sandbox_python: bool = option(True, help="run SkyRL-Gym's Python tool in our sandbox (false: as it ships, "
                                             "a plain python -c on this machine)")
    python_memory_mb: int = option(512, help="memory limit of a sandboxed Python tool call, MiB", validator=gt(0))


def _registry() -> dict:
    import skyrl_gym

    return skyrl_gym.registry


def _sandboxed_group_class():
    """PythonCodeExecutorToolGroup whose ``python`` tool runs in our sandbox (same answers)."""
    from skyrl_gym.tools import PythonCodeExecutorToolGroup
    from skyrl_gym.tools.core import tool

    from skyrl_environments.sandbox import SandboxLimits, run_python

    class SandboxedPythonCodeExecutorToolGroup(PythonCodeExecutorToolGroup):
        memory_bytes = 512 * 2**20

        @tool
        def python(self, code: str) -> str:
            limits = SandboxLimits(wall_seconds=float(self.timeout), cpu_seconds=max(1, int(self.timeout + 0.999)),
                                   memory_bytes=self.memory_bytes)
            result = run_python(code, limits=limits)
            if result.killed_reason in ("timeout", "cpu"):
                return f"Error executing Python code: Execution timed out after {self.timeout} seconds."
            if result.stderr:
                return f"Error executing Python code: {result.stderr.strip()}"
            return result.stdout.strip() if result.stdout else ""

    return PythonCodeExecutorToolGroup, SandboxedPythonCodeExecutorToolGroup


def _numbers(mapping: Any) -> dict[str, float]:
    if not isinstance(mapping, dict):
        return {}
    return {str(k): float(v) for k, v in mapping.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool)}


class SkyRLGymEpisode:
    """One trajectory: one SkyRL-Gym environment (a :class:`skyrl_host.interfaces.Episode`)."""

    def __init__(self, adapter: "SkyRLGym", task: Task, env: Any):
        self.adapter, self.task, self.env = adapter, task, env

    def _out(self, messages: list) -> Any:
        messages = [dict(m) for m in messages]
        if self.adapter.config.render == "chat":
            return messages
        return "".join(str(m.get("content", "")) for m in messages)

    def reset(self) -> Any:
        prompt = ([dict(m) for m in self.task.messages] if self.task.messages is not None
                  else [{"role": "user", "content": self.task.prompt}])
        first, _metadata = self.env.init(prompt)
        return self._out(list(first))

    def step(self, response: str) -> EnvStep:
        out = self.env.step(response)
        done = bool(out["done"])
        metrics = _numbers(self.env.get_metrics()) if done else {}
        observation = None if done else self._out(list(out.get("observations") or []))
        return EnvStep(observation=observation, reward=float(out["reward"]), done=done, metrics=metrics)

    def close(self) -> None:
        self.env.close()


class SkyRLGym:
    """The adapter (a :class:`skyrl_host.interfaces.Environment`)."""

    def __init__(self, config: SkyRLGymConfig, dataset: Any = None, seed: int = 0):
        self.config, self.dataset, self.seed = config, dataset, seed
        from omegaconf import OmegaConf

        self.env_config = OmegaConf.create(dict(config.env_config))
        self.groups = _sandboxed_group_class() if config.sandbox_python else None
        if config.sandbox_python:
            from skyrl_environments.sandbox import SandboxUnavailable, run_python

            try:  # fail at the job's start, not in the first tool call
                run_python("pass")
            except SandboxUnavailable as e:
                raise UserError(f"[environment] sandbox_python: {e} (sandbox_python = false runs SkyRL-Gym's "
                                "Python tool unsandboxed)") from None

    def extras(self, task: Task) -> dict[str, Any]:
        meta = dict(task.meta)
        if "reward_spec" in meta:
            own = meta
        else:
            own = {"reward_spec": {"method": "rule", "ground_truth": task.answer}, "extra_info": {}}
        return {**self.config.extras, **own}

    def episode(self, task: Task, *, seed: int) -> SkyRLGymEpisode:
        import skyrl_gym

        env_id = self.config.env_id or task.meta.get("env_class")
        if not env_id:
            raise ValueError("the record has no env_class field and [environment] env_id is empty")
        env = skyrl_gym.make(env_id, env_config=self.env_config, extras=self.extras(task))
        if self.groups is not None and env.tool_groups:
            plain, sandboxed = self.groups
            groups = []
            for group in env.tool_groups:
                if type(group) is plain:
                    replacement = sandboxed(timeout=group.timeout)
                    replacement.memory_bytes = self.config.python_memory_mb * 2**20
                    group = replacement
                groups.append(group)
            env.init_tool_groups(groups)
        return SkyRLGymEpisode(self, task, env)


@hookimpl
def skyrl_register_environments(register: Any) -> None:
    register(
        "skyrl_gym",
        SkyRLGym,
        config=SkyRLGymConfig,
        description="SkyRL-Gym environments (skyrl-gym's BaseTextEnv: gsm8k_multi_turn, searchcode, ...) run unchanged",
    )
