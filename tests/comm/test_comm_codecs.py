"""fp16 / bf16 comm codecs: results within their precision of fp32, half the bytes on the wire."""

from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.distributed as dist
from comm_helpers import assert_close, seeded
from multiprocess import run_ranks

from recshard.comm import (
    BF16CommCodec,
    CommOp,
    FP16CommCodec,
    NoOpQuantizedCommCodec,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    QCommsConfig,
    QuantizedCommCodecs,
    alltoall_sequence,
    codecs_from_registry,
    comm_payload_bytes,
    get_qcomm_codecs_registry,
    reset_comm_payload_bytes,
)

TOLERANCE = {"fp16": dict(rtol=2e-3, atol=2e-3), "bf16": dict(rtol=2e-2, atol=2e-2)}


def _run(kind: str, codecs, rank: int, ws: int):  # noqa: ANN001, ANN202
    """Output and input gradient of one collective on this rank."""
    pg = dist.group.WORLD
    if kind == "a2a":
        dims = [3, 1, 2, 4][:ws]
        x = seeded(10 + rank, 4 * ws, dims[rank]).requires_grad_()
        out = PooledEmbeddingsAllToAll(pg, dims, codecs=codecs)(x).wait()
    elif kind == "rs":
        x = seeded(20 + rank, 3 * ws, 5).requires_grad_()
        out = PooledEmbeddingsReduceScatter(pg, codecs=codecs)(x).wait()
    else:  # sequence: rank r sends r + 2 rows to every rank; segment recat of one feature
        rows = [r + 2 for r in range(ws)]
        x = seeded(30 + rank, sum(rows), 4).requires_grad_()
        recat = torch.arange(ws, dtype=torch.int32)
        out = alltoall_sequence(
            x, recat, recat, torch.tensor(rows), [rank + 2] * ws, rows, codecs=codecs
        ).wait()
    (out * seeded(40 + rank, *out.shape)).sum().backward()
    return out.detach(), x.grad


def _codec_checks(rank: int, ws: int) -> Dict[str, Dict[str, int]]:
    payload: Dict[str, Dict[str, int]] = {}
    for precision, codec in (("fp32", None), ("fp16", FP16CommCodec()), ("bf16", BF16CommCodec())):
        codecs = None if codec is None else QuantizedCommCodecs(codec, codec)
        reset_comm_payload_bytes()
        for kind in ("a2a", "rs", "seq"):
            out, grad = _run(kind, codecs, rank, ws)
            assert out.dtype == grad.dtype == torch.float32
            if codec is not None:
                ref_out, ref_grad = _run(kind, None, rank, ws)
                assert_close(out, ref_out, f"{precision} {kind} forward", **TOLERANCE[precision])
                assert_close(grad, ref_grad, f"{precision} {kind} backward", **TOLERANCE[precision])
        payload[precision] = comm_payload_bytes()
    return payload


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_codecs_close_to_fp32_with_half_the_bytes(world_size: int) -> None:
    for payload in run_ranks(world_size, _codec_checks, timeout=90):
        ops = ["alltoall_pooled", "reduce_scatter_v_pooled", "alltoall_sequence"]
        ops += [op + "_bwd" for op in ops]
        for op in ops:
            assert payload["fp32"][op] > 0, (op, payload)
            # fp16 and bf16 runs also ran fp32 references: subtract them
            assert payload["fp16"][op] - payload["fp32"][op] == payload["fp32"][op] // 2, op
            assert payload["bf16"][op] - payload["fp32"][op] == payload["fp32"][op] // 2, op


def test_codec_roundtrip_and_sizes() -> None:
    x = torch.randn(100) * 10
    for codec, dtype, tol in (
        (FP16CommCodec(), torch.float16, 1e-3),
        (BF16CommCodec(), torch.bfloat16, 1e-2),
    ):
        wire = codec.encode(x)
        assert wire.dtype == codec.quantized_dtype == dtype
        assert codec.calc_quantized_size(100) == 100 and codec.create_context() is None
        assert wire.numel() * wire.element_size() * 2 == x.numel() * x.element_size()
        torch.testing.assert_close(codec.decode(wire), x, rtol=tol, atol=tol)
    scaled = FP16CommCodec(loss_scale=1024.0)
    tiny = torch.full((4,), 1e-8)
    assert FP16CommCodec().decode(FP16CommCodec().encode(tiny)).abs().max() == 0  # underflows
    torch.testing.assert_close(scaled.decode(scaled.encode(tiny)), tiny, rtol=1e-2, atol=0.0)
    noop = NoOpQuantizedCommCodec()
    assert noop.encode(x) is x and noop.decode(x) is x


def test_registry_from_precision_name() -> None:
    registry = get_qcomm_codecs_registry("fp16")
    assert set(registry) == {op.name for op in CommOp}
    codecs = codecs_from_registry(registry, CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
    assert isinstance(codecs.forward, FP16CommCodec) and isinstance(codecs.backward, FP16CommCodec)
    assert get_qcomm_codecs_registry("fp32") is None and get_qcomm_codecs_registry(None) is None
    mixed = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision="bf16", backward_precision="fp32"),
        comm_ops=[CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER],
    )
    assert list(mixed) == ["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    rs = mixed["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    assert isinstance(rs.forward, BF16CommCodec) and isinstance(rs.backward, NoOpQuantizedCommCodec)
    assert codecs_from_registry(mixed, CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL) is None
    with pytest.raises(ValueError, match="unknown comm precision 'fp8'"):
        get_qcomm_codecs_registry("fp8")


def _fused_vs_separate(rank: int, ws: int) -> Dict[str, bool]:
    """The pooled all-to-all casts inside its layout copies for a cast-only codec; a loss scale
    of 1.0 (exact) takes the path with encode / decode passes of their own: bit-identical."""
    same = {}
    for name, codec_type in (("fp16", FP16CommCodec), ("bf16", BF16CommCodec)):
        fused = _run("a2a", QuantizedCommCodecs(codec_type(), codec_type()), rank, ws)
        scaled = codec_type(loss_scale=1.0)
        separate = _run("a2a", QuantizedCommCodecs(scaled, scaled), rank, ws)
        same[name] = all(torch.equal(a, b) for a, b in zip(fused, separate))
    return same


def test_fused_cast_equals_separate_encode_decode() -> None:
    assert FP16CommCodec().cast_to(torch.float32) == torch.float16
    assert FP16CommCodec(loss_scale=1.0).cast_to(torch.float32) is None
    assert NoOpQuantizedCommCodec().cast_to(torch.float64) == torch.float64
    for result in run_ranks(3, _fused_vs_separate, timeout=90):
        assert result == {"fp16": True, "bf16": True}
