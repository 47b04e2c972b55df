"""[cluster] launcher = "ray": the backend and the engine in Ray actors (placement groups),
rollouts through the object store, weights through the job's transport between the two
actors. The same job learns exactly as with one process: every metric but timings is
equal, step by step, for `delta` and for `broadcast`; the actors and their placement
groups are gone afterwards."""

from __future__ import annotations


import pytest

from skyrl_host.testing import learning_metrics


def write(make_job, tmp_path, name: str, *, launcher: str, engine_dtype: str, weight_sync: dict, cluster=None,
          **sections):
    """The tiny RL job (``make_job``: the skyrl_tiny_rl_job fixture) under ``launcher``."""
    return make_job(tmp_path, name, cluster={"launcher": launcher, **(cluster or {})}, engine={"dtype": engine_dtype},
                    weight_sync=weight_sync, **sections)


def run(skyrl_cli, make_job, tmp_path, name: str, **options) -> list[dict]:
    job = write(make_job, tmp_path, name, **options)
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    return job.rows()


def place_job(job, host):
    """The job's placement, made directly as the driver makes it (not through ``skyrl run``),
    and the job's plugin choices."""
    from skyrl_host.config import load_job
    from skyrl_host.interfaces import PlacementRequest

    spec = load_job(job.path, host)
    p = spec.plugins
    request = PlacementRequest(model=p["model"], backend=p["backend"], precision=p["precision"], alphabet="0123456789:",
                               seed=3, total_steps=3, algorithm=p["algorithm"].create(), engine=p["engine"],
                               sampler=p["sampler"], weight_sync=p["weight_sync"], threads=1)
    return spec.launcher.create(spec.cluster).place(request), p


def learning(rows: list[dict]) -> list[dict]:
    return [learning_metrics(r) for r in rows]


# An evaluation greedy where the job samples at temperature 1: the engine actors must use
# the sampler each call brings, not their own (the evaluation's numbers match one process's).
EVAL = {"eval": {"n_samples": 2, "k": [1, 2], "prompts": 8, "temperature": 0.0, "max_new_tokens": 24, "name": "reverse_digits",
                 "min_len": 3, "max_len": 4, "prefix": ""}}


@pytest.mark.slow
def test_ray_launcher_learns_exactly_like_one_process(skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    local = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "local", launcher="local", engine_dtype="auto",
                weight_sync={"transport": "inproc"}, **EVAL)
    delta = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "delta", launcher="ray", engine_dtype="float32",
                weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/weights", "dtype": "float32"}, **EVAL)
    broadcast = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "broadcast", launcher="ray", engine_dtype="float32",
                    weight_sync={"transport": "broadcast", "dtype": "float32"})
    assert [r["step"] for r in local] == [0, 1, 2, 3] and [r["step"] for r in delta] == [0, 1, 2, 3]
    evaluated = lambda rows: [{k: v for k, v in learning_metrics(r).items() if k.startswith("eval/")}  # noqa: E731
                              for r in rows if "eval/pass_at_1" in r]
    assert [r["step"] for r in local if "eval/pass_at_1" in r] == [0, 3]
    assert evaluated(delta) == evaluated(local)
    assert all(r["eval/pass_at_1"] == r["eval/pass_at_2"] for r in evaluated(local))  # greedy: two equal samples
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rows[1:]]  # noqa: E731
    local, delta = strip(local), strip(delta)
    assert [r["step"] for r in local] == [1, 2, 3]
    assert "reward_std" in learning(local)[0]
    assert learning(delta) == learning(local)
    assert learning(broadcast) == learning(local)
    assert [r["sync_version"] for r in delta] == [1, 2, 3] and all(r["sync_bytes"] > 0 for r in delta)
    assert [r["sync_collectives"] for r in broadcast] == [1, 1, 1]  # a tiny model fits one 64 MiB bucket
    import ray

    assert ray.available_resources().get("CPU") == 2  # every actor and placement group released


