"""The SFT job: packing boundaries and the loss mask (against per-document losses of
the plain model), the loss going down on a small task, exact resume (same documents,
same metrics), the example pair SFT -> RL, and job-file mistakes as user errors."""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib

import numpy as np
import pytest

from skyrl_host import hookimpl
from skyrl_host.checkpoints import latest_checkpoint
from skyrl_host.errors import JobFailed
from skyrl_host.jobs.sft import SFTLoss, pack_documents, pieces_of
from skyrl_host.testing import learning_metrics, step_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example_data_module():
    spec = importlib.util.spec_from_file_location("sft_warmstart_data", ROOT / "examples" / "sft_warmstart_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two reverse_digits corpora (prompt masked out): 3-5 digits and 6-8 digits."""
    root = tmp_path_factory.mktemp("corpora")
    build = _example_data_module().build
    build(root / "short", documents=600, seed=11, min_len=3, max_len=5)
    build(root / "long", documents=300, seed=12, min_len=6, max_len=8)
    return root


JOB = """
[job]
kind = "sft"
seed = 5
steps = {steps}
data_paths = {paths}
tokens_per_step = {budget}
max_seq_len = {max_seq_len}
alphabet = "0123456789:"
checkpoint_every = {every}
record_samples = true
threads = 1
output_dir = "{out}"

[model]
family = "qwen"
preset = "tiny"

[data]
{data}

[backend]
name = "torch"
lr = 3e-3
micro_batch_tokens = 256
"""


def write_job(tmp_path, corpora, name="job", steps=4, every=0, budget=400, max_seq_len=64, data='strategy = "shuffled"',
              paths=None):
    out = tmp_path / f"{name}_out"
    path = tmp_path / f"{name}.toml"
    paths = paths if paths is not None else [str(corpora / "short")]
    path.write_text(JOB.format(steps=steps, every=every, budget=budget, max_seq_len=max_seq_len, data=data,
                               paths=json.dumps(paths), out=out))
    return path, out


def comparable(row):
    """Every metric but timings (skyrl_host.testing.is_timing_metric)."""
    return learning_metrics(row, transport=True)


# -- packing and masking, against the plain model ------------------------------------


class Doc:
    """A stand-in corpus of in-memory documents (the reader's tokens/mask interface)."""

    def __init__(self, docs, masks):
        self.docs, self.masks = docs, masks
        self.lengths = np.asarray([len(d) for d in docs], dtype=np.int32)

    def tokens(self, i):
        return self.docs[i]

    def mask(self, i):
        return self.masks[i]


def _tiny_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, vocab_size=24, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(torch.float64)


def _reference(model, docs, masks):
    """The mean NLL over mask-1 tokens (never a document's first token) and its
    gradient norm, one document at a time through the plain model."""
    import torch

    model.zero_grad()
    total, count = 0.0, 0
    for ids, m in zip(docs, masks):
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
        lp = torch.log_softmax(model(input_ids=x).logits[0, :-1], dim=-1).gather(-1, x[0, 1:, None])[:, 0]
        keep = torch.as_tensor(np.asarray(m[1:], dtype=np.float64))
        total = total - (lp * keep).sum()
        count += int(keep.sum())
    loss = total / count
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), float(norm)


def _train_once(model, corpus, pieces, pack_length, micro_batch_tokens=4096):
    from skyrl_backends.torch import TorchBackendConfig
    from skyrl_backends.torch_backend import TorchBackend
    from skyrl_host.interfaces import LoadedModel

    backend = TorchBackend(TorchBackendConfig(lr=1e-3, max_grad_norm=0.0, pack_length=pack_length,
                                              micro_batch_tokens=micro_batch_tokens))
    backend.start(LoadedModel(model, None, [1]), seed=0, total_steps=1, reference=False)
    batch = pack_documents([corpus], pieces)
    loss = SFTLoss()
    return backend.train_step(batch, loss.advantages(batch, None), loss, temperature=1.0, max_new_tokens=64)


