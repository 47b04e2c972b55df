"""gymnasium: Gymnasium-style text environments, run unchanged, as skyrl environments.

Any environment registered with ``gymnasium.register`` whose actions are text (a
``gymnasium.spaces.Text`` action space, or any space but the numeric ones) can be an
``rl`` job's environment:

.. code-block:: toml

    [environment]
    name = "gymnasium"
    module = "my_games.envs"      # imported first, so its gymnasium.register calls run
    env_id = "my_games/Wordle-v0" # a registered id ("pkg.mod:Id-v0" imports pkg.mod too)
    env_kwargs = { words = 500 }  # keyword arguments of gymnasium.make

Per trajectory the adapter calls ``gymnasium.make(env_id, **env_kwargs)`` (with
``max_episode_steps`` when set) and maps the Gymnasium API onto the
:class:`skyrl_host.interfaces.Episode` protocol:

- ``reset`` -> ``env.reset(seed=SEED, options={**reset_options, "task": TASK})``:
  ``SEED`` is the trajectory's seed (a pure function of the job's seed, so resumed
  jobs replay the same games), ``TASK`` the dataset record as a plain dict
  ``{"prompt", "answer", "meta", "messages"}`` (an environment that plays its own game
  ignores it); the observation it returns is the first observation;
- ``step(response)`` -> ``env.step(response)``: the model's text is the action;
  ``(obs, reward, terminated, truncated, info)`` becomes ``EnvStep(observation=obs,
  reward=reward, done=terminated or truncated, metrics=...)``: the info's finite
  numbers (bools as 0/1) are the turn's metrics, and the last turn adds
  ``truncated`` (1.0 when the episode was truncated, e.g. by gymnasium's
  ``TimeLimit``, 0.0 when it terminated);
- ``close`` -> ``env.close()``.

Observations may be text, chat messages (a list of ``{"role", "content"}`` dicts) or
token ids (a list or a numpy array of ints); ``observation_key`` picks one entry of a
``Dict`` observation. The adapter makes one environment when the job starts, so an
unknown id, a module that does not import, ``env_kwargs`` the constructor refuses or a
numeric action space stop the job there with a user error naming the option.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Mapping
from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError, did_you_mean
from skyrl_host.interfaces import EnvStep, Task
from skyrl_host.options import gt, option

_KEY = "environment"


def _import_error(module: str) -> str | None:
    """Why ``module`` does not import (None: it does)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's module is theirs to fix
        return f"cannot import {module!r}: {type(exc).__name__}: {exc}"
    return None


def _split(env_id: str) -> tuple[str, str]:
    """gymnasium's ``"pkg.mod:Id-v0"`` form: (module to import, id)."""
    module, sep, name = env_id.rpartition(":")
    return (module, name) if sep else ("", env_id)


def _check_module(_inst: Any, _attr: Any, value: str) -> None:
    if value and (why := _import_error(value)):
        raise ValueError(f"{why} (the module whose gymnasium.register calls define env_id)")


def _check_env_id(inst: Any, _attr: Any, value: str) -> None:
    if not value:
        raise ValueError("expected a registered Gymnasium environment id, e.g. 'my_games/Wordle-v0'")
    if inst.module and _import_error(inst.module):
        return  # reported at `module`
    own_module, name = _split(value)
    if own_module and (why := _import_error(own_module)):
        raise ValueError(why)
    import gymnasium

    if name not in gymnasium.registry:
        ids = list(gymnasium.registry)
        hint = did_you_mean(name, ids)
        where = f" after importing {inst.module!r}" if inst.module else " (set module = \"pkg.mod\" to import " \
                                                                         "the module that registers it)"
        raise ValueError(f"expected a registered Gymnasium environment id, found {name!r}{hint}; "
                         f"not in gymnasium.registry{where}")


@attrs.frozen
class GymnasiumConfig:
    """Options of ``[environment]`` when ``name = "gymnasium"``."""

    module: str = option("", help="a module to import first, so that its gymnasium.register calls run "
                                  "(e.g. 'my_games.envs'; '' : none)", validator=_check_module)
    env_id: str = option("", help="a registered Gymnasium environment id whose actions are text "
                                  "(e.g. 'my_games/Wordle-v0'; 'pkg.mod:Id-v0' imports pkg.mod first)",
                         validator=_check_env_id)
    env_kwargs: dict = option(factory=dict, help="keyword arguments of gymnasium.make (the environment's "
                                                 "constructor's)")
    max_episode_steps: int | None = option(None, help="steps before gymnasium's TimeLimit truncates an episode "
                                                      "(unset: the registered spec's)", validator=gt(0))
    reset_options: dict = option(factory=dict, help="options every reset gets, besides 'task' (the dataset "
                                                    "record)")
    observation_key: str = option("", help="for Dict observations: the entry that is the model's observation")


