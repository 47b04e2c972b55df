"""No code path of the project unpickles: files, stores and messages from elsewhere are
read as safetensors, JSON, npz without objects, or torch's weights-only loader. The test
reads every source file of the host and the plugins (not the tests) for the calls that
would rebuild objects from bytes, and fails naming the file and line of any new one."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Each pattern with what it catches.
FORBIDDEN = {
    r"\bpickle\.(loads?|Unpickler)\b": "pickle.load / loads / Unpickler",
    r"\b(cloudpickle|dill|jsonpickle|shelve)\b": "a pickle-based library",
    r"\bmarshal\.loads?\b": "marshal.load",
    r"\bjoblib\.load\b": "joblib.load (pickle)",
    r"allow_pickle\s*=\s*True": "numpy with allow_pickle=True",
    r"weights_only\s*=\s*False": "torch.load with weights_only=False",
    r"\byaml\.(load|unsafe_load)\(": "yaml.load (may construct objects)",
    r"\bdist\.\w+_object(_list)?\(": "a torch.distributed object collective (pickle between the ranks)",
}
TORCH_LOAD = re.compile(r"\btorch\.load\(")

# Where an exception is allowed, and why (a line's text must contain the key).
ALLOWED: dict[tuple[str, str], str] = {
    ("skyrl_host/checkpoints.py", "class Restricted(pickle.Unpickler)"):
        "the check of torch.distributed.checkpoint's .metadata: find_class admits only its dataclasses, enums, "
        "torch.Size and dtypes, so a planted file is refused before torch unpickles it",
    ("skyrl_host/checkpoints.py", "torch.load(legacy, weights_only=True)"):
        "checkpoints written before state files: torch's weights-only loader (tensors and plain values only)",
    ("plugins/server/skyrl_server/_storage.py", "weights_only=True"):
        "the server's own checkpoints of optimizer state: torch's weights-only loader",
    # Object collectives run among one job's own ranks, inside a process group that only the
    # job's processes joined (SECURITY.md: the ranks of a job trust each other).
    ("plugins/weightsync/skyrl_weightsync/_broadcast.py", "dist.broadcast_object_list("):
        "the broadcast transport's header, trainer rank 0 to the job's engine processes",
    ("plugins/backends/skyrl_backends/_weights.py", "dist.broadcast_object_list(meta"):
        "tensor names and shapes from rank 0 to the job's other trainer ranks",
    ("plugins/backends/skyrl_backends/_train_step.py", "dist.all_gather_object(gathered, local_metrics"):
        "each trainer rank's metrics",
    ("plugins/backends/skyrl_backends/_mcore_checkpoint.py", "dist.all_gather_object(everyone, steps)"):
        "each megatron rank's optimizer step counts",
    ("plugins/backends/skyrl_backends/_mcore_trainer.py", "dist.all_gather_object(gathered"):
        "megatron ranks' weight pieces for the gathered model",
    ("plugins/backends/skyrl_backends/_mcore_trainer.py", "dist.broadcast_object_list(box, src=0)"):
        "megatron rank 0's answer to the other ranks",
}


def sources() -> list[pathlib.Path]:
    files = sorted((ROOT / "skyrl_host").rglob("*.py"))
    for pkg in sorted((ROOT / "plugins").glob("*/skyrl_*")):
        files += sorted(pkg.rglob("*.py"))
    for pkg in sorted((ROOT / "examples").glob("*/skyrl_*")):
        files += sorted(pkg.rglob("*.py"))
    return [f for f in files if "/tests/" not in f.as_posix()]


def allowed(rel: str, line: str) -> bool:
    return any(rel == f and key in line for (f, key) in ALLOWED)


def test_no_source_file_unpickles() -> None:
    files = sources()
    assert len(files) > 100  # the host and every plugin were read
    found = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if allowed(rel, line):
                continue
            for pattern, what in FORBIDDEN.items():
                if re.search(pattern, code):
                    found.append(f"{rel}:{n}: {what}: {line.strip()}")
            if TORCH_LOAD.search(code) and "weights_only=True" not in code:
                found.append(f"{rel}:{n}: torch.load without weights_only=True: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_allowed_exception_is_still_there() -> None:
    """An entry of ALLOWED whose line is gone is stale: remove it, so it cannot hide a new one."""
    texts = {f.relative_to(ROOT).as_posix(): f.read_text() for f in sources()}
    stale = [f"{f}: {key}" for (f, key) in ALLOWED if key not in texts.get(f, "")]
    assert not stale, stale


def test_the_check_catches_what_it_looks_for(tmp_path) -> None:
    lines = ["x = pickle.loads(data)", "torch.load(p)", "torch.load(p, weights_only=False)", "import dill",
             "np.load(f, allow_pickle=True)", "yaml.load(s)"]
    hits = 0
    for line in lines:
        hits += any(re.search(p, line) for p in FORBIDDEN) or bool(TORCH_LOAD.search(line) and
                                                                     "weights_only=True" not in line)
    assert hits == len(lines)
    assert not any(re.search(p, "torch.load(p, weights_only=True)") for p in FORBIDDEN)
