"""`benchmarks/quant.py` runs at tiny sizes and prints the JSON lines it promises."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

import torch.distributed as dist
from multiprocess import run_ranks

ROOT = str(Path(__file__).resolve().parents[2])


def _bench_module():  # noqa: ANN202
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from benchmarks import quant

    return quant


def test_lookup_benchmark_reports_size_and_speed(capsys) -> None:
    _bench_module().bench_lookups(num_tables=2, rows=64, dim=8, batch=4, pooling=2, repeats=1)
    records = {r["name"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(records) == {
        "float_ebc",
        "quant_fp32",
        "quant_fp16",
        "quant_int8",
        "quant_int4",
        "quant_int2",
    }
    assert [records[f"quant_{n}"]["bytes_per_row"] for n in ("fp16", "int8", "int4", "int2")] == [
        16,
        12,
        8,
        6,
    ]  # values plus 4 bytes of scale/bias for the integer types
    assert all(r["ids_per_s"] > 0 for r in records.values())


def _collectives(rank: int, ws: int) -> List[str]:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        _bench_module().bench_collectives([(4, 8)], repeats=1)
    dist.barrier()
    return out.getvalue().splitlines()


def test_collective_benchmark_halves_the_bytes_with_codecs() -> None:
    records = [json.loads(line) for line in run_ranks(2, _collectives, timeout=120)[0]]
    payload = {(r["bench"], r["precision"], r["direction"]): r["payload_bytes"] for r in records}
    assert len(payload) == 12
    for (bench, precision, direction), size in payload.items():
        if precision != "fp32":
            assert size * 2 == payload[(bench, "fp32", direction)]
