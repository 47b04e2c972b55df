"""Registration: origins, collisions, override=True, argument checks, unknown names."""

from __future__ import annotations

import attrs
import pytest

from skyrl_host import hookimpl
from skyrl_host.errors import UserError
from skyrl_host.registry import KINDS


def dataset_plugin(name: str, override: bool = False, factory=dict):
    class Plugin:
        @hookimpl
        def skyrl_register_datasets(self, register):
            register(name, factory, description=f"dataset {name}", override=override)

    return Plugin()


def test_origin_records_plugin_distribution_and_version(skyrl_empty_host) -> None:
    skyrl_empty_host.add_plugin(dataset_plugin("squares"), "mine", distribution="acme", version="1.2")
    reg = skyrl_empty_host.registry.get("datasets", "squares")
    assert (reg.origin.plugin, reg.origin.distribution, reg.origin.version) == ("mine", "acme", "1.2")
    assert reg.description == "dataset squares"
    assert skyrl_empty_host.records["mine"].registered == {"datasets": ["squares"]}


def test_same_name_twice_is_an_error_naming_both_plugins(skyrl_empty_host) -> None:
    skyrl_empty_host.add_plugin(dataset_plugin("squares"), "first", "acme-a", "1.0")
    skyrl_empty_host.add_plugin(dataset_plugin("squares"), "second", "acme-b", "2.0")
    with pytest.raises(UserError) as info:
        skyrl_empty_host.get("datasets", "squares")
    msg = str(info.value)
    assert "dataset 'squares' is registered by plugin 'first' (acme-a 1.0) and plugin 'second' (acme-b 2.0)" in msg
    assert "neither passes override=True" in msg
    assert [c.name for c in skyrl_empty_host.registry.conflicts()] == ["squares"]


@pytest.mark.parametrize("override_first", [True, False])
def test_override_wins_whatever_the_order(skyrl_empty_host, override_first) -> None:
    builtin = dataset_plugin("squares", factory=dict)
    replacement = dataset_plugin("squares", override=True, factory=list)
    plugins = [("replacement", replacement), ("builtin", builtin)]
    if not override_first:
        plugins.reverse()
    for name, obj in plugins:
        skyrl_empty_host.add_plugin(obj, name)
    reg = skyrl_empty_host.get("datasets", "squares")
    assert reg.factory is list and reg.origin.plugin == "replacement"
    assert [(w.origin.plugin, lose.origin.plugin) for w, lose in skyrl_empty_host.registry.overridden()] == [
        ("replacement", "builtin")
    ]
    assert skyrl_empty_host.registry.conflicts() == []


def test_two_overrides_are_a_conflict(skyrl_empty_host) -> None:
    skyrl_empty_host.add_plugin(dataset_plugin("squares", override=True), "a")
    skyrl_empty_host.add_plugin(dataset_plugin("squares", override=True), "b")
    with pytest.raises(UserError, match="both pass override=True"):
        skyrl_empty_host.get("datasets", "squares")


def test_same_name_in_different_kinds_is_fine(skyrl_empty_host) -> None:
    class Plugin:
        @hookimpl
        def skyrl_register_samplers(self, register):
            register("squares", dict, description="a sampler")

    skyrl_empty_host.add_plugin(dataset_plugin("squares"), "a")
    skyrl_empty_host.add_plugin(Plugin(), "b")
    assert skyrl_empty_host.get("samplers", "squares").origin.plugin == "b"
    assert skyrl_empty_host.get("datasets", "squares").origin.plugin == "a"


def test_unknown_name_lists_available_and_suggests_closest(skyrl_empty_host) -> None:
    for n in ("arithmetic", "reverse_digits", "letter_count"):
        skyrl_empty_host.add_plugin(dataset_plugin(n), f"p_{n}")
    with pytest.raises(UserError) as info:
        skyrl_empty_host.get("datasets", "arithmatic")
    assert str(info.value) == (
        "error: unknown dataset 'arithmatic' (did you mean 'arithmetic'?); "
        "available: 'arithmetic', 'letter_count', 'reverse_digits'"
    )


@attrs.define
class GoodConfig:
    x: int = 1


class NotAttrs:
    pass


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"name": "bad name", "factory": dict, "description": "d"}, "ValueError: invalid dataset name 'bad name'"),
        ({"name": "ok", "factory": 3, "description": "d"}, "TypeError: dataset 'ok': factory must be callable, got 3"),
        ({"name": "ok", "factory": dict, "description": ""}, "ValueError: dataset 'ok': description must be one non-empty line"),
        ({"name": "ok", "factory": dict, "description": "a\nb"}, "ValueError: dataset 'ok': description must be one non-empty line"),
        ({"name": "ok", "factory": dict, "description": "d", "config": NotAttrs}, "TypeError: dataset 'ok': config must be an attrs class"),
        ({"name": "ok", "factory": dict, "description": "d", "slots": {}}, "TypeError: dataset 'ok': only job kinds take slots"),
        ({"name": "ok", "factory": dict}, "TypeError: register() missing 1 required keyword-only argument: 'description'"),
    ],
)
def test_register_checks_its_arguments(skyrl_empty_host, kwargs, error) -> None:
    class Plugin:
        @hookimpl
        def skyrl_register_datasets(self, register):
            register("fine", dict, config=GoodConfig, description="registered first")
            register(**kwargs)

    rec = skyrl_empty_host.add_plugin(Plugin(), "checked")
    assert skyrl_empty_host.registry.names("datasets") == []  # nothing half-registered
    assert rec.status == "failed"
    assert rec.error.startswith(f"skyrl_register_datasets raised {error}")


