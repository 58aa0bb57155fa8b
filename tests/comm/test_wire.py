"""The KJT all-to-all's wire format: ids and lengths in the narrowest type that holds them,
one buffer per destination (its lengths, then its keys' ids).

Checked by what really crosses the wire (`comm_payload_bytes`) and by what arrives (the same
numbers, in the sender's dtype), for the bare `KJTAllToAll` and for sharded collections.
"""

from __future__ import annotations

import copy
from typing import Dict

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from recshard.comm import KJTAllToAll
from recshard.comm.request import comm_payload_bytes, reset_comm_payload_bytes
from recshard.comm.wire import id_wire_dtype, pack, segment_bytes, unpack
from recshard.distributed import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recshard.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from recshard.types import BoundsCheckMode, ShardingEnv


@pytest.mark.parametrize(
    "rows, expected",
    [
        (1, torch.uint8),
        (256, torch.uint8),
        (257, torch.uint16),
        (2**16, torch.uint16),
        (2**16 + 1, torch.int32),
        (2**31, torch.int32),
        (2**31 + 1, torch.int64),
        (2**40, torch.int64),
        (None, torch.int64),
    ],
)
def test_id_wire_dtype_is_the_narrowest_that_holds_every_id(rows, expected) -> None:  # noqa: ANN001
    assert id_wire_dtype(rows, torch.int64) == expected


def test_id_wire_dtype_never_widens() -> None:
    assert id_wire_dtype(2**40, torch.int32) == torch.int32  # int32 ids stay int32
    assert id_wire_dtype(None, torch.int32) == torch.int32
    assert id_wire_dtype(100, torch.int32) == torch.uint8


def test_a_table_of_2_pow_31_rows_or_more_keeps_int64_ids() -> None:
    """Plan-only: a meta EBC (nothing allocated) whose tables straddle the int32 limit."""
    tables = [
        EmbeddingBagConfig(
            num_embeddings=rows, embedding_dim=4, name=f"t{i}", feature_names=[f"f{i}"]
        )
        for i, rows in enumerate([2**31, 2**31 + 1, 2**33])
    ]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        ebc, {t.name: table_wise(0) for t in tables}, world_size=1
    )
    assert all(p.is_meta for p in ebc.parameters())
    wire = [id_wire_dtype(t.num_embeddings, torch.int64) for t in tables]
    assert [plan[t.name].sharding_type for t in tables] == ["table_wise"] * 3
    assert wire == [torch.int32, torch.int64, torch.int64]


def test_pack_unpack_round_trip_in_any_order() -> None:
    counts = [3, 0, 5, 1, 7]
    dtypes = [torch.uint8, torch.int64, torch.uint16, torch.int32, torch.int64]
    highs = [256, 2**40, 2**16, 2**31, 2**62]
    g = torch.Generator().manual_seed(0)
    segments = [torch.randint(0, h, (n,), generator=g) for n, h in zip(counts, highs)]
    packed = pack(torch.cat(segments), counts, dtypes, "test_pack")
    assert packed.dtype == torch.uint8
    assert packed.numel() == sum(segment_bytes(n, d) for n, d in zip(counts, dtypes))
    assert [segment_bytes(n, d) for n, d in zip(counts, dtypes)] == [8, 0, 16, 8, 56]
    order = [4, 0, 2, 1, 3]
    out = unpack(packed, counts, dtypes, torch.int64, order, "test_unpack")
    assert torch.equal(out, torch.cat([segments[i] for i in order]))
    weights = torch.rand(sum(counts), generator=g)
    back = unpack(
        pack(weights, counts, [torch.float32] * 5, "w"),
        counts,
        [torch.float32] * 5,
        torch.float32,
        None,
        "w_out",
    )
    assert torch.equal(back, weights)  # bit for bit


# rows per key: uint8, int64 (2**31 + 1 rows: id 2**31 does not fit int32), uint16, unchecked
_ROWS = [200, 2**31 + 1, 60_000, None]
_HIGH = [200, 2**31 + 1, 60_000, 2**50]