# Spaces whose actions are numbers: the model's text cannot be one.
_NUMERIC_SPACES = ("Discrete", "Box", "MultiDiscrete", "MultiBinary")


def _metrics(info: Any) -> dict[str, float]:
    """The finite numbers of a step's info (bools as 0/1); anything else is left out."""
    import numpy as np  # gymnasium's own dependency

    if not isinstance(info, Mapping):
        return {}
    out = {}
    for key, value in info.items():
        if isinstance(value, (bool, np.bool_)):
            out[str(key)] = float(bool(value))
        elif isinstance(value, numbers.Real) and math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out


def task_dict(task: Task) -> dict[str, Any]:
    """The dataset record as the environment's reset sees it (``options["task"]``)."""
    return {"prompt": task.prompt, "answer": task.answer, "meta": dict(task.meta),
            "messages": None if task.messages is None else [dict(m) for m in task.messages]}


class GymnasiumEpisode:
    """One trajectory: one Gymnasium environment (a :class:`skyrl_host.interfaces.Episode`)."""

    def __init__(self, adapter: "Gymnasium", task: Task, seed: int, env: Any):
        self.adapter, self.task, self.seed, self.env = adapter, task, seed, env

    def _observation(self, obs: Any) -> Any:
        key = self.adapter.config.observation_key
        if key:
            if not isinstance(obs, Mapping) or key not in obs:
                raise ValueError(f"observation_key {key!r} is not an entry of the observation {obs!r:.200}")
            obs = obs[key]
        if hasattr(obs, "tolist") and not isinstance(obs, (str, bytes)):  # numpy token ids
            obs = obs.tolist()
        if isinstance(obs, tuple):
            obs = list(obs)
        if isinstance(obs, list) and obs and all(isinstance(m, Mapping) for m in obs):
            obs = [dict(m) for m in obs]
        return obs

    def reset(self) -> Any:
        options = {**self.adapter.config.reset_options, "task": task_dict(self.task)}
        obs, _info = self.env.reset(seed=self.seed, options=options)
        return self._observation(obs)

    def step(self, response: str) -> EnvStep:
        obs, reward, terminated, truncated, info = self.env.step(response)
        done = bool(terminated) or bool(truncated)
        metrics = _metrics(info)
        if done:
            metrics["truncated"] = 0.0 if terminated else 1.0
        return EnvStep(observation=None if done else self._observation(obs), reward=float(reward), done=done,
                       metrics=metrics)

    def close(self) -> None:
        self.env.close()


class Gymnasium:
    """The adapter (a :class:`skyrl_host.interfaces.Environment`)."""

    def __init__(self, config: GymnasiumConfig, dataset: Any = None, seed: int = 0):
        self.config, self.dataset, self.seed = config, dataset, seed
        for module in (config.module, _split(config.env_id)[0]):
            if module and (why := _import_error(module)):
                raise UserError(Problem(why, key=f"{_KEY}.module"))
        # One environment now: constructor errors and numeric action spaces stop the job
        # at its start, not as a failure in every trajectory.
        try:
            env = self._make()
        except Exception as exc:  # noqa: BLE001 - the user's environment refused its options
            raise UserError(Problem(f"gymnasium.make({config.env_id!r}, **env_kwargs) failed: "
                                    f"{type(exc).__name__}: {exc}", key=f"{_KEY}.env_kwargs")) from None
        try:
            action = type(env.action_space).__name__
            if action in _NUMERIC_SPACES:
                raise UserError(Problem(
                    f"{config.env_id!r} takes {env.action_space} actions, but the model's response is text: "
                    "name an environment whose action space is gymnasium.spaces.Text", key=f"{_KEY}.env_id"))
            space = env.observation_space
            if type(space).__name__ == "Dict" and not config.observation_key:
                raise UserError(Problem(
                    f"{config.env_id!r} observes a Dict ({', '.join(map(repr, space.spaces))}): name the entry "
                    "that is the model's observation", key=f"{_KEY}.observation_key"))
        finally:
            env.close()

    def _make(self) -> Any:
        import gymnasium

        kwargs = dict(self.config.env_kwargs)
        if self.config.max_episode_steps is not None:
            kwargs["max_episode_steps"] = self.config.max_episode_steps
        return gymnasium.make(self.config.env_id, **kwargs)

    def episode(self, task: Task, *, seed: int) -> GymnasiumEpisode:
        return GymnasiumEpisode(self, task, seed, self._make())


@hookimpl
def skyrl_register_environments(register: Any) -> None:
    register(
        "gymnasium",
        Gymnasium,
        config=GymnasiumConfig,
        description="Gymnasium text environments (a registered env id whose actions are text) run unchanged",
    )