def test_every_kind_has_its_registration_hook(skyrl_empty_host) -> None:
    for kind in KINDS.values():
        assert getattr(skyrl_empty_host.pm.hook, kind.hook).has_spec(), kind.hook


@pytest.mark.parametrize(
    "slots, config, error",
    [
        ({"datasets": None}, None, "ValueError: job kind 'k': unknown slot table 'datasets' (did you mean 'dataset'?)"),
        ({"sampler": 3}, None, "TypeError: job kind 'k': the default of slot 'sampler' must be a name or None"),
        ({}, attrs.make_class("C", {"steps": attrs.field(default=1)}), "ValueError: job kind 'k': config key 'steps' is owned by the host's [job] table"),
    ],
)
def test_job_kind_registration_checks_slots_and_keys(skyrl_empty_host, slots, config, error) -> None:
    class Plugin:
        @hookimpl
        def skyrl_register_jobs(self, register):
            register("k", dict, config=config, description="a job kind", slots=slots)

    rec = skyrl_empty_host.add_plugin(Plugin(), "jobs")
    assert skyrl_empty_host.registry.names("jobs") == []
    assert rec.error.startswith(f"skyrl_register_jobs raised {error}")


def test_conflict_among_three_plugins(skyrl_empty_host) -> None:
    skyrl_empty_host.add_plugin(dataset_plugin("squares"), "a")
    skyrl_empty_host.add_plugin(dataset_plugin("squares", override=True), "b")
    skyrl_empty_host.add_plugin(dataset_plugin("squares", override=True), "c")
    with pytest.raises(UserError) as info:
        skyrl_empty_host.get("datasets", "squares")
    assert str(info.value) == (
        "error: dataset 'squares' is registered by plugin 'a', plugin 'b' and plugin 'c' and 2 pass override=True; "
        "block all but one with SKYRL_DISABLE_PLUGINS, or let exactly one register with override=True"
    )


def test_a_table_without_its_selector_goes_to_the_plugin_that_claims_it_highest(skyrl_host, skyrl_plugin, skyrl_cli,
                                                                                  tmp_path) -> None:
    import attrs

    from skyrl_host import hookimpl

    @attrs.frozen
    class Opts:
        path: str = ""

    def claim(priority):
        def claims(table):
            if table.get("path", "").startswith("acme:"):
                return priority, f"{table['path']!r} is acme's at {priority}"
            return None
        return claims

    def broken(table):
        raise RuntimeError("a plugin's bug")

    class Plugin:
        @hookimpl
        def skyrl_register_models(self, register):
            register("acme-specific", object, config=Opts, description="claims at 3", claims=claim(3))
            register("acme-generic", object, config=Opts, description="claims at 1", claims=claim(1))
            register("acme-broken", object, config=Opts, description="raises", claims=broken)

    skyrl_plugin(Plugin())
    job = tmp_path / "job.toml"
    job.write_text('[job]\nkind = "rl"\nsteps = 1\n[model]\npath = "acme:x"\n[dataset]\nname = "reverse_digits"\n')
    from skyrl_host.config import load_job

    spec = load_job(job, skyrl_host, [])
    assert spec.plugins["model"].name == "acme-specific"
    assert spec.plugins["model"].chosen_by == "family 'acme-specific' chosen: 'acme:x' is acme's at 3"
    out = skyrl_cli("validate", str(job))
    assert out.exit_code == 0 and "(family 'acme-specific' chosen: 'acme:x' is acme's at 3)" in out.stdout

    class Rival:
        @hookimpl
        def skyrl_register_models(self, register):
            register("acme-rival", object, config=Opts, description="claims at 3 too", claims=claim(3))

    skyrl_plugin(Rival())
    out = skyrl_cli("validate", str(job))
    assert out.exit_code == 2
    assert ("model.family: missing; both model family 'acme-rival' and 'acme-specific' could take this table: "
            "set family to one of them") in out.stderr
    # Nobody claims it: the plain "missing" message, as before.
    job.write_text('[job]\nkind = "rl"\nsteps = 1\n[model]\npath = "elsewhere"\n[dataset]\nname = "reverse_digits"\n')
    out = skyrl_cli("validate", str(job))
    assert out.exit_code == 2 and "model.family: missing required key (the model family to use)" in out.stderr
