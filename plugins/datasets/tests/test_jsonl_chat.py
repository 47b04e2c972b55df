"""jsonl chat records: ``messages`` (``messages_key``) and ``system_prompt``."""

from __future__ import annotations

import json

import pytest

from skyrl_datasets.jsonl import Jsonl, JsonlConfig
from skyrl_host.errors import UserError
from skyrl_host.interfaces import Task

SYSTEM = {"role": "system", "content": "Answer with a number."}


def write(tmp_path, records):
    path = tmp_path / "data.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_chat_records_become_tasks_with_messages(tmp_path) -> None:
    turns = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "And 3+3?"}]
    path = write(tmp_path, [{"messages": turns, "answer": 6, "id": 1}, {"prompt": "plain 1+1?", "answer": "2"}])
    ds = Jsonl(JsonlConfig(path=path, shuffle=False))
    assert ds.tasks == [
        Task(prompt="And 3+3?", answer="6", meta={"id": 1}, messages=tuple(turns)),  # prompt: the last user turn
        Task(prompt="plain 1+1?", answer="2"),  # plain records are unchanged
    ]
    assert ds.reward(ds.tasks[0], " 6\n") == 1.0 and ds.reward(ds.tasks[0], "4") == 0.0
    assert set("What is 2+2? And 3+3? 6") <= set(ds.alphabet)  # every message's characters


def test_system_prompt_opens_every_prompt_unless_the_record_has_its_own(tmp_path) -> None:
    own = {"role": "system", "content": "Be terse."}
    path = write(tmp_path, [{"prompt": "1+1?", "answer": "2"},
                            {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},
                            {"messages": [own, {"role": "user", "content": "3+3?"}], "answer": "6"}])
    ds = Jsonl(JsonlConfig(path=path, shuffle=False, system_prompt=SYSTEM["content"]))
    assert [t.messages for t in ds.tasks] == [
        (SYSTEM, {"role": "user", "content": "1+1?"}),  # a plain prompt becomes the user's message
        (SYSTEM, {"role": "user", "content": "2+2?"}),
        (own, {"role": "user", "content": "3+3?"}),
    ]
    assert [t.prompt for t in ds.tasks] == ["1+1?", "2+2?", "3+3?"]


def test_a_custom_messages_key(tmp_path) -> None:
    path = write(tmp_path, [{"conversation": [{"role": "user", "content": "hi"}], "answer": "hello"}])
    ds = Jsonl(JsonlConfig(path=path, messages_key="conversation"))
    assert ds.tasks[0].messages == ({"role": "user", "content": "hi"},)
    with pytest.raises(ValueError, match="messages_key and answer_key must differ"):
        JsonlConfig(path=path, messages_key="answer")


def test_malformed_chat_records_are_user_errors_naming_file_and_line(tmp_path) -> None:
    user = {"role": "user", "content": "q"}
    path = write(tmp_path, [
        {"messages": [user], "answer": "a"},
        {"messages": [], "answer": "a"},
        {"messages": "q", "answer": "a"},
        {"messages": [user, {"role": "assistant"}], "answer": "a"},
        {"messages": [user, {"role": "assistant", "content": "a"}], "answer": "a"},
        {"messages": [user], "prompt": "q", "answer": "a"},
    ])
    with pytest.raises(UserError) as info:
        Jsonl(JsonlConfig(path=path))
    assert [str(p) for p in info.value.problems] == [
        f"{path}:2: expected the messages 'messages' to be a non-empty list of {{role, content}} objects, found []",
        f"{path}:3: expected the messages 'messages' to be a non-empty list of {{role, content}} objects, found \"q\"",
        f"{path}:4: expected messages[1] to be an object with string 'role' and 'content', found {{\"role\": \"assistant\"}}",
        f"{path}:5: the last of the messages 'messages' is the assistant's; a prompt ends with the user's turn "
        "(drop the answer, or move it to 'answer')",
        f"{path}:6: give either the prompt 'prompt' or the messages 'messages', not both",
    ]


def test_a_malformed_chat_file_stops_the_job_with_exit_code_2(skyrl_cli, tmp_path) -> None:
    data = write(tmp_path, [{"messages": [], "answer": "a"}])
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "rl"\nsteps = 1\noutput_dir = {json.dumps(str(tmp_path / "out"))}\n'
                   f'[model]\nfamily = "qwen"\npreset = "tiny"\n'
                   f'[dataset]\nname = "jsonl"\npath = {json.dumps(data)}\n')
    result = skyrl_cli("run", str(job))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert f"{data}:1: expected the messages 'messages' to be a non-empty list" in result.stderr
