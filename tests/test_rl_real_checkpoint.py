"""The rl job on a real-shaped checkpoint (the skyrl_real_checkpoint fixture of skyrl-models,
loaded through ``[model] path`` as a downloaded one): plain-text prompts, chat prompts
rendered with the checkpoint's chat template, and the user errors of that path."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from skyrl_host.interfaces import Task
from skyrl_host.jobs.rl import check_chat_template, encode_task
from skyrl_host.errors import UserError

PLAIN = [{"prompt": f"What is {a} plus {b}? Answer:", "answer": str(a + b)} for a, b in [(3, 4), (12, 30), (7, 8)]]
CHATS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)}
         for a, b in [(3, 4), (12, 30), (7, 8)]]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def real_job(make_job, tmp_path, checkpoint, records, name="job", **dataset):
    """Two steps of 2 prompts x 2 samples on the checkpoint, jsonl prompts, exact reward."""
    data = write_jsonl(tmp_path / f"{name}.jsonl", records)
    return make_job(tmp_path, name, job={"steps": 2, "batch_size": 2, "n_samples": 2, "max_new_tokens": 4},
                    model={"family": "qwen", "path": checkpoint, "preset": None},
                    dataset={"name": "jsonl", "path": data, "min_len": None, "max_len": None, "prefix": None, **dataset},
                    backend={"micro_batch_tokens": 256})


def assert_sane(rows):
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["entropy"]), r
        assert 0.0 <= r["reward_mean"] <= 1.0 and 0.0 <= r["accuracy"] <= 1.0
        assert 1.0 <= r["response_length_mean"] <= 4.0
    assert rows[0]["logprob_diff_max"] < 1e-3  # engine and trainer score the same distribution


@pytest.mark.parametrize("records", [PLAIN, CHATS], ids=["plain", "chat"])
def test_an_rl_job_runs_on_a_real_shaped_checkpoint(skyrl_cli, skyrl_tiny_rl_job, skyrl_real_checkpoint, tmp_path,
                                                    records) -> None:
    job = real_job(skyrl_tiny_rl_job, tmp_path, skyrl_real_checkpoint("qwen3"), records)
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    assert_sane(job.rows())


def test_plain_prompts_are_encoded_and_chats_rendered_with_the_template(skyrl_real_checkpoint) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(skyrl_real_checkpoint("qwen3"))
    plain = encode_task(tok, Task(prompt="What is 3 plus 4?"))
    assert plain == tok.encode("What is 3 plus 4?") and tok.decode(plain) == "What is 3 plus 4?"
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 4?"})
    chat = encode_task(tok, Task(prompt="What is 3 plus 4?", messages=messages))
    assert tok.decode(chat) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n"
                                "<|im_start|>assistant\n")
    check_chat_template(tok, messages)  # a template that opens the assistant's turn passes


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_chats_on_a_tokenizer_without_a_chat_template_are_a_user_error(skyrl_cli, skyrl_tiny_rl_job,
                                                                       skyrl_real_checkpoint, tmp_path) -> None:
    folder = copy_checkpoint(skyrl_real_checkpoint("qwen3"), tmp_path / "no-template")
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    result = skyrl_cli("run", str(real_job(skyrl_tiny_rl_job, tmp_path, folder, CHATS).path))
    assert result.exit_code == 2
    assert "Traceback" not in result.stderr
    assert f"the tokenizer of [model] path '{folder}' has no chat template" in result.stderr
    assert "chat_template.jinja" in result.stderr  # the fix


def test_a_chat_template_without_a_generation_prompt_is_a_user_error(skyrl_cli, skyrl_tiny_rl_job,
                                                                     skyrl_real_checkpoint, tmp_path) -> None:
    folder = copy_checkpoint(skyrl_real_checkpoint("qwen3"), tmp_path / "no-generation-prompt")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    result = skyrl_cli("run", str(real_job(skyrl_tiny_rl_job, tmp_path, folder, CHATS).path))
    assert result.exit_code == 2
    assert "Traceback" not in result.stderr
    assert f"the chat template of the tokenizer of [model] path '{folder}' renders no generation prompt" in result.stderr


def test_the_chat_template_is_checked_before_any_model_is_read(skyrl_host, skyrl_tiny_rl_job,
                                                              skyrl_real_checkpoint, tmp_path) -> None:
    """The driver checks the first chat against the tokenizer alone: the error comes before
    the launcher places anything (no model built, no process started)."""
    from skyrl_host.config import load_job
    from skyrl_host.jobs.rl import RLDriver
    from skyrl_host.runner import Run

    folder = copy_checkpoint(skyrl_real_checkpoint("qwen3"), tmp_path / "no-template")
    (folder / "chat_template.jinja").unlink()
    spec = load_job(str(real_job(skyrl_tiny_rl_job, tmp_path, folder, CHATS).path), skyrl_host)
    driver = RLDriver(Run(spec=spec, host=skyrl_host, output_dir=tmp_path / "out", total_steps=2))
    with pytest.raises(UserError, match="has no chat template"):
        driver.build()
    assert driver.placement is None and not hasattr(driver, "loaded")


def test_a_preset_with_chats_is_a_user_error_pointing_to_path(skyrl_real_checkpoint) -> None:
    from skyrl_models.qwen import QwenConfig, make_family

    tok = make_family(QwenConfig(preset="tiny")).load(alphabet="abc ", seed=0).tokenizer
    with pytest.raises(UserError, match=r"a preset's, built for characters\) has no chat template; set \[model\] path"):
        check_chat_template(tok, [{"role": "user", "content": "abc"}])
