"""The `files` dataset as a user switching from verl or SkyRL meets it: the Parquet files
and datasets folders their preprocessing scripts write (rows written here from the
formats' definitions, through Hugging Face `datasets` as those scripts do), read
unchanged; rewards by data source; one clear error per bad input; row groups read one at
a time."""

from __future__ import annotations

import json
import os

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from skyrl_datasets.files import Files, FilesConfig
from skyrl_datasets.verifiers import Gsm8k, MultipleChoice
from skyrl_host.errors import UserError

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
QUESTIONS = [(f"Tom has {a} apples and buys {b} more. How many apples does he have?", str(a + b))
             for a, b in [(3, 4), (12, 30), (7, 7), (100, 250), (9, 1), (48, 24)]]


def verl_row(i: int, question: str, answer: str) -> dict:
    """A row of verl's examples/data_preprocess/gsm8k.py."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "answer": f"... #### {answer}", "question": question}}


def skyrl_row(i: int, question: str, answer: str) -> dict:
    """A row of SkyRL's examples/gsm8k/gsm8k_dataset.py."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "answer": f"... #### {answer}", "question": question}}


def write_all(tmp_path, make=verl_row):
    """The same rows as Parquet and a save_to_disk folder (through `datasets`) and as JSON lines."""
    import datasets

    rows = [make(i, q, a) for i, (q, a) in enumerate(QUESTIONS)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "train.parquet"))
    ds.save_to_disk(str(tmp_path / "train_disk"))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def files(path, **kw) -> Files:
    return Files(FilesConfig(path=str(path) if not isinstance(path, list) else [str(p) for p in path], **kw), seed=5)


@pytest.mark.parametrize("make", [verl_row, skyrl_row])
def test_the_three_forms_of_one_dataset_give_the_same_tasks_in_the_same_order(make, tmp_path) -> None:
    rows = write_all(tmp_path, make)
    seen = {}
    for name in ("train.parquet", "train_disk", "train.jsonl"):
        ds = files(tmp_path / name)
        assert len(ds) == 6
        tasks = ds.batch(1, 6) + ds.batch(2, 6)  # two epochs
        seen[name] = [(t.prompt, t.answer, t.messages, t.meta["extra_info"]["index"]) for t in tasks]
        assert sorted(t.answer for t in tasks[:6]) == sorted(a for _, a in QUESTIONS)  # an epoch: each row once
        first = tasks[0]
        row = rows[first.meta["extra_info"]["index"]]
        assert first.messages == tuple(row["prompt"]) and first.prompt == row["prompt"][0]["content"]
        assert first.meta == row  # every field, for environments and user rewards
    assert seen["train.parquet"] == seen["train_disk"] == seen["train.jsonl"]
    epochs = [[s[3] for s in seen["train.parquet"][:6]], [s[3] for s in seen["train.parquet"][6:]]]
    assert epochs[0] != epochs[1] and epochs[0] != list(range(6))  # shuffled, anew each epoch
    again = files(tmp_path / "train.parquet")
    assert [t.answer for t in again.batch(2, 6)] == [s[1] for s in seen["train.parquet"][6:]]  # resume: same prompts


