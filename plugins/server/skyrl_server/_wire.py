"""The protobuf bodies, through the messages the SDK itself ships (``tinker.proto.tinker_public_pb2``):
ForwardBackwardRequest in, ForwardBackwardOutput and SampleResponse out."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from skyrl_server._errors import BadRequest


PROTOBUF = "application/x-protobuf"


def _pb() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body as sent before ``Content-Encoding`` (zstd or none), at most ``limit`` bytes
    (413 past it: a small zstd frame can claim gigabytes)."""
    if len(body) > limit:
        raise BadRequest(f"the body has {len(body)} bytes, more than the {limit} this server takes", status=413)
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise BadRequest(f"Content-Encoding {encoding!r} is not accepted (zstd or none)", status=415)
    import zstandard

    try:
        params = zstandard.get_frame_parameters(body)
    except zstandard.ZstdError as exc:
        raise BadRequest(f"the zstd body does not decompress: {exc}") from None
    if params.content_size > limit:  # 0 or -1 when the frame does not say: the streaming bound below holds
        raise BadRequest(f"the zstd body inflates to {params.content_size} bytes, more than the {limit} this server "
                         "takes", status=413)
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        while chunk := reader.read(1 << 20):
            out += chunk
            if len(out) > limit:
                raise BadRequest(f"the zstd body inflates past the {limit} bytes this server takes", status=413)
    except zstandard.ZstdError as exc:
        raise BadRequest(f"the zstd body does not decompress: {exc}") from None
    return bytes(out)


def _array(msg: Any, what: str) -> np.ndarray:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise BadRequest(f"{what}: tensor dtype {msg.dtype} is not accepted (float32, int64 or int32)")
    if msg.HasField("sparse_csr"):
        raise BadRequest(f"{what}: sparse tensors are not served yet; send it dense")
    dtype = np.dtype(dtypes[msg.dtype])
    if len(msg.dense) % dtype.itemsize:
        raise BadRequest(f"{what}: {len(msg.dense)} bytes is not a whole number of {dtype.name} values")
    arr = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape)
    if shape and int(np.prod(shape)) != arr.size:
        raise BadRequest(f"{what}: shape {shape} does not hold {arr.size} values")
    if dtype.kind == "f" and not np.isfinite(arr).all():
        raise BadRequest(f"{what}: holds a NaN or an infinity")
    return arr


def forward_backward_request(body: bytes) -> dict[str, Any]:
    """The request's fields; each datum as ``{"tokens": int64 [N], "inputs": {name: array}}``."""
    from google.protobuf.message import DecodeError

    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise BadRequest(f"the body is not a ForwardBackwardRequest protobuf ({exc})") from None
    data = []
    for i, datum in enumerate(msg.data):
        parts = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise BadRequest(f"datum {i}: only encoded_text chunks are served (found {kind or 'an empty chunk'})")
            tokens = chunk.encoded_text.tokens
            if len(tokens) % 4:
                raise BadRequest(f"datum {i}: encoded_text tokens are not whole int32 values")
            parts.append(np.frombuffer(tokens, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        inputs = {name: _array(t, f"datum {i}: loss_fn_inputs[{name!r}]") for name, t in datum.loss_fn_inputs.items()}
        n_targets = inputs["target_tokens"].size if "target_tokens" in inputs else len(tokens)
        data.append({"tokens": tokens, "inputs": inputs, "spans": _spans(datum.model_input_spans, len(tokens), i),
                     "loss_spans": _spans(datum.loss_fn_input_spans, n_targets, i, "loss_fn_input_spans")})
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = float(v.number)
    if not msg.model_id:
        raise BadRequest("model_id: missing")
    return {"model_id": msg.model_id, "seq_id": int(msg.seq_id), "loss_fn": msg.loss_fn, "config": config,
            "forward_only": bool(msg.forward_only), "data": data}


def _spans(spans: Any, n_tokens: int, datum: int, field: str = "model_input_spans") -> list[tuple[str, str, int, int]] | None:
    """A datum's provenance spans (``model_input_spans`` or ``loss_fn_input_spans``) as
    ``(kind, sequence_id, offset, length)`` runs tiling its input (target) tokens
    ("prompt" or "sampled"), or None when it has none."""
    if not len(spans):
        return None
    out = []
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise BadRequest(f"datum {datum}: {field}[{j}] is empty")
        arm = getattr(span, kind)
        if not arm.sequence_id or arm.offset < 0 or arm.length < 0:
            raise BadRequest(f"datum {datum}: {field}[{j}] needs a sequence_id, offset >= 0 and length >= 0")
        out.append(("prompt" if kind == "prompt_tokens" else "sampled", arm.sequence_id, int(arm.offset), int(arm.length)))
    total = sum(r[3] for r in out)
    if total != n_tokens:
        raise BadRequest(f"datum {datum}: {field} cover {total} positions, the field has {n_tokens}")
    return out


def _batched(arrays: Sequence[np.ndarray]) -> Any:
    pb = _pb()
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    data = b"".join(a.tobytes() for a in arrays)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def forward_backward_output(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=dict(metrics))
    if outputs:
        record = msg.loss_fn_outputs.add()
        record.type_tag = "ArrayRecord"
        record.num_datums = len(outputs)
        for name in outputs[0]:
            record.fields[name].CopyFrom(_batched([o[name] for o in outputs]))
    return msg.SerializeToString()


def sample_response(result: Mapping[str, Any]) -> bytes:
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for seq in result["sequences"]:
        s = msg.sequences.add()
        s.stop_reason = reasons[seq["stop_reason"]]
        s.tokens = np.ascontiguousarray(seq["tokens"], dtype=np.int32).tobytes()
        s.logprobs = np.ascontiguousarray(seq["logprobs"], dtype=np.float32).tobytes()
        if seq.get("topk") is not None:
            s.topk_sampled_logprobs.CopyFrom(_topk(seq["topk"]))
    if result.get("prompt_logprobs") is not None:
        msg.prompt_logprobs = np.ascontiguousarray(result["prompt_logprobs"], dtype=np.float32).tobytes()
    if result.get("prompt_topk") is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(result["prompt_topk"]))
    return msg.SerializeToString()


def _topk(pair: tuple[np.ndarray, np.ndarray]) -> Any:
    """A TopkLogprobs message from (token ids [n, k], logprobs [n, k])."""
    ids, lps = pair
    n, k = ids.shape
    return _pb().TopkLogprobs(length=n, k=k, token_ids=np.ascontiguousarray(ids, dtype=np.int32).tobytes(),
                              logprobs=np.ascontiguousarray(lps, dtype=np.float32).tobytes())
