"""``transport = "delta"``: compressed XOR deltas of the published weights on any fsspec URL.

The trainer keeps the bytes it last published (in the wire dtype, bfloat16 by
default). Each new version stores, per tensor that changed, the XOR of its new bytes
with those (sparse positions + values when few 16-bit words changed, else the dense
XOR), zstd-compressed and checksummed (xxHash3), as payload files, then a manifest,
then the ``LATEST`` pointer, all under ``uri`` (``file://``, ``memory://``, ``s3://``,
``gs://``: whatever fsspec opens). Unchanged tensors cost nothing. Every
``keyframe_every`` versions (and whenever the publisher has no previous bytes, e.g.
after a restart) a full version is written, so a receiver joining late, or one many
versions behind, catches up from the nearest keyframe.

Receivers fetch while the engine is still generating (``prefetch``), then at a safe
point verify every checksum, apply byte-exactly and hand the engine the complete new
weights; a missing, torn or corrupted version leaves the engine on its last complete
version and the error names the version and the file. See docs/weightsync.md.

``[weight_sync] transport = "delta"``, ``uri = "s3://bucket/run-1"``.
This module is light: the factory imports :mod:`skyrl_weightsync._delta`; the halves
(``DeltaSender``, ``DeltaReceiver``, ``DeltaError``) are imported from here on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs

from skyrl_host import hookimpl
from skyrl_host.options import ge, gt, in_interval, option
from skyrl_weightsync import lazy_exports, wire_dtype_problem


# The transport's halves, for programs that drive them themselves (benchmarks, other
# distributions' tests): imported on first use (PEP 562), so that discovering this plugin
# imports none of numpy, zstandard, xxhash, fsspec. ``version_dir``: where a version's files are.
__getattr__ = lazy_exports(__name__, {
    "DeltaSender": "skyrl_weightsync._delta.sender",
    "DeltaReceiver": "skyrl_weightsync._delta.receiver",
    "DeltaError": "skyrl_weightsync._delta.store",
    "version_dir": "skyrl_weightsync._delta.store",
})

if TYPE_CHECKING:
    from skyrl_weightsync._delta.receiver import DeltaReceiver
    from skyrl_weightsync._delta.sender import DeltaSender
    from skyrl_weightsync._delta.store import DeltaError, version_dir


def _check_uri(_inst: Any, _attr: Any, value: str) -> None:
    import fsspec
    from fsspec.core import split_protocol

    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a URL or path, e.g. 'file:///tmp/run/weights' or 's3://bucket/run-1'")
    protocol = split_protocol(value)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(f"unknown protocol {protocol!r} in {value!r} (fsspec knows: file, memory, s3, gs, ...)") from None
    except ImportError as exc:
        raise ValueError(f"protocol {protocol!r} needs a package that is not installed: {exc}") from None
    bucket = value.split("://", 1)[1].split("/", 1)[0] if "://" in value else "?"
    if protocol in ("s3", "s3a", "gs", "gcs") and not bucket:
        raise ValueError(f"no bucket in {value!r}: expected {protocol}://bucket/prefix, "
                         f"e.g. '{protocol}://my-bucket/run-1'")


_check_uri.__doc__ = "a URL fsspec can open"


@attrs.frozen
class DeltaConfig:
    """Options of ``[weight_sync]`` when ``transport = "delta"``."""

    uri: str = option(help="where versions are written and read: any fsspec URL (file://, memory://, s3://, gs://)",
                      validator=_check_uri)
    storage_options: dict[str, Any] = option(
        factory=dict, help="options for the fsspec filesystem, e.g. {client_kwargs = {endpoint_url = \"...\"}}"
    )
    dtype: Literal["bfloat16", "float32"] = option("bfloat16", help="dtype of the weights on the wire (and in the engine)")
    keyframe_every: int = option(20, help="write a full version every N versions (0: only when needed)", validator=ge(0))
    max_bytes: int = option(
        1 << 40, help="the most tensor bytes a version read from the store may claim (a manifest claiming more is "
        "refused before anything is read or allocated)", validator=gt(0))
    level: int = option(1, help="zstd compression level", validator=in_interval(-7, 22))
    threads: int = option(2, help="zstd compression threads", validator=ge(0))
    background: Literal["auto", "on", "off"] = option(
        "auto", help="async RL's staged hand-over: encode and write each version in a thread of the sender's own "
        "while the trainer trains on (a second host copy of the weights meanwhile); auto: when the trainer computes "
        "on an accelerator (on CPU the thread would take the trainer's own cores)")


def check(spec: Any) -> list[tuple[str, str]]:
    """Job-level check: an engine that serves the trainer's own tensors (same dtype) must
    not be handed weights of another dtype: that would overwrite the trainer's."""
    transport = spec.plugins.get("weight_sync")
    if transport is not None and spec.cluster.launcher != "local" and transport.config.uri.startswith("memory://"):
        return [("weight_sync.uri", "a memory:// URL lives in one process, but the engine runs in another "
                 f"([cluster] launcher = {spec.cluster.launcher!r}): use a file://, s3:// or gs:// URL")]
    return wire_dtype_problem(spec, "delta")


def create(config: DeltaConfig) -> Any:
    from skyrl_weightsync._delta.transport import Delta

    return Delta(config)


@hookimpl
def skyrl_register_weight_transports(register: Any) -> None:
    register(
        "delta",
        create,
        config=DeltaConfig,
        description="Compressed, checksummed XOR deltas of the weights on any fsspec URL (file, memory, s3, gs)",
        check=check,
    )