def test_many_row_groups_and_files_each_row_once_per_epoch_reading_one_group_at_a_time(tmp_path) -> None:
    n = 1000
    for part in range(2):
        table = pa.table({"prompt": [f"q{part}-{i}" for i in range(n)], "answer": [str(i) for i in range(n)],
                          "data_source": ["openai/gsm8k"] * n})
        pq.write_table(table, tmp_path / f"part-{part}.parquet", row_group_size=100)
    ds = files(tmp_path / "part-*.parquet")
    assert len(ds) == 2 * n and len(ds._rows.blocks) == 20
    epoch = [t.prompt for t in ds.batch(1, 2 * n)]
    assert sorted(epoch) == sorted(f"q{p}-{i}" for p in range(2) for i in range(n))
    # Blocks are walked one after another: the first 100 prompts come from one row group.
    assert len({(p.split("-")[0], int(p.split("-")[1]) // 100) for p in epoch[:100]}) == 1
    assert len(ds._rows._cache) <= 4
    unshuffled = files(tmp_path, shuffle=False)  # a folder of Parquet files, in name order
    assert [t.prompt for t in unshuffled.batch(1, 3)] == ["q0-0", "q0-1", "q0-2"]


class CountingFileSystem(LocalFileSystem):
    """The local filesystem under the protocol ``counting://``, counting the bytes read."""

    protocol = "counting"
    read_bytes = 0

    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode, **kw)
        raw_read = f.read

        def read(*args):
            data = raw_read(*args)
            CountingFileSystem.read_bytes += len(data)
            return data

        f.read = read
        return f

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("counting://"))


def test_a_large_parquet_file_opens_from_its_footer_and_a_batch_reads_one_row_group(tmp_path) -> None:
    fsspec.register_implementation("counting", CountingFileSystem, clobber=True)
    n, group = 200_000, 10_000
    text = "x" * 60
    table = pa.table({"prompt": [f"{text} {i}" for i in range(n)], "answer": [str(i) for i in range(n)],
                      "data_source": ["openai/gsm8k"] * n})
    path = tmp_path / "big.parquet"
    pq.write_table(table, path, row_group_size=group, compression="none")
    size = os.path.getsize(path)
    CountingFileSystem.read_bytes = 0
    ds = files(f"counting://{path}")
    opened = CountingFileSystem.read_bytes
    assert len(ds) == n and opened < size / 100, (opened, size)  # the footer, not the rows
    ds.batch(1, 64)
    assert CountingFileSystem.read_bytes - opened < 2 * size / (n // group), (CountingFileSystem.read_bytes, size)


def test_dotted_paths_reach_fields_of_rows_that_differ(tmp_path) -> None:
    rows = [{"question": {"text": "What is 2 + 2?"}, "extra_info": {"answer": 4}, "meta": {"src": "mine"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "own.parquet")
    ds = files(tmp_path / "own.parquet", prompt_key="question.text", answer_key="extra_info.answer",
               data_source_key="meta.src", rewards={"mine": "gsm8k_flexible"})
    (task,) = ds.batch(1, 1)
    assert (task.prompt, task.answer, task.messages) == ("What is 2 + 2?", "4", None)
    assert ds.reward(task, "two and two make 4") == 1.0 and ds.reward(task, "5") == 0.0
    assert ds.reward(task, "two and two make 4.") == 0.0  # verl's flexible rule keeps the full stop: "4." != "4"


def test_gsm8k_strict_and_flexible_as_verl_defines_them() -> None:
    strict, flexible = Gsm8k("strict"), Gsm8k("flexible")
    assert strict.extract("so 1,234 in all #### 1,234") == "1234"
    assert strict.extract("The answer is 72.") is None and flexible.extract("The answer is 72.") == "72."
    assert flexible.extract("first 3 then 72") == "72"
    assert strict.extract("#### 5 then again #### 6") == "6"  # the last one
    assert strict.extract("#### $1,000") is None  # the dollar sign is not part of verl's number pattern
    long = "#### 9 " + "x" * 400 + " #### 10"
    assert strict.extract(long) == "10" and strict.extract("#### 9 " + "x" * 400) is None  # the last 300 characters
    from skyrl_host.interfaces import Task

    task = Task(prompt="p", answer="72")
    assert strict(task, "... #### 72") == 1.0 and strict(task, "... #### 72.0") == 0.0  # text, as verl compares
    assert strict.metrics() == {"gsm8k_scored": 2.0, "gsm8k_no_answer": 0.0, "gsm8k_correct": 1.0}


def test_multiple_choice_finds_the_chosen_letter() -> None:
    mc = MultipleChoice()
    for text, letter in [("I pick \\boxed{C}", "C"), ("Answer: (B)", "B"), ("The answer is D.", "D"),
                         ("Between (A) and (C), (C) fits", "C"), ("so it must be\nA", "A"), ("no idea", None)]:
        assert mc.extract(text) == letter, text
    from skyrl_host.interfaces import Task

    assert mc(Task(prompt="p", answer="(c)"), "Answer: C") == 1.0 and mc(Task(prompt="p", answer="B"), "Answer: C") == 0.0


def score(task, completion):  # a user's reward: f(task, completion)
    return float(completion.strip().endswith(task.answer))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # a verl reward function
    return {"score": float(ground_truth in solution_str and data_source == "mine/words"), "acc": True}


def test_rewards_by_data_source_builtin_table_user_functions_and_a_default(tmp_path) -> None:
    rows = [
        {"data_source": "openai/gsm8k", "prompt": "a", "reward_model": {"ground_truth": "7"}},
        {"data_source": "HuggingFaceH4/MATH-500", "prompt": "b", "reward_model": {"ground_truth": "\\frac{1}{2}"}},
        {"data_source": "cais/mmlu", "prompt": "c", "reward_model": {"ground_truth": "B"}},
        {"data_source": "aime2024", "prompt": "d", "reward_model": {"ground_truth": "33"}},
        {"data_source": "mine/words", "prompt": "e", "reward_model": {"ground_truth": "cat"}},
        {"data_source": "mine/ends", "prompt": "f", "reward_model": {"ground_truth": "dog"}},
        {"data_source": "other", "prompt": "g", "reward_model": {"ground_truth": "x"}},
    ]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    here = __name__
    ds = files(path, shuffle=False, rewards={"mine/words": f"{here}:compute_score", "mine/e*": f"{here}:score"},
               default_reward="exact")
    tasks = {t.meta["data_source"]: t for t in ds.batch(1, 7)}
    cases = {
        "openai/gsm8k": ("#### 7", "7"), "HuggingFaceH4/MATH-500": ("so \\boxed{0.5}", "\\boxed{2}"),
        "cais/mmlu": ("Answer: B", "Answer: A"), "aime2024": ("\\boxed{33}", "\\boxed{34}"),
        "mine/words": ("a cat", "a dog"), "mine/ends": ("hot dog", "dog house"), "other": (" x ", "y"),
    }
    for source, (right, wrong) in cases.items():
        assert (ds.reward(tasks[source], right), ds.reward(tasks[source], wrong)) == (1.0, 0.0), source
    metrics = ds.reward_metrics()
    assert metrics["gsm8k_correct"] == 1.0 and metrics["multiple_choice_scored"] == 2.0
    assert metrics["math_correct"] == 2.0 and metrics["exact_correct"] == 1.0


def test_one_reward_for_every_row(tmp_path) -> None:
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "answer": "B", "data_source": "openai/gsm8k"}]),
                   tmp_path / "x.parquet")
    ds = files(tmp_path / "x.parquet", reward="multiple_choice")
    (task,) = ds.batch(1, 1)
    assert ds.reward(task, "Answer: B") == 1.0  # not gsm8k: the job's reward wins over the data source