@pytest.mark.slow
def test_a_teacher_in_its_own_actor_scores_as_in_one_process(skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    import ray

    made = skyrl_tiny_rl_job(tmp_path, "teacher_src", job={"seed": 9, "steps": 1, "save_final": True})
    assert skyrl_cli("run", str(made.path)).exit_code == 0
    # GRPO with the teacher's top-4 KL in its loss: the actor sends back logprobs and top-k both.
    distil = {"algorithm": {"name": "grpo", "teacher_kl_coef": 1.0, "teacher_kl_topk": 4},
              "teacher": {"family": "qwen", "path": str(made.out / "final")}}
    local = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "local", launcher="local", engine_dtype="auto",
                weight_sync={"transport": "inproc"}, **distil)
    # Three actors (backend, engine, teacher) on the fixture's 2 CPUs.
    actors = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "actors", launcher="ray", engine_dtype="float32",
                 cluster={"cpus_per_actor": 0.5},
                 weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/weights", "dtype": "float32"}, **distil)
    assert local[0]["teacher_kl"] > 0.005  # a teacher that differs from the student
    assert learning(actors) == learning(local) and all(r["teacher_kl_loss"] > 0 for r in local)
    assert ray.available_resources().get("CPU") == 2  # the teacher's actor released with the others


def test_one_process_transports_are_refused_with_ray(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path = write(skyrl_tiny_rl_job, tmp_path, "o", launcher="ray", engine_dtype="float32",
                 weight_sync={"transport": "inproc"}).path
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "weight_sync.transport: transport 'inproc' hands tensors over within one process" in result.stderr
    write(skyrl_tiny_rl_job, tmp_path, "o", launcher="ray", engine_dtype="float32",
          weight_sync={"transport": "delta", "uri": "memory://weights"})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "weight_sync.uri: a memory:// URL lives in one process, but the engine runs in another" in result.stderr


def test_rollout_batches_cross_the_object_store_without_copies(skyrl_ray) -> None:
    import numpy as np
    import ray

    from skyrl_host.rollout import CSR, RolloutBatch

    batch = RolloutBatch.from_sequences([[1, 2, 3]] * 64, [[4, 5, 6, 7]] * 64, [[-0.5] * 4] * 64, group_ids=list(range(64)))
    batch.side_channels["routed_experts"] = np.zeros((batch.n_tokens, 4, 2), dtype=np.uint8)
    batch.side_channels["sample_support"] = CSR.from_rows([[4, 9]] * int(batch.loss_mask.sum()))
    ref = ray.put(dict(batch.to_arrays()))
    first, second = ray.get(ref), ray.get(ref)
    for name, array in first.items():
        # Read-only views of the object store's memory: two gets share it, nothing was copied.
        assert not array.flags.writeable and np.shares_memory(array, second[name]), name
    back = RolloutBatch.from_arrays(first)
    assert np.array_equal(back.tokens, batch.tokens) and back.side_channels["sample_support"].n_rows == 256


def metrics_close(a: list[dict], b: list[dict], rel: float) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(learning(a), learning(b)):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=1e-6), (ra["step"], k)


def ranks(replicas: int) -> dict:
    """[cluster] for two backend actors and ``replicas`` engine actors (launcher = "ray")."""
    return {"trainer_ranks": 2, "engine_replicas": replicas, "cpus_per_actor": 0.5}


@pytest.mark.slow
def test_two_ddp_ranks_train_like_one_process(skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """Two backend ranks (DDP across two actors), each on its share of the batch's
    sequences, take the one-process step: the same metrics up to float32 reduction order."""
    local = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "local", launcher="local", engine_dtype="auto",
                weight_sync={"transport": "inproc"})
    ddp = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "ddp", launcher="ray", cluster=ranks(1), engine_dtype="float32",
              weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/w", "dtype": "float32"},
              backend={"data_parallel": "ddp"})
    assert "reward_std" in learning(ddp)[0]
    metrics_close(ddp, local, rel=1e-4)
    assert [r["sequences"] for r in ddp] == [32.0, 32.0, 32.0]  # both ranks' shares counted once


