"""The kind table (skyrl_host.kinds.KINDS) is the one list of plugin kinds: the hook
specifications, the registry, the job-file slots and the docs must all agree with it,
and every Protocol of skyrl_host.interfaces is either a kind's or a documented
capability."""

from __future__ import annotations

import inspect
import pathlib
import typing

from skyrl_host import hookspecs, interfaces
from skyrl_host.config import SLOTS
from skyrl_host.contracts import members
from skyrl_host.kinds import KINDS, PROTOCOLS, SLOT_KINDS
from skyrl_host.registry import Registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = {name: (ROOT / "docs" / name).read_text() for name in ("architecture.md", "writing-plugins.md", "hooks.md")}


def protocols() -> dict[str, type]:
    return {
        name: obj for name, obj in vars(interfaces).items()
        if inspect.isclass(obj) and getattr(obj, "_is_protocol", False) and obj.__module__ == interfaces.__name__
    }


def capabilities() -> dict[str, type]:
    kind_protocols = set(PROTOCOLS.values())
    return {name: p for name, p in protocols().items() if p not in kind_protocols}


def test_every_registration_hook_is_a_kind_and_every_kind_has_its_hook() -> None:
    register_hooks = {n for n in dir(hookspecs) if n.startswith("skyrl_register_") and n != "skyrl_register_commands"}
    assert register_hooks == {k.hook for k in KINDS.values()}
    for kind in KINDS.values():
        doc = inspect.getdoc(getattr(hookspecs, kind.hook))
        assert f"``[{kind.table}] {kind.selector} = " in doc, (kind.hook, doc)
        assert f"skyrl_host.interfaces.{kind.protocol.__name__}" in doc, (kind.hook, doc)


def test_the_registry_and_the_job_file_slots_follow_the_table() -> None:
    assert set(Registry()._candidates) == set(KINDS)
    assert {t: (s.kind, s.selector, s.many) for t, s in SLOTS.items()} == {
        t: (k.key, k.selector, k.many) for t, k in SLOT_KINDS.items()
    }
    # The host's own tables are kinds too, but no job kind lists them as slots.
    assert {k.table for k in KINDS.values() if k.host_table} == {"job", "cluster", "observers"}
    tables = [k.table for k in KINDS.values()]
    assert len(tables) == len(set(tables)), tables


def test_every_kind_protocol_is_runtime_checkable_and_declares_members() -> None:
    for kind in KINDS.values():
        assert getattr(kind.protocol, "_is_runtime_protocol", False), kind.protocol
        assert members(kind.protocol), kind.protocol
        assert kind.description and "\n" not in kind.description


def test_every_protocol_is_a_kind_or_a_capability_with_a_contract() -> None:
    for name, proto in capabilities().items():
        assert getattr(proto, "_is_runtime_protocol", False), name
        assert inspect.getdoc(proto), f"capability {name} has no docstring"
        assert members(proto), name
    for must in ("QuantizedServing", "AdapterTraining", "AdapterServing", "SharedWeights", "SplitTransport",
                 "ShardedWeights", "SideChannels", "TurnContinuation", "TokenizerLoading", "RewardKL"):
        assert must in capabilities(), must


def test_the_docs_show_the_kind_table_and_every_capability() -> None:
    for doc_name in ("architecture.md", "writing-plugins.md"):
        doc = DOCS[doc_name]
        for kind in KINDS.values():
            row = f"| `{kind.key}` | `{kind.hook}` | `[{kind.table}] {kind.selector}` | `{kind.protocol.__name__}` |"
            assert row in doc, f"{doc_name} lacks the kind row {row}"
        for name in capabilities():
            assert f"`{name}`" in doc, f"{doc_name} does not mention the capability {name}"
    for kind in KINDS.values():
        assert f"### `{kind.hook}(register)`" in DOCS["hooks.md"], kind.hook


def test_the_plugin_author_face_is_small() -> None:
    """What a plugin author imports lives in a few public modules that import nothing
    of the loader."""
    import skyrl_host.options as options

    assert set(options.__all__) == {"option", "OptionError", "gt", "ge", "lt", "le", "in_interval"}
    hints = typing.get_type_hints(interfaces.PlacementRequest)
    assert {"model", "backend", "precision", "engine", "weight_sync"} <= set(hints)
