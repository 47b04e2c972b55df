"""Multi-turn rollouts of the ``rl`` job (``[environment] name = ...``).

Many trajectories are in flight at once, split into ``env_waves`` waves (default 1).
Each turn, a wave's live trajectories are generated in one engine call; their episodes'
``step`` calls then run concurrently in worker threads (each under the job's
``step_timeout``) while the engine serves the other waves, and the wave continues once
all of its steps have answered. With one wave, decode and environment steps take
turns; with two or more, slow tools overlap the other waves' decoding. A wave's calls
depend only on its own history (members, seeds), never on the order the waves are
served in, so the trajectories are a pure function of the seed for a given wave count. Tokens are never re-derived from text: a turn continues from the
exact ids of the history through the engine's ``continue_turn``
(:class:`skyrl_host.interfaces.TurnContinuation`), which returns only the new segment
(the observation's tokens and the response); :meth:`RolloutBatch.append_turn` joins it,
observation tokens masked from the loss, per-turn side channels (routes, support sets)
carried. Only the new observation is rendered: text and token ids as they are, chat
messages as the chat template's suffix after a finished assistant turn.

Faults stay in their trajectory: an episode that raises, runs past ``step_timeout`` or
answers something malformed ends that trajectory with a recorded failure, and the job
goes on. Everything but timeouts is a pure function of the seed, so a resumed job
replays the same trajectories.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable, Mapping, Sequence

import attrs

from skyrl_host.interfaces import EnvStep, Task

FAILURE_KINDS = ("error", "timeout", "malformed")


class EpisodeFailure(Exception):
    """An episode broke its contract (a malformed answer)."""


# -- the default: one turn, scored by the dataset ------------------------------------


class SingleTurnEpisode:
    """The prompt, one response, the dataset's reward."""

    def __init__(self, dataset: Any, task: Task):
        self.dataset, self.task = dataset, task

    def reset(self) -> Any:
        return list(self.task.messages) if self.task.messages is not None else self.task.prompt

    def step(self, response: str) -> EnvStep:
        return EnvStep(observation=None, reward=float(self.dataset.reward(self.task, response)), done=True)

    def close(self) -> None:
        pass


class SingleTurn:
    """``[environment] name = "single_turn"`` (the default): one response per prompt,
    rewarded by the dataset. The ``rl`` driver runs it with its batched single-turn
    path, so jobs without an ``[environment]`` table are exactly what they were."""

    def __init__(self, config: Any = None, *, dataset: Any, seed: int = 0):
        self.dataset = dataset

    def episode(self, task: Task, *, seed: int) -> SingleTurnEpisode:
        return SingleTurnEpisode(self.dataset, task)


# -- worker threads with timeouts ----------------------------------------------------


class _Call:
    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.started = threading.Event()
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.t_start = 0.0
        self._lock = threading.Lock()
        self._abandoned = False
        self._after: Callable[[Any], None] | None = None

    def run(self) -> None:
        self.t_start = time.monotonic()
        self.started.set()
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - an environment's failure is its trajectory's
            self.error = exc
        with self._lock:
            self.done.set()
            after = self._after if self._abandoned else None
        if after is not None:
            try:
                after(self.value)
            except Exception:  # noqa: BLE001 - cleaning up after an abandoned call
                pass

    def abandon(self, after: Callable[[Any], None] | None) -> bool:
        """Give up on a call still running; ``after(value)`` runs in its thread once it
        returns (e.g. closing the episode). False when it finished meanwhile."""
        with self._lock:
            if self.done.is_set():
                return False
            self._abandoned, self._after = True, after
            return True


