"""Entry-point discovery: order, failure isolation, block/allow, check_pending."""

from __future__ import annotations

import sys

import pytest

from skyrl_host.errors import UserError
from skyrl_host.plugins import build_host, iter_entry_points

DATASET_PLUGIN = """
from skyrl_host import hookimpl

@hookimpl
def skyrl_register_datasets(register):
    register({name!r}, dict, description="a dataset named {name}")
"""


def only(*names: str) -> dict[str, str]:
    return {"SKYRL_LOAD_PLUGINS": ",".join(names)}


def test_entry_points_are_sorted_and_loaded_in_that_order(make_dist) -> None:
    s = make_dist.suffix
    make_dist("acme-zeta", {f"zeta{s}": f"zeta{s}", f"alpha{s}": f"alpha{s}"},
              {f"zeta{s}": DATASET_PLUGIN.format(name="z"), f"alpha{s}": DATASET_PLUGIN.format(name="a")})
    make_dist("acme-mid", {f"mid{s}": f"mid{s}"}, {f"mid{s}": DATASET_PLUGIN.format(name="m")})
    names = [ep.name for ep in iter_entry_points() if ep.name.endswith(s)]
    assert names == [f"alpha{s}", f"mid{s}", f"zeta{s}"]
    host = build_host(env=only(*names))
    assert [n for n, r in host.records.items() if r.status == "loaded"] == names
    assert list(host.records) == sorted(host.records)  # blocked ones are recorded in the same order
    # Pluggy calls the newest registration first; the registry must still be deterministic.
    assert host.registry.names("datasets") == ["a", "m", "z"]
    assert [r.origin.distribution for r in host.registry.entries("datasets")] == ["acme-zeta", "acme-mid", "acme-zeta"]


def test_all_installed_skyrl_entry_points_are_sorted() -> None:
    eps = iter_entry_points()
    keys = [(ep.name, ep.dist.metadata["Name"].lower().replace("_", "-"), ep.value) for ep in eps]
    assert keys == sorted(keys)
    assert {"metrics_jsonl", "progress", "reward_check", "letter_count"} <= {ep.name for ep in eps}


def test_a_broken_plugin_is_recorded_and_others_still_work(make_dist) -> None:
    s = make_dist.suffix
    make_dist("acme-broken", {f"broken{s}": f"broken{s}"}, {f"broken{s}": "import no_such_module_anywhere\n"}, version="2.3")
    make_dist("acme-syntax", {f"syntax{s}": f"syntax{s}"}, {f"syntax{s}": "def oops(:\n"})
    make_dist("acme-good", {f"good{s}": f"good{s}"}, {f"good{s}": DATASET_PLUGIN.format(name=f"good{s}")})
    host = build_host()
    broken = host.records[f"broken{s}"]
    assert broken.status == "failed"
    assert (broken.distribution, broken.version, broken.entry_point) == ("acme-broken", "2.3", f"broken{s}")
    assert broken.error == "ModuleNotFoundError: No module named 'no_such_module_anywhere'"
    assert "Traceback" in broken.traceback
    assert host.records[f"syntax{s}"].error.startswith("SyntaxError")
    assert host.registry.get("datasets", f"good{s}").origin.distribution == "acme-good"
    assert host.registry.get("jobs", "reward_check")  # the built-ins are unaffected


def test_needing_what_a_broken_plugin_provides_names_the_plugin(make_dist) -> None:
    s = make_dist.suffix
    make_dist("acme-broken", {f"tasks{s}": f"tasks{s}"}, {f"tasks{s}": "raise RuntimeError('boom at import')\n"}, "0.9")
    host = build_host()
    with pytest.raises(UserError) as info:
        host.get("datasets", f"tasks{s}")
    assert str(info.value) == (
        f"error: dataset 'tasks{s}' would come from plugin 'tasks{s}' (acme-broken 0.9), which failed to load: "
        "RuntimeError: boom at import (run `skyrl plugins --all` for details)"
    )
    # A name no loaded plugin has: the failed plugins are listed as possible providers.
    with pytest.raises(UserError, match=rf"unknown dataset 'other'.*plugin 'tasks{s}' \(acme-broken 0.9\): RuntimeError"):
        host.get("datasets", "other")


def test_a_registration_hook_that_raises_keeps_none_of_its_names(make_dist) -> None:
    s = make_dist.suffix
    make_dist("acme-half", {f"half{s}": f"half{s}"}, {f"half{s}": """
        from skyrl_host import hookimpl

        @hookimpl
        def skyrl_register_samplers(register):
            register("fine_sampler", dict, description="registered before the failure")

        @hookimpl
        def skyrl_register_datasets(register):
            register("first", dict, description="registered before the failure")
            raise ValueError("second dataset is broken")
    """})
    host = build_host(env=only(f"half{s}"))
    rec = host.records[f"half{s}"]
    assert host.registry.names("datasets") == []
    assert host.registry.names("samplers") == []
    assert rec.status == "failed"
    assert rec.error == "skyrl_register_datasets raised ValueError: second dataset is broken"
    assert host.pm.get_plugin(f"half{s}") is None  # its observers, if any, are gone too


