"""Many sampling requests against ``skyrl serve``: does every one complete, what does the
server add per request, and how close is its throughput to the embedded engine's own?

    python benchmarks/tinker_load.py [--requests 131072] [--sdk-requests 512] [--max-tokens 8]
                                     [--rounds 3] [--workers 4] [--concurrency 4096]

The script starts ``skyrl serve`` on 127.0.0.1 (a server file of its own: the tiny Qwen3
preset with a character tokenizer over digits and ':') and drives it from outside:

- ``http``: ``--workers`` client processes, each with aiohttp from its own source address
  127.0.0.(2+w) (one address has ~28k ephemeral ports), behave like the SDK: a session and a
  sampling session of their own, then per request ``POST /api/v1/asample`` and long-polls of
  ``POST /api/v1/retrieve_future`` until the protobuf ``SampleResponse`` arrives. At most
  ``--concurrency`` requests are in flight (all workers together; the server is one process
  and this machine allows 20,000 open files a process, each in-flight request holds one
  connection). A 429 (admission control, ``[server] max_queued_tokens``) is "retry later":
  the request is sent again after a short backoff and the retry counted.
- ``engine``: the baseline a user would run instead, the same preset's embedded engine in this
  process, one offline ``generate`` over the same prompts (one response each, the same
  ``max_tokens`` and temperature).
- ``sdk``: ``--sdk-requests`` requests through the official ``tinker`` SDK
  (``ServiceClient.create_sampling_client(base_model=...)``, ``sample`` futures), and the engine
  once more on those prompts.

``--rounds`` rounds alternate engine, http (A B A B ...) on the round's share of the prompts;
the ratio quoted is the median over rounds of (server generated tokens/s) / (engine tokens/s).

Server overhead per request: the time the server's HTTP path takes with the engine out of the
way, measured under the load itself: the ``asample`` round trip (parse, validate, queue, reply
with the request id) plus, for every ``--probe-every``-th request, one more ``retrieve_future``
of its already finished result (lookup and protobuf reply). The rest of a request's latency is
waiting for the engine (queued behind the other requests, then decoding). Both include the
client's own event-loop delay (the clients share the machine's cores with the server).
Peak RSS: the server process's VmHWM at the end. CPU seconds per round, by process (the
engine's, the server's, the clients'), and per request: on a machine whose clients share the
server's cores, the clients' share bounds the ratio whatever the server does. ``--server-cpus``
and ``--client-cpus`` pin them apart (the server and the baseline engine on the same cores) on
a machine with cores to spare. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import pathlib
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = "skyrl/qwen-tiny"
ALPHABET = "0123456789:"
KEY = "tml-load-benchmark"
PROTOBUF = "application/x-protobuf"
FIRST_CHAR_ID = 3  # the character tokenizers: <pad>, <eos>, <unk>, then the sorted alphabet


def make_prompts(count: int, seed: int) -> list[list[int]]:
    """reverse_digits-shaped prompts: 3-5 distinct digits and ':', as token ids."""
    ids = {c: FIRST_CHAR_ID + i for i, c in enumerate(sorted(ALPHABET))}
    rng = random.Random(seed)
    return [[ids[c] for c in "".join(rng.sample("0123456789", rng.randint(3, 5))) + ":"] for _ in range(count)]


def server_file(folder: pathlib.Path, max_queued_tokens: int | None) -> pathlib.Path:
    path = folder / "server.toml"
    extra = f"max_queued_tokens = {max_queued_tokens}\n" if max_queued_tokens else ""
    path.write_text(f"""[server]
