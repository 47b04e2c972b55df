"""`skyrl data tokenize` and `skyrl data info`, through the `skyrl` command line: round trips
against the tokenizer's own ids and transformers' own assistant masks, Parquet, chunking and
worker counts, resume after a real SIGKILL, user errors, and the numbers `info` prints."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from skyrl_datasets.corpus import CorpusWriter, open_corpus

from skyrl_datasets_tests_tokenizer import CHATML, TRAINING_TEXT, build_tokenizer  # loaded by conftest.py

CLI = [sys.executable, "-c", "from skyrl_host.cli import entry; entry()"]


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = " ".join(TRAINING_TEXT).split() + ["naïve", "émoji 🙂", "日本語", "\n", "  "]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": rng.choice(TRAINING_TEXT)[: rng.randint(1, 40)]})
            msgs.append({"role": "assistant", "content": rng.choice(TRAINING_TEXT)[rng.randint(0, 10) :]})
        out.append(msgs)
    return out


def write_jsonl(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def write_parquet(path: pathlib.Path, records: list[dict], row_group_size: int) -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def corpus_bytes(prefix: pathlib.Path) -> dict[str, bytes]:
    return {s: pathlib.Path(f"{prefix}{s}").read_bytes() for s in (".json", ".tokens", ".index", ".mask") if pathlib.Path(f"{prefix}{s}").exists()}


@pytest.fixture(scope="module")
def hf_tok(tiny_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer)


def test_registered_as_a_command_group(skyrl_cli) -> None:
    r = skyrl_cli("data", "--help")
    assert r.exit_code == 0 and "tokenize" in r.stdout and "info" in r.stdout


def test_plain_text_round_trip(tmp_path, skyrl_cli, tiny_tokenizer, hf_tok) -> None:
    docs = texts(300)
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t, "n": i} for i, t in enumerate(docs)])
    r = skyrl_cli("data", "tokenize", str(src), "--tokenizer", str(tiny_tokenizer), "--out", str(tmp_path / "out" / "a"), "--chunk-mb", "0.002", "--workers", "2")
    assert r.exit_code == 0, r.stderr
    assert "300 documents" in r.stderr
    c = open_corpus(str(tmp_path / "out" / "a"))
    assert c.n_docs == 300 and not c.has_mask
    eos = hf_tok.eos_token_id
    for i, t in enumerate(docs):
        assert c.tokens(i).tolist() == hf_tok(t)["input_ids"] + [eos]
    assert (c.meta["eos_id"], c.meta["vocab_size"], c.meta["tokenizer"]) == (eos, len(hf_tok), str(tiny_tokenizer))
    assert not (tmp_path / "out" / "a.parts").exists()


def test_chat_round_trip_masks_equal_transformers_assistant_masks(tmp_path, skyrl_cli, tiny_tokenizer, hf_tok) -> None:
    convs = conversations(120)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in convs])
    r = skyrl_cli("data", "tokenize", str(src), "--tokenizer", str(tiny_tokenizer), "--out", str(tmp_path / "c"), "--messages-key", "messages", "--chunk-mb", "0.003", "--workers", "2")
    assert r.exit_code == 0, r.stderr
    c = open_corpus(str(tmp_path / "c"))
    assert c.n_docs == 120 and c.has_mask
    for i, msgs in enumerate(convs):
        ref = hf_tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert c.tokens(i).tolist() == list(ref["input_ids"])
        assert c.mask(i).tolist() == list(ref["assistant_masks"])
        # the trained tokens decode to exactly the assistant turns and their end markers
        trained = hf_tok.decode(c.tokens(i)[c.mask(i) == 1])
        assert trained == "".join(m["content"] + "<|im_end|>\n" for m in msgs if m["role"] == "assistant")


def test_prefix_unstable_template_falls_back_to_generation_markers(tmp_path, skyrl_cli) -> None:
    # The first line counts the messages, so a prefix renders differently from the whole.
    counting = "# {{ messages | length }} messages\n" + CHATML
    tok_dir = build_tokenizer(tmp_path / "tok", chat_template=counting)
    convs = conversations(10, seed=2)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in convs])
    r = skyrl_cli("data", "tokenize", str(src), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "c"), "--messages-key", "messages")
    assert r.exit_code == 0, r.stderr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    c = open_corpus(str(tmp_path / "c"))
    for i, msgs in enumerate(convs):
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert c.tokens(i).tolist() == list(ref["input_ids"]) and c.mask(i).tolist() == list(ref["assistant_masks"])
    # without generation markers there is no safe way to find the assistant turns: a user error
    unmarked = counting.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok2 = build_tokenizer(tmp_path / "tok2", chat_template=unmarked)
    r = skyrl_cli("data", "tokenize", str(src), "--tokenizer", str(tok2), "--out", str(tmp_path / "d"), "--messages-key", "messages")
    assert r.exit_code == 2 and "c.jsonl:1" in r.stderr and "{% generation %}" in r.stderr


def test_parquet_and_jsonl_inputs_keep_input_order(tmp_path, skyrl_cli, tiny_tokenizer, hf_tok) -> None:
    a, b = texts(70, seed=1), texts(50, seed=2)
    pq_file = write_parquet(tmp_path / "a.parquet", [{"body": t, "x": i} for i, t in enumerate(a)], row_group_size=16)
    jl_file = write_jsonl(tmp_path / "b.jsonl", [{"body": t} for t in b])
    r = skyrl_cli("data", "tokenize", str(pq_file), str(jl_file), "--tokenizer", str(tiny_tokenizer), "--out", str(tmp_path / "m"), "--text-key", "body", "--chunk-rows", "5", "--chunk-mb", "0.001", "--workers", "2")
    assert r.exit_code == 0, r.stderr
    c = open_corpus(str(tmp_path / "m"))
    assert [c.tokens(i).tolist() for i in range(c.n_docs)] == [hf_tok(t)["input_ids"] + [hf_tok.eos_token_id] for t in a + b]


def test_parquet_chat_messages(tmp_path, skyrl_cli, tiny_tokenizer, hf_tok) -> None:
    convs = conversations(30, seed=5)
    src = write_parquet(tmp_path / "c.parquet", [{"messages": m} for m in convs], row_group_size=7)
    r = skyrl_cli("data", "tokenize", str(src), "--tokenizer", str(tiny_tokenizer), "--out", str(tmp_path / "c"), "--messages-key", "messages", "--chunk-rows", "4")
    assert r.exit_code == 0, r.stderr
    c = open_corpus(str(tmp_path / "c"))
    for i, msgs in enumerate(convs):
        ref = hf_tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert c.tokens(i).tolist() == list(ref["input_ids"]) and c.mask(i).tolist() == list(ref["assistant_masks"])


def test_same_bytes_for_any_chunking_and_worker_count(tmp_path, skyrl_cli, tiny_tokenizer) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in conversations(80, seed=9)])
    outs = []
    for i, (chunk, workers) in enumerate([("8", "1"), ("0.001", "2"), ("0.004", "2")]):
        prefix = tmp_path / "same" / str(i)
        r = skyrl_cli("data", "tokenize", str(src), "--tokenizer", str(tiny_tokenizer), "--out", str(prefix), "--messages-key", "messages", "--chunk-mb", chunk, "--workers", workers, "--quiet")
        assert r.exit_code == 0, r.stderr
        outs.append(corpus_bytes(prefix))
    assert outs[0] == outs[1] == outs[2] and set(outs[0]) == {".json", ".tokens", ".index", ".mask"}


def test_resume_after_sigkill_is_byte_identical(tmp_path, tiny_tokenizer) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in conversations(3000, seed=4)])
    args = [str(src), "--tokenizer", str(tiny_tokenizer), "--messages-key", "messages", "--chunk-mb", "0.01", "--workers", "2", "--quiet"]
    base = CLI + ["data", "tokenize"]
    subprocess.run(base + args + ["--out", str(tmp_path / "ref" / "c")], check=True, capture_output=True)
    ref = corpus_bytes(tmp_path / "ref" / "c")
    n_chunks = -(-src.stat().st_size // int(0.01 * (1 << 20)))

    out = tmp_path / "run" / "c"
    proc = subprocess.Popen(base + args + ["--out", str(out)], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = pathlib.Path(f"{out}.parts")
    deadline = time.monotonic() + 120
    while len(list(parts.glob("*.npz"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its workers, mid-run
    proc.wait()
    kept = len(list(parts.glob("*.npz")))
    assert not pathlib.Path(f"{out}.json").exists(), "the run finished before it was killed; the test proves nothing"
    assert 3 <= kept < n_chunks

    again = subprocess.run(base + args + ["--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr

    resumed = subprocess.run(base + args + ["--out", str(out), "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "chunks kept from the interrupted run" in resumed.stderr
    assert corpus_bytes(out) == ref
    assert not parts.exists()


def test_resume_refuses_changed_inputs(tmp_path, skyrl_cli, tiny_tokenizer) -> None:
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts(50)])
    parts = tmp_path / "a.parts"
    parts.mkdir()
    (parts / "manifest.json").write_text(json.dumps({"inputs": [], "chunks": 1}))
    r = skyrl_cli("data", "tokenize", str(src), "--tokenizer", str(tiny_tokenizer), "--out", str(tmp_path / "a"), "--resume")
    assert r.exit_code == 2 and "cannot resume" in r.stderr and "inputs" in r.stderr
    r = skyrl_cli("data", "tokenize", str(src), "--tokenizer", str(tiny_tokenizer), "--out", str(tmp_path / "a"), "--force")
    assert r.exit_code == 0 and open_corpus(str(tmp_path / "a")).n_docs == 50


def user_error(r) -> str:
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    # one message (after the progress bar, if the error came from a record mid-run)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and r.stderr.count("error:") == 1
    return last


def test_user_errors_exit_2_with_one_message(tmp_path, skyrl_cli, tiny_tokenizer) -> None:
    tok = str(tiny_tokenizer)
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "hello"}, {"text": "world"}])

    err = user_error(skyrl_cli("data", "tokenize", str(tmp_path / "missing.jsonl"), "--tokenizer", tok, "--out", str(tmp_path / "o")))
    assert "missing.jsonl: no such file" in err

    (tmp_path / "not_a_tokenizer").mkdir()
    err = user_error(skyrl_cli("data", "tokenize", str(good), "--tokenizer", str(tmp_path / "not_a_tokenizer"), "--out", str(tmp_path / "o")))
    assert "--tokenizer: cannot load a tokenizer" in err

    err = user_error(skyrl_cli("data", "tokenize", str(good), "--tokenizer", tok, "--out", str(tmp_path / "o"), "--text-key", "body"))
    assert "good.jsonl:1: no key 'body'; keys: 'text' (set --text-key)" in err

    err = user_error(skyrl_cli("data", "tokenize", str(good), "--tokenizer", tok, "--out", str(tmp_path / "o"), "--messages-key", "msgs"))
    assert "no key 'msgs'" in err

    (tmp_path / "data.csv").write_text("text\nhello\n")
    err = user_error(skyrl_cli("data", "tokenize", str(tmp_path / "data.csv"), "--tokenizer", tok, "--out", str(tmp_path / "o")))
    assert "unknown input type" in err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n{"text": 5}\n')
    err = user_error(skyrl_cli("data", "tokenize", str(bad), "--tokenizer", tok, "--out", str(tmp_path / "b")))
    assert "bad.jsonl:3: invalid JSON" in err
    assert not (tmp_path / "b.parts").exists()  # nothing to resume: the input must change

    chat_bad = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": "hi"}])
    err = user_error(skyrl_cli("data", "tokenize", str(chat_bad), "--tokenizer", tok, "--out", str(tmp_path / "cb"), "--messages-key", "messages"))
    assert "chat.jsonl:2: 'messages': expected a non-empty list of messages" in err

    pq_file = write_parquet(tmp_path / "p.parquet", [{"body": "x"}], row_group_size=10)
    err = user_error(skyrl_cli("data", "tokenize", str(pq_file), "--tokenizer", tok, "--out", str(tmp_path / "o")))
    assert "p.parquet: no column 'text'; columns: 'body'" in err

    assert skyrl_cli("data", "tokenize", str(good), "--tokenizer", tok, "--out", str(tmp_path / "done")).exit_code == 0
    err = user_error(skyrl_cli("data", "tokenize", str(good), "--tokenizer", tok, "--out", str(tmp_path / "done")))
    assert "a corpus already exists here; add --force" in err
    err = user_error(skyrl_cli("data", "tokenize", str(good), "--tokenizer", tok, "--out", str(tmp_path / "done"), "--resume"))
    assert "already complete" in err

    (tmp_path / "empty.jsonl").write_text("\n\n")
    err = user_error(skyrl_cli("data", "tokenize", str(tmp_path / "empty.jsonl"), "--tokenizer", tok, "--out", str(tmp_path / "e")))
    assert "the inputs hold no records" in err and not (tmp_path / "e.json").exists()

    err = user_error(skyrl_cli("data", "info", str(tmp_path / "nowhere")))
    assert "no corpus at this prefix" in err


def test_user_error_from_the_console_script_has_no_traceback(tmp_path) -> None:
    r = subprocess.run(CLI + ["data", "tokenize", str(tmp_path / "nope.jsonl"), "--tokenizer", "x", "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {tmp_path / 'nope.jsonl'}: no such file"


def test_info_numbers_histogram_and_plot(tmp_path, skyrl_cli) -> None:
    lengths = [1, 2, 2, 3, 10, 100, 1000, 1000]
    with CorpusWriter(tmp_path / "c", vocab_size=500, eos_id=0, tokenizer="tiny") as w:
        for n in lengths:
            w.add(np.arange(n) % 500, np.ones(n, np.uint8))
    r = skyrl_cli("data", "info", str(tmp_path / "c"), "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["documents"], info["tokens"]) == (8, sum(lengths))
    assert (info["min_length"], info["max_length"]) == (1, 1000)
    assert info["mean_length"] == pytest.approx(sum(lengths) / 8)
    assert sum(h["count"] for h in info["histogram"]) == 8
    for h in info["histogram"]:
        assert h["count"] == sum(h["min"] <= n <= h["max"] for n in lengths)
    assert info["loss_mask"] is True and info["tokenizer"] == "tiny"

    r = skyrl_cli("data", "info", str(tmp_path / "c"), "--plot", str(tmp_path / "h.png"))
    assert r.exit_code == 0
    assert "documents:   8" in r.stdout and "tokens:      2,118" in r.stdout
    assert "mean 264.8, min 1, max 1,000" in r.stdout
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
