"""The ``nixl`` transport's halves (import torch and NIXL).

**Sender** (one per trainer rank). At the first ``publish`` it works out what this rank
serves: a plain tensor is served whole; a ``DTensor`` serves the box its local shard
covers in the global tensor (``compute_local_shape_and_global_offset``: ``Shard(d)`` on
any mesh dimension, uneven shards included), and a value replicated over a mesh
dimension only from the rank at coordinate 0 there, so no byte is served twice; two
names for one tensor (tied weights) are served once. It allocates one flat buffer per
device for those pieces, in the wire dtype, and registers it with its NIXL agent
(``DRAM`` for CPU memory, ``VRAM`` for CUDA memory: the tensor's device decides), plus a
16-byte header ``[sequence, version]`` in DRAM. Every publish is a seqlock: the sequence
turns odd, the pieces are copied into the same buffers, the version is written, the
sequence turns even. Nothing is gathered, no collective is called.

``endpoint()`` (after the first publish) is what a receiver needs, as picklable bytes:
the agent's name and NIXL metadata (connection info and the registered regions), the
header's and the buffers' addresses, and the layout: every tensor's name, wire dtype
and global shape, and each piece's box (global offset, local shape) and place in the
buffer.

**Receiver** (one per engine rank; ``shard=(k, n)``: the k-th of n row slices of every
tensor of 2 or more dimensions, the way ``torch.tensor_split`` cuts dim 0; 1-D and 0-D
tensors whole). ``connect(endpoints)`` intersects the boxes it needs with the boxes the
trainer ranks serve, turns each intersection into contiguous byte runs (one per piece
when slices are along rows, one per row otherwise; adjacent runs merged) and prepares,
once per connect, one NIXL READ request per (peer, buffer) holding all of its runs,
into one registered staging buffer on ``device``. ``sync(engine, target)`` reads every
peer's header, checks the target version (sequence even), posts all the data reads at
once, waits, reads the headers again and checks that they did not move, and only then
calls ``engine.update_weights`` with views of the staging buffer (so nothing the engine
holds changes on a failure). Errors are :class:`~.agent.NixlError` and name the version and
the peer (agent name and trainer rank) or the tensor.

Modules (this package imports none of them itself):

- :mod:`.agent`: NIXL itself: loading it, agents, the :class:`~.agent.Poller` that
  drives a serving agent's progress, :class:`~.agent.NixlError` (no torch, NIXL on use);
- :mod:`.shards`: the geometry: which box of a global tensor a (``DTensor``) shard
  covers, a receiver's row slice, boxes as contiguous byte runs and their merges;
- :mod:`.sender`: :class:`~.sender.NixlSender`, one trainer rank's half, and the
  endpoint it publishes;
- :mod:`.receiver`: :class:`~.receiver.NixlReceiver`, one engine rank's half.
"""
