"""The continuous batcher (``skyrl_engines.continuous``): requests submitted together or
while others decode get what each would get alone (greedy: EmbeddedEngine.generate's
tokens and logprobs; seeded sampling: the same draws whatever else is batched), rows of
different adapters share a decode batch, newcomers join at the next step, stops end rows
early."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from skyrl_engines.continuous import Adapter, ContinuousBatcher
from skyrl_engines.embedded import Embedded, EmbeddedConfig
from skyrl_host.interfaces import LoadedModel
from skyrl_samplers.greedy import build_greedy as GreedySampler  # the greedy sampler plugin's factory

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [20, 21], [4, 4, 4, 4, 4, 4, 4], [9], [30, 2, 17, 9, 22, 6, 13, 8, 1, 5]]
CONFIG = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]}
CHARS = "abcdefghijklmnopqrstuvwxyz012345"  # token i decodes to CHARS[i]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def char_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def engine(max_batch_size: int = 256):
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         intermediate_size=128, vocab_size=32, tie_word_embeddings=True, initializer_range=0.2)
    e = Embedded(EmbeddedConfig(max_batch_size=max_batch_size))
    e.start(LoadedModel(model=Qwen3ForCausalLM(config), tokenizer=char_tokenizer(), stop_token_ids=[1]))
    return e


def random_adapter(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in CONFIG["targets"] and isinstance(m, torch.nn.Linear):
            out[f"{name}.lora_A"] = torch.randn(CONFIG["rank"], m.in_features, generator=g) * 0.3
            out[f"{name}.lora_B"] = torch.randn(m.out_features, CONFIG["rank"], generator=g) * 0.3
    return out


def solo_greedy(e, prompt: list[int], max_tokens: int) -> tuple[list[int], np.ndarray, bool]:
    batch = e.generate([prompt], n=1, sampler=GreedySampler(), max_new_tokens=max_tokens, seed=0)
    return batch.response(0).tolist(), np.asarray(batch.response_logprobs(0)), not bool(batch.truncated[0])


def assert_matches_solo(result, solo) -> None:
    tokens, logprobs, stopped = solo
    seq = result["sequences"][0]
    assert seq["tokens"].tolist() == tokens
    np.testing.assert_allclose(seq["logprobs"], logprobs, atol=1e-5)
    assert seq["stop_reason"] == ("stop" if stopped else "length")


def wait_for(predicate, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.0005)


def test_greedy_together_and_staggered_equal_each_request_alone() -> None:
    e = engine(max_batch_size=3)  # 7 prompts, 3 live rows: the rest wait and join as rows finish
    solo = [solo_greedy(e, p, 12) for p in PROMPTS]
    b = ContinuousBatcher(e)
    try:
        together = [f.result(30) for f in [b.submit(p, temperature=0, max_tokens=12) for p in PROMPTS]]
        for r, s in zip(together, solo):
            assert_matches_solo(r, s)
        assert b.stats["max_rows"] == 3
        staggered = []
        for p in PROMPTS:  # each submitted while the ones before decode
            before = b.stats["decode_forwards"]
            staggered.append(b.submit(p, temperature=0, max_tokens=12))
            wait_for(lambda: b.stats["decode_forwards"] >= before + 2 or staggered[-1].done())
        for f, s in zip(staggered, solo):
            assert_matches_solo(f.result(30), s)
    finally:
        b.close()


def test_seeded_sampling_is_the_same_whatever_else_is_batched() -> None:
    e = engine()
    b = ContinuousBatcher(e)
    params = dict(n=3, temperature=0.9, top_k=6, top_p=0.9, seed=11, max_tokens=10)
    try:
        alone = b.submit([5, 6, 7], **params).result(30)
        others = [b.submit(p, n=2, temperature=1.3, seed=i, max_tokens=14) for i, p in enumerate(PROMPTS)]
        wait_for(lambda: b.stats["decode_forwards"] >= 3)
        crowded = b.submit([5, 6, 7], **params)
        more = [b.submit(p, temperature=0, max_tokens=5) for p in PROMPTS]
        crowded = crowded.result(30)
        for f in others + more:
            f.result(30)
        other_seed = b.submit([5, 6, 7], **{**params, "seed": 12}).result(30)
    finally:
        b.close()
    toks = [s["tokens"].tolist() for s in alone["sequences"]]
    assert toks == [s["tokens"].tolist() for s in crowded["sequences"]]
    for a, c in zip(alone["sequences"], crowded["sequences"]):
        np.testing.assert_allclose(a["logprobs"], c["logprobs"], atol=1e-5)
    assert len(set(map(tuple, toks))) > 1  # the samples of one request differ from each other
    assert toks != [s["tokens"].tolist() for s in other_seed["sequences"]]
    # top_k = 6: every sampled token is among the 6 most likely, so its logprob is a share of <= 6 tokens
    assert all((s["logprobs"] <= 0).all() and (s["logprobs"] > -30).all() for s in alone["sequences"])


def test_two_adapters_and_the_base_in_one_batch_equal_their_solo_runs() -> None:
    e = engine()
    tensors = {k: random_adapter(e.model, seed) for k, seed in (("a", 1), ("b", 2))}
    solo = {}
    for key in ("a", "b"):
        e.update_adapter(list(tensors[key].items()), CONFIG, version=1)
        solo[key] = [solo_greedy(e, p, 10) for p in PROMPTS[:4]]
    e2 = engine()  # a fresh engine: no adapter served, so generate is the base model
    solo[None] = [solo_greedy(e2, p, 10) for p in PROMPTS[:4]]
    assert solo["a"] != solo["b"] and solo["a"] != solo[None]  # the adapters change what is sampled
    b = ContinuousBatcher(e2)
    adapters = {k: Adapter(k, tensors[k], CONFIG) for k in ("a", "b")}
    try:
        futures = {k: [b.submit(p, temperature=0, max_tokens=10, adapter=adapters.get(k)) for p in PROMPTS[:4]]
                   for k in ("a", None, "b")}
        for k, fs in futures.items():
            for f, s in zip(fs, solo[k]):
                assert_matches_solo(f.result(30), s)
        assert b.stats["max_adapters"] == 2 and b.stats["max_rows"] >= 8  # the adapters' rows decoded together
    finally:
        b.close()


def test_a_request_submitted_while_another_decodes_joins_the_next_step() -> None:
    e = engine()
    long_prompt, short_prompt = PROMPTS[1], PROMPTS[4]
    solo_long, solo_short = solo_greedy(e, long_prompt, 40), solo_greedy(e, short_prompt, 12)
    assert len(solo_long[0]) == 40 and len(solo_short[0]) == 12  # neither meets a stop token
    b = ContinuousBatcher(e)
    try:
        first = b.submit(long_prompt, temperature=0, max_tokens=40)
        wait_for(lambda: b.stats["decode_forwards"] >= 4)
        second = b.submit(short_prompt, temperature=0, max_tokens=12)
        assert_matches_solo(second.result(30), solo_short)
        assert_matches_solo(first.result(30), solo_long)
        # alone they take 39 + 11 decode forwards; together the short one rides along
        assert b.stats["decode_forwards"] == 39 and b.stats["prefill_forwards"] == 2
    finally:
        b.close()


def test_stop_tokens_and_strings_end_rows_early() -> None:
    e = engine()
    prompt = PROMPTS[1]
    tokens, _, _ = solo_greedy(e, prompt, 24)
    stop_tok = tokens[5]
    k = tokens.index(stop_tok) + 1
    text = "".join(CHARS[t] for t in tokens)
    stop_str = text[7:10]
    k_str = next(j for j in range(1, 25) if stop_str in text[:j])
    b = ContinuousBatcher(e)
    try:
        by_token = b.submit(prompt, temperature=0, max_tokens=24, stop_token_ids=[stop_tok]).result(30)
        assert b.stats["decode_forwards"] == k - 1  # the row ended at the stop token, not after 24 tokens
        by_string = b.submit(prompt, temperature=0, max_tokens=24, stop_strings=["zzzzz", stop_str]).result(30)
        assert b.stats["decode_forwards"] == (k - 1) + (k_str - 1)
    finally:
        b.close()
    seq = by_token["sequences"][0]
    assert seq["tokens"].tolist() == tokens[:k] and seq["stop_reason"] == "stop"
    seq = by_string["sequences"][0]
    assert seq["tokens"].tolist() == tokens[:k_str] and seq["stop_reason"] == "stop"


def test_prompt_logprobs_and_a_bad_adapter_fail_alone() -> None:
    e = engine()
    b = ContinuousBatcher(e)
    prompt = PROMPTS[6]
    try:
        bad = b.submit(prompt, temperature=0, max_tokens=3, adapter=Adapter("bad", {"nope": torch.zeros(1)}, CONFIG))
        good = b.submit(prompt, temperature=0, max_tokens=3, prompt_logprobs=True)
        with pytest.raises(ValueError, match="nope"):
            bad.result(30)
        lp = good.result(30)["prompt_logprobs"]
        assert b.queued_tokens == 0
    finally:
        b.close()
    with torch.no_grad():
        logits = e.model(input_ids=torch.tensor([prompt])).logits[0]
    want = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].numpy()
    assert np.isnan(lp[0]) and len(lp) == len(prompt)
    np.testing.assert_allclose(lp[1:], want, atol=1e-5)


def test_a_fault_inside_a_shared_batch_fails_only_the_request_that_causes_it() -> None:
    """A request whose own forward fails (a fault injected into the model: any prefill that
    holds the token POISON raises) shares one prefill with six others. The batch cannot
    tell whose row it was: every request starts over alone, the poisoned one fails alone
    with the error, and the six give exactly what they give in a batch without it."""
    POISON = 31
    prompts = [p for p in PROMPTS if POISON not in p][:6]
    kw = dict(temperature=0.8, top_k=0, top_p=1.0, max_tokens=6)
    e = engine()
    b = ContinuousBatcher(e)
    try:
        with b._cond:  # every request waits until all are queued: one shared prefill
            want = [b.submit(p, seed=i, **kw) for i, p in enumerate(prompts)]
        want = [f.result(60) for f in want]
    finally:
        b.close()

    def poison(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > 1 and bool((ids == POISON).any()):
            raise RuntimeError("injected fault: a poisoned prompt")

    hook = e.model.model.register_forward_pre_hook(poison, with_kwargs=True)
    b = ContinuousBatcher(e)
    try:
        with b._cond:
            got = [b.submit(p, seed=i, **kw) for i, p in enumerate(prompts)]
            bad = b.submit([2, POISON, 3], seed=9, **kw)
        with pytest.raises(RuntimeError, match="injected fault"):
            bad.result(60)
        got = [f.result(60) for f in got]
        assert b.stats["isolated"] == 7 and b.queued_tokens == 0
        # The batcher goes on batching: two more requests share a batch again.
        again = [b.submit(p, seed=i, **kw) for i, p in enumerate(prompts[:2])]
        again = [f.result(60) for f in again]
    finally:
        b.close()
        hook.remove()
    for w, g in zip(want + want[:2], got + again):
        for sw, sg in zip(w["sequences"], g["sequences"]):
            assert sg["tokens"].tolist() == sw["tokens"].tolist() and sg["stop_reason"] == sw["stop_reason"]
            np.testing.assert_allclose(sg["logprobs"], sw["logprobs"], atol=1e-5)


def test_recorded_routes_are_the_models_own_and_kept_sets_hold_the_token(skyrl_host) -> None:
    from skyrl_toolkit.routing import RouterHooks

    reg = skyrl_host.registry.get("models", "qwen")
    loaded = reg.create(reg.config(preset="tiny-moe")).load(alphabet="0123456789+=:", seed=0)
    e = Embedded(EmbeddedConfig(return_routed_experts=True))
    e.start(loaded)
    b = ContinuousBatcher(e)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12]]
    try:
        futures = [b.submit(p, n=2, temperature=1.0, top_k=3, seed=5, max_tokens=6, record=True) for p in prompts]
        results = [f.result(30) for f in futures]
    finally:
        b.close()
    hooks = RouterHooks(loaded.model, loaded.routers)  # a teacher-forced forward of each whole sequence
    try:
        for p, r in zip(prompts, results):
            for seq in r["sequences"]:
                toks = seq["tokens"].tolist()
                assert all(len(k) == 3 and t in k for t, k in zip(toks, seq["kept"]))  # top_k 3 sets, token in them
                with torch.no_grad(), hooks.recording():
                    loaded.model(torch.tensor([p + toks[:-1]]))
                    want = np.sort(hooks.take().numpy(), axis=-1)
                got = np.sort(np.concatenate([r["prompt_routes"], seq["routes"][:-1]]), axis=-1)
                np.testing.assert_array_equal(got, want)
                assert not seq["routes"][-1].any()  # the last token was never fed back
    finally:
        hooks.remove()


def test_a_linear_attention_model_decodes_in_waves_and_equals_solo_runs(skyrl_host) -> None:
    reg = skyrl_host.registry.get("models", "qwen")
    loaded = reg.create(reg.config(preset="tiny-qwen3.5")).load(alphabet="0123456789+=:", seed=0)
    e = Embedded(EmbeddedConfig())
    e.start(loaded)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12]]
    solo = [solo_greedy(e, p, 8) for p in prompts]
    b = ContinuousBatcher(e)
    assert not b.slots  # its Gated DeltaNet states cannot take rows into a running batch
    try:
        first = [b.submit(p, temperature=0, max_tokens=8) for p in prompts[:2]]
        wait_for(lambda: b.stats["decode_forwards"] >= 1)
        late = b.submit(prompts[2], temperature=0, max_tokens=8)  # waits for the wave to end
        for f, s in zip(first + [late], solo):
            assert_matches_solo(f.result(30), s)
    finally:
        b.close()
    assert b.stats["prefill_forwards"] >= 2
