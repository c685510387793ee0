"""Expose an intermediate tensor of a serialized ONNX model as an extra graph output.

Why: batched synthesis needs each item's true audio length, and Piper's exported
VITS model only outputs the padded audio. The per-phoneme frame counts (``w_ceil``,
the model's only ``Ceil`` node) give it: samples = sum(w_ceil) * hop_length. Piper's
own tool for this (piper.patch_voice_with_alignment) needs the ``onnx`` package; this
module edits the protobuf wire format directly so only onnxruntime is needed.

The edit relies on a documented protobuf rule: when a non-repeated message field
(ModelProto.graph) occurs twice, parsers merge the second into the first, and
repeated fields (GraphProto.output) concatenate. So appending
``graph { output { name: "..." } }`` to the file adds one output and changes nothing
else.
"""

from __future__ import annotations

from collections.abc import Iterator

# Field numbers from onnx.proto.
_MODEL_GRAPH = 7
_GRAPH_NODE = 1
_GRAPH_OUTPUT = 12
_NODE_OUTPUT = 2
_NODE_OP_TYPE = 4
_VALUE_INFO_NAME = 1

# Protobuf wire types.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def op_outputs(model: bytes, op_type: str) -> list[str]:
    """Names of the output tensors of every top-level node with this op_type."""
    names: list[str] = []
    for graph in _fields(memoryview(model), _MODEL_GRAPH):
        for node in _fields(graph, _GRAPH_NODE):
            ops = [bytes(v).decode() for v in _fields(node, _NODE_OP_TYPE)]
            if ops == [op_type]:
                names.extend(bytes(v).decode() for v in _fields(node, _NODE_OUTPUT))
    return names


def graph_outputs(model: bytes) -> list[str]:
    """Names of the model's graph outputs, in order."""
    names: list[str] = []
    for graph in _fields(memoryview(model), _MODEL_GRAPH):
        for info in _fields(graph, _GRAPH_OUTPUT):
            names.extend(bytes(v).decode() for v in _fields(info, _VALUE_INFO_NAME))
    return names


def with_extra_output(model: bytes, tensor_name: str) -> bytes:
    """The model with ``tensor_name`` appended to its graph outputs."""
    value_info = _len_field(_VALUE_INFO_NAME, tensor_name.encode())
    graph = _len_field(_GRAPH_OUTPUT, value_info)
    return model + _len_field(_MODEL_GRAPH, graph)


def _fields(buf: memoryview, wanted: int) -> Iterator[memoryview]:
    """Payloads of the length-delimited fields numbered ``wanted`` in one message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _LEN:
            size, pos = _varint(buf, pos)
            if number == wanted:
                yield buf[pos : pos + size]
            pos += size
        else:
            pos = _skip_scalar(buf, pos, wire_type)


def _skip_scalar(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _varint(buf, pos)[1]
    if wire_type == _I64:
        return pos + 8
    if wire_type == _I32:
        return pos + 4
    # Groups (3, 4) are never used by onnx.proto: anything else means corrupt input.
    raise ValueError(f"unexpected protobuf wire type {wire_type} at byte {pos}")


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | _LEN) + _encode_varint(len(payload)) + payload