class EnvWorkers:
    """Daemon worker threads for environment calls. A call that runs past its timeout
    is abandoned (its thread replaced, so hung environments never starve the pool, and
    never block the process's exit)."""

    def __init__(self, n: int):
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        for _ in range(n):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="skyrl-env", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._queue.get().run()

    def submit(self, fns: Sequence[Callable[[], Any]]) -> list[_Call]:
        """Queue ``fns`` (they start as threads free up) and return at once."""
        calls = [_Call(f) for f in fns]
        for c in calls:
            self._queue.put(c)
        return calls

    def collect(
        self, calls: Sequence[_Call], timeout: float, after_timeout: Sequence[Callable[[Any], None] | None]
    ) -> list[tuple[str, Any]]:
        """Wait for submitted calls; each result is ``("ok", value)``, ``("error", exc)``
        or ``("timeout", None)`` (a call longer than ``timeout`` seconds from its start)."""
        out: list[tuple[str, Any]] = []
        for c, after in zip(calls, after_timeout):
            c.started.wait()
            if not c.done.wait(max(0.0, c.t_start + timeout - time.monotonic())) and c.abandon(after):
                self._spawn()
                out.append(("timeout", None))
            elif c.error is not None:
                out.append(("error", c.error))
            else:
                out.append(("ok", c.value))
        return out

    def run(
        self, fns: Sequence[Callable[[], Any]], timeout: float, after_timeout: Sequence[Callable[[Any], None] | None]
    ) -> list[tuple[str, Any]]:
        """Run ``fns`` concurrently and wait for them (:meth:`submit` then :meth:`collect`)."""
        return self.collect(self.submit(fns), timeout, after_timeout)


# -- observations to tokens ----------------------------------------------------------


def _messages(obs: Any) -> list[dict[str, str]] | None:
    if isinstance(obs, (list, tuple)) and obs and all(isinstance(m, Mapping) for m in obs):
        if all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in obs):
            return [{"role": m["role"], "content": m["content"]} for m in obs]
        raise EpisodeFailure("chat messages need string 'role' and 'content'")
    return None


class ObservationTokens:
    """Renders observations to token ids with the job's tokenizer."""

    # A finished exchange the new messages are rendered after; only what the template
    # adds after it is kept (templates that rewrite earlier turns touch only this one).
    _BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)

    def _ids(self, ids: Any) -> list[int]:
        out = [int(i) for i in ids]
        if any(i != j for i, j in zip(out, ids)) or any(not 0 <= i < self.vocab for i in out):
            raise EpisodeFailure(f"token ids must be integers in [0, {self.vocab})")
        return out

    def first(self, obs: Any) -> list[int]:
        """The prompt: text encoded as the single-turn job encodes a plain prompt, chat
        messages rendered with the assistant's turn opened."""
        if isinstance(obs, str):
            ids = list(self.tokenizer.encode(obs))
        elif (msgs := _messages(obs)) is not None:
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        elif isinstance(obs, (list, tuple)):
            ids = obs
        else:
            raise EpisodeFailure(f"an observation is chat messages, text or token ids, not {type(obs).__name__}")
        ids = self._ids(ids)
        if not ids:
            raise EpisodeFailure("the first observation is empty")
        return ids

    def next(self, obs: Any) -> list[int]:
        """A later observation's tokens, to append after the history's exact ids."""
        if isinstance(obs, str):
            return self._ids(self.tokenizer.encode(obs, add_special_tokens=False))
        if isinstance(obs, (list, tuple)) and not obs and self.tokenizer.chat_template:
            msgs = []  # no new message (a tool that printed nothing): the assistant's turn opened again
        else:
            msgs = _messages(obs)
        if msgs is not None:
            t = self.tokenizer
            before = t.apply_chat_template(self._BASE, add_generation_prompt=False, tokenize=False)
            after = t.apply_chat_template(self._BASE + msgs, add_generation_prompt=True, tokenize=False)
            if not after.startswith(before):
                raise EpisodeFailure("the chat template rewrites earlier turns: cannot render only the new messages")
            return self._ids(t.encode(after[len(before):], add_special_tokens=False))
        if isinstance(obs, (list, tuple)):
            return self._ids(obs)
        raise EpisodeFailure(f"an observation is chat messages, text or token ids, not {type(obs).__name__}")


