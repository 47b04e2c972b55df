"""The device kit: every GPU check that needs no vLLM, one command, one JSON summary.

    bash benchmarks/device/prepare.sh              # here, once: the wheels the lent machine lacks -> .whl/
    bash benchmarks/device/run.sh [--cpu] [--only NAME,...] [--budget SECONDS]   # there (or here with --cpu)

``run.sh`` installs the carried wheels into a folder of its own, writes the project's
distribution metadata beside them (so the ``skyrl`` entry points are found without an
install), puts both and the source folders on ``PYTHONPATH`` and calls ``kit.py run``.
This file holds the rest:

- ``run``: the checks (``CHECKS``), each a subprocess under its own timeout inside one
  overall budget, each summarised from what it wrote (``metrics.jsonl``, a benchmark's
  JSON); a check that fails or hangs is reported and the others still run. Writes
  ``summary.json`` and ``logs.tar.gz`` (every check's output) under ``--out`` (run.sh:
  ``$OUT`` when set) and prints the summary. ``--cpu``: the same checks on the CPU at tiny
  sizes, the wiring proven before a GPU sees it (tests/test_device_kit.py runs it in CI).
- ``metadata DEST``: the ``*.dist-info`` folders of the distributions the kit runs.
- ``preflight``: what the machine has: Python, torch, CUDA, every requirement of those
  distributions (installed version, satisfied or not, where it comes from), plugin load
  errors. The first check of ``run``.
- ``needs``: the distributions the kit needs (the closure of its distributions'
  requirements for Python 3.12 on Linux x86-64) that are neither on the lent machine
  (``lent_machine.txt``) nor in ``wheels.txt``: what prepare.sh and the CI test check.

Exit codes: 0 every check passed; 1 one failed (see its ``error`` and the log); 2 a usage
error.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

KIT = pathlib.Path(__file__).resolve().parent
ROOT = KIT.parents[1]

# The distributions the kit runs, by source folder: not skyrl-launchers (Ray cannot travel:
# its wheel is 79 MB), not skyrl-environments (SkyRL-Gym, gymnasium: no check needs them).
DISTRIBUTIONS = {
    "skyrl-host": ROOT,
    "skyrl-toolkit": ROOT / "plugins" / "toolkit",
    "skyrl-launchers": ROOT / "plugins" / "launchers",  # the local launcher (the ray one needs Ray: not run there)
    "skyrl-models": ROOT / "plugins" / "models",
    "skyrl-algorithms": ROOT / "plugins" / "algorithms",
    "skyrl-rewards": ROOT / "plugins" / "rewards",
    "skyrl-replay": ROOT / "plugins" / "replay",
    "skyrl-precisions": ROOT / "plugins" / "precisions",
    "skyrl-weightsync": ROOT / "plugins" / "weightsync",
    "skyrl-samplers": ROOT / "plugins" / "samplers",
    "skyrl-datasets": ROOT / "plugins" / "datasets",
    "skyrl-engines": ROOT / "plugins" / "engines",
    "skyrl-backends": ROOT / "plugins" / "backends",
    "skyrl-server": ROOT / "plugins" / "server",
}
LIBRARIES = {"skyrl-toolkit"}  # distributions with no skyrl plugins of their own
# Where requirement markers are evaluated: the lent machine's interpreter.
LENT_MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "platform_release": "", "platform_version": "",
    "implementation_version": "3.12.3", "extra": "",
}


# -- package lists -------------------------------------------------------------------------


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: pathlib.Path) -> dict[str, str | None]:
    """``name [version]`` or ``name==version`` lines (``#`` comments) -> {canonical name: version or None}."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" in line:
            name, version = (s.strip() for s in line.split("==", 1))
        else:
            parts = line.split()
            name, version = parts[0], (parts[1] if len(parts) > 1 else None)
        out[canonical(name)] = version
    return out


def lent_packages() -> dict[str, str | None]:
    return read_list(KIT / "lent_machine.txt")


def carried_wheels() -> dict[str, str | None]:
    return read_list(KIT / "wheels.txt")


def project(folder: pathlib.Path) -> dict:
    import tomllib

    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def requirement_closure(roots: list[str], metadata_of: Callable[[str], list[str] | None],
                        leaf: Callable[[str], bool] = lambda name: False) -> dict[str, list[str]]:
    """{canonical name: the requirement strings that asked for it} for ``roots`` and
    everything they require (markers evaluated for the lent machine; extras ignored).
    ``metadata_of(name)``: the requirement strings of an installed or carried
    distribution, or None when nothing is known of it. ``leaf(name)``: whether to stop
    there (a package the lent machine has: its own requirements are met there)."""
    from packaging.requirements import Requirement

    asked: dict[str, list[str]] = {}
    stack = list(roots)
    while stack:
        text = stack.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(LENT_MARKERS):
            continue
        name = canonical(req.name)
        first = name not in asked
        asked.setdefault(name, []).append(text)
        if first and not name.startswith("skyrl-") and not leaf(name):
            stack.extend(metadata_of(req.name) or [])
    return asked


def installed_requires(name: str) -> list[str] | None:
    import importlib.metadata as md

    try:
        return list(md.distribution(name).requires or [])
    except md.PackageNotFoundError:
        return None


def kit_roots() -> list[str]:
    roots: list[str] = []
    for folder in DISTRIBUTIONS.values():
        roots += project(folder).get("dependencies", [])
    return roots


def missing_on_lent_machine(metadata_of: Callable[[str], list[str] | None] = installed_requires,
                            lent: dict[str, str | None] | None = None,
                            carried: dict[str, str | None] | None = None) -> dict[str, str]:
    """{distribution: why} for every distribution the kit needs that is neither on the lent
    machine (``lent``, default lent_machine.txt) nor carried (``carried``, default
    wheels.txt), or is there at a version its requirements refuse."""
    from packaging.requirements import Requirement

    lent = lent_packages() if lent is None else lent
    carried = carried_wheels() if carried is None else carried
    problems: dict[str, str] = {}
    closure = requirement_closure(kit_roots(), metadata_of, leaf=lambda n: n in lent and n not in carried)
    for name, asked in sorted(closure.items()):
        if name.startswith("skyrl-"):
            continue
        if name in carried:
            version = carried[name]
            refused = [a for a in asked if version and not Requirement(a).specifier.contains(version, prereleases=True)]
            if refused:
                problems[name] = f"carried at {version}, but {refused[0]!r} refuses it"
        elif name in lent:
            version = lent[name]
            refused = [a for a in asked if version and not Requirement(a).specifier.contains(version, prereleases=True)]
            if refused:
                problems[name] = f"the lent machine has {version}, but {refused[0]!r} refuses it: carry it"
        else:
            problems[name] = f"neither on the lent machine nor in wheels.txt (asked by {asked[0]!r})"
    return problems


def wheel_requires(folder: pathlib.Path) -> Callable[[str], list[str] | None]:
    """``metadata_of`` reading the METADATA of the wheels in ``folder``, falling back to the
    installed distributions for the rest."""
    import zipfile

    found: dict[str, list[str]] = {}
    for whl in folder.glob("*.whl"):
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode()
        name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
        found[canonical(name)] = [m.strip() for m in re.findall(r"^Requires-Dist: (.+)$", text, re.M)]

    def metadata_of(name: str) -> list[str] | None:
        got = found.get(canonical(name))
        return got if got is not None else installed_requires(name)

    return metadata_of


# Modules a check imported on this machine that the lent machine may lack without harm:
# imported only where installed, each behind an ImportError or availability check.
OPTIONAL_IMPORTS = {
    "wandb": "megatron-core's inference context: try/except ImportError",
    "platformdirs": "wandb's",
    "boto3": "accelerate's SageMaker config: only when importlib finds it",
    "botocore": "boto3's", "jmespath": "boto3's", "s3transfer": "boto3's",
    "dill": "torch.utils._import_utils.import_dill: only when importlib finds it (a machine with datasets has it)",
}


def recorded_imports(folder: pathlib.Path) -> dict[str, str]:
    """{top-level module: its file} over every ``imports-*.json`` the recorder wrote."""
    modules: dict[str, str] = {}
    for path in sorted(folder.glob("imports-*.json")):
        modules.update(json.loads(path.read_text())["modules"])
    return modules


def unexplained_imports(modules: dict[str, str], lent: dict[str, str | None] | None = None,
                        carried: dict[str, str | None] | None = None) -> dict[str, str]:
    """{module: why} for each recorded module the lent machine would not have: not from a
    distribution on the lent machine or carried, nor required by one of the lent machine's
    own packages (its versions bring their own: huggingface-hub 2.x here imports httpx2,
    1.33 there does not), nor in ``OPTIONAL_IMPORTS``."""
    import importlib.metadata as md

    lent = lent_packages() if lent is None else lent
    carried = carried_wheels() if carried is None else carried
    by_module = md.packages_distributions()
    provided = set(lent) | set(carried)
    # What the lent machine's packages require, as installed here.
    below_lent = set(requirement_closure([n for n in lent if n != "python"], installed_requires))
    problems = {}
    for module, where in sorted(modules.items()):
        if module.startswith(("__editable__", "_sysconfigdata")) or f"{os.sep}_vendor{os.sep}" in where:
            continue  # this virtual environment's own machinery, or a package's vendored copy
        if module in OPTIONAL_IMPORTS:
            continue
        dists = {canonical(d) for d in by_module.get(module, [])}
        if not dists:
            problems[module] = f"no installed distribution provides it ({where})"
        elif not dists & (provided | below_lent) and not any(d.startswith("skyrl-") for d in dists):
            problems[module] = f"from {', '.join(sorted(dists))}: not on the lent machine, not in wheels.txt"
    return problems


# -- the project's metadata, without an install --------------------------------------------


def write_metadata(dest: pathlib.Path) -> list[str]:
    """Write a ``*.dist-info`` folder (METADATA, entry_points.txt, top_level.txt) for each
    distribution the kit runs into ``dest``; returns the source folders that go on
    ``PYTHONPATH`` beside it. importlib.metadata finds the entry points there exactly as
    an installed distribution's."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("skyrl_*.dist-info"):
        shutil.rmtree(old)
    for name, folder in DISTRIBUTIONS.items():
        proj = project(folder)
        info = dest / f"{canonical(proj['name']).replace('-', '_')}-{proj['version']}.dist-info"
        info.mkdir()
        lines = ["Metadata-Version: 2.1", f"Name: {proj['name']}", f"Version: {proj['version']}"]
        lines += [f"Requires-Dist: {r}" for r in proj.get("dependencies", [])]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
        groups = proj.get("entry-points", {})
        ini = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items())
        (info / "entry_points.txt").write_text(ini)
        packages = sorted(p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()
                          and p.name.startswith("skyrl_"))
        (info / "top_level.txt").write_text("\n".join(packages) + "\n")
    return [str(folder) for folder in DISTRIBUTIONS.values()]


# -- preflight ----------------------------------------------------------------------------


def preflight() -> dict:
    """What this machine has for the kit (printed as JSON by ``kit.py preflight``)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    problems: list[str] = []
    packages: dict[str, Any] = {}
    for name, asked in sorted(requirement_closure(kit_roots(), installed_requires).items()):
        if name.startswith("skyrl-"):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            packages[name] = {"installed": None}
            problems.append(f"{name}: not installed ({asked[0]!r})")
            continue
        refused = [a for a in asked if not Requirement(a).specifier.contains(dist.version, prereleases=True)]
        where = str(dist.locate_file(""))
        packages[name] = {"installed": dist.version, "from": where}
        if refused:
            packages[name]["refused_by"] = refused
            problems.append(f"{name} {dist.version}: refused by {refused[0]!r}")
    out["packages"] = packages
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.cuda.is_available()
        if out["cuda"]:
            out["device"] = torch.cuda.get_device_name(0)
            out["capability"] = list(torch.cuda.get_device_capability(0))
            out["cuda_version"] = torch.version.cuda
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the summary says what broke
        problems.append(f"import torch: {type(exc).__name__}: {exc}")
    try:
        from skyrl_host.plugins import build_host

        host = build_host()
        records = host.records.values()
        out["plugins"] = len(records)
        failed = {r.name: r.error for r in records if getattr(r, "error", None)}
        needed = {canonical(n) for n in DISTRIBUTIONS}
        for plugin, error in failed.items():
            record = host.records[plugin]
            if canonical(getattr(record, "distribution", "") or "") in needed:
                problems.append(f"plugin {plugin!r} failed to load: {error}")
        out["plugin_errors"] = failed
        dists = {r.distribution for r in records if getattr(r, "distribution", None)}
        out["distributions_found"] = sorted(dists)
        absent = sorted(set(DISTRIBUTIONS) - LIBRARIES - {canonical(d) for d in dists})
        if absent:
            problems.append(f"no plugins found of {', '.join(absent)} (metadata not on PYTHONPATH?)")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"skyrl_host.plugins.build_host(): {type(exc).__name__}: {exc}")
    out["problems"] = problems
    out["ok"] = not problems
    return out


