"""files: prompts from Parquet, JSON lines or Hugging Face ``datasets`` folders, in the
row formats verl and SkyRL write, with rewards chosen by each row's ``data_source``.

A row (one prompt) of verl's preprocessing scripts::

    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "..."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

and of SkyRL's (``env_class`` names a SkyRL-Gym environment)::

    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "..."}],
     "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": "72"},
     "extra_info": {...}}

are read unchanged. The prompt (``prompt_key``, a dotted path) is text, or a chat (a
list of ``{role, content}`` messages) that the ``rl`` driver renders with the model's
chat template. The ground truth is the first of ``reward_model.ground_truth``,
``reward_spec.ground_truth`` and ``answer`` a row has (or ``answer_key``). Every field
of the row is in :attr:`Task.meta`, so an environment sees ``env_class``,
``reward_spec`` and ``extra_info`` as SkyRL-Gym expects them.

The reward of a row: ``reward`` when it names one; with ``reward = "auto"`` (the
default), ``rewards[data_source]``, else the built-in choice for well-known sources
(:data:`skyrl_datasets.verifiers.BY_DATA_SOURCE`: ``openai/gsm8k`` -> ``gsm8k``,
MATH sets -> ``math``, ...), else ``default_reward``; a row left without one is an
error naming the file, the row and its ``data_source``.

Order: every epoch is every row once. With ``shuffle`` (the default) the blocks (row
groups, record batches, 1,024 lines) are permuted by (seed, epoch), and the rows within
each block by (seed, epoch, block): a block is read once per epoch, and memory holds a
few blocks, whatever the file's size. Step ``s`` with batch size ``n`` takes items
``[(s-1)*n, s*n)`` of the endless sequence of epochs, so a resumed job sees exactly the
prompts it would have seen.
"""

from __future__ import annotations

import inspect
import numbers
import os
from typing import Any, Mapping

import attrs
import numpy as np

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError, did_you_mean
from skyrl_host.interfaces import Task
from skyrl_host.options import option

from skyrl_datasets import verifiers
from skyrl_toolkit.functions import load_function
from skyrl_datasets._tables import MISSING, RowError, Rows, field, open_tables

GROUND_TRUTHS = ("reward_model.ground_truth", "reward_spec.ground_truth", "answer")
MAX_PROBLEMS = 20


def _check_reward_name(value: str, *, auto: bool) -> None:
    names = tuple(verifiers.REWARDS) + (("auto",) if auto else ())
    if value in names:
        return
    module, sep, func = value.partition(":")
    if not sep or not module or not func:
        raise ValueError(f"expected one of {', '.join(map(repr, names))} or 'module:function', found {value!r}"
                         f"{did_you_mean(value, names)}")


def _check_reward(_inst: Any, _attr: Any, value: str) -> None:
    _check_reward_name(value, auto=True)


def _check_rewards(_inst: Any, _attr: Any, value: Mapping[str, str]) -> None:
    for source, name in value.items():
        if not isinstance(name, str):
            raise ValueError(f"{source!r}: expected a reward name, found {name!r}")
        try:
            _check_reward_name(name, auto=False)
        except ValueError as exc:
            raise ValueError(f"{source!r}: {exc}") from None


def _check_default(_inst: Any, _attr: Any, value: str | None) -> None:
    if value is not None:
        _check_reward_name(value, auto=False)


def _check_paths(_inst: Any, _attr: Any, value: Any) -> None:
    paths = [value] if isinstance(value, str) else value
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError("expected a path or URL, or a non-empty list of them")
    for p in paths:  # local paths are checked at validate (URLs and globs when opened)
        if "://" in p or "::" in p or any(c in p for c in "*?["):
            continue
        local = os.path.expanduser(p)
        if not os.path.exists(local):
            where = "" if os.path.isabs(local) else f" (relative to the current folder {os.getcwd()!r})"
            raise ValueError(f"expected an existing file or folder, found nothing at {p!r}{where}")


@attrs.frozen
class FilesConfig:
    """Options of ``[dataset]`` when ``name = "files"``."""

    path: str | list[str] = option(
        help="the prompt files: a .parquet, .jsonl or .arrow file, a glob, a folder of them, or a datasets "
        "save_to_disk folder; local or an fsspec URL (s3://...); or a list of these, read in order",
        validator=_check_paths,
    )
    storage_options: dict = option(factory=dict, help="fsspec options for URLs (e.g. client_kwargs.endpoint_url)")
    prompt_key: str = option("prompt", help="the dotted path of the prompt: text, or a list of {role, content} messages")
    answer_key: str | None = option(
        None, help="the dotted path of the ground truth (default: reward_model.ground_truth, "
        "reward_spec.ground_truth or answer, the first a row has)",
    )
    data_source_key: str = option("data_source", help="the dotted path of the row's data source")
    system_prompt: str | None = option(
        None, help="a system message opening every prompt (rows with their own system message keep theirs)"
    )
    reward: str = option(
        "auto",
        help="'auto' (by each row's data source: rewards, the built-in sources, default_reward), or one reward "
        "for every row: 'gsm8k', 'gsm8k_flexible', 'math', 'multiple_choice', 'exact' or 'module:function'",
        validator=_check_reward,
    )
    rewards: dict = option(
        factory=dict, help="the reward of each data source, e.g. {\"my/source\" = \"math\"}; a key ending in * "
        "matches sources starting so", validator=_check_rewards,
    )
    default_reward: str | None = option(
        None, help="the reward of rows whose data source has none (default: such a row is an error)",
        validator=_check_default,
    )
    shuffle: bool = option(True, help="a new order each epoch, seeded by (seed, epoch): blocks, then rows within")