def _checked(answer: Any) -> EnvStep:
    if not isinstance(answer, EnvStep):
        raise EpisodeFailure(f"step returned {type(answer).__name__}, not an EnvStep")
    try:
        reward = float(answer.reward)
        metrics = {str(k): float(v) for k, v in dict(answer.metrics).items()}
    except (TypeError, ValueError) as exc:
        raise EpisodeFailure(f"reward and metrics must be numbers: {exc}") from None
    if not math.isfinite(reward) or not all(math.isfinite(v) for v in metrics.values()):
        raise EpisodeFailure("reward and metrics must be finite")
    if not isinstance(answer.done, bool):
        raise EpisodeFailure(f"done must be a bool, not {type(answer.done).__name__}")
    if not answer.done and answer.observation is None:
        raise EpisodeFailure("an episode that is not done must give an observation")
    return EnvStep(observation=answer.observation, reward=reward, done=answer.done, metrics=metrics)


# -- the rollout -----------------------------------------------------------------------


@attrs.frozen
class MultiTurnOptions:
    max_turns: int
    max_total_tokens: int
    max_new_tokens: int
    step_timeout: float
    reward_gamma: float
    failed_trajectories: str  # "zero" | "exclude"
    env_waves: int = 1  # trajectories split in this many waves that decode while the others' steps run


@attrs.define
class _Wave:
    """Trajectories that decode together and then wait for their environment steps."""

    index: int
    live: list[int]  # trajectory indices still running
    pending: list[list[int]]  # the next tokens to feed each (prompts, then observations)
    conv: Any = None  # RolloutBatch of the conversations so far
    turn: int = 0
    calls: Any = None  # the submitted environment steps of the last turn


@attrs.define
class Rollout:
    batch: Any  # RolloutBatch of the scored trajectories (None when none is left)
    rewards: Any  # float32 [S]
    metrics: dict[str, float]
    gen_time: float
    gen_tokens: int


def trajectory_seed(seed: int, index: int) -> int:
    """The episode seed of one trajectory of a step: a pure function."""
    return (seed * 7_919 + index * 104_729 + 17) % (2**63 - 1)


def wave_seed(seed: int, wave: int) -> int:
    """The seed of one wave's engine calls (wave 0 keeps the step's seed)."""
    return seed if wave == 0 else (seed * 65_537 + wave * 257 + 3) % (2**63 - 1)


def turn_seed(seed: int, turn: int, part: int) -> int:
    return (seed * 31_337 + turn * 1_009 + part * 13) % (2**63 - 1)