# -- the checks ---------------------------------------------------------------------------


@dataclass
class Context:
    cpu: bool
    work: pathlib.Path  # this check's folder
    python: str = sys.executable

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    def skyrl(self, *args: str) -> list[str]:
        return [self.python, "-m", "skyrl_host", *args]

    def job(self, path: str, *sets: str, steps: int, out: str = "run") -> list[str]:
        """``skyrl run`` of a job file with ``--set`` overrides, into ``work/out``."""
        cmd = self.skyrl("run", str(ROOT / path), "--overwrite", "--set", f'job.output_dir="{self.work / out}"',
                         "--set", f"job.steps={steps}", "--set", "job.checkpoint_every=0",
                         "--set", "job.save_final=false")
        for s in sets:
            cmd += ["--set", s]
        return cmd


@dataclass
class Check:
    name: str
    what: str
    timeout: tuple[float, float]  # seconds: (GPU, CPU)
    commands: Callable[[Context], list[list[str]]]  # run one after another, each must exit 0
    summarize: Callable[[Context, list[str]], dict] = lambda ctx, outputs: {}  # (each command's output)
    env: dict[str, str] = field(default_factory=dict)


def metrics_rows(folder: pathlib.Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:  # a last line without its newline: a write in progress
            continue
        if "step" in row and "event" not in row:
            rows.append(row)
    return rows


def job_summary(folder: pathlib.Path, *, warmup: int = 1) -> dict:
    """A run's numbers a person looks at first: reward at the start and the end, step time
    (median, after ``warmup`` steps), tokens/s, the engine/trainer gap."""
    rows = metrics_rows(folder)
    if not rows:
        raise ValueError(f"{folder}: no metrics were written")
    timed = rows[warmup:] or rows
    out: dict[str, Any] = {"steps": len(rows)}
    head, tail = rows[: max(1, min(5, len(rows) // 2))], rows[-max(1, min(10, len(rows) // 2)):]
    if "reward_mean" in rows[0]:
        out["reward_first"] = statistics.fmean(r["reward_mean"] for r in head)
        out["reward_last"] = statistics.fmean(r["reward_mean"] for r in tail)
    for key in ("step_time", "gen_tokens_per_s", "train_tokens_per_s", "sync_seconds"):
        values = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        if values:
            out[f"median_{key}"] = statistics.median(values)
    gaps = [r["logprob_diff_max"] for r in rows if isinstance(r.get("logprob_diff_max"), (int, float))]
    if gaps:
        out["logprob_diff_max"] = max(gaps)
        out["logprob_diff_mean"] = statistics.fmean(r["logprob_diff_mean"] for r in rows if "logprob_diff_mean" in r)
    return out


def last_json(text: str) -> Any:
    """The last JSON object a benchmark printed (its stdout may hold log lines before it)."""
    start = text.rfind("\n{")
    while start >= -1:
        try:
            return json.loads(text[start + 1:])
        except ValueError:
            if start <= 0:
                break
            start = text.rfind("\n{", 0, start)
    raise ValueError("no JSON object at the end of the output")


# The jobs' devices: both the engine and the backend.
def on(ctx: Context) -> list[str]:
    return [f'engine.device="{ctx.device}"', f'backend.device="{ctx.device}"']


def threads(ctx: Context) -> list[str]:
    return ["job.threads=2"] if ctx.cpu else []


DELTA = ['weight_sync.transport="delta"', 'weight_sync.dtype="float32"']

# A real-shaped MoE: Qwen3-30B-A3B's layer (hidden 2048, 32 heads x 128, 4 KV heads, 128
# experts of 768, top-8) with 2 layers, on the GPU; the tiny-moe preset on the CPU.
MOE_REAL = ["model.hidden_size=2048", "model.num_layers=2", "model.num_heads=32", "model.num_kv_heads=4",
            "model.head_dim=128", "model.intermediate_size=768", "model.num_experts=128", "model.top_k=8"]
# A dense model that keeps an H100 busy for the precisions' step times (Qwen3-8B's widths, 4 layers).
DENSE_REAL = ["model.hidden_size=4096", "model.num_layers=4", "model.num_heads=32", "model.num_kv_heads=8",
              "model.head_dim=128", "model.intermediate_size=12288"]


def quickstart(ctx: Context) -> list[list[str]]:
    return [ctx.job("examples/quickstart.toml", *on(ctx), *threads(ctx), steps=5 if ctx.cpu else 100)]


def shared_prompts(ctx: Context) -> list[list[str]]:
    """The quickstart with every micro-batch in flat rows (on a GPU "auto" keeps its short
    sequences in padded rows), so each prompt's samples share it: the tree masks' SDPA on the device."""
    return [ctx.job("examples/quickstart.toml", 'backend.flat_rows="always"', "backend.share_prompts=true", *on(ctx),
                    *threads(ctx), steps=5 if ctx.cpu else 100)]


def moe_r3_support(ctx: Context) -> list[list[str]]:
    sets = ['model.family="qwen"', 'model.preset="tiny-moe"', *([] if ctx.cpu else MOE_REAL)]
    return [ctx.job("examples/replay_ablation.toml", *sets, *on(ctx), *threads(ctx), steps=3 if ctx.cpu else 10)]


def delta_sync(ctx: Context) -> list[list[str]]:
    uri = f'weight_sync.uri="file://{ctx.work / "weights"}"'
    return [ctx.job("examples/quickstart.toml", *on(ctx), *threads(ctx), *DELTA, uri, steps=3 if ctx.cpu else 20)]


def async_delta(ctx: Context) -> list[list[str]]:
    uri = f'weight_sync.uri="file://{ctx.work / "weights"}"'
    return [ctx.job("examples/quickstart.toml", *on(ctx), *threads(ctx), *DELTA, uri, 'job.mode="async"',
                    "job.max_staleness=1", "engine.share_weights=false", steps=4 if ctx.cpu else 40)]


def opd_teacher(ctx: Context) -> list[list[str]]:
    """On-policy distillation with the teacher scoring on the device (the tiny preset as
    its own teacher: teacher_kl starts at ~0, and each step runs the teacher's forward),
    and the top-4 teacher KL term beside it (the teacher's top-k from its logits on the
    device, the student's logprobs of those ids gathered from the trainer's)."""
    sets = ['algorithm.name="opd"', "algorithm.teacher_kl_coef=0.1", "algorithm.teacher_kl_topk=4",
            'teacher.family="qwen"', 'teacher.preset="tiny"', f'teacher.device="{ctx.device}"']
    return [ctx.job("examples/quickstart.toml", *on(ctx), *threads(ctx), *sets, steps=3 if ctx.cpu else 20)]


def opd_teacher_summary(ctx: Context, outputs: list[str]) -> dict:
    out = job_summary(ctx.work / "run")
    rows = metrics_rows(ctx.work / "run")
    for key in ("teacher_kl", "teacher_kl_loss"):
        values = [r.get(key) for r in rows]
        if not values or any(v is None or v != v for v in values):
            raise ValueError(f"{key} missing or NaN: {values[:5]}")
        out[f"{key}_last"] = values[-1]
    return out


# A tiny Qwen3 sequence classifier (random weights) with the real-shaped BPE tokenizer and
# its chat template, built where the check runs: the reward model the job's part loads.
_REWARD_MODEL = """
import sys, torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification
from skyrl_models import checkpoints
folder = sys.argv[1]
checkpoints.build_tokenizer(folder + "/tok")
tok = AutoTokenizer.from_pretrained(folder + "/tok")
torch.manual_seed(0)
config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1,
                     pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
Qwen3ForSequenceClassification(config).save_pretrained(folder + "/rm")
tok.save_pretrained(folder + "/rm")
"""


def reward_model(ctx: Context) -> list[list[str]]:
    """A [reward] part scoring with a sequence-classification model on the device, beside the
    dataset's rule reward (weight 0.1), in the quickstart."""
    sets = ['reward.parts=["dataset", "reward_model"]', f'reward.reward_model.path="{ctx.work / "rm"}"',
            f'reward.reward_model.device="{ctx.device}"', "reward.reward_model.weight=0.1"]
    return [[ctx.python, "-c", _REWARD_MODEL, str(ctx.work)],
            ctx.job("examples/quickstart.toml", *on(ctx), *threads(ctx), *sets, steps=3 if ctx.cpu else 20)]


def reward_model_summary(ctx: Context, outputs: list[str]) -> dict:
    out = job_summary(ctx.work / "run")
    rows = metrics_rows(ctx.work / "run")
    means = [r.get("reward/reward_model_mean") for r in rows]
    if not means or any(m is None or m != m for m in means):
        raise ValueError(f"reward/reward_model_mean missing or NaN: {means[:5]}")
    out["reward_model_mean_first"], out["reward_model_mean_last"] = means[0], means[-1]
    return out


def megatron_quickstart(ctx: Context) -> list[list[str]]:
    return [ctx.job("examples/quickstart.toml", 'backend.name="megatron"', *on(ctx), *threads(ctx),
                    steps=3 if ctx.cpu else 30)]


PRECISION_RUNS = {  # name -> [precision] table; every run computes in bf16 autocast
    "bf16": 'precision={name="bf16"}',
    "fp8": 'precision={name="fp8"}',
    "fp8_rowwise": 'precision={name="fp8", scaling="rowwise"}',
    "mxfp8": 'precision={name="mxfp8"}',
}


def precisions(ctx: Context) -> list[list[str]]:
    size = [] if ctx.cpu else DENSE_REAL
    cmds = []
    # bf16 twice, first and last: its spread says how much of a ratio is noise.
    for run in PRECISION_ORDER:
        table = PRECISION_RUNS[run.removesuffix("_again")]
        cmds.append(ctx.job("examples/quickstart.toml", table, 'backend.compute_dtype="bfloat16"',
                            'engine.dtype="bfloat16"', "engine.share_weights=false", *size, *on(ctx), *threads(ctx),
                            steps=3 if ctx.cpu else 8, out=run))
    return cmds


PRECISION_ORDER = ("bf16", "fp8", "fp8_rowwise", "mxfp8", "bf16_again")


def precisions_summary(ctx: Context, outputs: list[str]) -> dict:
    runs = {run: job_summary(ctx.work / run, warmup=1 if ctx.cpu else 2)
            for run in PRECISION_ORDER}
    base = statistics.fmean([runs["bf16"]["median_step_time"], runs["bf16_again"]["median_step_time"]])
    out: dict[str, Any] = {"bf16_spread": abs(runs["bf16"]["median_step_time"] / runs["bf16_again"]["median_step_time"] - 1)}
    for run, s in runs.items():
        out[run] = {k: s[k] for k in ("median_step_time", "logprob_diff_mean", "logprob_diff_max") if k in s}
        out[run]["step_time_vs_bf16"] = s["median_step_time"] / base
    for run, output in zip(PRECISION_ORDER, outputs):
        # The precision's own line: "precision fp8: torchao kernels (fp8_rowwise, ...): 8 layers on torchao's, ..."
        said = re.search(r"^precision \w+: (\w+) kernels \((\w+).*?\): (\d+) layers on torchao's", output, re.M)
        if said:
            out[run].update(kernels=said.group(1), format=said.group(2), torchao_layers=int(said.group(3)))
    return out


def megatron_step(ctx: Context) -> list[list[str]]:
    models = "tiny" if ctx.cpu else "tiny-moe,qwen3-2l"
    return [[ctx.python, str(ROOT / "benchmarks" / "megatron_step.py"), "--models", models,
             "--repeats", "1" if ctx.cpu else "3", "--device", ctx.device]]


def fsdp2(ctx: Context) -> list[list[str]]:
    return [[ctx.python, str(KIT / "fsdp2_check.py"), "--device", ctx.device, "--steps", "2" if ctx.cpu else "5",
             "--kind", "tiny" if ctx.cpu else "qwen3"]]


def tinker_load(ctx: Context) -> list[list[str]]:
    sizes = (["--requests", "192", "--sdk-requests", "8", "--rounds", "1", "--workers", "1", "--concurrency", "64"]
             if ctx.cpu else ["--requests", "131072", "--sdk-requests", "512", "--rounds", "2", "--workers", "8",
                              "--concurrency", "4096", "--threads", "8"])
    return [[ctx.python, str(ROOT / "benchmarks" / "tinker_load.py"), *sizes]]


def tinker_rl_loop(ctx: Context) -> list[list[str]]:
    sizes = ["--steps", "2", "--prompts", "4", "--group", "4"] if ctx.cpu else ["--steps", "30"]
    return [[ctx.python, str(ROOT / "examples" / "tinker_rl_loop.py"), *sizes, "--out", str(ctx.work / "run")]]


def tinker_rl_summary(ctx: Context, outputs: list[str]) -> dict:
    result = last_json(outputs[-1])
    rows = metrics_rows(ctx.work / "run")
    keep = {k: result[k] for k in ("steps", "s_per_step", "reward_first5", "reward_last5", "exact_match_last5")}
    keep["median_train_s"] = statistics.median(r["train_s"] for r in rows)
    keep["median_sample_s"] = statistics.median(r["sample_s"] for r in rows)
    return keep


def tinker_summary(ctx: Context, outputs: list[str]) -> dict:
    result = last_json(outputs[-1])
    keep = {}
    for key, value in result.items():
        if isinstance(value, (int, float, str, bool)) or key in ("http", "sdk", "ratio", "server"):
            keep[key] = value
    return keep


def benchmark_json(ctx: Context, outputs: list[str]) -> dict:
    return last_json(outputs[-1])


def run_summary(ctx: Context, outputs: list[str]) -> dict:
    return job_summary(ctx.work / "run")


CHECKS = [
    Check("preflight", "Python, torch, CUDA, every requirement and plugin the kit needs", (60, 120),
          lambda ctx: [[ctx.python, str(KIT / "kit.py"), "preflight"]], benchmark_json),
    Check("quickstart", "the quickstart with the engine and the backend on the device", (90, 120), quickstart,
          run_summary),
    Check("moe_r3_support", "a Qwen3-30B-A3B-shaped MoE (2 layers) with r3 + support replay, bf16 engine",
          (120, 180), moe_r3_support, run_summary),
    Check("fsdp2", "FSDP2 over a one-rank group (NCCL on CUDA) against no data parallelism, the same steps",
          (75, 120), fsdp2, benchmark_json),
    Check("delta_sync", "the quickstart with delta weight sync (file:// store, float32 on the wire)", (60, 120),
          delta_sync, run_summary),
    Check("async_delta", "async RL (k = 1) with the delta written in the background", (60, 120), async_delta,
          run_summary),
    Check("opd_teacher", "on-policy distillation and a top-4 teacher KL term, the [teacher] scoring on the device",
          (60, 120), opd_teacher, opd_teacher_summary),
    Check("reward_model", "a [reward] part scoring with a sequence-classification model on the device", (75, 120),
          reward_model, reward_model_summary),
    Check("megatron_step", "megatron vs torch backend: the same first step (parity), then step times", (120, 180),
          megatron_step, benchmark_json),
    Check("megatron_quickstart", "the quickstart on the megatron backend on the device", (75, 180),
          megatron_quickstart, run_summary),
    Check("precisions", "bf16 / fp8 blockwise / fp8 rowwise / mxfp8 step times and engine/trainer gaps, bf16 autocast",
          (180, 480), precisions, precisions_summary),
    Check("tinker_rl_loop", "the official tinker SDK trains a LoRA adapter through skyrl serve (RL loop)",
          (90, 180), tinker_rl_loop, tinker_rl_summary),
    Check("tinker_load", "skyrl serve under the Tinker load benchmark: served tokens/s vs offline generation",
          (200, 300), tinker_load, tinker_summary),
    Check("shared_prompts", "the quickstart in flat rows with shared prompts (tree-masked attention) on the device",
          (90, 120), shared_prompts, run_summary),
]


# -- running them ---------------------------------------------------------------------------


def run_one(check: Check, ctx: Context, timeout: float, log: pathlib.Path, env: dict[str, str]) -> dict:
    """Run ``check``'s commands (output to ``log``), then summarise; never raises."""
    t0 = time.perf_counter()
    result: dict[str, Any] = {"what": check.what}
    output = []
    with log.open("w") as fh:
        for cmd in check.commands(ctx):
            left = timeout - (time.perf_counter() - t0)
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            if left <= 1:
                result.update(ok=False, error=f"timed out after {timeout:.0f} s")
                break
            # A session of its own: a timeout kills the check's children too (servers, ranks).
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**env, **check.env}, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                fh.write(out)
                result.update(ok=False, error=f"timed out after {timeout:.0f} s")
                break
            fh.write(out)
            output.append(out)
            if proc.returncode != 0:
                lines = [x for x in out.splitlines() if x.strip()]
                result.update(ok=False, rc=proc.returncode, error="\n".join(lines[-25:])[-3000:])
                break
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if "ok" not in result:
        try:
            result.update(check.summarize(ctx, output))
            result.setdefault("ok", True)
        except Exception as exc:  # noqa: BLE001 - a summary that cannot be read is a failed check
            result.update(ok=False, error=f"summary: {type(exc).__name__}: {exc}")
    return result


def compact(summary: dict[str, Any], limit: int = 600) -> dict[str, Any]:
    """``summary`` for a terminal: the preflight's package table left out (summary.json has
    it) and every string cut to its last ``limit`` characters."""
    def cut(value: Any) -> Any:
        if isinstance(value, str) and len(value) > limit:
            return "..." + value[-limit:]
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, list):
            return [cut(v) for v in value]
        return value

    out = cut(summary)
    pre = out.get("checks", {}).get("preflight")
    if isinstance(pre, dict) and "packages" in pre:
        pre["packages"] = f"{len(pre['packages'])} packages: see summary.json"
    return out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def run(args: argparse.Namespace) -> int:
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else []
    unknown = sorted(set(only) - {c.name for c in CHECKS})
    if unknown:
        print(f"error: unknown check(s) {', '.join(unknown)}; the checks: {', '.join(c.name for c in CHECKS)}",
              file=sys.stderr)
        return 2
    chosen = [c for c in CHECKS if not only or c.name in only]
    if args.budget is None:
        args.budget = 1500.0 if args.cpu else 510.0
    out_dir = pathlib.Path(args.out) if args.out else None
    work = pathlib.Path(tempfile.mkdtemp(prefix="skyrl_device_kit_"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled")
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run never touches a GPU, even on a GPU machine
    summary: dict[str, Any] = {"kit": "benchmarks/device/run.sh" + (" --cpu" if args.cpu else ""),
                               "commit": git_commit(), "budget_s": args.budget, "checks": {}}
    start = time.perf_counter()
    for check in chosen:
        left = args.budget - (time.perf_counter() - start)
        if left < 15:
            summary["checks"][check.name] = {"what": check.what, "ok": False,
                                             "error": f"skipped: {args.budget:.0f} s budget spent"}
            continue
        timeout = min(check.timeout[1 if args.cpu else 0], left - 5)
        folder = work / check.name
        folder.mkdir()
        ctx = Context(cpu=args.cpu, work=folder)
        result = run_one(check, ctx, timeout, work / f"{check.name}.log", env)
        summary["checks"][check.name] = result
        if check.name == "preflight" and isinstance(result.get("torch"), str):
            summary.update({k: result[k] for k in ("python", "torch", "device", "capability") if k in result})
        state = "ok" if result.get("ok") else "FAILED"
        print(f"[device kit] {check.name}: {state} in {result['wall_s']} s", file=sys.stderr, flush=True)
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    summary["ok"] = all(c.get("ok") for c in summary["checks"].values())
    text = json.dumps(summary, indent=1, default=str)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.json").write_text(text + "\n")
        with tarfile.open(out_dir / "logs.tar.gz", "w:gz") as tar:
            for log in sorted(work.glob("*.log")):
                data = log.read_bytes()[-4 << 20:]  # the last 4 MiB of each: what comes back is limited
                info = tarfile.TarInfo(f"logs/{log.name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    # stdout: the summary without the preflight's package table and with long errors cut, so
    # that it fits what a remote runner shows (the device tool: the last 12,000 characters).
    print(json.dumps(compact(summary), indent=1, default=str))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"[device kit] work folder kept: {work}", file=sys.stderr)
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kit.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the checks")
    p.add_argument("--cpu", action="store_true", help="the same checks on the CPU at tiny sizes")
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all checks together (default 510 on the device: its 10-minute call; 840 with --cpu, "
                   "a shared CI machine)")
    p.add_argument("--out", default=None, help="folder for summary.json and logs.tar.gz")
    p.add_argument("--keep", action="store_true", help="keep the work folder (runs, metrics, logs)")
    p = sub.add_parser("metadata", help="write the kit distributions' *.dist-info into DEST; print the source folders")
    p.add_argument("dest")
    sub.add_parser("preflight", help="what this machine has for the kit (JSON)")
    p = sub.add_parser("needs", help="distributions the kit needs that the lent machine lacks and nobody carries")
    p.add_argument("--wheels", default=None, help="a folder of downloaded wheels: read their requirements too")
    sub.add_parser("list", help="the checks, one a line")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    if args.command == "metadata":
        print(os.pathsep.join(write_metadata(pathlib.Path(args.dest))))
        return 0
    if args.command == "preflight":
        report = preflight()
        print(json.dumps(report, indent=1))
        return 0 if report["ok"] else 1
    if args.command == "needs":
        metadata_of = wheel_requires(pathlib.Path(args.wheels)) if args.wheels else installed_requires
        problems = missing_on_lent_machine(metadata_of)
        print(json.dumps({"ok": not problems, "problems": problems}, indent=1))
        return 0 if not problems else 1
    if args.command == "list":
        for check in CHECKS:
            print(f"{check.name:20} {check.what}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
