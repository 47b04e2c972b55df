"""skyrl_host.testing, the pytest plugin for plugin authors, loaded through its
pytest11 entry point in a fresh pytest run."""

from __future__ import annotations

import importlib.metadata


def test_registered_as_pytest11_entry_point() -> None:
    eps = importlib.metadata.entry_points(group="pytest11")
    assert any(ep.name == "skyrl" and ep.value == "skyrl_host.testing" for ep in eps)


def test_fixtures_in_a_plugin_authors_test_suite(pytester) -> None:
    pytester.makepyfile(
        test_author="""
        import attrs
        from skyrl_host import hookimpl

        class Greedy:
            @hookimpl
            def skyrl_register_samplers(self, register):
                register("always_top", lambda config: "sampler", description="always the top token")

        def test_register_for_one_test(skyrl_host, skyrl_plugin):
            record = skyrl_plugin(Greedy(), "greedy_plugin")
            assert record.hooks == ["skyrl_register_samplers"]
            assert skyrl_host.registry.get("samplers", "always_top").origin.plugin == "greedy_plugin"

        def test_next_test_gets_a_fresh_host(skyrl_host):
            assert "always_top" not in skyrl_host.registry.names("samplers")
            assert "reward_check" in skyrl_host.registry.names("jobs")  # installed plugins are loaded

        def test_empty_host(skyrl_empty_host):
            assert skyrl_empty_host.records == {}
            assert skyrl_empty_host.registry.names("jobs") == []

        def test_cli_sees_the_registered_plugin(skyrl_plugin, skyrl_cli):
            skyrl_plugin(Greedy(), "greedy_plugin")
            result = skyrl_cli("plugins", "--hook", "skyrl_register_samplers")
            assert result.exit_code == 0
            assert "greedy_plugin  [loaded]  (registered in-process)" in result.stdout
            assert "sampler always_top: always the top token" in result.stdout
        """
    )
    # (in a process of its own: an in-process run takes back the modules it imported, numpy's
    # among them, which cannot be imported twice in one process: later tests in this worker
    # would fail to import it)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


def test_remove_plugin_takes_back_its_names(skyrl_empty_host) -> None:
    from skyrl_host import hookimpl

    class P:
        @hookimpl
        def skyrl_register_datasets(self, register):
            register("temp", dict, description="temporary")

    skyrl_empty_host.add_plugin(P(), "temporary")
    assert skyrl_empty_host.registry.names("datasets") == ["temp"]
    skyrl_empty_host.remove_plugin("temporary")
    assert skyrl_empty_host.registry.names("datasets") == []
    assert "temporary" not in skyrl_empty_host.records


def test_tiny_rl_job_merges_sections(skyrl_tiny_rl_job, tmp_path) -> None:
    import tomllib

    from skyrl_host.testing import TINY_RL_JOB

    job = skyrl_tiny_rl_job(tmp_path, "j", job={"steps": 2, "save_final": None}, dataset={"prefix": None}, engine=None,
                            weight_sync={"transport": "inproc"},
                            backend={"lora_rank": 4, "lora_targets": ["q_proj", "v_proj"]})
    assert job.path == tmp_path / "j.toml" and job.out == tmp_path / "j"
    text = job.path.read_text()
    assert text.index("[dataset]") < text.index("[weight_sync]") < text.index("[backend]")  # the usual order
    got = tomllib.loads(text)
    assert got["job"] == {**{k: v for k, v in TINY_RL_JOB["job"].items() if k != "save_final"}, "steps": 2,
                          "output_dir": str(tmp_path / "j")}
    assert "prefix" not in got["dataset"] and "engine" not in got
    assert got["backend"] == {"name": "torch", "lr": 5e-4, "lora_rank": 4, "lora_targets": ["q_proj", "v_proj"]}
    assert TINY_RL_JOB["job"]["steps"] == 3 and "weight_sync" not in TINY_RL_JOB  # the base is left alone


def test_learning_metrics_drop_timings_and_the_transports_own_only() -> None:
    from skyrl_host.testing import is_timing_metric, learning_metrics

    row = {"step": 1, "time": 1.0, "step_time": 2.0, "gen_tokens_per_s": 3.0, "train_tokens_per_s": 4.0,
           "data_time_s": 5.0, "reward_std": 0.5, "reward_mean": 0.1, "sequences": 32.0, "sync_bytes": 10.0,
           "sync_seconds": 0.1, "loss_tokens": 7.0}
    kept = {"step", "reward_std", "reward_mean", "sequences", "loss_tokens"}
    assert learning_metrics(row).keys() == kept
    assert learning_metrics(row, transport=True).keys() == kept | {"sync_bytes"}
    assert not any(is_timing_metric(k) for k in ("reward_std", "kl_reward_penalty_mean", "logprob_diff_max", "lr"))
