"""``transport = "nixl"``: sharded transfer over NIXL (one-sided reads, UCX underneath).

Every trainer rank runs a NIXL agent and serves **its own shards**: at its first
``publish`` it copies them (in the wire dtype) into buffers it registers once, in the
memory the tensors live in (DRAM on CPU, VRAM on GPU: the same code), and reuses them
for every later version; a small registered header holds the version being served.
Nothing is gathered: not on rank 0, not across the ranks of a sharded parameter
(FSDP2 ``DTensor`` shards are served where they are; a replicated value by one rank).

Each engine rank's receiver knows every trainer rank's layout (the launcher hands it
the senders' ``endpoint()`` bytes), computes the byte ranges it needs (all of each
tensor, or, for a tensor-parallel engine rank ``shard=(k, n)``, its k-th row slice of
every 2-D+ tensor) and **reads only those**, with batched NIXL READs from the engine
side into staging buffers. It checks each peer's header for the target version before
and after the read and hands the engine the complete set only then; any failure (a
wrong version, a publish racing the read, a dead peer) raises naming the version and
the peer, and the engine keeps its last version. See docs/weightsync.md.

This module is light: the factory imports :mod:`skyrl_weightsync._nixl` (and NIXL); the
halves (``NixlSender``, ``NixlReceiver``, ``NixlError``) and the agent helpers
(``make_agent``, ``Poller``) are imported from here on first use.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import UserError
from skyrl_host.options import gt, option
from skyrl_weightsync import lazy_exports, weights_to_serve, wire_dtype_problem

from skyrl_weightsync._nixl_hint import INSTALL_HINT  # noqa: E402 - also this module's public name


# The transport's halves, for programs that drive them themselves (benchmarks, other
# distributions' tests), and for raw NIXL transfers an agent (``make_agent``) and the
# ``Poller`` that serves its reads: imported on first use (PEP 562), so that discovering
# this plugin imports neither torch nor NIXL.
__getattr__ = lazy_exports(__name__, {
    "NixlSender": "skyrl_weightsync._nixl.sender",
    "NixlReceiver": "skyrl_weightsync._nixl.receiver",
    "NixlError": "skyrl_weightsync._nixl.agent",
    "make_agent": "skyrl_weightsync._nixl.agent",
    "Poller": "skyrl_weightsync._nixl.agent",
})

if TYPE_CHECKING:
    from skyrl_weightsync._nixl.agent import NixlError, Poller, make_agent
    from skyrl_weightsync._nixl.receiver import NixlReceiver
    from skyrl_weightsync._nixl.sender import NixlSender


@attrs.frozen
class NixlConfig:
    """Options of ``[weight_sync]`` when ``transport = "nixl"``."""

    dtype: Literal["bfloat16", "float32"] = option("bfloat16",
                                                   help="dtype of the weights on the wire (and in the engine)")
    backend: str = option("UCX", help="the NIXL backend plugin that moves the bytes")
    timeout_s: float = option(60.0, help="how long a receiver waits for one transfer before it gives up",
                              validator=gt(0))
    progress_thread: bool = option(False, help="trainer ranks run NIXL's own progress thread (it spins a core; "
                                               "off: a light poller every millisecond)")


def nixl_installed() -> bool:
    """Whether a NIXL Python package is importable (``nixl`` or the ``nixl_cu12`` wheel), without importing it."""
    for name in ("nixl", "nixl_cu12"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # ValueError: blocked (sys.modules[name] is None)
            pass
    return False


class Nixl:
    """The transport: ``sender(rank=, world=)`` on each trainer rank, ``receiver(shard=, device=)``
    on each engine rank; ``publish`` runs both halves in one process (``launcher = "local"``)."""

    collective = False
    rendezvous = True  # the receivers need the senders' endpoint() bytes (after the first publish): connect(endpoints)
    carries_payload = False

    def __init__(self, config: NixlConfig | None = None):
        self.config = config or NixlConfig()
        self._local: tuple[Any, Any] | None = None

    def sender(self, *, rank: int = 0, world: int = 1, **_ignored: Any) -> Any:
        from skyrl_weightsync._nixl.sender import NixlSender

        return NixlSender(rank=rank, world=world, dtype=self.config.dtype, backend=self.config.backend,
                          progress_thread=self.config.progress_thread)

    def receiver(self, *, peers: Any = None, shard: tuple[int, int] = (0, 1), device: Any = "cpu",
                 engine: Any = None, **_ignored: Any) -> Any:
        """An engine rank's half; ``engine``: one whose workers receive themselves
        (WorkerReceiving) gets a half that has them read (each worker its whole tensors)."""
        from skyrl_host.contracts import receives_in_workers

        if engine is not None and receives_in_workers(engine):
            receiver: Any = NixlInWorkers(self.config)
        else:
            from skyrl_weightsync._nixl.receiver import NixlReceiver

            receiver = NixlReceiver(shard=shard, device=device, backend=self.config.backend,
                                    timeout_s=self.config.timeout_s)
        if peers:
            receiver.connect(peers)
        return receiver

    def publish(self, backend: Any, engine: Any, version: int) -> dict[str, float]:
        """One process: this process's sender serves what the engine is to serve
        (``serving_weights()``: the whole tensors, quantized with a precision) and a
        receiver reads them: in the same process (two NIXL agents, over UCX loopback), or
        in the engine's workers where they receive themselves."""
        if self._local is None:
            self._local = (self.sender(), None)
        sender, receiver = self._local
        stats = dict(sender.publish(version, weights_to_serve(backend)))
        if receiver is None:
            receiver = self.receiver(peers=[sender.endpoint()], engine=engine)
            self._local = (sender, receiver)
        stats.update(receiver.sync(engine, target=version))
        return stats

    def close(self) -> None:
        if self._local is not None:
            sender, receiver = self._local
            if receiver is not None:
                receiver.close()
            sender.close()
            self._local = None


