"""Each sampler is its own plugin, registered through the installed entry points,
with the defaults of its name; the registered modules import no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest

import skyrl_samplers.greedy
import skyrl_samplers.min_p
import skyrl_samplers.temperature
import skyrl_samplers.top_k
import skyrl_samplers.top_p
from skyrl_host.interfaces import Sampler

MODULES = {
    "temperature": skyrl_samplers.temperature,
    "greedy": skyrl_samplers.greedy,
    "top_k": skyrl_samplers.top_k,
    "top_p": skyrl_samplers.top_p,
    "min_p": skyrl_samplers.min_p,
}

DEFAULTS = {
    "temperature": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "return_support": False, "logprobs": "processed"},
    "top_k": {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "return_support": False, "logprobs": "processed"},
    "top_p": {"temperature": 1.0, "top_k": 0, "top_p": 0.95, "min_p": 0.0, "return_support": False, "logprobs": "processed"},
    "min_p": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.05, "return_support": False, "logprobs": "processed"},
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_registered_through_installed_entry_points(skyrl_host, name: str) -> None:
    reg = skyrl_host.registry.get("samplers", name)
    assert reg.origin.distribution == "skyrl-samplers"
    assert skyrl_host.records[name].entry_point == f"skyrl_samplers.{name}"
    assert skyrl_host.records[name].status == "loaded"
    assert skyrl_host.pm.get_plugin(name) is MODULES[name]


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_each_name_only_changes_the_defaults(skyrl_host, name: str) -> None:
    reg = skyrl_host.registry.get("samplers", name)
    config = reg.config()
    assert attrs.asdict(config) == DEFAULTS[name]
    sampler = reg.create(config)
    assert isinstance(sampler, Sampler)
    assert (sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p, sampler.return_support, sampler.logprobs) == tuple(
        DEFAULTS[name].values()
    )
    # Every name accepts all four options.
    custom = reg.create(reg.config(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1))
    assert (custom.temperature, custom.top_k, custom.top_p, custom.min_p) == (0.5, 7, 0.9, 0.1)


def test_greedy_takes_only_return_support(skyrl_host) -> None:
    reg = skyrl_host.registry.get("samplers", "greedy")
    assert attrs.asdict(reg.config()) == {"return_support": False}
    sampler = reg.create(reg.config())
    assert isinstance(sampler, Sampler)
    assert sampler.temperature == 1.0
    assert sampler.return_support is False
    assert reg.create(reg.config(return_support=True)).return_support is True


@pytest.mark.parametrize("name", sorted(MODULES))
def test_return_support_defaults_off_and_reaches_the_sampler(skyrl_host, name: str) -> None:
    reg = skyrl_host.registry.get("samplers", name)
    assert reg.create(reg.config()).return_support is False
    assert reg.create(reg.config(return_support=True)).return_support is True


def test_entry_point_modules_import_no_torch() -> None:
    code = (
        "import json, sys\n"
        "import skyrl_samplers.temperature, skyrl_samplers.greedy, skyrl_samplers.top_k, "
        "skyrl_samplers.top_p, skyrl_samplers.min_p\n"
        "skyrl_samplers.top_p.TopPConfig(top_k=3)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