api_keys = ["{KEY}"]
storage = "{folder / 'storage'}"
max_lora_rank = 8
{extra}
[models."{BASE}"]
family = "qwen"
preset = "tiny"
alphabet = "{ALPHABET}"
""")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/api/v1/{route}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-API-Key": KEY})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def parse_cpus(spec: str | None) -> set[int]:
    """``"0-1,4"`` -> {0, 1, 4}; None -> empty (no pinning)."""
    out: set[int] = set()
    for part in (spec or "").split(","):
        if part.strip():
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (their threads included)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50_ms": None, "p99_ms": None}
    s = sorted(xs)
    return {"p50_ms": round(1e3 * s[len(s) // 2], 3), "p99_ms": round(1e3 * s[min(len(s) - 1, int(len(s) * 0.99))], 3)}


# -- the raw HTTP client (one per worker process) -----------------------------------------


async def _session_ids(http: Any, url: str, headers: dict[str, str]) -> str:
    async with http.post(f"{url}/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "load"},
                         headers=headers) as r:
        session = (await r.json())["session_id"]
    async with http.post(f"{url}/api/v1/create_sampling_session",
                         json={"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE},
                         headers=headers) as r:
        return (await r.json())["sampling_session_id"]


class Client:
    """One worker's aiohttp client: its own session and sampling session (made before any
    timed round), a connection pool from its own source address."""

    def __init__(self, url: str, source: str, concurrency: int, max_tokens: int, probe_every: int,
                 poll_timeout: float):
        self.url, self.source, self.concurrency = url, source, concurrency
        self.max_tokens, self.probe_every, self.poll_timeout = max_tokens, probe_every, poll_timeout

    async def open(self) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.concurrency + 8, local_addr=(self.source, 0))
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.poll_timeout)
        self.http = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self.headers = {"X-API-Key": KEY}
        self.sampling_id = await _session_ids(self.http, self.url, self.headers)

    async def drive(self, prompts: list[list[int]], first_index: int) -> dict[str, Any]:
        import aiohttp

        from tinker.proto import tinker_public_pb2 as pb

        http, url, headers, sampling_id = self.http, self.url, self.headers, self.sampling_id
        out: dict[str, Any] = {"completed": 0, "failed": 0, "retries_429": 0, "try_again": 0, "tokens": 0,
                               "errors": {}, "latency": [], "submit": [], "ready_retrieve": []}
        sem = asyncio.Semaphore(self.concurrency)

        def fail(reason: str) -> None:
            out["failed"] += 1
            out["errors"][reason] = out["errors"].get(reason, 0) + 1

        async def one(i: int, prompt: list[int]) -> None:
            body = {"sampling_session_id": sampling_id, "seq_id": i + 1, "num_samples": 1, "type": "sample",
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                    "sampling_params": {"max_tokens": self.max_tokens, "temperature": 1.0, "seed": i}}
            async with sem:
                t0 = time.perf_counter()
                try:
                    backoff = 0.05
                    while True:
                        ts = time.perf_counter()
                        async with http.post(f"{url}/api/v1/asample", json=body, headers=headers) as r:
                            reply = await r.json(content_type=None)
                            status = r.status
                        if status == 429:  # admission control: retry later
                            out["retries_429"] += 1
                            await asyncio.sleep(backoff * (0.5 + random.random()))
                            backoff = min(backoff * 2, 2.0)
                            continue
                        break
                    if status != 200:
                        return fail(f"asample {status}: {str(reply.get('error', reply))[:80]}")
                    submit = time.perf_counter() - ts
                    request = {"request_id": reply["request_id"]}
                    while True:
                        async with http.post(f"{url}/api/v1/retrieve_future", json=request,
                                             headers={**headers, "Accept": PROTOBUF}) as r:
                            status, kind, data = r.status, r.headers.get("Content-Type", ""), await r.read()
                        if status != 200:
                            return fail(f"retrieve_future {status}: {data[:80]!r}")
                        if PROTOBUF in kind:
                            break
                        reply = json.loads(data)
                        if reply.get("type") == "try_again":
                            out["try_again"] += 1
                            continue
                        return fail(f"result error: {str(reply.get('error', reply))[:80]}")
                    latency = time.perf_counter() - t0
                    msg = pb.SampleResponse()
                    msg.ParseFromString(data)
                    out["tokens"] += sum(len(s.tokens) // 4 for s in msg.sequences)  # int32 bytes
                    out["completed"] += 1
                    out["latency"].append(latency)
                    if i % self.probe_every == 0:  # the finished result once more: the server's path alone
                        tr = time.perf_counter()
                        async with http.post(f"{url}/api/v1/retrieve_future", json=request,
                                             headers={**headers, "Accept": PROTOBUF}) as r:
                            await r.read()
                            ok = r.status == 200 and PROTOBUF in r.headers.get("Content-Type", "")
                        if ok:
                            out["submit"].append(submit)
                            out["ready_retrieve"].append(time.perf_counter() - tr)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    fail(f"{type(exc).__name__}: {str(exc)[:60]}")

        await asyncio.gather(*(one(first_index + k, p) for k, p in enumerate(prompts)))
        return out


def worker(index: int, url: str, jobs: Any, results: Any, args: dict[str, Any]) -> None:
    """A client process: opens its client, then runs each job (prompts, first index) sent to
    it and answers its counts; None ends it."""

    async def run() -> None:
        client = Client(url, f"127.0.0.{2 + index}", **args)
        await client.open()
        results.put((index, "ready"))
        loop = asyncio.get_running_loop()
        try:
            while True:
                job = await loop.run_in_executor(None, jobs.get)
                if job is None:
                    return
                results.put((index, await client.drive(*job)))
        finally:
            await client.http.close()

    asyncio.run(run())


# -- the baseline -------------------------------------------------------------------------


class Baseline:
    """The same preset (weights from the same seed, the same tokenizer) in the embedded
    engine of this process, with the server's temperature sampler."""

    def __init__(self, threads: int):
        import torch

        from skyrl_host.plugins import build_host

        torch.set_num_threads(threads)
        host = build_host()
        reg = host.get("models", "qwen")
        family = reg.create(reg.config(preset="tiny"))
        loaded = family.load(alphabet=ALPHABET, seed=0)
        engine_reg = host.get("engines", "embedded")
        self.engine = engine_reg.create(engine_reg.config())
        self.engine.start(loaded)
        sampler = host.get("samplers", "temperature")
        self.sampler = sampler.create(sampler.config(temperature=1.0))

    def run(self, prompts: list[list[int]], max_tokens: int, seed: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        batch = self.engine.generate(prompts, n=1, sampler=self.sampler, max_new_tokens=max_tokens, seed=seed)
        return int(batch.response_lens.sum()), time.perf_counter() - t0


def run_sdk(url: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    sampler = service.create_sampling_client(base_model=BASE)
    if hasattr(sampler, "result"):
        sampler = sampler.result()
    t0 = time.perf_counter()
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
               for i, p in enumerate(prompts)]
    completed = failed = tokens = 0
    errors: dict[str, int] = {}
    for f in futures:
        try:
            res = f.result()
        except Exception as exc:  # noqa: BLE001 - counted and named, the run goes on
            failed += 1
            reason = f"{type(exc).__name__}: {str(exc)[:60]}"
            errors[reason] = errors.get(reason, 0) + 1
            continue
        completed += 1
        tokens += sum(len(s.tokens) for s in res.sequences)
    wall = time.perf_counter() - t0
    service.close("completed")
    return {"completed": completed, "failed": failed, "errors": errors, "tokens": tokens, "wall_s": wall}


def git_state() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    try:
        return {"commit": git("rev-parse", "--short", "HEAD").strip(),
                "modified_files": git("status", "--porcelain", "--untracked-files=no").split()[1::2]}
    except (OSError, subprocess.CalledProcessError):
        return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=131072, help="sampling requests over raw HTTP (all rounds)")
    ap.add_argument("--sdk-requests", type=int, default=512, help="sampling requests through the tinker SDK (0: none)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="alternating engine / http rounds, --requests split among them")
    ap.add_argument("--workers", type=int, default=4, help="client processes (source addresses 127.0.0.2, .3, ...)")
    ap.add_argument("--concurrency", type=int, default=4096,
                    help="requests in flight, all workers together (16384 overloads the server's one event loop: "
                    "connects time out after 30 s, long-polls after 60 s)")
    ap.add_argument("--probe-every", type=int, default=16, help="one extra retrieve of a finished result every N requests")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the baseline engine")
    ap.add_argument("--max-queued-tokens", type=int, default=None, help="[server] max_queued_tokens (default: the server's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-cpus", default=None,
                    help="pin the server and the baseline engine to these cores (e.g. 0-1; Linux), so both get the same "
                    "cores; default: no pinning")
    ap.add_argument("--client-cpus", default=None,
                    help="pin the client processes to these cores (e.g. 2-5): on a machine with spare cores the "
                    "clients then stop competing with the server for its cores, as clients on other machines would not")
    args = ap.parse_args()
    if args.requests < args.rounds or args.workers < 1 or args.workers > 250 or args.concurrency < args.workers:
        ap.error("need --requests >= --rounds, 1 <= --workers <= 250 and --concurrency >= --workers")

    server_cpus, client_cpus = parse_cpus(args.server_cpus), parse_cpus(args.client_cpus)
    if server_cpus:
        os.sched_setaffinity(0, server_cpus)  # the baseline engine runs here; the server inherits it
    t_start = time.perf_counter()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="tinker_load_"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (folder / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", "from skyrl_host.cli import entry; entry()", "serve",
                             str(server_file(folder, args.max_queued_tokens)), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    ctx = mp.get_context("spawn")
    jobs = [ctx.Queue() for _ in range(args.workers)]
    results = ctx.Queue()
    per_worker = {"concurrency": max(1, args.concurrency // args.workers), "max_tokens": args.max_tokens,
                  "probe_every": args.probe_every, "poll_timeout": 60.0}
    procs = [ctx.Process(target=worker, args=(w, url, jobs[w], results, per_worker), daemon=True)
             for w in range(args.workers)]
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"skyrl serve exited with code {proc.returncode}; see {folder / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("skyrl serve did not answer within 180 s") from None
                time.sleep(0.2)
        rss_idle = peak_rss_mib(proc.pid)
        for p in procs:
            p.start()
            if client_cpus:
                os.sched_setaffinity(p.pid, client_cpus)
        baseline = Baseline(args.threads)
        prompts = make_prompts(args.requests, args.seed)
        warm = make_prompts(64, args.seed + 1)
        baseline.run(warm, args.max_tokens, 0)
        for _ in procs:
            results.get()  # every client has its sessions
        for w in range(args.workers):  # one untimed request each: connections up, server paths warm
            jobs[w].put((warm[w % len(warm):][:1], 10**9 + w))
        for _ in procs:
            results.get()

        rounds = []
        share = args.requests // args.rounds
        for r in range(args.rounds):
            chunk = prompts[r * share: (r + 1) * share if r < args.rounds - 1 else args.requests]
            first = r * share
            e_cpu0 = time.process_time()
            e_tokens, e_wall = baseline.run(chunk, args.max_tokens, args.seed + r)
            e_cpu = time.process_time() - e_cpu0
            cpu0 = {who: cpu_seconds(pids) for who, pids in (("server", [proc.pid]), ("clients", [p.pid for p in procs]))}
            t0 = time.perf_counter()
            step = -(-len(chunk) // args.workers)
            for w in range(args.workers):
                jobs[w].put((chunk[w * step: (w + 1) * step], first + w * step))
            parts = [results.get()[1] for _ in range(args.workers)]
            h_wall = time.perf_counter() - t0
            cpu = {who: round(cpu_seconds(pids) - cpu0[who], 2)
                   for who, pids in (("server", [proc.pid]), ("clients", [p.pid for p in procs]))}
            merged: dict[str, Any] = {k: 0 for k in ("completed", "failed", "retries_429", "try_again", "tokens")}
            errors: dict[str, int] = {}
            lat, sub, ready = [], [], []
            for part in parts:
                for k in merged:
                    merged[k] += part[k]
                for k, v in part["errors"].items():
                    errors[k] = errors.get(k, 0) + v
                lat += part["latency"]
                sub += part["submit"]
                ready += part["ready_retrieve"]
            overhead = [a + b for a, b in zip(sub, ready)]
            rounds.append({
                "requests": len(chunk),
                "engine": {"tokens": e_tokens, "wall_s": round(e_wall, 3), "tokens_per_s": round(e_tokens / e_wall, 1),
                           "cpu_s": round(e_cpu, 2)},
                # CPU seconds the round took, by process: the server's and the clients' (which share
                # this machine's cores with it); the engine's above. Per request: what the cores pay.
                "cpu_s": cpu, "cpu_ms_per_request": {
                    "engine": round(1000 * e_cpu / len(chunk), 3),
                    **{who: round(1000 * v / max(1, merged["completed"]), 3) for who, v in cpu.items()}},
                "http": {**merged, "errors": errors, "wall_s": round(h_wall, 3),
                         "tokens_per_s": round(merged["tokens"] / h_wall, 1),
                         "requests_per_s": round(merged["completed"] / h_wall, 1),
                         "latency": percentiles(lat), "overhead": percentiles(overhead),
                         "asample_round_trip": percentiles(sub), "ready_retrieve": percentiles(ready),
                         "overhead_samples": len(overhead)},
                "ratio_http_vs_engine": round((merged["tokens"] / h_wall) / (e_tokens / e_wall), 4),
            })
            print(f"tinker_load.py: round {r + 1}: {merged['completed']}/{len(chunk)} completed, "
                  f"{merged['failed']} failed, ratio {rounds[-1]['ratio_http_vs_engine']}"
                  f"{', errors ' + json.dumps(errors) if errors else ''}", file=sys.stderr)

        sdk = None
        if args.sdk_requests:
            sdk_prompts = make_prompts(args.sdk_requests, args.seed + 2)
            e_tokens, e_wall = baseline.run(sdk_prompts, args.max_tokens, args.seed + 99)
            sdk = run_sdk(url, sdk_prompts, args.max_tokens)
            sdk["tokens_per_s"] = round(sdk["tokens"] / sdk["wall_s"], 1)
            sdk["wall_s"] = round(sdk["wall_s"], 3)
            sdk["engine_tokens_per_s"] = round(e_tokens / e_wall, 1)
            sdk["ratio_sdk_vs_engine"] = round(sdk["tokens_per_s"] / sdk["engine_tokens_per_s"], 4)
        rss_peak = peak_rss_mib(proc.pid)
    finally:
        for q in jobs:
            q.put(None)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

    import torch

    ratios = [r["ratio_http_vs_engine"] for r in rounds]
    completed = sum(r["http"]["completed"] for r in rounds)
    failed = sum(r["http"]["failed"] for r in rounds)
    print(json.dumps({
        "benchmark": "tinker_load",
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/tinker_load.py " + " ".join(sys.argv[1:]),
        "model": f"{BASE} (qwen preset tiny, alphabet {ALPHABET!r})",
        "max_tokens": args.max_tokens, "workers": args.workers, "concurrency": args.concurrency,
        "cpus": {"machine": os.cpu_count(), "server_and_engine": sorted(server_cpus) or "all",
                 "clients": sorted(client_cpus) or "all"},
        "requests": args.requests, "completed": completed, "failed": failed,
        "retries_429": sum(r["http"]["retries_429"] for r in rounds),
        "overhead_p50_ms_median": statistics.median(r["http"]["overhead"]["p50_ms"] or 0 for r in rounds),
        "overhead_p99_ms_median": statistics.median(r["http"]["overhead"]["p99_ms"] or 0 for r in rounds),
        "ratio_http_vs_engine_median": round(statistics.median(ratios), 4),
        "ratio_http_vs_engine_per_round": ratios,
        "server_rss_mib": {"after_start": rss_idle, "peak": rss_peak},
        "rounds": rounds,
        "sdk": sdk,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "git": git_state(),
    }, indent=2))


if __name__ == "__main__":
    main()
