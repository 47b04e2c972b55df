"""In-memory vs on-disk weight names: every tiny preset of every family maps its
in-memory weights (fused 3-D experts) to exactly the tensors ``save_pretrained`` writes,
and back, element for element."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from skyrl_models import glm, hf, kimi, nemotron, qwen

CASES = (
    [("qwen", p) for p in qwen.PRESETS]
    + [("glm", p) for p in glm.PRESETS]
    + [("kimi", p) for p in kimi.PRESETS]
    + [("nemotron", p) for p in nemotron.PRESETS]
    + [("hf", p) for p in hf.PRESETS]
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load(skyrl_host, family: str, preset: str):
    reg = skyrl_host.registry.get("models", family)
    fam = reg.create(reg.config(preset=preset))
    return fam, fam.load(alphabet="0123456789+=:", seed=0)


@pytest.mark.parametrize(("family", "preset"), CASES, ids=[p for _, p in CASES])
def test_disk_names_are_what_save_pretrained_writes(skyrl_host, tmp_path, family: str, preset: str) -> None:
    fam, loaded = load(skyrl_host, family, preset)
    model = loaded.model
    fam.save(loaded, str(tmp_path / "m"))
    saved = {}
    for f in sorted((tmp_path / "m").glob("*.safetensors")):
        saved.update(load_file(str(f)))
    state = model.state_dict()
    disk = dict(fam.disk_weights(model, state.items()))
    # save_pretrained writes a tied weight once; everything else is the same tensors.
    assert set(saved) <= set(disk) and len(set(disk) - set(saved)) <= 1
    for name, t in saved.items():
        assert torch.equal(disk[name], t), name
    # And back: the saved file gives the in-memory state element for element.
    back = fam.memory_weights(model, saved)
    assert set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name
    layout = fam.weight_layout(model)
    fused = [n for n, disk_names in layout.items() if len(disk_names) > 1 and ".experts." in n]
    if loaded.routers:
        assert fused, "an MoE model has fused expert tensors"
        n_experts = loaded.routers[0].n_experts
        for name in fused:  # one on-disk tensor per expert (and per projection for gate_up)
            assert len(layout[name]) in (n_experts, 2 * n_experts), (name, layout[name][:3])


def test_memory_weights_errors_name_the_tensor(skyrl_host) -> None:
    fam, loaded = load(skyrl_host, "qwen", "tiny-moe")
    model = loaded.model
    disk = dict(fam.disk_weights(model, model.state_dict().items()))
    one = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert one in disk
    with pytest.raises(KeyError, match=one.replace(".", r"\.") + r".*part of 'model\.layers\.1\.mlp\.experts\.gate_up_proj'"):
        fam.memory_weights(model, {k: v for k, v in disk.items() if k != one})
    with pytest.raises(ValueError, match=r"has shape \(3, 64\), expected \(64, 64\)"):
        fam.memory_weights(model, {**disk, one: torch.zeros(3, 64)})
    with pytest.raises(ValueError, match="'extra.weight' has no place in the model"):
        fam.memory_weights(model, {**disk, "extra.weight": torch.zeros(1)})


@pytest.mark.parametrize(("family", "preset"), CASES, ids=[p for _, p in CASES])
def test_tokenizer_only_load_gives_what_the_full_load_gives(skyrl_host, tmp_path, family: str, preset: str) -> None:
    """The Ray driver loads only the tokenizer (``load_tokenizer``): the same ids and stop
    ids as the full load, for the preset and for the folder it saves."""
    fam, loaded = load(skyrl_host, family, preset)
    light = fam.load_tokenizer(alphabet="0123456789+=:")
    assert light.model is None
    assert list(light.stop_token_ids) == list(loaded.stop_token_ids)
    assert light.tokenizer.encode("12+3=15") == loaded.tokenizer.encode("12+3=15")
    fam.save(loaded, str(tmp_path / "m"))
    reg = skyrl_host.registry.get("models", family)
    from_folder = reg.create(reg.config(path=str(tmp_path / "m")))
    full, light = from_folder.load(alphabet=None, seed=0), from_folder.load_tokenizer(alphabet=None)
    assert light.model is None and list(light.stop_token_ids) == list(full.stop_token_ids)
    assert light.tokenizer.encode("12+3=15") == full.tokenizer.encode("12+3=15")
