"""Quantized weights through the transports: payloads (e4m3, packed int4) and scales
(``<weight>@<format>``) travel as they are, the manifest names their dtypes and format
tags, and a job with ``delta`` learns exactly as the same job with ``inproc``."""

from __future__ import annotations

import json

import pytest
import torch

from skyrl_precisions._formats import FORMATS


@pytest.fixture(scope="module")
def host():
    from skyrl_host.plugins import build_host

    return build_host()


def create(host, kind: str, name: str, **options):
    reg = host.registry.get(kind, name)
    return reg.create(reg.config(**options))


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "int4"])
def test_delta_carries_quantized_payloads_and_scales_byte_exactly(host, tmp_path, name: str) -> None:
    from skyrl_weightsync._delta import DeltaReceiver, DeltaSender

    family = create(host, "models", "qwen", preset="tiny-moe")
    precision = create(host, "precisions", name)
    backend = create(host, "backends", "torch", lr=1e-2)
    backend.start(family.load(alphabet="0123456789", seed=1), seed=0, total_steps=2, reference=False, precision=precision)
    engine = create(host, "engines", "embedded", dtype="bfloat16")
    engine.start(family.load(alphabet="0123456789", seed=1), precision=precision)
    uri = f"file://{tmp_path}/w"
    sender, receiver = DeltaSender(uri), DeltaReceiver(uri)
    for version in (0, 1):
        if version:  # one optimizer step moves the masters, so the quantized weights change
            with torch.no_grad():
                for p in backend.module.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
            precision.invalidate()
        sender.publish(version, backend.serving_weights())
        receiver.sync(engine, target=version)
        served = dict(engine.model.named_parameters(remove_duplicate=False))
        for n, want in precision.unpack(backend.serving_weights(), torch.bfloat16):
            assert torch.equal(served[n], want.to(torch.bfloat16)), (version, n)
    manifest = json.loads(next((tmp_path / "w").rglob("v00000001/manifest.json")).read_text())
    entries = {e["name"]: e for e in manifest["tensors"]}
    weight = precision.quantized[0]
    assert entries[weight]["dtype"] == ("uint8" if name == "int4" else "float8_e4m3fn")
    scale = entries[f"{weight}@{name}"]
    assert scale["dtype"] == ("float8_e8m0fnu" if name == "mxfp8" else "float32")
    bf16_bytes = sum(p.numel() * 2 for p in backend.module.parameters())
    wire = sum(e["nbytes"] for e in manifest["tensors"])
    assert wire < {"fp8": 0.56, "mxfp8": 0.57, "int4": 0.36}[name] * bf16_bytes  # quantized on the wire
    assert FORMATS[name].name == name


JOB = """
[job]
kind = "rl"
seed = 2
steps = 3
batch_size = 4
n_samples = 4
max_new_tokens = 6
checkpoint_every = 0
save_final = false
threads = 1
output_dir = "{out}"

[model]
family = "qwen"
preset = "tiny-moe"

[dataset]
name = "reverse_digits"
min_len = 3
max_len = 4

[engine]
name = "embedded"
dtype = "bfloat16"

[precision]
name = "fp8"

[weight_sync]
{sync}

[backend]
name = "torch"
lr = 1e-3
"""

TIMING = ("time", "_s", "per_s", "sync")


def learning(path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows if "step" in r and "event" not in r]


@pytest.mark.parametrize("transport", ["delta", "nixl"])
def test_an_fp8_job_learns_exactly_like_inproc(skyrl_cli, tmp_path, transport: str) -> None:
    """The quantized payloads and scales through ``delta`` (files) or ``nixl`` (NIXL
    reads, one process): every learning metric equals the ``inproc`` run's."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL (nixl-cu12) comes with the test requirements")
    syncs = {"delta": f'transport = "delta"\nuri = "file://{tmp_path}/w"', "nixl": 'transport = "nixl"'}
    out = {}
    for case, sync in (("inproc", 'transport = "inproc"'), (transport, syncs[transport])):
        (tmp_path / f"{case}.toml").write_text(JOB.format(out=tmp_path / case, sync=sync))
        result = skyrl_cli("run", str(tmp_path / f"{case}.toml"))
        assert result.exit_code == 0, result.stderr
        out[case] = learning(tmp_path / case / "metrics.jsonl")
    assert len(out["inproc"]) == 3 and out[transport] == out["inproc"]


def test_validate_refuses_what_cannot_serve_the_quantized_numbers(skyrl_cli, tmp_path) -> None:
    path = tmp_path / "job.toml"
    text = JOB.format(out=tmp_path / "o", sync=f'transport = "delta"\nuri = "file://{tmp_path}/w"')
    path.write_text(text + "lora_rank = 4\n")
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "precision 'fp8' with LoRA (backend.lora_rank = 4)" in result.stderr
    text = JOB.format(out=tmp_path / "o", sync='transport = "nixl"').replace('launcher', 'launcher')
    path.write_text(text.replace("[model]", '[cluster]\nlauncher = "ray"\ntrainer_ranks = 2\n\n[model]')
                    + 'data_parallel = "fsdp2"\n')
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "transport 'nixl' serves each FSDP2 rank's shards of the master weights; precision 'fp8'" in result.stderr
