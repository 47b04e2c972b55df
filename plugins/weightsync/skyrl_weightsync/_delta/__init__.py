"""The ``delta`` transport's implementation: XOR deltas of the published bytes,
compressed and checksummed, on any fsspec URL (imports numpy, zstandard, xxhash,
fsspec; torch only to convert tensors).

Modules (this package imports none of them itself):

- :mod:`.codec`: the bytes of a version: tensors to wire bytes and back, the XOR of
  two versions as a sparse or dense payload, zstd, checksums (numpy, zstandard, xxhash);
- :mod:`.store`: the layout under the URL (manifests, ``LATEST``, epochs), whole-object
  writes and reads through fsspec, :class:`~.store.DeltaError`;
- :mod:`.sender`: :class:`~.sender.DeltaSender`, the trainer's half;
- :mod:`.receiver`: :class:`~.receiver.DeltaReceiver`, the engine's half;
- :mod:`.transport`: :class:`~.transport.Delta`, the transport the plugin creates.

Layout under the URL::

    LATEST                          the newest complete version: {"epoch": 1, "version": 12}, written last
    e001/v00000012/manifest.json    version 12: base version, and per tensor name, dtype,
                                    shape, sizes, payload file, checksums
    e001/v00000012/pack0000.zst     the small payloads (under 1 MiB), end to end, ~8 MiB a pack
    e001/v00000012/t00003.zst       a larger payload, an object of its own (unchanged: no payload)

An **epoch** is one publisher process: a publisher that starts (a new run, or a resumed
one that publishes a version again) opens the next epoch with a keyframe, so version
numbers only need to grow within an epoch and a resumed run never overwrites what
receivers may be reading. Receivers follow ``LATEST`` into a new epoch from its keyframe.

A version is either a **keyframe** (``base`` null: every tensor's bytes, compressed) or
a **delta** on ``base = version - 1``: per changed tensor, the XOR of its new bytes
with the previously published ones. Sparse changes are stored as (gaps between
changed 16-bit words, XOR values); dense ones as the XOR bytes; both zstd-compressed.

Writers write the payloads, then the manifest, then ``LATEST`` (each a single small
object: atomic on object stores; a rename on local disk). A reader that sees ``LATEST =
v`` therefore finds every manifest and payload of ``v`` complete. A publisher killed
before ``LATEST`` leaves the previous version current; a publisher that restarts
without its previous bytes in memory starts with a keyframe.

A receiver applies a version only after every payload's checksum matched, and checks
each tensor's resulting bytes against the manifest; on any mismatch it undoes what it
applied (XOR is its own inverse) and raises, naming the version and the file: the
engine keeps its last complete version.

Speed (benchmarks/weight_sync.py): the sender reads each tensor's memory in place and
compares it with its copy of the last version a cache-sized chunk at a time, writing
back only the changed words (a failed publish XORs its payloads back out); payloads
are written by threads while the next tensors are encoded, and read by threads; small
payloads share pack objects (one write and one read for many tensors).
Big buffers are reused across versions: fresh ones cost page faults.

The modules import each other relatively, so a copy of this package from another
commit imports as a package of its own (``benchmarks/weight_sync.py --compare-rev``).
"""