class NixlInWorkers:
    """The engine's half when the engine's workers read themselves (WorkerReceiving):
    ``connect`` keeps the trainer ranks' endpoints for the workers' recipe, ``sync`` has
    every worker read ``target`` (beside generation) and apply it (all of them, or none)."""

    def __init__(self, config: NixlConfig):
        self.config = config
        self.recipe: dict[str, Any] | None = None

    def connect(self, endpoints: Any) -> None:
        import base64

        from skyrl_host.statefile import dumps_state

        raw = [e if isinstance(e, (bytes, bytearray)) else dumps_state(dict(e)) for e in endpoints]
        self.recipe = {"receiver": "nixl",
                       "kwargs": {"endpoints": [base64.b64encode(bytes(e)).decode() for e in raw],
                                  "backend": self.config.backend, "timeout_s": self.config.timeout_s}}

    def sync(self, engine: Any, target: int | None = None, **_unused: Any) -> dict[str, float]:
        from skyrl_weightsync._workers import InWorkers

        if self.recipe is None:
            raise RuntimeError(f"version {target}: sync before connect(endpoints)")
        return InWorkers(engine, self.recipe).sync(engine, target)

    def close(self) -> None:
        pass


def create(config: NixlConfig) -> Nixl:
    if not nixl_installed():
        raise UserError(f"[weight_sync] transport = \"nixl\" needs NIXL, which is not installed: {INSTALL_HINT}")
    return Nixl(config)


def check(spec: Any) -> list[tuple[str, str]]:
    """Job-level checks: NIXL is installed; in one process, an engine that serves the
    trainer's own tensors is not handed weights of another dtype (they would overwrite
    the trainer's)."""
    key = "weight_sync.transport" if "weight_sync" in getattr(spec, "raw", {}) else "weight_sync"
    if not nixl_installed():
        return [(key, f"transport 'nixl' needs NIXL, which is not installed: {INSTALL_HINT}")]
    return wire_dtype_problem(spec, "nixl", f", or dtype = \"{_model_dtype(spec)}\"")


def _model_dtype(spec: Any) -> Any:
    model = spec.plugins.get("model")
    return getattr(getattr(model, "config", None), "dtype", None)


@hookimpl
def skyrl_register_weight_transports(register: Any) -> None:
    register(
        "nixl",
        create,
        config=NixlConfig,
        description="Sharded NIXL reads: each trainer rank serves its own shards, each engine rank reads its bytes",
        check=check,
    )
