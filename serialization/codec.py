"""msgpack encoding of Loom's messages, numpy arrays included.

Arrays are written in msgpack-numpy's map format ({b"nd": True, b"type", b"kind", b"shape",
b"data"}), so any msgpack + msgpack_numpy peer can read our messages; msgspec does the rest of the
encoding, which is several times faster than msgpack-python on our structs. Nothing is pickled:
object arrays are refused.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec
import numpy as np


def _encode_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "OV":
            raise TypeError(f"refusing to encode a numpy array of dtype {obj.dtype}")
        arr = np.ascontiguousarray(obj)
        return {
            b"nd": True,
            b"type": arr.dtype.str,
            b"kind": b"",
            b"shape": list(arr.shape),
            b"data": arr.data,
        }
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


def _array_from_map(obj: dict, copy: bool) -> np.ndarray:
    def get(key: str) -> Any:
        return obj[key.encode()] if key.encode() in obj else obj[key]

    dtype = np.dtype(get("type"))
    if dtype.kind in "OV":
        raise ValueError(f"refusing to decode a numpy array of dtype {dtype}")
    shape = tuple(int(d) for d in get("shape"))
    data = get("data")
    arr = np.frombuffer(data, dtype=dtype)
    if arr.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError("numpy array data does not match its shape")
    arr = arr.reshape(shape)
    return arr.copy() if copy else arr


def _make_decode_hook(copy: bool) -> Callable[[type, Any], Any]:
    def hook(type_: type, obj: Any) -> Any:
        if type_ is np.ndarray:
            if isinstance(obj, np.ndarray):
                return obj
            if isinstance(obj, dict):
                return _array_from_map(obj, copy)
            if isinstance(obj, list):  # a plain list of numbers is accepted too
                return np.asarray(obj)
        raise NotImplementedError(f"cannot decode {type(obj).__name__} as {type_}")

    return hook


def msgpack_numpy_encoder() -> Callable[[Any], bytes]:
    """An encoder function that turns messages (numpy arrays included) into bytes."""
    return msgspec.msgpack.Encoder(enc_hook=_encode_hook).encode


def msgpack_numpy_decoder(type_: Any, copy: bool = True) -> Callable[[bytes], Any]:
    """A decoder function for `type_`; with copy=False arrays are read-only views of the frame."""
    return msgspec.msgpack.Decoder(type_, dec_hook=_make_decode_hook(copy)).decode