class MultiTurnRollout:
    """Runs the trajectories of one step (``n`` per task, grouped by task)."""

    def __init__(
        self, environment: Any, engine: Any, sampler: Any, tokenizer: Any, stop_token_ids: Sequence[int],
        options: MultiTurnOptions, workers: EnvWorkers,
    ):
        self.env, self.engine, self.sampler = environment, engine, sampler
        self.tokenizer, self.stop = tokenizer, set(int(s) for s in stop_token_ids)
        self.render = ObservationTokens(tokenizer)
        self.opt, self.workers = options, workers

    def _text(self, ids: Any) -> str:
        return self.tokenizer.decode([int(t) for t in ids if int(t) not in self.stop], skip_special_tokens=False)

    def _generate(self, history: Any, turns: list[list[int]], caps: list[int], seed: int, turn: int) -> tuple[Any, list]:
        """One response per conversation, each under its own new-token cap (conversations
        with equal caps share an engine call): the conversations continued, and each
        one's new response ids. ``history`` None: the first turn (``turns``: prompts)."""
        import numpy as np

        from skyrl_host.rollout import RolloutBatch

        order: list[int] = []
        parts, responses = [], []
        for part, cap in enumerate(sorted(set(caps))):
            idx = [i for i, c in enumerate(caps) if c == cap]
            order += idx
            s = turn_seed(seed, turn, part)
            if history is None:
                b = self.engine.generate([turns[i] for i in idx], n=1, sampler=self.sampler, max_new_tokens=cap, seed=s)
                parts.append(b)
                responses += [b.response(j) for j in range(len(idx))]
            else:
                sub = history.select(idx)
                seg = self.engine.continue_turn(sub, [turns[i] for i in idx], sampler=self.sampler,
                                                max_new_tokens=cap, seed=s)
                parts.append(sub.append_turn(seg))
                responses += [seg.response(j) for j in range(len(idx))]
        if len(parts) == 1:
            return parts[0], responses
        back = np.argsort(np.asarray(order), kind="stable")
        return RolloutBatch.concat(parts).select(back), [responses[j] for j in back]

    def run(self, tasks: Sequence[Task], n: int, seed: int) -> Rollout:
        import numpy as np

        from skyrl_host.rollout import RolloutBatch

        opt = self.opt
        S = len(tasks) * n
        groups = np.repeat(np.arange(len(tasks), dtype=np.int64), n)
        episodes: list[Any] = [None] * S
        returns = np.zeros(S, dtype=np.float64)
        turns = np.zeros(S, dtype=np.int64)
        failed: dict[int, str] = {}
        ended_by: dict[str, int] = defaultdict(int)
        env_metrics: dict[str, list[float]] = defaultdict(list)
        env_wait = 0.0

        def close_later(ep: Any) -> None:
            if isinstance(ep, tuple) and ep and ep[0] is not None:  # (episode, observation) of a late reset
                ep[0].close()

        def start(i: int) -> Callable[[], Any]:
            def call() -> Any:
                ep = self.env.episode(tasks[i // n], seed=trajectory_seed(seed, i))
                try:
                    return ep, ep.reset()
                except BaseException:
                    ep.close()
                    raise
            return call

        w0 = time.perf_counter()
        started = self.workers.run([start(i) for i in range(S)], opt.step_timeout, [close_later] * S)
        env_wait += time.perf_counter() - w0
        prompts: dict[int, list[int]] = {}
        for i, (status, value) in enumerate(started):
            if status == "ok":
                episodes[i] = value[0]
                try:
                    prompts[i] = self.render.first(value[1])
                except EpisodeFailure:
                    status = "malformed"
            if status != "ok":
                failed[i] = status
        live = [i for i in range(S) if i in prompts and opt.max_total_tokens - len(prompts[i]) >= 1]
        for i in prompts:
            if i not in live:
                failed[i] = "malformed"  # a prompt longer than the trajectory's token budget

        finished: list[Any] = []  # (original indices, batch) of trajectories that ended
        gen_time, gen_tokens = 0.0, 0
        n_waves = max(1, min(opt.env_waves, len(live)))
        waves = deque(_Wave(index=w, live=[int(i) for i in chunk], pending=[prompts[int(i)] for i in chunk])
                      for w, chunk in enumerate(np.array_split(np.asarray(live, dtype=np.int64), n_waves)))
        # Each wave decodes, then its environment steps run in the worker threads while
        # the other waves decode; it decodes again once all of its steps have answered.
        # A wave's calls (members, seeds) depend only on its own history, so the
        # trajectories are the same whatever order the waves happen to be served in.
        while waves:
            wave = waves.popleft()
            if wave.calls is not None:
                w0 = time.perf_counter()
                answers = self.workers.collect(wave.calls, opt.step_timeout,
                                               [(lambda _v, ep=episodes[i]: ep.close()) for i in wave.live])
                env_wait += time.perf_counter() - w0
                wave.calls = None
                cont, obs_ids, done_k = [], [], []
                conv, turn = wave.conv, wave.turn
                for k, (status, value) in enumerate(answers):
                    i = wave.live[k]
                    if status == "ok":
                        try:
                            answer = _checked(value)
                            nxt = None if answer.done else self.render.next(answer.observation)
                        except EpisodeFailure:
                            status = "malformed"
                    if status != "ok":
                        failed[i] = status
                        if status == "timeout":
                            episodes[i] = None  # closed by its thread once the step returns
                        done_k.append(k)
                        continue
                    returns[i] += (opt.reward_gamma ** (turn - 1)) * answer.reward
                    for name, v in answer.metrics.items():
                        env_metrics[name].append(v)
                    if answer.done:
                        ended_by["done"] += 1
                        done_k.append(k)
                    elif turn >= opt.max_turns:
                        ended_by["turn_limit"] += 1
                        done_k.append(k)
                    elif int(conv.seq_lens[k]) + len(nxt) + 1 > opt.max_total_tokens:
                        ended_by["token_budget"] += 1
                        done_k.append(k)
                    else:
                        cont.append(k)
                        obs_ids.append(nxt)
                if done_k:
                    finished.append((np.asarray([wave.live[k] for k in done_k]), conv.select(done_k)))
                if not cont:
                    continue  # every trajectory of this wave ended
                wave.conv = conv.select(cont) if len(cont) < len(wave.live) else conv
                wave.live = [wave.live[k] for k in cont]
                wave.pending = obs_ids

            wave.turn += 1
            live, conv = wave.live, wave.conv
            lens = [len(wave.pending[k]) + (0 if conv is None else int(conv.seq_lens[k])) for k in range(len(live))]
            caps = [min(opt.max_new_tokens, opt.max_total_tokens - L) for L in lens]
            g0 = time.perf_counter()
            before = 0 if conv is None else int(conv.loss_mask.sum())
            conv, responses = self._generate(conv, wave.pending, caps, wave_seed(seed, wave.index), wave.turn)
            conv.group_ids = groups[np.asarray(live)]
            gen_time += time.perf_counter() - g0
            gen_tokens += int(conv.loss_mask.sum()) - before
            texts = [self._text(r) for r in responses]
            turns[np.asarray(live)] = wave.turn
            wave.conv, wave.pending = conv, []
            wave.calls = self.workers.submit(
                [(lambda ep=episodes[i], text=text: ep.step(text)) for i, text in zip(live, texts)])
            waves.append(wave)

        # Close every episode still held (abandoned ones close in their own thread).
        open_eps = [ep for ep in episodes if ep is not None]
        w0 = time.perf_counter()
        closed = self.workers.run([ep.close for ep in open_eps], opt.step_timeout, [None] * len(open_eps))
        env_wait += time.perf_counter() - w0

        keep_failed = opt.failed_trajectories == "zero"
        idx_parts, batch_parts = [], []
        for idx, b in finished:
            sel = [k for k, i in enumerate(idx) if keep_failed or int(i) not in failed]
            if sel:
                idx_parts.append(idx[sel])
                batch_parts.append(b.select(sel) if len(sel) < len(idx) else b)
        batch, rewards = None, np.zeros(0, dtype=np.float32)
        if batch_parts:
            order = np.concatenate(idx_parts)
            batch = RolloutBatch.concat(batch_parts) if len(batch_parts) > 1 else batch_parts[0]
            batch = batch.select(np.argsort(order, kind="stable"))
            order = np.sort(order)
            r = returns[order].copy()
            r[[k for k, i in enumerate(order) if int(i) in failed]] = 0.0
            rewards = r.astype(np.float32)
            batch.rewards = rewards.copy()

        metrics: dict[str, float] = {
            "turns_mean": float(turns[turns > 0].mean()) if (turns > 0).any() else 0.0,
            "env_failures": float(len(failed)),
            **{f"env_{kind}s": float(sum(1 for v in failed.values() if v == kind)) for kind in FAILURE_KINDS},
            "env_close_errors": float(sum(1 for status, _ in closed if status != "ok")),
            "turn_limit_fraction": ended_by["turn_limit"] / S,
            "token_budget_fraction": ended_by["token_budget"] / S,
            "env_wait_time_s": env_wait,
        }
        metrics.update({f"env/{k}": float(np.mean(v)) for k, v in sorted(env_metrics.items())})
        return Rollout(batch=batch, rewards=rewards, metrics=metrics, gen_time=gen_time, gen_tokens=gen_tokens)
