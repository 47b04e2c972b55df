"""The `local` launcher and the contracts it checks when it places a job: the handles it
gives the driver satisfy the Protocols the drivers call, and a plugin lacking a
capability the job needs is one clear user error naming it, before anything trains."""

from __future__ import annotations

from typing import Any

from skyrl_host import hookimpl
from skyrl_host.config import load_job
from skyrl_host.contracts import missing
from skyrl_host.interfaces import BackendHandle, EngineHandle, Placement, PlacementRequest


def request_for(spec: Any, algorithm: Any) -> PlacementRequest:
    p = spec.plugins
    return PlacementRequest(model=p["model"], backend=p["backend"], precision=p["precision"], alphabet="0123456789:",
                            seed=spec.job.seed, total_steps=spec.job.steps, algorithm=algorithm,
                            replay=tuple(p["replay"]), engine=p["engine"], sampler=p["sampler"],
                            weight_sync=p["weight_sync"], threads=1)


def test_the_local_placement_satisfies_the_drivers_protocols(skyrl_host, skyrl_tiny_rl_job, tmp_path) -> None:
    job = skyrl_tiny_rl_job(tmp_path, weight_sync={"transport": "inproc"})
    spec = load_job(job.path, skyrl_host)
    assert spec.launcher.name == "local"
    launcher = spec.launcher.create(spec.cluster)
    placement = launcher.place(request_for(spec, spec.plugins["algorithm"].create()))
    try:
        assert missing(placement, Placement) == []
        assert missing(placement.backend, BackendHandle) == []
        assert missing(placement.engine, EngineHandle) == []
        assert placement.vocab_size == placement.loaded.model.get_input_embeddings().num_embeddings
        stats = placement.publish(1)
        assert placement.engine.weight_version == 1 and stats["sync_tensors_shared"] > 0
    finally:
        placement.close()
        placement.close()  # idempotent


class ForgetfulBackend:
    """A backend that trains (it wraps the torch backend) but cannot serve quantized weights."""

    def __init__(self, inner: Any):
        self.inner = inner

    def start(self, loaded, *, seed, total_steps, reference, replay=(), precision=None):
        return self.inner.start(loaded, seed=seed, total_steps=total_steps, reference=reference, replay=replay,
                                precision=precision)

    def train_step(self, *args, **kwargs):
        return self.inner.train_step(*args, **kwargs)

    def named_weights(self):
        return self.inner.named_weights()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        return self.inner.load_state_dict(state)


def test_a_backend_without_quantized_serving_is_refused_by_name(skyrl_cli, skyrl_plugin, skyrl_tiny_rl_job,
                                                                tmp_path) -> None:
    class Plugin:
        @hookimpl
        def skyrl_register_backends(self, register):
            def make(config):
                from skyrl_backends.torch import TorchBackendConfig
                from skyrl_backends.torch_backend import TorchBackend

                return ForgetfulBackend(TorchBackend(TorchBackendConfig()))

            register("forgetful", make, description="trains, serves no quantized weights")

    skyrl_plugin(Plugin(), "forgetful_plugin")
    job = skyrl_tiny_rl_job(tmp_path, backend={"name": "forgetful", "lr": None}, precision={"name": "int4"},
                            engine={"dtype": "float32"}, weight_sync={"transport": "inproc"})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 2, result.stderr
    assert result.stderr.endswith(
        "\nerror: backend 'forgetful' (plugin 'forgetful_plugin') lacks the QuantizedServing capability "
        "(serving_weights), which precision 'int4' needs\n"
    )
    assert "Traceback" not in result.stderr
    assert not (job.out / "metrics.jsonl").exists() or "\"step\"" not in (job.out / "metrics.jsonl").read_text()


def test_the_local_launcher_places_one_rank_and_one_replica(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    job = skyrl_tiny_rl_job(tmp_path, cluster={"trainer_ranks": 2}, backend={"data_parallel": "ddp"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2
    assert result.stderr.endswith("cluster.trainer_ranks: more than one needs launcher = \"ray\" (launcher is 'local')\n")
    job = skyrl_tiny_rl_job(tmp_path, cluster={"cpus_per_actor": 2.0})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2
    assert result.stderr.endswith("cluster.cpus_per_actor: unknown key: launcher 'local' takes no options\n")


def test_each_plugin_object_is_made_once_in_one_process(skyrl_cli, skyrl_plugin, skyrl_tiny_rl_job, tmp_path) -> None:
    """The placement makes the model family, the sampler and the replay strategies, once
    each, and hands the driver what it needs (no second family for the tokenizer, no
    second sampler or strategies for the engine)."""
    from skyrl_models.qwen import QwenConfig, make_family
    from skyrl_replay.support import SupportConfig, create as make_support
    from skyrl_samplers.top_k import TopKConfig, build_sampler, sampler_traits

    made = {"family": 0, "sampler": 0, "replay": 0}

    def counted(what, factory):
        def make(config=None):
            made[what] += 1
            return factory(config)
        return make

    class Counting:
        @hookimpl
        def skyrl_register_models(self, register):
            register("counted_qwen", counted("family", make_family), config=QwenConfig, description="qwen, counted")

        @hookimpl
        def skyrl_register_samplers(self, register):
            register("counted_top_k", counted("sampler", build_sampler), config=TopKConfig,
                     description="top-k, counted", traits=sampler_traits)

        @hookimpl
        def skyrl_register_replay_strategies(self, register):
            register("counted_support", counted("replay", make_support), config=SupportConfig,
                     description="support replay, counted")

    skyrl_plugin(Counting(), "counting")
    job = skyrl_tiny_rl_job(tmp_path, job={"steps": 1}, model={"family": "counted_qwen"},
                            sampler={"name": "counted_top_k", "top_k": 4, "return_support": True},
                            replay={"strategies": ["counted_support"]})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    assert made == {"family": 1, "sampler": 1, "replay": 1}