@pytest.mark.parametrize(
    "variable, value, loaded, blocked_reason",
    [
        ("SKYRL_DISABLE_PLUGINS", "one{s}", ["two{s}"], "blocked by SKYRL_DISABLE_PLUGINS"),
        ("SKYRL_DISABLE_PLUGINS", " ONE{s} , two{s} ", [], "blocked by SKYRL_DISABLE_PLUGINS"),
        ("SKYRL_DISABLE_PLUGINS", "acme_pair", [], "blocked by SKYRL_DISABLE_PLUGINS"),  # a distribution name
        ("SKYRL_LOAD_PLUGINS", "two{s}", ["two{s}"], "not listed in SKYRL_LOAD_PLUGINS"),
        ("SKYRL_LOAD_PLUGINS", "", [], "not listed in SKYRL_LOAD_PLUGINS"),
    ],
)
def test_block_and_allow_lists_act_before_import(make_dist, variable, value, loaded, blocked_reason) -> None:
    s = make_dist.suffix
    make_dist("acme-pair", {f"one{s}": f"one{s}", f"two{s}": f"two{s}"},
              {f"one{s}": DATASET_PLUGIN.format(name="one"), f"two{s}": DATASET_PLUGIN.format(name="two")})
    host = build_host(env={variable: value.format(s=s)})
    mine = {n: r for n, r in host.records.items() if n.endswith(s)}
    assert sorted(n for n, r in mine.items() if r.status == "loaded") == [n.format(s=s) for n in loaded]
    for name, rec in mine.items():
        if rec.status == "blocked":
            assert rec.error == blocked_reason
            assert name not in sys.modules, "a blocked plugin must not be imported"
            assert host.pm.is_blocked(name)


def test_disable_wins_over_allow(make_dist) -> None:
    s = make_dist.suffix
    make_dist("acme-one", {f"one{s}": f"one{s}"}, {f"one{s}": DATASET_PLUGIN.format(name="one")})
    host = build_host(env={"SKYRL_LOAD_PLUGINS": f"one{s}", "SKYRL_DISABLE_PLUGINS": f"one{s}"})
    assert host.records[f"one{s}"].status == "blocked"


@pytest.mark.parametrize(
    "source, error",
    [
        (
            "from skyrl_host import hookimpl\n@hookimpl\ndef skyrl_registr_datasets(register):\n    pass\n",
            "PluginValidationError: unknown hook 'skyrl_registr_datasets' (did you mean 'skyrl_register_datasets'?)",
        ),
        (  # unmarked functions named skyrl_* are hook implementations too, so typos fail loudly
            "def skyrl_step_finised(run, step, metrics):\n    pass\n",
            "PluginValidationError: unknown hook 'skyrl_step_finised' (did you mean 'skyrl_step_finished'?)",
        ),
        (
            "from skyrl_host import hookimpl\n@hookimpl\ndef skyrl_register_datasets(registr):\n    pass\n",
            "PluginValidationError: Plugin 'pending{s}' for hook 'skyrl_register_datasets'",
        ),
    ],
)
def test_check_pending_fails_the_plugin_with_a_misspelled_hook(make_dist, source, error) -> None:
    s = make_dist.suffix
    make_dist("acme-typo", {f"pending{s}": f"pending{s}"}, {f"pending{s}": source})
    host = build_host()
    rec = host.records[f"pending{s}"]
    assert rec.status == "failed"
    assert rec.error.startswith(error.format(s=s))
    assert rec.distribution == "acme-typo"
    assert host.pm.get_plugin(f"pending{s}") is None
    host.pm.check_pending()  # what remains is consistent


def test_two_distributions_with_one_plugin_name(make_dist) -> None:
    s = make_dist.suffix
    make_dist("acme-a", {f"same{s}": f"same_a{s}"}, {f"same_a{s}": DATASET_PLUGIN.format(name="from_a")})
    make_dist("acme-b", {f"same{s}": f"same_b{s}"}, {f"same_b{s}": DATASET_PLUGIN.format(name="from_b")})
    host = build_host(env=only(f"same{s}"))
    assert host.records[f"same{s}"].distribution == "acme-a"
    dup = host.records[f"same{s} (acme-b)"]
    assert dup.status == "failed"
    assert dup.error == f"plugin name 'same{s}' is already used by plugin 'same{s}' (acme-a 1.0)"
    assert host.registry.names("datasets") == ["from_a"]


def test_each_build_makes_a_new_manager() -> None:
    a, b = build_host(), build_host()
    assert a.pm is not b.pm and a.registry is not b.registry
    assert a.registry.names("jobs") == b.registry.names("jobs")


def test_trace_env_prints_hook_calls(capfd) -> None:
    host = build_host(env={"SKYRL_TRACE_HOOKS": "1", "SKYRL_LOAD_PLUGINS": "reward_check"})
    host.registry  # noqa: B018
    assert "skyrl hook: skyrl_register_jobs [reward_check]" in capfd.readouterr().err
