"""workers.runtime.blob: checkpoints and embeddings round-trip bit for bit, old torch.save bytes still load,
and bytes that are not a whole blob fail with a message."""

from __future__ import annotations

import io
import math

import pytest
import torch

from workers.runtime import blob
from workers.runtime.common import host_copy


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(a), as_bytes(b)) if a.numel() else True


def a_checkpoint() -> dict:
    generator = torch.Generator("cpu").manual_seed(7)
    latents = torch.randn(1, 16, 3, 8, 8, generator=generator)
    return {
        "format": "wan/1",
        "step": 3,
        "steps": 8,
        "sigma": 0.25,
        "no_value": None,
        "flag": True,
        "latents": latents,
        "bf16": torch.randn(2, 77, 32, generator=generator).to(torch.bfloat16),
        "half": torch.randn(5, generator=generator).half(),
        "scalar": torch.tensor(999),
        "mask": torch.tensor([True, False, True]),
        "generator_state": generator.get_state(),
        "strided": latents[0, :, 1].transpose(0, 1),  # not contiguous
        "empty": torch.zeros(0, 4),
        "history": {"model_outputs": [latents * 2, None], "timestep_list": [torch.tensor(5), torch.tensor(3)]},
        "pair": (1, torch.ones(2)),
        "not_finite": [math.inf, -math.inf],
    }


def test_a_checkpoint_round_trips_bit_for_bit():
    original = a_checkpoint()
    back = blob.loads(blob.dumps(original))
    assert back.keys() == original.keys()
    for name, value in original.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(back[name], value), name
    assert back["format"] == "wan/1" and back["step"] == 3 and back["sigma"] == 0.25
    assert back["no_value"] is None and back["flag"] is True
    assert same_bits(back["history"]["model_outputs"][0], original["history"]["model_outputs"][0])
    assert back["history"]["model_outputs"][1] is None
    assert [int(t) for t in back["history"]["timestep_list"]] == [5, 3]
    assert isinstance(back["pair"], tuple) and back["pair"][0] == 1 and same_bits(back["pair"][1], torch.ones(2))
    assert back["not_finite"] == [math.inf, -math.inf]


def test_loaded_tensors_are_writable_and_independent():
    # A restored state is stepped in place: each tensor must own writable memory, not the blob's bytes.
    data = bytes(blob.dumps({"a": torch.zeros(4), "b": torch.zeros(4)}))
    back = blob.loads(data)
    back["a"] += 1
    assert back["b"].sum() == 0 and blob.loads(data)["a"].sum() == 0


def test_what_torch_save_wrote_still_loads():
    # Checkpoints and embeddings stored before this format (a job in flight across an upgrade).
    original = a_checkpoint()
    buffer = io.BytesIO()
    torch.save(original, buffer)
    back = blob.loads(buffer.getvalue())
    assert same_bits(back["latents"], original["latents"]) and back["step"] == 3


@pytest.mark.parametrize("lost", [b"", bytes(4096), b"GSBL"], ids=["empty", "zeros", "a-few-bytes"])
def test_what_a_lost_write_leaves_is_refused_as_not_a_blob(lost):
    """A file renamed into place whose bytes never reached the disk (a power loss before its fsync)."""
    with pytest.raises(blob.BlobError, match="not a blob"):
        blob.loads(lost)


def test_a_cut_torch_save_file_is_refused_as_a_blob_error():
    buffer = io.BytesIO()
    torch.save(a_checkpoint(), buffer)
    with pytest.raises(blob.BlobError, match="torch.save file unreadable"):
        blob.loads(buffer.getvalue()[:100])


def test_each_tensor_starts_aligned():
    data = blob.dumps({"x": torch.ones(3, dtype=torch.uint8), "y": torch.ones(5, dtype=torch.float64)})
    # header, padding, x's 3 bytes, padding, y's 40 bytes: y starts at a multiple of ALIGN
    assert len(data) % blob.ALIGN == 40 and data[-40:] == torch.ones(5, dtype=torch.float64).numpy().tobytes()


@pytest.mark.parametrize("keep", [12, 40, -1, -1000])
def test_a_truncated_blob_fails_with_a_message(keep):
    data = blob.dumps(a_checkpoint())
    with pytest.raises(blob.BlobError, match="truncated"):
        blob.loads(data[:keep])


def test_bytes_after_the_blob_are_refused():
    with pytest.raises(blob.BlobError, match="bytes after"):
        blob.loads(blob.dumps({"x": torch.ones(2)}) + b"\0")


def test_a_damaged_header_fails_with_a_message():
    data = blob.dumps({"x": torch.ones(2)})
    at = len(blob.MAGIC) + 8
    data[at : at + 1] = b"#"
    with pytest.raises(blob.BlobError, match="header unreadable"):
        blob.loads(data)


@pytest.mark.parametrize(
    "value, where",
    [({"x": object()}, ".x"), ({1: torch.ones(1)}, "not a string"), ({"__tensor__": 1}, "reserved")],
)
def test_what_it_cannot_hold_is_refused_by_name(value, where):
    with pytest.raises(TypeError, match=where.replace(".", r"\.")):
        blob.dumps(value)


def test_host_copy_is_a_copy():
    tensor = torch.arange(6.0).reshape(2, 3).t()
    copy = host_copy(tensor)
    copy += 1
    assert same_bits(tensor, torch.arange(6.0).reshape(2, 3).t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_come_back_on_the_cpu_bit_for_bit():
    on_card = torch.randn(3, 4, device="cuda", dtype=torch.bfloat16)
    pinned = host_copy(on_card)
    assert pinned.is_pinned() and same_bits(pinned, on_card.cpu())
    back = blob.loads(blob.dumps({"t": on_card}))["t"]
    assert back.device.type == "cpu" and same_bits(back, on_card.cpu())
