"""A ``[model] path`` whose safetensors files are truncated, corrupt or missing: ``skyrl
validate`` and ``skyrl run`` say which file and the fix in one line (exit code 2), before
any training; the families' loader says it too when the folder changed after its check."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
from typing import Any, Callable

import pytest
import torch

from skyrl_host.errors import USER_ERROR_EXIT_CODE, UserError
from skyrl_models.qwen import QwenConfig, make_family

ALPHABET = "0123456789reverse :"
FIX = "re-download or re-save the checkpoint"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """A sound tiny Qwen3 folder saved through its family, and the same model sharded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("checkpoints")
        family = make_family(QwenConfig(preset="tiny"))
        lm = family.load(alphabet=ALPHABET, seed=0)
        family.save(lm, str(root / "single"))
        lm.model.save_pretrained(root / "sharded", max_shard_size="200KB")
        lm.tokenizer.save_pretrained(root / "sharded")
    finally:
        torch.set_num_threads(before)
    return {"single": root / "single", "sharded": root / "sharded"}


@pytest.fixture
def folder(tmp_path: pathlib.Path, checkpoints: dict[str, pathlib.Path]) -> Callable[[str], pathlib.Path]:
    def copy(kind: str) -> pathlib.Path:
        out = tmp_path / kind
        shutil.copytree(checkpoints[kind], out)
        return out

    return copy


def shards(path: pathlib.Path) -> list[str]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def job(tiny: Any, tmp_path: pathlib.Path, path: pathlib.Path) -> Any:
    return tiny(tmp_path, model={"preset": None, "path": str(path)})


def assert_one_line(result: Any, line: str) -> None:
    assert result.exit_code == USER_ERROR_EXIT_CODE, result
    assert result.stderr.strip().splitlines() == [line], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_validate_and_run_name_a_truncated_file(folder, tmp_path, skyrl_cli, skyrl_tiny_rl_job) -> None:
    path = folder("single")
    file = path / "model.safetensors"
    full = file.stat().st_size
    os.truncate(file, 100_000)  # past the header, short of the tensors
    tiny = job(skyrl_tiny_rl_job, tmp_path, path)
    message = (f"error: {tiny.path}:15: model.path: {str(file)!r} is truncated: the header promises {full} bytes, "
               f"the file has 100000; {FIX}")
    assert_one_line(skyrl_cli("validate", str(tiny.path)), message)
    assert_one_line(skyrl_cli("run", str(tiny.path)), message)
    assert not tiny.out.exists()  # refused before anything was written
    assert file.stat().st_size == 100_000  # the checkpoint itself is left as it was


def test_a_file_shorter_than_its_header(folder, tmp_path, skyrl_cli, skyrl_tiny_rl_job) -> None:
    path = folder("single")
    file = path / "model.safetensors"
    (n,) = struct.unpack("<Q", file.read_bytes()[:8])
    os.truncate(file, 100)
    tiny = job(skyrl_tiny_rl_job, tmp_path, path)
    assert_one_line(skyrl_cli("validate", str(tiny.path)),
                    f"error: {tiny.path}:15: model.path: {str(file)!r} is truncated: its header alone is {8 + n} "
                    f"bytes long, the file has 100; {FIX}")
    os.truncate(file, 3)
    assert_one_line(skyrl_cli("validate", str(tiny.path)),
                    f"error: {tiny.path}:15: model.path: {str(file)!r} is truncated: 3 bytes, not even the 8-byte "
                    f"header length; {FIX}")


def test_overwritten_header_bytes(folder, tmp_path, skyrl_cli, skyrl_tiny_rl_job) -> None:
    path = folder("single")
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    tiny = job(skyrl_tiny_rl_job, tmp_path, path)
    corrupt = bytes(data)
    corrupt = corrupt[:8] + b"\x00\xff" + corrupt[10:]  # the JSON's first bytes
    file.write_bytes(corrupt)
    assert_one_line(skyrl_cli("run", str(tiny.path)),
                    f"error: {tiny.path}:15: model.path: {str(file)!r} is corrupt: its header is not a JSON object; "
                    f"{FIX}")
    file.write_bytes(b"\xff" * 8 + bytes(data[8:]))  # the header length
    assert_one_line(skyrl_cli("validate", str(tiny.path)),
                    f"error: {tiny.path}:15: model.path: {str(file)!r} is not a safetensors file (corrupt): its first "
                    f"8 bytes give a header of {2**64 - 1} bytes, more than the format allows; {FIX}")
    file.write_bytes(bytes(data) + b"\0" * 10)  # bytes after the last tensor
    assert_one_line(skyrl_cli("validate", str(tiny.path)),
                    f"error: {tiny.path}:15: model.path: {str(file)!r} is corrupt: the header accounts for "
                    f"{len(data)} bytes, the file has {len(data) + 10} (10 bytes too many); {FIX}")


def test_sharded_checkpoint_missing_truncated_or_bad_index(folder, tmp_path, skyrl_cli, skyrl_tiny_rl_job) -> None:
    path = folder("sharded")
    names = shards(path)
    assert len(names) >= 2 and not (path / "model.safetensors").exists()
    tiny = job(skyrl_tiny_rl_job, tmp_path, path)
    where = f"error: {tiny.path}:15: model.path:"
    assert skyrl_cli("validate", str(tiny.path)).exit_code == 0  # sound shards pass
    last = path / names[-1]
    size = last.stat().st_size
    os.truncate(last, size - 1)
    assert_one_line(skyrl_cli("run", str(tiny.path)),
                    f"{where} {str(last)!r} is truncated: the header promises {size} bytes, the file has {size - 1}; "
                    f"{FIX}")
    last.unlink()
    assert_one_line(skyrl_cli("run", str(tiny.path)),
                    f"{where} {str(last)!r} is missing: model.safetensors.index.json names {len(names)} shards; {FIX}")
    index = path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    assert_one_line(skyrl_cli("validate", str(tiny.path)), f"{where} {str(index)!r} is corrupt: not valid JSON; {FIX}")
    index.write_text('{"metadata": {}}')
    assert_one_line(skyrl_cli("validate", str(tiny.path)),
                    f"{where} {str(index)!r} is corrupt: it has no weight_map of tensor names to shard files; {FIX}")
    assert not tiny.out.exists()


def test_the_loader_checks_again_a_folder_that_changed_after_its_config(folder) -> None:
    path = folder("single")
    config = QwenConfig(path=str(path))  # sound when configured
    file = path / "model.safetensors"
    full = file.stat().st_size
    os.truncate(file, full - 4)
    with pytest.raises(UserError) as info:
        make_family(config).load(alphabet=None, seed=0)
    assert str(info.value) == (f"error: model.path: {str(file)!r} is truncated: the header promises {full} bytes, "
                               f"the file has {full - 4}; {FIX}")


def test_a_header_safetensors_itself_rejects_is_a_user_error(folder) -> None:
    """A header whose lengths add up but whose dtype does not fit a tensor's bytes: our
    check passes it, from_pretrained's SafetensorError becomes the user error."""
    path = folder("single")
    file = path / "model.safetensors"
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + n]
    assert b'"F32"' in header
    file.write_bytes(data[:8] + header.replace(b'"F32"', b'"F16"', 1) + data[8 + n:])  # same length
    with pytest.raises(UserError) as info:
        make_family(QwenConfig(path=str(path))).load(alphabet=None, seed=0)
    message = str(info.value)
    assert message.startswith(f"error: model.path: cannot load the model from {str(path)!r}: "
                              "Error while deserializing header")
    assert message.endswith(f"; {FIX}") and "\n" not in message