@pytest.mark.slow
def test_fsdp2_over_one_rank_trains_like_one_process(skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """FSDP2 over a single backend actor (one GPU's set-up: the actor joins a group of
    one) takes the one-process step."""
    local = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "local", launcher="local", engine_dtype="auto",
                weight_sync={"transport": "inproc"})
    one = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "one", launcher="ray", engine_dtype="float32",
              weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/w1", "dtype": "float32"},
              backend={"data_parallel": "fsdp2"})
    metrics_close(one, local, rel=1e-4)


@pytest.mark.slow
def test_fsdp2_ranks_broadcast_to_two_engine_replicas(skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """FSDP2 over two backend actors; rank 0 broadcasts to two engine replicas that split
    each step's prompts. Every engine serves the trainer's weights: the trainer's
    logprobs of the replicas' tokens equal theirs (float32 both sides)."""
    out = tmp_path / "fsdp"
    rows = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "fsdp", launcher="ray", cluster=ranks(2), engine_dtype="float32",
               weight_sync={"transport": "broadcast", "dtype": "float32"}, job={"save_final": True},
               backend={"data_parallel": "fsdp2"})
    assert [r["weight_version"] for r in rows] == [0.0, 1.0, 2.0]
    assert all(r["kept_groups"] == 8 and r["sequences"] == 32 for r in rows)
    assert max(r["logprob_diff_max"] for r in rows) < 1e-4
    assert (out / "final" / "config.json").is_file()
    import ray

    assert ray.available_resources().get("CPU") == 2


def test_several_ranks_need_ray_and_a_data_parallel_mode(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path = write(skyrl_tiny_rl_job, tmp_path, "o", launcher="local", cluster={"engine_replicas": 2},
                 engine_dtype="float32", weight_sync={"transport": "inproc"}).path
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert 'cluster.engine_replicas: more than one needs launcher = "ray" (launcher is \'local\')' in result.stderr
    write(skyrl_tiny_rl_job, tmp_path, "o", launcher="ray", cluster={"trainer_ranks": 4}, engine_dtype="float32",
          weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/w"})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert ('backend.data_parallel: [cluster] trainer_ranks = 4 trains data parallel: set data_parallel = "ddp" '
            'or "fsdp2"') in result.stderr


def test_sequences_split_between_ranks_by_tokens() -> None:
    import numpy as np

    from skyrl_launchers._ray_actors import replica_seed, split_sequences

    parts = split_sequences(np.array([10, 10, 10, 10, 40]), 2)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4]]  # 40 tokens each
    parts = split_sequences(np.array([5] * 7), 3)
    assert sorted(sum((p.tolist() for p in parts), [])) == list(range(7)) and [len(p) for p in parts] == [2, 3, 2]
    assert [p.tolist() for p in split_sequences(np.array([100]), 2)] == [[], [0]]  # a rank may get nothing
    assert replica_seed(123, 0) == 123 and len({replica_seed(123, i) for i in range(8)}) == 8


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "sync", "backend_extra", "n_ranks"), [
    ("fp8", "broadcast", {}, 1),
    ("int4", "lora", {"lora_rank": 4}, 1),
    ("mxfp8", "nixl", {"data_parallel": "ddp"}, 2),
    ("int4", "nixl", {"data_parallel": "fsdp2"}, 2),
], ids=["fp8-broadcast", "int4-lora", "mxfp8-nixl-ddp", "int4-nixl-fsdp2"])
def test_quantized_jobs_in_actors_learn_like_one_process(skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path, precision,
                                                          sync, backend_extra, n_ranks) -> None:
    """The engine actor builds its own model and serves the quantized weights the backend
    actors ship (fp8 payloads + scales through broadcast; for LoRA on a frozen int4 base,
    the adapters as one object; mxfp8 from rank 0 of two DDP ranks through NIXL; int4
    from two FSDP2 ranks, each quantizing and serving its own shards through NIXL): every
    learning metric equals the one-process run's (to float32 reduction order with two
    ranks)."""
    def job(name: str, launcher: str, transport: str, cluster: dict) -> list[dict]:
        # One process trains on one rank: no data_parallel there.
        extra = {k: v for k, v in backend_extra.items() if launcher == "ray" or k != "data_parallel"}
        return run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, name, launcher=launcher, cluster=cluster,
                   engine_dtype="bfloat16", weight_sync={"transport": transport}, backend=extra,
                   precision={"name": precision})

    cluster = {"trainer_ranks": n_ranks, "cpus_per_actor": 0.5} if n_ranks > 1 else {}
    local = job("local", "local", "inproc", {})
    actors = job("ray", "ray", sync, cluster)
    if n_ranks == 1:
        assert learning(actors) == learning(local)
    else:
        # Two ranks reduce gradients in another order (float32 round-off), and a weight
        # that round-off moves across a quantization boundary moves by a whole step: the
        # runs part after the first update. Before it they agree; the gap stays at the
        # one-process run's level throughout.
        metrics_close(actors[:1], local[:1], rel=1e-4)
        gap = sum(r["logprob_diff_mean"] for r in actors) / len(actors)
        assert gap < 2 * sum(r["logprob_diff_mean"] for r in local) / len(local)
    assert max(r["logprob_diff_max"] for r in actors) < 0.1


