"""python_tool: the model may run Python before it answers.

A response holding ``<python>CODE</python>`` (the tag is an option) is a tool call:
the environment runs CODE in the sandbox (:mod:`skyrl_environments.sandbox`: its
own namespaces, no network, no access to the job's files, wall-clock, CPU, memory
and process limits) and answers with what it printed, as the next observation::

    <output>
    STDOUT, then STDERR (a traceback if it raised)
    [a note when it timed out, was killed or its output was cut]
    </output>

A response without a tool call (or any response once ``max_tool_calls`` calls were
made) is the final answer: the trajectory ends, scored by the dataset's reward on
that response. Tool calls earn no reward of their own.

Chat tasks (``Task.messages``) get ``instructions`` as a system message (joined to
theirs if they have one) and the tool's output as a message of ``observation_role``;
plain-text tasks get the prompt as it is and the output as plain text.

The sandbox needs root; where it cannot be set up the job stops at its start with a
user error (code never runs unsandboxed).
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import UserError
from skyrl_host.interfaces import EnvStep, Task
from skyrl_host.options import ge, gt, option

DEFAULT_INSTRUCTIONS = (
    "You can run Python code: write it between <python> and </python>. You will see what it "
    "prints (standard output, then standard error) between <output> and </output>. The code runs "
    "in a fresh, isolated process each time (nothing is kept between calls, no network, no files). "
    "When you know the answer, reply with the answer alone, without code."
)

_ROLES = ("user", "tool", "system")


def _check_role(_inst: Any, _attr: Any, value: str) -> None:
    if value not in _ROLES:
        raise ValueError(f"expected one of {', '.join(map(repr, _ROLES))}, found {value!r}")


def _check_tag(_inst: Any, _attr: Any, value: str) -> None:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", value):
        raise ValueError(f"expected a tag name (letters, digits, '_' or '-', starting with a letter), found {value!r}")


@attrs.frozen
class PythonToolConfig:
    """Options of ``[environment]`` when ``name = "python_tool"``."""

    tag: str = option("python", help="the tag the model writes code in: <TAG>code</TAG>", validator=_check_tag)
    max_tool_calls: int = option(4, help="tool calls per trajectory; after that a response is the final answer",
                                 validator=ge(0))
    wall_seconds: float = option(5.0, help="wall-clock limit of one run of the code", validator=gt(0))
    cpu_seconds: int = option(5, help="CPU-time limit of one run (per process)", validator=gt(0))
    memory_mb: int = option(512, help="address-space limit of each process of a run, MiB", validator=gt(0))
    max_processes: int = option(16, help="processes a run may have at once", validator=gt(0))
    disk_mb: int = option(32, help="room for files in the run's private folder, MiB", validator=gt(0))
    output_chars: int = option(2000, help="characters of the output shown to the model (the rest is cut)",
                               validator=gt(0))
    observation_role: str = option("user", help="role of the output's message in chat tasks: 'user', 'tool' or 'system'",
                                   validator=_check_role)
    instructions: str = option(DEFAULT_INSTRUCTIONS, help="system message for chat tasks ('' for none)")


def _limits(config: PythonToolConfig):
    from skyrl_environments.sandbox import SandboxLimits

    return SandboxLimits(
        wall_seconds=config.wall_seconds, cpu_seconds=config.cpu_seconds,
        memory_bytes=config.memory_mb * 2**20, max_processes=config.max_processes,
        output_bytes=4 * config.output_chars + 1024, disk_bytes=config.disk_mb * 2**20)


def render_output(result: Any, limit: int, wall_seconds: float) -> str:
    """The observation text for a SandboxResult: stdout, then stderr, then notes, within
    ``limit`` characters. Long output keeps the head of stdout and the tail of stderr
    (where a traceback names its exception)."""
    out, err = result.stdout, result.stderr
    cut = len(out) + len(err) > limit or result.truncated
    if len(out) + len(err) > limit:
        err_room = min(len(err), max(limit // 2, limit - len(out)))
        err = err[len(err) - err_room:]
        out = out[:limit - err_room]
    text = out + ("\n" if out and err and not out.endswith("\n") else "") + err
    notes = []
    if cut:
        notes.append("[output cut]")
    if result.killed_reason == "timeout":
        notes.append(f"[stopped: ran past its time limit of {wall_seconds:g} s]")
    elif result.killed_reason == "cpu":
        notes.append("[stopped: used up its CPU-time limit]")
    elif result.killed_reason == "output":
        notes.append("[stopped: printed too much]")
    elif result.killed_reason:
        notes.append(f"[stopped by {result.killed_reason}]")
    elif result.exit_code:
        notes.append(f"[exit status {result.exit_code}]")
    if text and not text.endswith("\n"):
        text += "\n"
    return "<output>\n" + text + "".join(n + "\n" for n in notes) + "</output>"


class PythonToolEpisode:
    """One trajectory (a :class:`skyrl_host.interfaces.Episode`)."""

    def __init__(self, env: "PythonTool", task: Task):
        self.env, self.task = env, task
        self.calls = 0
        self.chat = task.messages is not None

    def reset(self) -> Any:
        if not self.chat:
            return self.task.prompt
        messages = [dict(m) for m in self.task.messages]
        instructions = self.env.config.instructions
        if instructions:
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{instructions}"
            else:
                messages.insert(0, {"role": "system", "content": instructions})
        return messages

    def find_code(self, response: str) -> str | None:
        """The code of the response's last tool call, or None. A last tag left open (the
        engine stopped at the closing tag, or the response was cut) holds the rest."""
        opening, closing = f"<{self.env.config.tag}>", f"</{self.env.config.tag}>"
        start = response.rfind(opening)
        if start < 0:
            return None
        rest = response[start + len(opening):]
        end = rest.find(closing)
        return rest if end < 0 else rest[:end]

    def step(self, response: str) -> EnvStep:
        from skyrl_environments.sandbox import run_python

        code = self.find_code(response) if self.calls < self.env.config.max_tool_calls else None
        if code is None:
            reward = float(self.env.dataset.reward(self.task, response))
            return EnvStep(observation=None, reward=reward, done=True,
                           metrics={"tool_calls": float(self.calls)})
        self.calls += 1
        result = run_python(code, limits=self.env.limits)
        text = render_output(result, self.env.config.output_chars, self.env.config.wall_seconds)
        observation = ([{"role": self.env.config.observation_role, "content": text}] if self.chat
                       else "\n" + text + "\n")
        return EnvStep(observation=observation, reward=0.0, done=False, metrics={
            "tool_errors": float(result.exit_code != 0),
            "tool_timeouts": float(result.timed_out),
            "tool_seconds": result.seconds,
        })

    def close(self) -> None:
        pass  # every run of the sandbox cleaned up after itself


class PythonTool:
    """The environment (a :class:`skyrl_host.interfaces.Environment`)."""

    def __init__(self, config: PythonToolConfig, dataset: Any = None, seed: int = 0):
        from skyrl_environments.sandbox import SandboxUnavailable, run_python

        if dataset is None or not callable(getattr(dataset, "reward", None)):
            raise UserError("[environment] name = \"python_tool\" scores final answers with the dataset's "
                            "reward: the job needs a [dataset] with a reward")
        self.config, self.dataset, self.seed = config, dataset, seed
        self.limits = _limits(config)
        try:  # fail at the job's start, not in the first trajectory
            probe = run_python("print('ok')", limits=self.limits)
        except SandboxUnavailable as e:
            raise UserError(f"[environment] name = \"python_tool\" cannot run: {e}") from None
        if probe.stdout != "ok\n":
            raise UserError(f"[environment] name = \"python_tool\" cannot run: the sandbox's test run "
                            f"printed {probe.stdout!r} (stderr {probe.stderr[-300:]!r})")

    def episode(self, task: Task, *, seed: int) -> PythonToolEpisode:
        return PythonToolEpisode(self, task)


@hookimpl
def skyrl_register_environments(register: Any) -> None:
    register(
        "python_tool",
        PythonTool,
        config=PythonToolConfig,
        description="The model runs Python (<python>...</python>) in a sandbox before it answers; "
                    "scored by the dataset's reward",
    )
