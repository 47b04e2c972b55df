"""The megatron backend in whole rl jobs (issue 18): a run resumed from a checkpoint
equals the uninterrupted run, metric for metric (also with expert parallelism over Ray
actors; tensor parallelism there matches one process); its final Hugging Face folder gives the
trained megatron model's logits in transformers; the quickstart learns with
``--set backend.name=megatron``; ``skyrl validate`` refuses what the backend cannot run."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from skyrl_host.testing import learning_metrics, step_rows

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[3]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


@pytest.fixture(autouse=True, scope="module")
def released_parallel_state():
    """The megatron backend starts a one-process torch.distributed group for megatron-core;
    later tests in this process must not find it (they would read it as a launcher's)."""
    yield
    from skyrl_backends.megatron_backend import release_parallel_state

    release_parallel_state()


def write_job(make_job, tmp_path, name: str, steps: int, every: int):
    job = make_job(tmp_path, name,
                   job={"steps": steps, "batch_size": 4, "checkpoint_every": every, "save_final": None,
                        "output_dir": tmp_path / f"{name}_out"},
                   dataset={"prefix": None}, engine=None, algorithm={"name": "grpo"}, precision={"name": "int4"},
                   backend={"name": "megatron", "lr": 1e-3, "micro_batch_tokens": 128})
    return job.path, job.out


def test_resume_equals_the_uninterrupted_run_and_the_final_folder_loads(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """A 6-step run (int4 weights: the engine computes with the quantized weights the
    megatron trainer used) with checkpoints every 2 steps; a copy of its folder cut back to
    the step-4 checkpoint (as a kill -9 after it leaves it) and resumed repeats steps 5 and
    6 metric for metric (the host's checkpoint machinery is the torch backend's, kill -9 and
    torn writes tested there: tests/test_rl_job.py)."""
    import shutil

    steps = 6
    full_path, full_out = write_job(skyrl_tiny_rl_job, tmp_path, "full", steps, 2)
    proc = subprocess.run([SKYRL, "run", str(full_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr  # megatron-core's import-time warnings stay quiet
    expected = [learning_metrics(r, transport=True) for r in step_rows(full_out)]
    # the engine serves what the megatron trainer computes (the float32 masters would be 1e-2 off)
    assert max(r["logprob_diff_max"] for r in expected) < 1e-4

    path, out = write_job(skyrl_tiny_rl_job, tmp_path, "cut", steps, 2)
    shutil.copytree(full_out, out)
    shutil.rmtree(out / "checkpoints" / "step_000006")
    shutil.rmtree(out / "final")
    result = skyrl_cli("run", str(path), "--resume")
    assert result.exit_code == 0, result.stderr[-3000:]
    assert "(resumed after step 4)" in result.stderr
    assert [learning_metrics(r, transport=True) for r in step_rows(out)] == expected

    # The final folder: transformers' logits are the trained megatron model's (from the
    # last checkpoint, rebuilt by the backend), on packed rows and on a plain forward.
    last = sorted((full_out / "checkpoints").iterdir())[-1]
    assert not (last / "backend.pt").exists()  # the backend state is megatron-core's distributed checkpoint
    assert_final_folder_is_the_checkpoint(full_out)


def test_the_quickstart_learns_with_the_megatron_backend(tmp_path) -> None:
    """The README's quickstart, --set backend.name=megatron, cut to 70 steps (the full
    1000-step run is in docs/backends.md: 0.03 -> 0.998, as the torch backend's): the reward
    climbs (at step 70 the full run's 10-step mean was 0.16, from 0.03)."""
    out = tmp_path / "quickstart"
    proc = subprocess.run(
        [SKYRL, "run", "examples/quickstart.toml", "--set", "backend.name=\"megatron\"", "--set", "job.steps=70",
         "--set", "job.checkpoint_every=0", "--set", f"job.output_dir=\"{out}\""],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = step_rows(out)
    first = np.mean([r["reward_mean"] for r in rows[:5]])
    last = np.mean([r["reward_mean"] for r in rows[-10:]])
    assert first <= 0.1 and last >= first + 0.07, (first, last)
    assert max(r["logprob_diff_max"] for r in rows) < 1e-4


def test_async_mode_runs_with_the_default_shared_engine(skyrl_tiny_rl_job, skyrl_cli, tmp_path) -> None:
    """``mode = "async"`` with the embedded engine as a job gets it (sharing the loaded
    model's tensors): the megatron backend trains its own copy (OwnWeights), so the job runs
    (the torch backend needs share_weights = false here); every sample after the first step
    is one version old, and the first step's engine/trainer gap is round-off (int4: the
    engine got the quantized weights, not the masters)."""
    job = skyrl_tiny_rl_job(tmp_path, "async", job={"steps": 4, "batch_size": 4, "checkpoint_every": 0, "save_final": None,
                                                    "mode": "async", "max_staleness": 1, "output_dir": tmp_path / "out"},
                            dataset={"prefix": None}, engine={"return_token_versions": True}, algorithm={"name": "grpo"},
                            precision={"name": "int4"}, backend={"name": "megatron", "lr": 1e-3, "micro_batch_tokens": 128})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr[-3000:]
    rows = step_rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["logprob_diff_max"] < 1e-5
    assert all(r["staleness_mean"] == 1.0 for r in rows[1:])


@pytest.mark.parametrize("override, message", [
    ("backend.tensor_parallel=2", "backend.tensor_parallel: the megatron backend runs [cluster] trainer_ranks / "
     "tensor_parallel data-parallel replicas of the model, with expert_parallel ranks sharing the experts: "
     "tensor_parallel x expert_parallel = 2 must divide trainer_ranks = 1"),
    ("backend.expert_parallel=2", "backend.expert_parallel: the megatron backend runs [cluster] trainer_ranks / "),
    ("backend.pipeline_parallel=2", "backend.pipeline_parallel: the megatron backend runs [cluster] trainer_ranks / "
     "(tensor_parallel x pipeline_parallel) data-parallel replicas of the model, with expert_parallel ranks sharing the "
     "experts: tensor_parallel x expert_parallel x pipeline_parallel = 2 must divide trainer_ranks = 1"),
    ("backend.context_parallel=2", "backend.context_parallel: the megatron backend runs [cluster] trainer_ranks / "
     "(tensor_parallel x context_parallel) data-parallel replicas of the model: tensor_parallel x context_parallel = 2 "
     "must divide trainer_ranks = 1"),
    ("backend.context_parallel=2;backend.pipeline_parallel=2", "backend.context_parallel: context_parallel = 2 with "
     "pipeline_parallel = 2 is not built (context parallelism runs with tensor_parallel and data-parallel replicas)"),
    ('backend.context_parallel=2;cluster.trainer_ranks=2;cluster.launcher="ray";weight_sync.transport="broadcast";model.family="kimi";model.preset="tiny-kimi"', "backend.context_parallel: "
     "context_parallel = 2 is not built for multi-latent attention"),
    ('model.preset="tiny-qwen3-next"', "model.preset: the megatron backend cannot build this model: model_type "
     "'qwen3_next' is not mapped"),
    ('backend.compute_dtype="bfloat16"', "backend.compute_dtype: compute_dtype = \"bfloat16\" trains with the megatron "
     "backend on CUDA only: on a CPU megatron-core's linear layers fail in the backward pass"),
])
def test_validate_refuses_what_the_backend_cannot_run(skyrl_cli, override: str, message: str) -> None:
    sets = [arg for item in override.split(";") for arg in ("--set", item)]
    result = skyrl_cli("validate", str(ROOT / "examples/quickstart.toml"), "--set", "backend.name=\"megatron\"", *sets)
    assert result.exit_code == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr


def test_a_one_process_engine_may_take_any_wire_dtype(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """The engine sharing the loaded model's tensors does not share the megatron trainer's
    (OwnWeights): delta and nixl may ship bfloat16 into it, where the torch backend's job
    is refused (the torch backend trains the shared tensors)."""
    for transport in ("delta", "nixl"):
        sync = {"transport": transport, "dtype": "bfloat16"}
        if transport == "delta":
            sync["uri"] = f"file://{tmp_path}/weights"
        job = skyrl_tiny_rl_job(tmp_path, transport, engine={"dtype": "auto"}, weight_sync=sync,
                                backend={"name": "megatron"}, job={"steps": 2})
        result = skyrl_cli("validate", str(job.path))
        assert result.exit_code == 0, result.stderr
        if transport == "delta":  # and the job runs: the engine computes with the bfloat16-rounded weights
            result = skyrl_cli("run", str(job.path))
            assert result.exit_code == 0, result.stderr[-3000:]
            rows = job.rows()
            assert [r["step"] for r in rows] == [1, 2] and 1e-6 < rows[-1]["logprob_diff_max"] < 0.5, rows
        torch_path = skyrl_tiny_rl_job(tmp_path, transport + "-torch", engine={"dtype": "auto"}, weight_sync=sync).path
        result = skyrl_cli("validate", str(torch_path))
        assert result.exit_code == 2 and f"the {transport} transport ships bfloat16 weights" in result.stderr


def test_validate_reads_a_folders_config(skyrl_cli, tmp_path) -> None:
    """A Hugging Face folder whose config.json asks for a RoPE scaling the backend does not map
    (llama3's) is refused at validate time; so is one whose 3 layers two pipeline stages
    cannot share."""
    import json

    import transformers

    folder = tmp_path / "model"
    cfg = transformers.Qwen3Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=16, intermediate_size=64, vocab_size=40,
                                   rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 128})
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    job = (ROOT / "examples/quickstart.toml").read_text().replace('preset = "tiny"', f'path = "{folder}"')
    assert f'path = "{folder}"' in job
    (tmp_path / "job.toml").write_text(job)
    result = skyrl_cli("validate", str(tmp_path / "job.toml"), "--set", "backend.name=\"megatron\"")
    assert result.exit_code == 2
    assert "rope_type 'llama3' (mapped: default, linear, yarn)" in result.stderr, result.stderr

    cfg.num_hidden_layers, cfg.rope_parameters = 3, {"rope_type": "default", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    result = skyrl_cli("validate", str(tmp_path / "job.toml"), "--set", "backend.name=\"megatron\"", "--set",
                       "backend.pipeline_parallel=2")
    assert result.exit_code == 2
    assert ("backend.pipeline_parallel: pipeline_parallel = 2 must divide the model's 3 decoder layers (each pipeline "
            "stage holds as many)") in result.stderr, result.stderr


# -- tensor and expert parallelism in jobs: the Ray launcher's backend actors ----------------------


def megatron_job(make_job, tmp_path, name: str, *, parallel: dict | None = None, preset: str = "tiny", steps: int = 3,
                 every: int = 0, ranks: int | None = None, final: bool = False):
    """The tiny rl job on the megatron backend: one process, or ``parallel`` ([backend]
    tensor_parallel / expert_parallel / pipeline_parallel) over as many Ray backend actors
    (or ``ranks``: data-parallel replicas), delta in float32; ``final``: the final Hugging
    Face folder saved."""
    ranks = ranks or max((parallel or {}).values(), default=1)
    # (an engine actor beside the backend actors in the Ray session's 2 CPUs)
    cpus = 0.5 if ranks < 4 else 0.4
    cluster = {"launcher": "ray", "trainer_ranks": ranks, "cpus_per_actor": cpus} if parallel else {"launcher": "local"}
    sync = {"transport": "delta", "uri": f"file://{tmp_path}/{name}-weights", "dtype": "float32"} if parallel else {
        "transport": "inproc"}
    job = {"steps": steps, "checkpoint_every": every, "output_dir": tmp_path / f"{name}_out", "save_final": final}
    return make_job(tmp_path, name, job=job,
                    cluster=cluster, model={"preset": preset}, engine={"dtype": "float32" if parallel else "auto"},
                    weight_sync=sync, backend={"name": "megatron", "lr": 1e-3, **(parallel or {})})


def test_tensor_data_and_pipeline_parallel_ranks_in_ray_actors_train_like_one_process(
        skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """[backend] tensor_parallel = 2 over two Ray backend actors (the launcher gives both
    the whole batch), two data-parallel replicas of the model (trainer_ranks = 2,
    tensor_parallel = 1: the launcher gives each half of the sequences, the gradients are
    summed over them), pipeline_parallel = 2 (each actor one stage, both the whole
    batch) and context_parallel = 2 (both the whole batch, each half of every row's
    slots): the one-process run's metrics up to float32 reduction order; the replicas'
    checkpoint is one model's (megatron-core writes each tensor once), each stage writes
    its own layers. The pipeline run's final Hugging Face folder (its weights gathered from
    both stages) gives, in transformers, the logits of its last checkpoint read by one
    process."""
    runs = {}
    for name, parallel, ranks in (("one", None, None), ("tp", {"tensor_parallel": 2}, None),
                                  ("dp", {"tensor_parallel": 1}, 2), ("pp", {"pipeline_parallel": 2}, None),
                                  ("cp", {"context_parallel": 2}, None)):
        job = megatron_job(skyrl_tiny_rl_job, tmp_path, name, parallel=parallel, ranks=ranks, every=3,
                           final=name == "pp")
        result = skyrl_cli("run", str(job.path))
        assert result.exit_code == 0, result.stderr[-3000:]
        runs[name] = [learning_metrics(r) for r in job.rows()]
        shards = job.out / "checkpoints" / "step_000003" / "backend"
        runs[name + " files"] = sorted(p.name.split("_")[2] for p in shards.glob("__*_*.distcp"))
    assert len(runs["tp"]) == len(runs["one"]) == len(runs["dp"]) == len(runs["pp"]) == len(runs["cp"]) == 3
    for name in ("tp", "dp", "pp", "cp"):
        for a, b in zip(runs[name], runs["one"]):
            for key in ("reward_mean", "loss", "entropy", "grad_norm", "logprob_diff_mean", "sequences"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (name, a["step"], key)
    assert set(runs["tp files"]) == {"0", "1"} and set(runs["dp files"]) == {"0"}, runs
    assert set(runs["cp files"]) == {"0"}, runs  # (the context-parallel ranks hold one model: written once)
    assert set(runs["pp files"]) == {"0", "1"}, runs
    assert_final_folder_is_the_checkpoint(tmp_path / "pp_out")


def assert_final_folder_is_the_checkpoint(out) -> None:
    """``out/final`` in transformers gives the logits of the megatron model its last
    checkpoint holds (read by one process), on packed rows and on a plain forward."""
    import transformers

    from skyrl_backends.megatron import MegatronBackendConfig, create
    from skyrl_backends.megatron_backend import MegatronLM
    from skyrl_host.interfaces import LoadedModel

    final = transformers.AutoModelForCausalLM.from_pretrained(out / "final").float().eval()
    last = sorted((out / "checkpoints").iterdir())[-1]
    be = create(MegatronBackendConfig(lr=1e-3))
    start = transformers.AutoModelForCausalLM.from_pretrained(out / "final").float()
    be.start(LoadedModel(model=start, tokenizer=None, stop_token_ids=[], family="qwen"), seed=0, total_steps=1,
             reference=False)
    be.load_checkpoint(str(last / "backend"))
    vocab = final.config.vocab_size
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, vocab, (2, 9)))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        got = MegatronLM(be.module)(ids, pos, torch.arange(18))
        want = torch.cat([final(input_ids=ids[:1]).logits[0], final(input_ids=ids[1:, :4]).logits[0],
                          final(input_ids=ids[1:, 4:]).logits[0]])
    assert float((got - want).abs().max()) <= 1e-5


def test_tensor_parallel_ranks_in_ray_actors_serve_the_quantized_weights_they_train_with(
        skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """tensor_parallel = 2 over two Ray backend actors with [precision] int4: the ranks
    compute with the int4 weights cut from the whole transformers weights, rank 0 serves
    the packed weights, and the engine's logprobs are the trainer's at every step (4.8e-7
    measured)."""
    job = megatron_job(skyrl_tiny_rl_job, tmp_path, "tpq", parallel={"tensor_parallel": 2})
    job.path.write_text(job.path.read_text() + '\n[precision]\nname = "int4"\n')
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr[-3000:]
    rows = job.rows()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["logprob_diff_max"] for r in rows) < 1e-4


def test_tensor_and_expert_parallel_together_in_four_ray_actors_train_like_one_process(
        skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """tensor_parallel = 2 with expert_parallel = 2 over four Ray backend actors on tiny-moe
    (each expert-parallel rank half of the sequences and of the experts, each expert split
    over a tensor-parallel pair): the one-process run's metrics up to float32 reduction order."""
    runs = {}
    for name, parallel, ranks in (("one", None, None), ("tpep", {"tensor_parallel": 2, "expert_parallel": 2}, 4)):
        job = megatron_job(skyrl_tiny_rl_job, tmp_path, name, parallel=parallel, ranks=ranks, preset="tiny-moe")
        result = skyrl_cli("run", str(job.path))
        assert result.exit_code == 0, result.stderr[-3000:]
        runs[name] = [learning_metrics(r) for r in job.rows()]
    assert len(runs["tpep"]) == len(runs["one"]) == 3
    for a, b in zip(runs["tpep"], runs["one"]):
        for key in ("reward_mean", "loss", "entropy", "grad_norm", "logprob_diff_mean", "sequences"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_expert_parallel_ranks_in_ray_actors_resume_exactly(skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """[backend] expert_parallel = 2 over two Ray backend actors on tiny-moe (each its share
    of the sequences and half of the experts): each rank writes its part of the checkpoint
    (megatron-core's distributed checkpointing), and a run resumed from step 2 repeats the
    uninterrupted run's steps 3 and 4 number for number. The same checkpoint resumed in
    one process (expert_parallel = 1, the local launcher) repeats them too, up to the
    float32 round-off between the layouts."""
    import shutil

    job = megatron_job(skyrl_tiny_rl_job, tmp_path, "ep", parallel={"expert_parallel": 2}, preset="tiny-moe", steps=4,
                       every=2)
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr[-3000:]
    full = [learning_metrics(r) for r in job.rows()]  # (the transport's sync_* differ: a resumed delta sends a keyframe)
    assert full[0]["logprob_diff_max"] < 1e-4 and full[-1]["logprob_diff_max"] < 1e-4  # the engine got the gathered experts
    shards = job.out / "checkpoints" / "step_000002" / "backend"
    assert {p.name.split("_")[2] for p in shards.glob("__*_*.distcp")} == {"0", "1"}  # (__{rank}_{file}.distcp)
    assert (shards / "metadata.json").is_file() and not (shards.parent / "backend.pt").exists()
    kept = tmp_path / "step_000002"
    shutil.copytree(shards.parent, kept)
    shutil.rmtree(job.out / "checkpoints" / "step_000004")
    shutil.rmtree(job.out / "final", ignore_errors=True)
    result = skyrl_cli("run", str(job.path), "--resume")
    assert result.exit_code == 0, result.stderr[-3000:]
    assert "(resumed after step 2)" in result.stderr
    resumed = [learning_metrics(r) for r in job.rows()]
    diffs = {k: (a[k], b.get(k)) for a, b in zip(resumed, full) for k in a if a[k] != b.get(k)}
    assert resumed == full, diffs

    # Another layout: the same job in one process reads the two ranks' checkpoint.
    alone = megatron_job(skyrl_tiny_rl_job, tmp_path, "alone", preset="tiny-moe", steps=4, every=2)
    shutil.copytree(job.out, alone.out, ignore=shutil.ignore_patterns("checkpoints", "final"))
    shutil.copytree(kept, alone.out / "checkpoints" / "step_000002")
    result = skyrl_cli("run", str(alone.path), "--resume")
    assert result.exit_code == 0, result.stderr[-3000:]
    assert "(resumed after step 2)" in result.stderr
    one = [learning_metrics(r) for r in alone.rows()]
    assert [r["step"] for r in one] == [1, 2, 3, 4]
    for a, b in zip(one[2:], full[2:]):
        for key in ("reward_mean", "loss", "entropy", "grad_norm", "logprob_diff_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