@pytest.mark.slow
def test_nixl_engines_read_every_fsdp2_ranks_shards(skyrl_ray, skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    """nixl under Ray: each of two FSDP2 backend actors serves its own shards; each of two
    engine replicas reads its part from both and serves exactly the trainer's weights."""
    import nixl_cu12  # noqa: F401  (NIXL comes with the test requirements: skyrl-weightsync[test])

    rows = run(skyrl_cli, skyrl_tiny_rl_job, tmp_path, "nixl", launcher="ray", cluster=ranks(2), engine_dtype="float32",
               weight_sync={"transport": "nixl", "dtype": "float32"}, backend={"data_parallel": "fsdp2"})
    assert [r["weight_version"] for r in rows] == [0.0, 1.0, 2.0]
    assert max(r["logprob_diff_max"] for r in rows) < 1e-4  # both replicas serve the trainer's weights
    assert all(r["kept_groups"] == 8 and r["sequences"] == 32 for r in rows)


def test_the_ray_placement_hands_the_driver_the_same_protocols(skyrl_ray, skyrl_host, skyrl_tiny_rl_job,
                                                               tmp_path) -> None:
    """What the driver gets from the ray launcher satisfies the Protocols it gets from the
    local one, and close() releases every actor and placement group."""
    import ray

    from skyrl_host.contracts import missing
    from skyrl_host.interfaces import BackendHandle, EngineHandle, Placement, ReferenceScoring

    job = write(skyrl_tiny_rl_job, tmp_path, "handles", launcher="ray", engine_dtype="float32",
                weight_sync={"transport": "delta", "uri": f"file://{tmp_path}/weights", "dtype": "float32"})
    placement, p = place_job(job, skyrl_host)
    try:
        assert placement.loaded.model is None  # the driver holds only the tokenizer
        for handle, protocol in ((placement, Placement), (placement.backend, BackendHandle),
                                 (placement.backend, ReferenceScoring), (placement.engine, EngineHandle)):
            assert missing(handle, protocol) == [], (handle, protocol)
        assert placement.vocab_size == len(placement.loaded.tokenizer) == 14  # 11 characters + 3 special tokens
        stats = placement.publish(1)
        assert placement.engine.weight_version == 1 and stats["sync_version"] == 1
    finally:
        placement.close()
    import time

    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # Ray frees placement groups asynchronously
    assert ray.available_resources().get("CPU") == 2


def test_a_transport_without_halves_is_refused_before_any_actor_starts(skyrl_cli, skyrl_plugin, skyrl_tiny_rl_job,
                                                                       tmp_path) -> None:
    from skyrl_host import hookimpl

    class OneProcessOnly:
        def __init__(self, config=None):
            self.config = config

        def publish(self, backend, engine, version):
            return {}

    class Plugin:
        @hookimpl
        def skyrl_register_weight_transports(self, register):
            register("oneproc", OneProcessOnly, description="both halves in one process only")

    skyrl_plugin(Plugin(), "oneproc_plugin")
    job = write(skyrl_tiny_rl_job, tmp_path, "oneproc", launcher="ray", engine_dtype="float32",
                weight_sync={"transport": "oneproc"})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 2, result.stderr
    assert result.stderr.endswith(
        "error: weight transport 'oneproc' (plugin 'oneproc_plugin') lacks the SplitTransport capability (collective, "
        "rendezvous, carries_payload, sender, receiver), which [cluster] launcher = \"ray\" (the engines run in "
        "processes of their own) needs\n"
    )



@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast", "nixl", "lora"])
def test_a_killed_engine_replica_is_regenerated_then_restarted_with_the_current_weights(
        skyrl_ray, skyrl_host, skyrl_tiny_rl_job, tmp_path, capfd, transport) -> None:
    """One of two engine replicas is killed: the same generate call gives the same batch
    (the survivor makes the lost replica's run with its seed); publishing goes on without
    it (``broadcast``: in a group formed again without it), and once its new actor is up
    (in its bundle, at once; with ``broadcast`` its first new actor is killed too, and
    another is started) it joins with the current weights (``broadcast``: the group formed
    again with it; ``nixl``: read from the trainer rank; ``lora``: the last adapters sent)
    and its weight version is checked: it samples exactly what the survivor samples from
    the same prompts and seed."""
    import time

    import numpy as np
    import ray

    from skyrl_host.rollout import RolloutBatch

    kill_new = transport == "broadcast"
    job = write(skyrl_tiny_rl_job, tmp_path, "killed", launcher="ray", engine_dtype="float32",
                cluster={"engine_replicas": 2, "cpus_per_actor": 0.5},
                weight_sync={"transport": transport, **({"dtype": "float32"} if transport != "lora" else {})},
                backend={"lora_rank": 4} if transport == "lora" else {})
    placement, p = place_job(job, skyrl_host)
    engine = placement.engine
    try:
        prompts = [placement.loaded.tokenizer.encode(f"{n}:") for n in (123, 4071, 56, 9382, 704, 21)]
        sampler = p["sampler"].create()

        def generate(seed: int) -> RolloutBatch:
            return engine.generate(prompts, n=2, sampler=sampler, max_new_tokens=6, seed=seed)

        assert placement.publish(1)["sync_version"] == 1
        before = generate(11)
        ray.kill(engine.actors[1])  # its process ends; its placement-group bundle stays the job's
        after = generate(11)
        assert np.array_equal(after.tokens, before.tokens) and np.array_equal(after.logprobs, before.logprobs)
        if kill_new:
            ray.kill(engine.actors[1])  # its new actor too, before it served: not a second loss
        stats = placement.publish(2)  # broadcast: the group formed again without it
        assert stats["sync_version"] == 2 and stats["engine_replicas_lost"] == 1
        assert stats["engine_prompts_regenerated"] == 3 and stats["engine_replicas_live"] == 1
        version, deadline = 2, time.monotonic() + 180
        while stats["engine_replicas_restarted"] < 1:  # its new actor: up once it has loaded the model
            assert time.monotonic() < deadline, stats
            time.sleep(0.5)
            version += 1
            stats = placement.publish(version)
        assert stats["engine_replicas_live"] == 2 and engine.weight_version == version
        assert stats["engine_replicas_lost"] == 1 and stats["engine_replicas_restarted"] == 1
        notices = [x for x in capfd.readouterr().err.splitlines() if x.startswith("notice: engine replica 1")]
        assert len(notices) == 2 + kill_new, notices
        assert " lost (" in notices[0] and "restarted with weight version" in notices[-1], notices
        assert not kill_new or "new actor died before it served" in notices[1], notices
        # Both replicas hold the same weights: the same prompts and seed, the same samples.
        a, b = ray.get([actor.generate.remote(prompts, 2, sampler, 6, 5, 0) for actor in engine.actors])
        assert np.array_equal(a["tokens"], b["tokens"]) and np.array_equal(a["logprobs"], b["logprobs"])
        stats = placement.publish(version + 1)  # a version more, to both (broadcast: in the group formed with it)
        assert stats["sync_version"] == version + 1 and engine.weight_version == version + 1
    finally:
        placement.close()
