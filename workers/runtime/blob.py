"""Checkpoints and embeddings as bytes: a JSON header, then each tensor's raw bytes, no pickle and no CRC.

`torch.save` into a buffer wrote a 42 MB Wan checkpoint (832×480×81) in 54 ms on an H200's host
(`bench.checkpoint_cost`): its zip writer computes a CRC32 of every record and grows a BytesIO by
copies. This format hands the storage the header and each tensor's own memory (`dump_parts`):

    b"GSBLOB1\\n" · header length (8 bytes, little-endian) · header (UTF-8 JSON) · padding · tensor bytes

The header holds the object with each tensor replaced by {"__tensor__": i} and, per tensor, its dtype,
shape and offset (64-byte aligned). Values: dicts with string keys, lists, tuples, str, int, float,
bool, None and tensors of any dtype. `loads` also reads what `torch.save` wrote (checkpoints and
embeddings stored before this format), tensors and plain values only (`weights_only`).
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import torch

MAGIC = b"GSBLOB1\n"
ALIGN = 64  # each tensor's bytes start at a multiple of this (aligned loads; any dtype's itemsize divides it)
_LENGTH_BYTES = 8
_TORCH_ZIP = b"PK\x03\x04"  # how a file of torch.save (a zip archive, since torch 1.6) begins


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {_dtype_name(dtype): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)}  # fmt: skip


class BlobError(ValueError):
    """Bytes that are not a whole blob: truncated, or a header that does not describe them."""


def dump_parts(obj: Any) -> list[bytes | memoryview]:
    """The object as blob bytes in parts: the header, then each tensor's own memory (no copy of a CPU
    tensor's bytes; a card's tensor is copied to page-locked memory first). A storage writes the parts
    one after another (`Storage.put` takes the list): 42 MB never pass through an intermediate buffer."""
    tensors: list[torch.Tensor] = []
    described = _describe(obj, tensors, "")
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(_aligned(end))
        end = offsets[-1] + tensor.numel() * tensor.element_size()
    manifest = [
        {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": offset} for t, offset in zip(tensors, offsets)
    ]
    body = {"object": described, "tensors": manifest, "bytes": end}  # "bytes": a cut or padded blob is refused
    header = json.dumps(body, separators=(",", ":")).encode()
    head = MAGIC + len(header).to_bytes(_LENGTH_BYTES, "little") + header
    parts: list[bytes | memoryview] = [head + bytes(_aligned(len(head)) - len(head))]
    written = 0
    for tensor, offset in zip(tensors, offsets):
        if offset > written:
            parts.append(bytes(offset - written))
        raw = _as_bytes(tensor)
        if raw.numel():
            parts.append(memoryview(raw.numpy()))
        written = offset + raw.numel()
    return parts


def dumps(obj: Any) -> bytearray:
    """The object as blob bytes, in one buffer."""
    return bytearray().join(dump_parts(obj))


def loads(data: bytes | bytearray | memoryview) -> Any:
    """The object `dumps` (or `torch.save`) wrote; tensors on the CPU, each in memory of its own."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        if bytes(view[: len(_TORCH_ZIP)]) != _TORCH_ZIP:  # empty, or zeros where a lost write was to be
            raise BlobError(f"not a blob: {len(view)} bytes starting {bytes(view[:8])!r}")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # written before this format
        except (RuntimeError, EOFError) as exc:  # a cut zip
            raise BlobError(f"torch.save file unreadable: {exc}") from exc
    header_at = len(MAGIC) + _LENGTH_BYTES
    if len(view) < header_at:
        raise BlobError(f"blob truncated: {len(view)} bytes, not even its header's length")
    length = int.from_bytes(view[len(MAGIC) : header_at], "little")
    if len(view) < header_at + length:
        raise BlobError(f"blob truncated: its header needs {length} bytes, {len(view) - header_at} are there")
    try:
        header = json.loads(bytes(view[header_at : header_at + length]))
        start = _aligned(header_at + length)
        expected = start + int(header["bytes"])
        if len(view) < expected:
            raise BlobError(f"blob truncated: {len(view)} bytes of {expected}")
        if len(view) > expected:
            raise BlobError(f"blob has {len(view) - expected} bytes after its end: not one whole blob")
        tensors = [_tensor(view, start, entry) for entry in header["tensors"]]
        return _rebuild(header["object"], tensors)
    except BlobError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BlobError(f"blob header unreadable: {exc}") from exc


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (its own memory where it can be)."""
    if tensor.device.type != "cpu":
        from .common import host_copy  # common imports torch's heavier helpers; only a card's tensor needs it

        tensor = host_copy(tensor)
    flat = tensor.detach().contiguous().reshape(-1)
    if tensor.dtype == torch.bool:
        flat = flat.to(torch.uint8)  # same bytes (0/1); bool has no byte view on every build
    return flat.view(torch.uint8)


def _describe(value: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        if _dtype_name(value.dtype) not in _DTYPES:
            where = path or "the top"
            raise TypeError(f"blob: tensor at {where} has dtype {value.dtype}, not one of {sorted(_DTYPES)}")
        tensors.append(value)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"blob: dict at {path or 'the top'} has a key that is not a string")
        if "__tensor__" in value or "__tuple__" in value or "__float__" in value:
            raise TypeError(f"blob: dict at {path or 'the top'} uses a reserved key")
        return {key: _describe(item, tensors, f"{path}.{key}") for key, item in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [_describe(item, tensors, f"{path}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [_describe(item, tensors, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}  # nan, inf, -inf: not JSON
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"blob: {type(value).__name__} at {path or 'the top'} is not a tensor or a plain value")


def _tensor(view: memoryview, start: int, entry: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    shape = [int(n) for n in entry["shape"]]
    numel = math.prod(shape)
    itemsize = dtype.itemsize
    offset = start + int(entry["offset"])
    if offset + numel * itemsize > len(view):
        raise BlobError(f"blob truncated: a tensor ends at byte {offset + numel * itemsize}, the blob at {len(view)}")
    raw = bytearray(view[offset : offset + numel * itemsize])  # its own writable memory: the state mutates it
    if dtype == torch.bool:
        return torch.frombuffer(raw, dtype=torch.uint8, count=numel).to(torch.bool).reshape(shape)
    if not numel:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype, count=numel).reshape(shape)


def _rebuild(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__tuple__" in value:
            return tuple(_rebuild(item, tensors) for item in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        return {key: _rebuild(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebuild(item, tensors) for item in value]
    return value