def test_packed_documents_train_like_separate_documents_and_the_mask_holds() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 24, n).astype(np.uint16) for n in (9, 5, 13, 7)]
    masks = [np.ones(len(d), np.uint8) for d in docs]
    masks[1][:3] = 0  # a prompt
    masks[2][-4:] = 0  # trailing tokens that do not train
    corpus = Doc(docs, masks)
    pieces = [[0, i, 0, len(d)] for i, d in enumerate(docs)]
    model = _tiny_model()
    want_loss, want_norm = _reference(copy.deepcopy(model), docs, masks)
    # All four documents in one row of one micro-batch (positions restart per document) ...
    packed = _train_once(copy.deepcopy(model), corpus, pieces, pack_length=4096)
    # ... and each document in a row and a micro-batch of its own.
    alone = _train_once(copy.deepcopy(model), corpus, pieces, pack_length=1, micro_batch_tokens=1)
    for got in (packed, alone):
        assert got["loss"] == pytest.approx(want_loss, rel=1e-9)
        assert got["grad_norm"] == pytest.approx(want_norm, rel=1e-7)
        assert got["loss_tokens"] == sum(int(m[1:].sum()) for m in masks)
        assert got["tokens"] == sum(len(d) for d in docs)
    # A masked-out last token changes nothing; changing a trained token changes the loss.
    edited = [d.copy() for d in docs]
    edited[2][-1] = (int(edited[2][-1]) + 1) % 24
    assert _train_once(copy.deepcopy(model), Doc(edited, masks), pieces, 4096)["loss"] == pytest.approx(want_loss, rel=1e-12)
    edited[0][-1] = (int(edited[0][-1]) + 1) % 24
    assert abs(_train_once(copy.deepcopy(model), Doc(edited, masks), pieces, 4096)["loss"] - want_loss) > 1e-6


def test_long_documents_are_split_so_every_token_is_predicted_once() -> None:
    assert pieces_of(1, 4, "split") == []
    assert pieces_of(4, 4, "split") == [(0, 4)]
    assert pieces_of(10, 4, "split") == [(0, 4), (3, 7), (6, 10)]
    assert pieces_of(11, 4, "split") == [(0, 4), (3, 7), (6, 10), (9, 11)]
    assert pieces_of(10, 4, "truncate") == [(0, 4)]
    for n in range(2, 40):
        predicted = [t for a, b in pieces_of(n, 5, "split") for t in range(a + 1, b)]
        assert predicted == list(range(1, n))  # every token but the first, once, in order


# -- the job end to end ----------------------------------------------------------------


@pytest.mark.slow
def test_sft_job_lowers_the_loss_and_saves_a_model_rl_can_load(skyrl_cli, corpora, tmp_path) -> None:
    import torch
    import transformers

    path, out = write_job(tmp_path, corpora, steps=30, budget=512)
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    rows = step_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in ("loss", "tokens", "loss_tokens", "tokens_per_s", "lr", "grad_norm", "epoch_0", "documents"):
        assert key in rows[0], key
    first, last = rows[0]["loss"], np.mean([r["loss"] for r in rows[-3:]])
    assert first > 2.0  # about log(14): the random preset guesses
    assert last < 0.6 * first, (first, last)
    assert all(r["tokens"] <= 512 for r in rows)
    assert rows[-1]["epoch_0"] == pytest.approx(sum(r["documents"] for r in rows) / 600, abs=1 / 600)
    assert (out / "plot.png").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    tok = transformers.AutoTokenizer.from_pretrained(out / "final")
    ids = torch.tensor([tok.encode("4071:")])
    assert model(ids).logits.shape[-1] >= 12


@pytest.mark.slow
def test_resume_draws_the_same_documents_and_reports_the_same_metrics(skyrl_cli, skyrl_plugin, corpora, tmp_path) -> None:
    paths = [str(corpora / "short"), str(corpora / "long")]
    # Two datasets mixed, documents split into pieces that spill over step boundaries.
    data = 'strategy = "mix"\nweights = [1, 2]'
    kw = dict(steps=6, every=2, budget=60, max_seq_len=7, data=data, paths=paths)
    full_path, full_out = write_job(tmp_path, corpora, "full", **kw)
    assert skyrl_cli("run", str(full_path)).exit_code == 0
    expected = [comparable(r) for r in step_rows(full_out)]
    expected_docs = (full_out / "samples.jsonl").read_text()
    assert sum(len(json.loads(line)["docs"]) for line in expected_docs.splitlines()) > 6 * 5

    class Crash:
        """Stops the job once, at step 5 (after the checkpoint of step 4)."""

        armed = True

        @hookimpl
        def skyrl_step_finished(self, step):
            if step == 5 and self.armed:
                self.armed = False
                raise JobFailed("the machine went away")

    path, out = write_job(tmp_path, corpora, "crashed", **kw)
    skyrl_plugin(Crash(), "crash")
    assert skyrl_cli("run", str(path)).exit_code == 1
    assert latest_checkpoint(out)[0] == 4
    resumed = skyrl_cli("run", str(path), "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert "(resumed after step 4)" in resumed.stderr
    got = [comparable(r) for r in step_rows(out)]
    assert [r["step"] for r in got] == list(range(1, 7))
    assert got == expected
    assert (out / "samples.jsonl").read_text() == expected_docs



# -- mistakes in the job file ---------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, expected",
    [
        (('strategy = "shuffled"', 'strategy = "shufled"'),
         ":20: data.strategy: unknown data strategy 'shufled' (did you mean 'shuffled'?); available: "),
        (("/short", "/nowhere"),
         ":6: job.data_paths: [0] '{root}/nowhere': no corpus at this prefix: expected {root}/nowhere.json"),
        (('strategy = "shuffled"', 'strategy = "mix"\nweights = [1, 2, 3]'),
         ":21: data.weights: has 3 entries, expected one per path of job.data_paths (1)"),
        (("tokens_per_step = 400", "tokens_per_step = 32"),
         ":7: job.tokens_per_step: expected at least max_seq_len (64), found 32"),
        (('strategy = "shuffled"', 'strategy = "mix"\nweights = [1]\ntemperature = 2.0'),
         ":22: data.temperature: give either weights or temperature, not both"),
        (('alphabet = "0123456789:"', ""),
         ":17: model.preset: a preset model builds a character-level tokenizer: set job.alphabet to the characters"),
    ],
    ids=["unknown-strategy", "missing-path", "weights-length", "budget-below-max-seq-len", "weights-and-temperature",
         "preset-without-alphabet"],
)
def test_job_file_mistakes_are_user_errors(skyrl_cli, corpora, tmp_path, edit, expected) -> None:
    path, out = write_job(tmp_path, corpora)
    text = path.read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1]))
    for command in ("validate", "run"):
        result = skyrl_cli(command, str(path))
        assert result.exit_code == 2, result.stderr
        assert result.stderr.startswith(f"error: {path}" + expected.format(root=corpora)), result.stderr
        assert "Traceback" not in result.stderr
    assert not (out / "metrics.jsonl").exists()


