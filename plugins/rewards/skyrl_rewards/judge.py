"""``judge``: a served model grades each response (LLM-as-judge) through an
OpenAI-compatible chat endpoint (``vllm serve``, SGLang, a hosted API).

Each (prompt, response) pair becomes one chat request: ``system`` (if any) and the
``template`` filled with ``{prompt}``, ``{response}`` and ``{reference}`` (the task's
reference answer, empty when it has none). The reply's last match of ``score_pattern``
(its first group) divided by ``scale`` is the score. Requests run ``concurrency`` at a
time, each bounded by ``timeout`` seconds and retried ``retries`` times with exponential
backoff (``backoff``, doubling) on a connection error, a timeout, a 429 or a 5xx; answers
are cached by (prompt, response), so a response sampled twice is judged once.

A pair the judge cannot grade (no answer after the retries, a 4xx, a reply without a
score) stops the job with one message naming the judge and what it answered, unless
``fallback`` is set: then it scores ``fallback`` and is counted (``judge_fallbacks``). The
API key comes from the environment variable ``api_key_env`` names, never the job file.
Counters every step: ``judge_requests``, ``judge_cache_hits``, ``judge_retries``,
``judge_fallbacks``."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import urllib.parse
from typing import Any, Sequence

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError
from skyrl_host.interfaces import Task
from skyrl_host.options import ge, gt, option

DEFAULT_TEMPLATE = (
    "Grade the response to the question below from 0 (wrong or useless) to 10 (correct and complete)."
    "{reference_line}\n\nQuestion:\n{prompt}\n\nResponse:\n{response}\n\n"
    "Think briefly, then end with a line 'Score: N'."
)
RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
MAX_REPLY_BYTES = 4 << 20  # an endpoint's answer larger than this is refused, not read on


def _check_url(_inst: Any, _attr: Any, value: str) -> None:
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http(s) URL of an OpenAI-compatible API (e.g. http://127.0.0.1:8000/v1), "
                         f"found {value!r}")


def _check_pattern(_inst: Any, _attr: Any, value: str) -> None:
    try:
        compiled = re.compile(value)
    except re.error as exc:
        raise ValueError(f"not a regular expression: {exc}") from None
    if compiled.groups < 1:
        raise ValueError("needs a group around the number, e.g. 'Score: (\\d+)'")


def _check_template(_inst: Any, _attr: Any, value: str) -> None:
    try:
        value.format(prompt="", response="", reference="", reference_line="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"may hold only {{prompt}}, {{response}}, {{reference}}, {{reference_line}}: {exc!r}") from None
    if "{response}" not in value:
        raise ValueError("must show the judge the {response}")


@attrs.frozen
class JudgeConfig:
    base_url: str = option(help="the OpenAI-compatible API's base URL, e.g. http://127.0.0.1:8000/v1",
                           validator=_check_url)
    model: str = option(help="the served model's name (its /v1/models id)")
    api_key_env: str | None = option(None, help="the environment variable holding the API key (none: no key)")
    template: str = option(DEFAULT_TEMPLATE, help="the user message: {prompt}, {response}, {reference}, "
                           "{reference_line} (a line with the reference answer, when the task has one)",
                           validator=_check_template)
    system: str | None = option(None, help="a system message before it")
    reply_prefix: str | None = option(
        None, help="the start of the judge's reply, written for it (e.g. 'Score:'; vLLM's and SGLang's "
        "continue_final_message): small judges then answer in the format; parsed with the reply")
    score_pattern: str = option(r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
                                help="a regular expression whose first group is the score (its last match counts)",
                                validator=_check_pattern)
    scale: float = option(10.0, help="the score is the parsed number divided by this", validator=gt(0))
    max_tokens: int = option(256, help="the judge's reply length at most", validator=gt(0))
    temperature: float = option(0.0, help="the judge's sampling temperature", validator=ge(0))
    concurrency: int = option(8, help="requests in flight at once", validator=gt(0))
    timeout: float = option(60.0, help="seconds one request may take", validator=gt(0))
    retries: int = option(3, help="retries of a request that failed to connect, timed out, or got a 429/5xx",
                          validator=ge(0))
    backoff: float = option(1.0, help="seconds before the first retry (doubling)", validator=ge(0))
    fallback: float | None = option(None, help="the score of a pair the judge cannot grade (none: stop the job)")
    cache_size: int = option(100_000, help="graded pairs remembered (by prompt and response)", validator=ge(0))
    weight: float = option(1.0, help="this part's share of the job's reward")


class JudgeError(Exception):
    """A pair the judge could not grade; the message says what happened."""


class Judge:
    def __init__(self, config: JudgeConfig, dataset: Any = None) -> None:
        self.config, self.weight = config, config.weight
        self.key = None
        if config.api_key_env is not None:
            self.key = os.environ.get(config.api_key_env)
            if not self.key:
                raise UserError(Problem(f"the environment variable {config.api_key_env!r} is not set",
                                        key="reward.judge.api_key_env"))
        self.pattern = re.compile(config.score_pattern)
        self.cache: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self.counters = {"judge_requests": 0, "judge_cache_hits": 0, "judge_retries": 0, "judge_fallbacks": 0}

    # -- one request --------------------------------------------------------------------

    def messages(self, task: Task, response: str) -> list[dict[str, str]]:
        reference = task.answer or ""
        line = f"\nThe reference answer is: {reference}" if reference else ""
        user = self.config.template.format(prompt=task.prompt, response=response, reference=reference,
                                           reference_line=line)
        prefix = [{"role": "assistant", "content": self.config.reply_prefix}] if self.config.reply_prefix else []
        return ([{"role": "system", "content": self.config.system}] if self.config.system else []) + [
            {"role": "user", "content": user}] + prefix

    def parse(self, reply: str) -> float:
        found = self.pattern.findall(reply)
        if not found:
            raise JudgeError(f"its reply holds no score matching {self.config.score_pattern!r}: {reply[-200:]!r}")
        last = found[-1][0] if isinstance(found[-1], tuple) else found[-1]
        try:
            return float(last) / self.config.scale
        except ValueError:
            raise JudgeError(f"its score {last!r} is not a number") from None

    async def _ask(self, session: Any, messages: list[dict[str, str]]) -> str:
        import aiohttp

        cfg = self.config
        url = cfg.base_url.rstrip("/") + "/chat/completions"
        body: dict[str, Any] = {"model": cfg.model, "messages": messages, "max_tokens": cfg.max_tokens,
                                "temperature": cfg.temperature}
        if cfg.reply_prefix:  # the reply continues the prefix (an extension vLLM and SGLang serve)
            body.update(continue_final_message=True, add_generation_prompt=False)
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        delay, last = cfg.backoff, ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                self.counters["judge_retries"] += 1
                await asyncio.sleep(delay)
                delay *= 2
            self.counters["judge_requests"] += 1
            try:
                async with session.post(url, json=body, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=cfg.timeout)) as reply:
                    raw = await reply.content.read(MAX_REPLY_BYTES + 1)
                    if len(raw) > MAX_REPLY_BYTES:
                        raise JudgeError(f"{url} answered more than {MAX_REPLY_BYTES} bytes")
                    text = raw.decode("utf-8", errors="replace")
                    if reply.status in RETRY_STATUS:
                        last = f"HTTP {reply.status}: {text[:200]}"
                        continue
                    if reply.status != 200:
                        raise JudgeError(f"{url} answered HTTP {reply.status}: {text[:300]}")
                    try:
                        content = str(json.loads(text)["choices"][0]["message"]["content"] or "")
                        return (cfg.reply_prefix or "") + content
                    except (ValueError, KeyError, IndexError, TypeError):
                        raise JudgeError(f"{url} answered something that is not a chat completion: {text[:200]!r}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise JudgeError(f"{url} did not answer after {cfg.retries + 1} attempt(s): {last}")

    async def _grade(self, session: Any, gate: asyncio.Semaphore, task: Task, response: str) -> float:
        async with gate:
            try:
                return self.parse(await self._ask(session, self.messages(task, response)))
            except JudgeError as exc:
                if self.config.fallback is None:
                    raise UserError(Problem(f"the judge {self.config.model!r} could not grade a response: {exc} "
                                            f"(set fallback to score such responses instead)",
                                            key="reward.judge")) from None
                self.counters["judge_fallbacks"] += 1
                return self.config.fallback

    async def _grade_all(self, pending: list[tuple[Task, str]]) -> list[float]:
        import aiohttp

        gate = asyncio.Semaphore(self.config.concurrency)
        async with aiohttp.ClientSession() as session:
            return list(await asyncio.gather(*(self._grade(session, gate, t, r) for t, r in pending)))

    # -- the RewardPart ---------------------------------------------------------------------

    def score(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        keys = [(t.prompt, c) for t, c in zip(tasks, completions)]
        todo = {}
        for (task, response), key in zip(zip(tasks, completions), keys):
            if key in self.cache:
                self.counters["judge_cache_hits"] += 1
                self.cache.move_to_end(key)
            elif key in todo:
                self.counters["judge_cache_hits"] += 1  # asked once, for both
            else:
                todo[key] = (task, response)
        if todo:
            grades = asyncio.run(self._grade_all(list(todo.values())))
            for key, grade in zip(todo, grades):
                self.cache[key] = grade
        out = [self.cache[k] for k in keys]
        while len(self.cache) > self.config.cache_size:
            self.cache.popitem(last=False)
        return out

    def reward_metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counters.items()}


@hookimpl
def skyrl_register_rewards(register: Any) -> None:
    register("judge", Judge, config=JudgeConfig,
             description="LLM-as-judge: a served model grades each response through an OpenAI-compatible endpoint")