def problem(exc: pytest.ExceptionInfo) -> str:
    return str(exc.value.problems[0])


def test_bad_rows_name_the_file_the_row_and_the_field(tmp_path) -> None:
    good = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"style": "rule", "ground_truth": "1"}}
    cases = {
        "no_truth": ({**good, "reward_model": {"style": "rule"}},
                     "row 0: missing the ground truth (reward_model.ground_truth or reward_spec.ground_truth or "
                     "answer) that reward 'gsm8k' needs"),
        "bad_prompt": ({**good, "prompt": {"text": "q"}},
                       "row 0: prompt: expected text or a list of {role, content} messages, found {'text': 'q'}"),
        "bad_message": ({**good, "prompt": [{"role": "user"}]},
                        "row 0: prompt[0]: expected a message with text 'role' and 'content'"),
        "no_reward": ({**good, "data_source": "my/new_set"},
                      "row 0: data_source: no reward for data source 'my/new_set': add it to [dataset] rewards, "
                      "or set default_reward"),
        "list_truth": ({**good, "reward_model": {"ground_truth": ["1", "2"]}},
                       "row 0: reward_model.ground_truth: expected the ground truth as text or a number"),
    }
    for name, (row, message) in cases.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist([row]), path)
        with pytest.raises(UserError) as exc:
            files(path, shuffle=False).batch(1, 1)
        assert problem(exc).startswith(f"{path}: {message}"), (name, problem(exc))
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps(good) + "\n\n  \n{not json\n")
    with pytest.raises(UserError) as exc:
        files(jsonl, shuffle=False).batch(1, 2)
    assert problem(exc) == f"{jsonl}: line 4: invalid JSON: Expecting property name enclosed in double quotes (column 2)"


