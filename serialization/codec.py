"""msgpack encoding of Loom's messages, numpy arrays included.

Arrays are written in msgpack-numpy's map format ({b"nd": True, b"type", b"kind", b"shape",
b"data"}), so any msgpack + msgpack_numpy peer can read our messages; msgspec does the rest of the
encoding, which is several times faster than msgpack-python on our structs. Nothing is pickled:
only arrays of numbers and bools are written or read, and every malformed array is a
ValueError (reported by the decoder as a msgspec.ValidationError).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import msgspec
import numpy as np

# Arrays on the wire hold numbers or bools; anything else (objects, strings, records, dates)
# is no message of ours, and an object array would let a peer hand us arbitrary Python values.
_ARRAY_KINDS = "biufc"
_MAX_DIMS = 32  # numpy 1.x's limit; no message of ours has more than 3


def _encode_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _ARRAY_KINDS:
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


def _checked_dtype(spec: Any) -> np.dtype:
    if not isinstance(spec, (str, bytes)):
        raise ValueError(f"numpy array type must be a string, not {type(spec).__name__}")
    try:
        dtype = np.dtype(spec)
    except (TypeError, ValueError, SyntaxError) as exc:  # (np.dtype raises all three)
        raise ValueError(f"bad numpy array type {spec!r:.40}: {exc}") from None
    if dtype.kind not in _ARRAY_KINDS:
        raise ValueError(f"refusing to decode a numpy array of dtype {dtype}")
    return dtype


def _checked_shape(dims: Any) -> tuple[int, ...]:
    # (bool is an int: refused, as are negative dims, which numpy would read as "infer")
    if not isinstance(dims, (list, tuple)) or len(dims) > _MAX_DIMS or not all(
            type(d) is int and d >= 0 for d in dims):
        raise ValueError("numpy array shape must be a list of at most "
                         f"{_MAX_DIMS} non-negative ints")
    return tuple(dims)


def _map_field(obj: dict, key: bytes) -> Any:
    """msgpack-numpy's keys are bytes; a peer may write them as strings."""
    if key in obj:
        return obj[key]
    name = key.decode()
    if name in obj:
        return obj[name]
    raise ValueError(f"numpy array map without {name!r}")


# The dtypes of the arrays seen, by their wire spelling: a step's five arrays each parsed
# their type string anew (a step message is decoded every decode step).
_dtype_of = functools.lru_cache(maxsize=64)(_checked_dtype)


def _array_from_map(obj: dict, copy: bool) -> np.ndarray:
    """A msgpack-numpy map as an array. Every way a map can be malformed is a ValueError (the
    decoder reports it as a ValidationError), so `decode_or_drop` sees one kind of failure."""
    spec = _map_field(obj, b"type")
    if not isinstance(spec, (str, bytes)):  # (unhashable ones too: checked before the cache)
        _checked_dtype(spec)
    dtype = _dtype_of(spec)
    shape = _checked_shape(_map_field(obj, b"shape"))
    data = _map_field(obj, b"data")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError("numpy array data must be binary")
    # The product in Python ints (no int64 wrap-around): data and shape must agree exactly, so
    # the frame's own size bounds the array.
    if memoryview(data).nbytes != math.prod(shape) * dtype.itemsize:
        raise ValueError("numpy array data does not match its shape")
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)
    if not dtype.isnative:  # a peer of the other byte order: torch.from_numpy refuses those
        return arr.astype(dtype.newbyteorder("="))
    return arr.copy() if copy else arr


def _array_from_list(obj: list) -> np.ndarray:
    """A plain (nested) list of numbers; mixed or non-numeric values would make an object or
    string array, and are refused."""
    try:
        arr = np.asarray(obj)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged, or ints beyond 64 bits
        raise ValueError(f"a list that is no numeric array: {exc}") from None
    if arr.dtype.kind not in _ARRAY_KINDS or arr.ndim > _MAX_DIMS:
        raise ValueError(f"a list of {arr.dtype} values, {arr.ndim} deep, is no numeric array")
    return arr


def _make_decode_hook(copy: bool) -> Callable[[type, Any], Any]:
    def hook(type_: type, obj: Any) -> Any:
        if type_ is np.ndarray:
            if isinstance(obj, np.ndarray):
                return obj
            if isinstance(obj, dict):
                return _array_from_map(obj, copy)
            if isinstance(obj, list):  # a plain list of numbers is accepted too
                return _array_from_list(obj)
            raise ValueError(f"cannot decode {type(obj).__name__} as a numpy array")
        raise NotImplementedError(f"cannot decode {type(obj).__name__} as {type_}")

    return hook


def msgpack_numpy_encoder() -> Callable[[Any], bytes]:
    """An encoder function that turns messages (numpy arrays included) into bytes."""
    return msgspec.msgpack.Encoder(enc_hook=_encode_hook).encode


def msgpack_numpy_decoder(type_: Any, copy: bool = True) -> Callable[[bytes], Any]:
    """A decoder function for `type_`; with copy=False arrays are read-only views of the frame."""
    return msgspec.msgpack.Decoder(type_, dec_hook=_make_decode_hook(copy)).decode
