"""Registration through the installed entry points, each algorithm's defaults,
config validation, and light imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import skyrl_algorithms.dapo
import skyrl_algorithms.dr_grpo
import skyrl_algorithms.grpo
import skyrl_algorithms.gspo
import skyrl_algorithms.rloo
from skyrl_host.config import Located, structure_table
from skyrl_host.interfaces import Algorithm

MODULES = {
    "grpo": (skyrl_algorithms.grpo, "Grpo", "GrpoConfig"),
    "dapo": (skyrl_algorithms.dapo, "Dapo", "DapoConfig"),
    "dr_grpo": (skyrl_algorithms.dr_grpo, "DrGrpo", "DrGrpoConfig"),
    "gspo": (skyrl_algorithms.gspo, "Gspo", "GspoConfig"),
    "rloo": (skyrl_algorithms.rloo, "Rloo", "RlooConfig"),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_registered_through_installed_entry_points(skyrl_host, name: str) -> None:
    module, factory, config = MODULES[name]
    reg = skyrl_host.registry.get("algorithms", name)
    assert reg.factory is getattr(module, factory)
    assert reg.config is getattr(module, config)
    assert reg.origin.distribution == "skyrl-algorithms"
    assert skyrl_host.records[name].entry_point == f"skyrl_algorithms.{name}"
    assert skyrl_host.pm.get_plugin(name) is module
    algo = reg.create(reg.config())
    assert isinstance(algo, Algorithm)


DEFAULTS = {
    "grpo": dict(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-mean", baseline="mean", scale_by_std=True,
                 ratio_level="token", dynamic_sampling=False, overlong_shaping=False),
    "dapo": dict(clip_low=0.2, clip_high=0.28, loss_agg="token-mean", baseline="mean", scale_by_std=True,
                 ratio_level="token", dynamic_sampling=True, overlong_shaping=True),
    "dr_grpo": dict(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-sum-norm", baseline="mean",
                    scale_by_std=False, ratio_level="token", dynamic_sampling=False, overlong_shaping=False),
    "gspo": dict(clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean", baseline="mean", scale_by_std=True,
                 ratio_level="sequence", dynamic_sampling=False, overlong_shaping=False),
    "rloo": dict(clip_low=0.2, clip_high=0.2, loss_agg="token-mean", baseline="leave_one_out", scale_by_std=False,
                 ratio_level="token", dynamic_sampling=False, overlong_shaping=False),
}
SHARED = dict(dual_clip_c=0.0, tis_cap=0.0, std="population", eps=1e-6, kl_coef=0.0, kl_estimator="k3", kl_in_reward=False,
              overlong_buffer=None, overlong_penalty=1.0, max_refill_rounds=10, off_policy="none",
              off_policy_level="token", off_policy_cap=None, icepop_beta=None, icepop_alpha=None, decoupled=False)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_defaults(name: str) -> None:
    module, _, config = MODULES[name]
    cfg = getattr(module, config)()
    for key, value in {**DEFAULTS[name], **SHARED}.items():
        assert getattr(cfg, key) == value, key


def check(data: dict, cls=skyrl_algorithms.grpo.GrpoConfig):
    out = Located("job.toml", {})
    inst = structure_table(cls, data, "algorithm", out, skip=["name"])
    return inst, [f"{p.key}: {p.message}" for p in out.problems]


def test_valid_table() -> None:
    inst, problems = check(
        {"name": "grpo", "clip_high": 0.28, "kl_coef": 0, "loss_agg": "token-mean", "tis_cap": 2, "std": "unbiased"}
    )
    assert problems == []
    assert inst.std == "unbiased"
    assert inst.clip_high == 0.28 and inst.kl_coef == 0.0 and inst.loss_agg == "token-mean" and inst.tis_cap == 2.0


def test_bad_choices_are_named_with_a_suggestion() -> None:
    _, problems = check({"kl_estimator": "k4", "loss_agg": "token_mean", "ratio_level": "seq", "std": "sample"})
    # In the order of the options.
    assert problems[0].startswith("algorithm.ratio_level: expected one of 'token', 'sequence', found string 'seq'")
    assert problems[1].startswith("algorithm.loss_agg: expected one of 'token-mean'")
    assert "did you mean 'token-mean'" in problems[1]
    assert problems[2].startswith("algorithm.std: expected one of 'population', 'unbiased', found string 'sample'")
    assert problems[3].startswith("algorithm.kl_estimator: expected one of 'k1', 'k2', 'k3', found string 'k4'")


def test_bounds() -> None:
    _, problems = check(
        {
            "clip_low": 1.0,
            "clip_high": -0.1,
            "dual_clip_c": 0.5,
            "tis_cap": -1,
            "eps": 0,
            "kl_coef": -0.1,
            "overlong_buffer": 0,
            "overlong_penalty": -1,
            "max_refill_rounds": -1,
        }
    )
    assert problems == [
        "algorithm.clip_low: expected a value in [0, 1), found 1.0",
        "algorithm.clip_high: expected a value in [0, 1), found -0.1",
        "algorithm.dual_clip_c: expected 0 (off) or a value > 1, found 0.5",
        "algorithm.tis_cap: expected a value >= 0, found -1.0",
        "algorithm.eps: expected a value > 0, found 0.0",
        "algorithm.kl_coef: expected a value >= 0, found -0.1",
        "algorithm.overlong_buffer: expected a value > 0, found 0",
        "algorithm.overlong_penalty: expected a value >= 0, found -1.0",
        "algorithm.max_refill_rounds: expected a value >= 0, found -1",
    ]


def test_unknown_key_suggests_the_option() -> None:
    _, problems = check({"clip_hihg": 0.3})
    assert problems[0].startswith("algorithm.clip_hihg: unknown key")
    assert "clip_high" in problems[0]


def test_importing_the_registered_modules_loads_neither_torch_nor_numpy() -> None:
    code = (
        "import sys\n"
        "import skyrl_algorithms.grpo, skyrl_algorithms.dapo, skyrl_algorithms.dr_grpo\n"
        "import skyrl_algorithms.gspo, skyrl_algorithms.rloo\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