def test_bad_files_are_one_clear_message(tmp_path) -> None:
    (tmp_path / "fake.parquet").write_text("prompt,answer\nq,1\n")
    (tmp_path / "notes.txt").write_text("hello")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "q", "answer": "1"}]),
                          "test": datasets.Dataset.from_list([{"prompt": "r", "answer": "2"}])}).save_to_disk(str(tmp_path / "dd"))
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../fake.parquet"}]}))
    cases = {
        "fake.parquet": "not a Parquet file: ",
        "notes.txt": "cannot tell the format: expected a .parquet, .jsonl or .arrow file, or a datasets save_to_disk folder",
        "dd": "a DatasetDict folder (splits 'train', 'test'): name one split's folder, e.g. ",
        "evil": "state.json names a data file '../fake.parquet': expected a plain *.arrow file name",
        "*.none": "the pattern matches no file",
    }
    for name, message in cases.items():
        with pytest.raises(UserError) as exc:
            files(tmp_path / name)
        assert problem(exc).startswith(f"{tmp_path / name}: {message}"), problem(exc)
    with pytest.raises(ValueError, match="expected an existing file or folder, found nothing at "):
        files(tmp_path / "missing.parquet")  # checked when the job file is validated
    single = tmp_path / "dd" / "test"
    assert [t.prompt for t in files(single, default_reward="exact").batch(1, 1)] == ["r"]  # one split's folder


def test_a_parquet_file_at_an_s3_url(tmp_path, skyrl_s3_server) -> None:
    import s3fs

    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": skyrl_s3_server}}
    fs = s3fs.S3FileSystem(**options)
    bucket = f"prompts-{os.getpid()}"
    fs.mkdir(bucket)
    write_all(tmp_path)
    fs.put_file(str(tmp_path / "train.parquet"), f"{bucket}/gsm8k/train.parquet")
    fs.put(str(tmp_path / "train_disk"), f"{bucket}/gsm8k/train_disk", recursive=True)
    local = [t.answer for t in files(tmp_path / "train.parquet").batch(1, 6)]
    for name in ("train.parquet", "train_disk"):
        ds = Files(FilesConfig(path=f"s3://{bucket}/gsm8k/{name}", storage_options=options), seed=5)
        assert [t.answer for t in ds.batch(1, 6)] == local
        ds.close()
    with pytest.raises(UserError, match="the bucket 'no-such-bucket' does not exist"):
        Files(FilesConfig(path="s3://no-such-bucket/train.parquet", storage_options=options))


# -- jobs ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_rl_job_reads_verl_and_skyrl_files_in_all_three_forms(skyrl_cli, skyrl_tiny_rl_job, skyrl_real_checkpoint,
                                                                 tmp_path) -> None:
    write_all(tmp_path, verl_row)
    skyrl = tmp_path / "skyrl"
    skyrl.mkdir()
    write_all(skyrl, skyrl_row)
    paths = [tmp_path / "train.parquet", skyrl / "train_disk", skyrl / "train.jsonl"]
    job = skyrl_tiny_rl_job(
        tmp_path, "gsm8k", job={"steps": 3, "batch_size": 6, "n_samples": 2, "max_new_tokens": 8},
        model={"family": "qwen", "path": skyrl_real_checkpoint("qwen3"), "preset": None},
        dataset={"name": "files", "path": [str(p) for p in paths], "min_len": None, "max_len": None, "prefix": None},
        backend={"micro_batch_tokens": 512})
    checked = skyrl_cli("validate", str(job.path))
    assert checked.exit_code == 0, checked.stderr
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    rows = job.rows()
    assert [r["step"] for r in rows] == [1, 2, 3]
    # 18 rows, 3 steps of 6 prompts x 2 samples: every completion scored by verl's GSM8K rule.
    assert rows[-1]["gsm8k_scored"] == 3 * 6 * 2
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "my/set", "prompt": "q", "answer": "1"}]), bad)
    job = skyrl_tiny_rl_job(
        tmp_path, "bad", model={"family": "qwen", "path": skyrl_real_checkpoint("qwen3"), "preset": None},
        dataset={"name": "files", "path": str(bad), "min_len": None, "max_len": None, "prefix": None})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert f"error: {bad}: row 0: data_source: no reward for data source 'my/set'" in result.stderr
    mistyped = skyrl_cli("validate", str(job.path), "--set", 'dataset.reward="gsm8"')
    assert mistyped.exit_code == 2 and "dataset.reward: expected one of" in mistyped.stderr
    assert "did you mean 'gsm8k'?" in mistyped.stderr
    missing = skyrl_cli("validate", str(job.path), "--set", f'dataset.path="{tmp_path / "nope.parquet"}"')
    assert missing.exit_code == 2 and "dataset.path: expected an existing file or folder, found nothing at" in missing.stderr