def test_sft_job_rejects_tables_it_does_not_use(skyrl_cli, corpora, tmp_path) -> None:
    path, _ = write_job(tmp_path, corpora)
    path.write_text(path.read_text() + '\n[dataset]\nname = "reverse_digits"\n')
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "dataset: job kind 'sft' does not use [dataset]; it uses [model], [backend], [data]" in result.stderr


# -- the example pair: SFT warm start, then RL from its checkpoint ---------------------


@pytest.mark.slow
def test_example_pair_sft_then_rl_from_its_checkpoint(skyrl_cli, tmp_path) -> None:
    corpus = tmp_path / "reverse_digits_sft"
    _example_data_module().build(corpus, documents=2000)
    sft_out, rl_out, scratch_out = tmp_path / "sft", tmp_path / "rl", tmp_path / "scratch"
    result = skyrl_cli("run", str(ROOT / "examples" / "sft_warmstart.toml"), "--set", f"job.data_paths=['{corpus}']",
                       "--set", f"job.output_dir='{sft_out}'", "--set", "job.steps=60", "--set", "job.threads=1")
    assert result.exit_code == 0, result.stderr
    sft_rows = step_rows(sft_out)
    assert sft_rows[-1]["loss"] < 0.5 * sft_rows[0]["loss"]

    rl_job = ROOT / "examples" / "rl_from_sft.toml"
    small = ["--set", "job.steps=2", "--set", "job.batch_size=16", "--set", "job.n_samples=4", "--set", "job.threads=1",
             "--set", "job.save_final=false"]
    result = skyrl_cli("run", str(rl_job), "--set", f"model.path='{sft_out / 'final'}'", "--set", f"job.output_dir='{rl_out}'", *small)
    assert result.exit_code == 0, result.stderr
    # The same RL job from the untrained preset (same tokenizer: the task's alphabet).
    scratch = tmp_path / "scratch.toml"
    scratch.write_text(rl_job.read_text().replace('path = "runs/sft_warmstart/final"', 'preset = "tiny"'))
    result = skyrl_cli("run", str(scratch), "--set", f"job.output_dir='{scratch_out}'", *small)
    assert result.exit_code == 0, result.stderr
    warm, cold = step_rows(rl_out)[0], step_rows(scratch_out)[0]
    assert warm["reward_mean"] > cold["reward_mean"] + 0.2, (warm["reward_mean"], cold["reward_mean"])


@pytest.mark.slow
def test_a_corpus_at_an_fsspec_url_trains_like_the_local_one(skyrl_cli, corpora, tmp_path) -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    for f in corpora.glob("short.*"):
        memory.pipe(f"/sft-test/{f.name}", f.read_bytes())
    runs = {}
    for name, data_path in (("local", str(corpora / "short")), ("remote", "memory://sft-test/short")):
        path, out = write_job(tmp_path, corpora, name, steps=3, paths=[data_path])
        result = skyrl_cli("run", str(path), "--set", f"job.cache_dir='{tmp_path / 'cache'}'", "--set", "job.save_final=false")
        assert result.exit_code == 0, result.stderr
        runs[name] = [comparable(r) for r in step_rows(out)]
    assert runs["remote"] == runs["local"]
    assert any((tmp_path / "cache").rglob("tokens.blocks"))  # read lazily through the local cache