class UserReward:
    """A user's function: ``f(task, completion)``, or verl's ``compute_score(data_source,
    solution_str, ground_truth, extra_info)`` (called by keyword; a dict result gives
    its ``score``)."""

    needs_answer = False

    def __init__(self, spec: str, key: str) -> None:
        self.spec = spec
        self.fn = load_function(spec, key)
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            params = {}
        self.verl_style = "solution_str" in params

    def __call__(self, task: Task, completion: str) -> float:
        if self.verl_style:
            meta = task.meta
            value = self.fn(data_source=meta.get("data_source"), solution_str=completion, ground_truth=task.answer,
                            extra_info=meta.get("extra_info"))
            if isinstance(value, Mapping):
                value = value.get("score")
        else:
            value = self.fn(task, completion)
        return value

    def metrics(self) -> dict[str, float]:
        own = getattr(self.fn, "metrics", None)
        return dict(own()) if callable(own) else {}


def make_reward(name: str, key: str) -> Any:
    return verifiers.REWARDS[name]() if name in verifiers.REWARDS else UserReward(name, key)


class Files:
    """The dataset (a :class:`skyrl_host.interfaces.Dataset`), also usable for evaluation:
    :meth:`rows` walks every row once, in file order."""

    def __init__(self, config: FilesConfig, seed: int = 0, *, key: str = "dataset") -> None:
        self.config = config
        self.seed = seed
        self.key = key
        paths = [config.path] if isinstance(config.path, str) else list(config.path)
        tables = []
        try:
            for p in paths:
                tables += open_tables(p, config.storage_options)
        except BaseException:
            for t in tables:
                t.close()
            raise
        self._rows = Rows(tables)
        if len(self._rows) == 0:
            raise UserError(Problem("holds no rows", file=", ".join(paths), key=f"{key}.path"))
        self._rewards: dict[str, Any] = {}  # reward name -> its object (one per name: counters live there)
        self._fixed = None if config.reward == "auto" else self._reward_object(config.reward)
        self._epoch: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._rows)

    # -- rewards ------------------------------------------------------------------------

    def _reward_object(self, name: str) -> Any:
        obj = self._rewards.get(name)
        if obj is None:
            obj = self._rewards[name] = make_reward(name, f"{self.key}.reward")
        return obj

    def reward_name(self, source: Any) -> str | None:
        """The reward a row of data source ``source`` is scored with (None: none)."""
        cfg = self.config
        if cfg.reward != "auto":
            return cfg.reward
        if isinstance(source, str):
            name = verifiers.reward_for_source(source, cfg.rewards) or verifiers.reward_for_source(
                source, verifiers.BY_DATA_SOURCE)
            if name is not None:
                return name
        return cfg.default_reward

    def source_of(self, task: Task) -> Any:
        """The data source of ``task`` (None when its row has none)."""
        source = field(task.meta, self.config.data_source_key)
        return None if source is MISSING else source

    def data_source(self, task: Task) -> str | None:
        """The :class:`~skyrl_host.interfaces.DataSources` capability: the row's data source as text."""
        source = self.source_of(task)
        return None if source is None else str(source)

    def extract_answer(self, task: Task, completion: str) -> str | None:
        """The :class:`~skyrl_host.interfaces.AnswerExtraction` capability: the answer the
        row's reward compares (None for a user's function, which extracts nothing)."""
        extract = getattr(self.reward_of(task), "extract", None)
        return extract(completion) if callable(extract) else None

    def reward_of(self, task: Task) -> Any:
        """The reward object scoring ``task`` (it has ``extract`` when it is a built-in one)."""
        if self._fixed is not None:
            return self._fixed
        name = self.reward_name(self.source_of(task))
        if name is None:  # rows are checked when read: only a Task made elsewhere gets here
            raise UserError(Problem(f"no reward for data source {self.source_of(task)!r}", key=f"{self.key}.rewards"))
        return self._reward_object(name)

    def reward(self, task: Task, completion: str) -> float:
        value = self.reward_of(task)(task, completion)
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
            raise UserError(Problem(f"reward {self.reward_name(self.source_of(task))!r} returned {value!r} "
                                    f"for prompt {task.prompt[:80]!r}; expected a number in [0, 1]",
                                    key=f"{self.key}.reward"))
        return float(value)

    def reward_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for obj in self._rewards.values():
            metrics = getattr(obj, "metrics", None)
            if callable(metrics):
                out.update(metrics())
        return out

    # -- rows to tasks --------------------------------------------------------------------

    def _task(self, row: Any) -> Task:
        if isinstance(row, RowError):
            raise row
        cfg = self.config
        prompt = field(row, cfg.prompt_key)
        messages = None
        if prompt is MISSING:
            raise RowError(f"{cfg.prompt_key}: missing (the prompt); fields: {', '.join(map(repr, row)) or '(none)'}")
        if isinstance(prompt, str):
            if cfg.system_prompt is not None:
                messages = ({"role": "user", "content": prompt},)
        elif isinstance(prompt, (list, tuple)):
            messages = _messages(prompt, cfg.prompt_key)
            prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        else:
            raise RowError(f"{cfg.prompt_key}: expected text or a list of {{role, content}} messages, "
                           f"found {_shown(prompt)}")
        if messages is not None and cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = ({"role": "system", "content": cfg.system_prompt}, *messages)
        keys = (cfg.answer_key,) if cfg.answer_key else GROUND_TRUTHS
        answer, answer_key = MISSING, keys[0]
        for k in keys:
            answer = field(row, k)
            if answer is not MISSING and answer is not None:
                answer_key = k
                break
        source = field(row, cfg.data_source_key)
        source = None if source is MISSING else source
        name = self.reward_name(source)
        if name is None:
            raise RowError(f"{cfg.data_source_key}: no reward for data source {source!r}: add it to "
                           f"[{self.key}] rewards, or set default_reward")
        reward = self._reward_object(name)
        if answer is MISSING or answer is None:
            if getattr(reward, "needs_answer", False):
                raise RowError(f"missing the ground truth ({' or '.join(keys)}) that reward {name!r} needs")
            answer = None
        elif isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise RowError(f"{answer_key}: expected the ground truth as text or a number, found {_shown(answer)}")
        elif not isinstance(answer, str):
            answer = str(answer)
        return Task(prompt=prompt, answer=answer, meta=dict(row), messages=messages)

    def _located(self, block: int, number: int, exc: RowError) -> UserError:
        file, row = self._rows.where(block, number)
        return UserError(Problem(str(exc), file=file, key=row))

    # -- order ----------------------------------------------------------------------------

    def _epoch_blocks(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block order, cumulative rows after each block in that order) of ``epoch``."""
        got = self._epoch.get(epoch)
        if got is None:
            order = np.arange(len(self._rows.blocks))
            if self.config.shuffle:
                order = np.random.default_rng([self.seed, epoch, 0x46494C45]).permutation(order)
            got = (order, np.cumsum(self._rows.sizes[order]))
            if len(self._epoch) >= 4:
                self._epoch.pop(next(iter(self._epoch)))
            self._epoch[epoch] = got
        return got

    def _within(self, epoch: int, block: int) -> np.ndarray | None:
        if not self.config.shuffle:
            return None
        perm = self._perms.get((epoch, block))
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch, block, 0x524F5753]).permutation(int(self._rows.sizes[block]))
            if len(self._perms) >= 8:
                self._perms.pop(next(iter(self._perms)))
            self._perms[(epoch, block)] = perm
        return perm

    def item(self, i: int) -> Task:
        """Item ``i`` (from 0) of the endless sequence of epochs."""
        n = len(self._rows)
        epoch, pos = divmod(i, n)
        order, ends = self._epoch_blocks(epoch)
        k = int(np.searchsorted(ends, pos, side="right"))
        block = int(order[k])
        offset = pos - (int(ends[k - 1]) if k else 0)
        perm = self._within(epoch, block)
        number, row = self._rows.block(block)[int(perm[offset]) if perm is not None else offset]
        try:
            return self._task(row)
        except RowError as exc:
            raise self._located(block, number, exc) from None

    def batch(self, step: int, size: int) -> list[Task]:
        if step < 1:
            raise ValueError(f"steps count from 1, got step {step}")
        return [self.item(i) for i in range((step - 1) * size, step * size)]

    def rows(self) -> list[Task]:
        """Every row once, in file order (for evaluation); every bad row is reported."""
        tasks, problems = [], []
        for block, number, row in self._rows:
            try:
                tasks.append(self._task(row))
            except RowError as exc:
                problems += self._located(block, number, exc).problems
        if problems:
            if len(problems) > MAX_PROBLEMS:
                problems = problems[:MAX_PROBLEMS] + [Problem(f"... and {len(problems) - MAX_PROBLEMS} more bad rows")]
            raise UserError(problems)
        return tasks

    def close(self) -> None:
        self._rows.close()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _messages(value: Any, key: str) -> tuple[dict[str, str], ...]:
    if not value:
        raise RowError(f"{key}: expected a non-empty list of {{role, content}} messages, found []")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise RowError(f"{key}[{i}]: expected a message with text 'role' and 'content', found {_shown(m)}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant":
        raise RowError(f"{key}: the last message is the assistant's; a prompt ends with the user's turn")
    return tuple(out)


@hookimpl
def skyrl_register_datasets(register: Any) -> None:
    register(
        "files",
        Files,
        config=FilesConfig,
        description="Prompts from Parquet, JSON lines or datasets folders (local or fsspec URLs) in verl's and "
        "SkyRL's row formats; rewards by data source (gsm8k, math, multiple choice, a function)",
    )
