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
    result = pytester.runpytest("-p", "no:cacheprovider")
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