@pytest.mark.slow
@pytest.mark.slow
def test_sft_on_the_megatron_backend_follows_the_torch_backend_and_resumes(skyrl_cli, corpora, tmp_path) -> None:
    """The same SFT job with [backend] name = "megatron": per-step loss and grad norm equal
    the torch backend's (same initial weights, fp32; within 1e-5), its checkpoints are
    megatron-core distributed checkpoints, and a copy of the run cut back to its step-5
    checkpoint and resumed repeats steps 6 to 10 metric for metric."""
    import shutil

    from skyrl_backends.megatron_backend import release_parallel_state

    try:
        _megatron_sft_runs(skyrl_cli, corpora, tmp_path, shutil)
    finally:
        release_parallel_state()  # (the one-process group megatron-core needed in this process)


def _megatron_sft_runs(skyrl_cli, corpora, tmp_path, shutil) -> None:
    rows = {}
    for name in ("torch", "megatron"):
        path, out = write_job(tmp_path, corpora, name, steps=10, every=5, budget=512)
        result = skyrl_cli("run", str(path), "--set", f'backend.name="{name}"')
        assert result.exit_code == 0, result.stderr[-3000:]
        rows[name] = step_rows(out)
    for a, b in zip(rows["megatron"], rows["torch"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert (a["tokens"], a["loss_tokens"], a["documents"]) == (b["tokens"], b["loss_tokens"], b["documents"])
    assert rows["megatron"][-1]["loss"] < 0.85 * rows["megatron"][0]["loss"]
    out = tmp_path / "megatron_out"
    assert (out / "checkpoints" / "step_000005" / "backend" / "metadata.json").is_file()
    path, cut = write_job(tmp_path, corpora, "cut", steps=10, every=5, budget=512)
    shutil.copytree(out, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000010")
    shutil.rmtree(cut / "final")
    result = skyrl_cli("run", str(path), "--resume", "--set", 'backend.name="megatron"')
    assert result.exit_code == 0, result.stderr[-3000:]
    assert "(resumed after step 5)" in result.stderr
    assert [comparable(r) for r in step_rows(cut)] == [comparable(r) for r in rows["megatron"]]


def test_sft_with_a_quantized_precision_trains_through_the_fake_quantized_forward(skyrl_cli, corpora, tmp_path) -> None:
    """``[precision] name = "int4"`` in an SFT job: the forward computes with int4
    weights (straight-through to the float32 masters) and the loss still falls; the
    first step's loss differs from the bf16 run's (the quantized forward is in use)."""
    losses = {}
    for name in ("bf16", "int4"):
        path, out = write_job(tmp_path, corpora, name=name, steps=15, budget=512)
        path.write_text(path.read_text() + f'\n[precision]\nname = "{name}"\n')
        result = skyrl_cli("run", str(path))
        assert result.exit_code == 0, result.stderr
        losses[name] = [r["loss"] for r in step_rows(out)]
    assert losses["int4"][0] != losses["bf16"][0]
    assert abs(losses["int4"][0] - losses["bf16"][0]) < 0.2 * losses["bf16"][0]
    assert np.mean(losses["int4"][-3:]) < 0.8 * losses["int4"][0], losses["int4"]


@pytest.mark.slow
def test_sft_on_two_ddp_ranks_in_ray_actors_trains_like_one_process(corpora, tmp_path) -> None:
    """``[cluster] launcher = "ray"`` with two backend ranks (DDP across two actors): the
    driver reads and packs the documents, each rank trains on its share of the step's
    sequences, and the step is the one-process step (float32 reduction order); the final
    model is gathered and saved; the actors are gone afterwards."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    import ray
    rows = {}
    for name, extra in (("local", ""), ("ray", 'data_parallel = "ddp"\n')):
        path, out = write_job(tmp_path, corpora, name=name, steps=5, budget=256)
        text = path.read_text() + extra
        if name == "ray":
            text = text.replace("[model]", '[cluster]\nlauncher = "ray"\ntrainer_ranks = 2\ncpus_per_actor = 0.5\n\n[model]')
        path.write_text(text)
        # (a short folder: Ray's socket paths under it must stay within AF_UNIX's 107 bytes,
        # and pytest's own temporary folders are deep, deeper still under pytest-xdist)
        ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp)
        try:
            result = subprocess.run([str(pathlib.Path(sys.executable).parent / "skyrl"), "run", str(path)],
                                    capture_output=True, text=True, env=env, timeout=600)
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[name] = [comparable(r) for r in step_rows(out)]
    assert len(rows["ray"]) == 5
    for a, b in zip(rows["ray"], rows["local"]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    assert (tmp_path / "ray_out" / "final" / "config.json").is_file()
    assert not ray.is_initialized()