def _bare_kjt(rank: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 40, (len(_ROWS) * 3,), generator=g, dtype=torch.int32)
    if rank == 1:  # its lengths need uint16 on the wire, the other ranks' uint8
        lengths[0] = 300
    per_key = lengths.view(len(_ROWS), 3).sum(1).tolist()
    values = torch.cat(
        [
            torch.randint(high - min(high, 1000), high, (n,), generator=g)
            for n, high in zip(per_key, _HIGH)
        ]
    )
    weights = torch.rand(values.numel(), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(
        [f"k{i}" for i in range(len(_ROWS))], values, lengths, weights=weights
    )


def _bare(rank: int, ws: int) -> Dict[str, object]:
    splits = [2, 2] if ws == 2 else [1, 1, 2]
    a2a = KJTAllToAll(dist.group.WORLD, splits)
    a2a.set_id_rows(_ROWS)
    plain = KJTAllToAll(dist.group.WORLD, splits)  # no rows: ids as they are
    kjt = _bare_kjt(rank)
    reset_comm_payload_bytes()
    narrow = a2a(kjt).wait().wait()
    sent = comm_payload_bytes()
    reset_comm_payload_bytes()
    wide = plain(kjt).wait().wait()
    sent_wide = comm_payload_bytes()
    counts = kjt.length_per_key()
    # to each destination: its keys' lengths (3 per key), then each key's ids
    lengths_dtype = torch.uint16 if rank == 1 else torch.uint8
    lengths_bytes = sum(segment_bytes(3 * n, lengths_dtype) for n in splits)
    return {
        "same": all(
            torch.equal(getattr(narrow, f)(), getattr(wide, f)())
            for f in ("values", "lengths", "weights")
        ),
        "dtypes": [narrow.values().dtype, narrow.lengths().dtype, narrow.weights().dtype],
        "values_bytes": sent["kjt_all_to_all_values"],
        "expected_values_bytes": lengths_bytes
        + sum(
            segment_bytes(n, d)
            for n, d in zip(counts, [torch.uint8, torch.int64, torch.uint16, torch.int64])
        ),
        "wide_values_bytes": sent_wide["kjt_all_to_all_values"],
        "payloads": sorted(sent),
        "weights_bytes": sent["kjt_all_to_all_weights"],
        "expected_weights_bytes": sum(segment_bytes(n, torch.float32) for n in counts),
        "max_id": int(wide.values().max()) if wide.values().numel() else 0,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_bare_kjt_all_to_all_sends_narrow_ids_and_lengths(world_size: int) -> None:
    results = run_ranks(world_size, _bare, timeout=90)
    for rank, r in enumerate(results):
        assert r["same"], rank  # the same numbers arrive as without narrowing
        assert r["dtypes"] == [torch.int64, torch.int32, torch.float32], rank
        assert r["values_bytes"] == r["expected_values_bytes"], rank
        assert r["values_bytes"] < r["wide_values_bytes"], rank
        # lengths travel with the ids: one all-to-all for both (and one for the weights)
        assert r["payloads"] == ["kjt_all_to_all_values", "kjt_all_to_all_weights"], rank
        assert r["weights_bytes"] == r["expected_weights_bytes"], rank
    assert max(r["max_id"] for r in results) > 2**31 - 1  # did not fit int32, arrived whole


def _sharded(rank: int, ws: int, sequence: bool) -> Dict[str, object]:
    """TW tables of 200 (uint8) and 1000 rows (uint16), one of 200 rows unchecked (NONE: its
    ids keep int64), and a row-wise table of 300 rows (blocks of 150: uint8)."""
    rows = {"small": 200, "mid": 1000, "unchecked": 200, "rw": 300}
    torch.manual_seed(0)
    if sequence:
        module = EmbeddingCollection(
            [
                EmbeddingConfig(num_embeddings=n, embedding_dim=4, name=t, feature_names=[f"f_{t}"])
                for t, n in rows.items()
            ]
        )
        sharder = EmbeddingCollectionSharder()
    else:
        module = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=n, embedding_dim=4, name=t, feature_names=[f"f_{t}"]
                )
                for t, n in rows.items()
            ]
        )
        sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        module,
        {
            "small": table_wise(0),
            "mid": table_wise(1 % ws),
            "unchecked": table_wise(0),
            "rw": row_wise(),
        },
        world_size=ws,
    )
    plan["unchecked"].bounds_check_mode = BoundsCheckMode.NONE
    sharded = sharder.shard(
        copy.deepcopy(module), plan, ShardingEnv.from_process_group(dist.group.WORLD)
    )
    g = torch.Generator().manual_seed(10 + rank)
    lengths = torch.randint(0, 6, (4 * 5,), generator=g, dtype=torch.int32)
    per_key = lengths.view(4, 5).sum(1).tolist()
    values = torch.cat(
        [torch.randint(0, n, (c,), generator=g) for n, c in zip(rows.values(), per_key)]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync([f"f_{t}" for t in rows], values, lengths)
    reset_comm_payload_bytes()
    out = sharded(kjt)
    sent = comm_payload_bytes()["kjt_all_to_all_values"]
    got = out.values() if not sequence else torch.cat([out[k].values() for k in sorted(out)])
    want = module(kjt)
    want = want.values() if not sequence else torch.cat([want[k].values() for k in sorted(want)])
    rw_ids = values[sum(per_key[:3]) :]
    buckets = [int((rw_ids < 150).sum()), int((rw_ids >= 150).sum())]
    # lengths (< 6: uint8, 5 per key): table-wise to rank 0 small + unchecked, to rank 1 mid;
    # row-wise one bucket to each rank
    lengths_bytes = segment_bytes(10, torch.uint8) + 3 * segment_bytes(5, torch.uint8)
    expected = (
        lengths_bytes
        + segment_bytes(per_key[0], torch.uint8)
        + segment_bytes(per_key[1], torch.uint16)
        + segment_bytes(per_key[2], torch.int64)
        + sum(segment_bytes(n, torch.uint8) for n in buckets)
    )
    return {"equal": bool(torch.allclose(got, want, atol=1e-6)), "sent": sent, "expected": expected}


@pytest.mark.parametrize("sequence", [False, True], ids=["ebc", "ec"])
def test_sharded_collections_send_ids_in_the_narrowest_type(sequence: bool) -> None:
    for rank, r in enumerate(run_ranks(2, _sharded, sequence, timeout=120)):
        assert r["equal"], rank
        assert r["sent"] == r["expected"], (rank, r)
