"""Bad input: clear errors before any collective, and one rank's bad batch stops every rank."""

from __future__ import annotations

from typing import Callable, List, Tuple

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from recshard.comm import (
    KJTAllToAll,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    SequenceEmbeddingsAllToAll,
    alltoall_pooled,
    alltoallv,
    reduce_scatter_pooled,
    reduce_scatter_v_pooled,
)
from recshard.sparse import KeyedJaggedTensor

Outcome = Tuple[str, str]  # exception type, message

BAD_BATCH = "table 't3': id 42 out of range [0, 10) at batch position 5\nsecond line with detail"


def _kjt(num_keys: int = 3, values_dtype: torch.dtype = torch.int64, weighted: bool = False):
    lengths = torch.tensor([1, 0] * num_keys, dtype=torch.int32)
    values = torch.arange(num_keys, dtype=values_dtype)
    weights = torch.ones(num_keys) if weighted else None
    keys = [f"f{k}" for k in range(num_keys)]
    return KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=2)


def _outcome(fn: Callable[[], object]) -> Outcome:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e)
    return "none", ""


def _verdicts(rank: int, ws: int) -> List[Outcome]:
    splits = [1] * (ws - 1) + [3 - (ws - 1)] if ws <= 3 else [1, 1, 1, 0]
    a2a = KJTAllToAll(dist.group.WORLD, splits)
    results = [
        # rank 0 rejected its batch and says why
        _outcome(lambda: a2a(_kjt(), BAD_BATCH if rank == 0 else None).wait()),
        # the group is still in step: a good step right after works everywhere
        _outcome(lambda: a2a(_kjt()).wait().wait()),
        # the last rank's KJT has the wrong number of keys (detected inside KJTAllToAll)
        _outcome(lambda: a2a(_kjt(2 if rank == ws - 1 else 3)).wait()),
        # rank 1 sends int32 ids where the others send int64
        _outcome(lambda: a2a(_kjt(values_dtype=torch.int32 if rank == 1 else torch.int64)).wait()),
        # rank 0 has weights, the others do not
        _outcome(lambda: a2a(_kjt(weighted=rank == 0)).wait()),
        # a long non-ASCII message is cut on a character boundary
        _outcome(lambda: a2a(_kjt(), "é" * 200 if rank == ws - 1 else None).wait()),
    ]
    results.append(_outcome(lambda: a2a(_kjt()).wait().wait()))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rejected_input_stops_every_rank(world_size: int) -> None:
    outcomes = run_ranks(world_size, _verdicts, timeout=60, pg_timeout_s=30)
    last = world_size - 1
    for rank, (verdict, good, bad_keys, dtypes, weights, long_msg, after) in enumerate(outcomes):
        if rank == 0:
            assert verdict == ("ValueError", BAD_BATCH)
        else:
            assert verdict == (
                "RuntimeError",
                "rank 0 rejected its input: table 't3': id 42 out of range [0, 10) "
                "at batch position 5",
            )
        assert good[0] == after[0] == "none", (good, after)
        if rank == last:
            assert bad_keys[0] == "ValueError" and "sum to 3 keys" in bad_keys[1], bad_keys
        else:
            assert bad_keys[0] == "RuntimeError", bad_keys
            assert bad_keys[1].startswith(f"rank {last} rejected its input: KJTAllToAll: splits")
        assert dtypes[0] == "ValueError", dtypes
        assert "ranks disagree on the values dtype" in dtypes[1] and "rank 1 int32" in dtypes[1]
        assert weights[0] == "ValueError" and "rank 0 float32, rank 1 none" in weights[1], weights
        if rank == last:
            assert long_msg[:2] == ("ValueError", "é" * 200)
        else:
            assert long_msg[0] == "RuntimeError" and long_msg[1].endswith("é" * 64), long_msg


def _bad_arguments(rank: int, ws: int) -> List[Outcome]:
    pg = dist.group.WORLD
    embs = torch.zeros(4, 2)
    results = [
        _outcome(lambda: KJTAllToAll(pg, [1, 1, 1])),
        _outcome(lambda: KJTAllToAll(pg, [2, -1])),
        _outcome(lambda: PooledEmbeddingsAllToAll(pg, [2])),
        _outcome(lambda: PooledEmbeddingsAllToAll(pg, [2, 2])(torch.zeros(4, 3))),
        _outcome(lambda: PooledEmbeddingsAllToAll(pg, [2, 2])(torch.zeros(3, 2))),
        _outcome(lambda: alltoall_pooled(embs, [2, 1], [2, 2])),
        _outcome(
            lambda: alltoallv(
                [torch.zeros(4, 1), torch.zeros(4, 1, dtype=torch.float16)], out_split=[2, 2]
            )
        ),
        _outcome(
            lambda: reduce_scatter_pooled([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
        ),
        _outcome(lambda: reduce_scatter_v_pooled(embs, [1, 2])),
        _outcome(lambda: PooledEmbeddingsReduceScatter(pg)(embs, [1, 1, 2])),
        _outcome(
            lambda: SequenceEmbeddingsAllToAll(pg, [1, 1])(
                torch.zeros(3, 2), torch.tensor([1, 1]), [1, 1], [1, 1]
            )
        ),
    ]
    dist.barrier()  # nothing was issued: the group is still in step
    return results


def test_bad_arguments_raise_before_any_collective() -> None:
    outcomes = run_ranks(2, _bad_arguments, timeout=60, pg_timeout_s=20)[0]
    expected = [
        "KJTAllToAll: splits [1, 1, 1] need one entry per rank (world size 2)",
        "KJTAllToAll: splits [2, -1] must be non-negative",
        "PooledEmbeddingsAllToAll: dim_sum_per_rank [2] needs one entry per rank (world size 2)",
        "alltoall_pooled: rank 0 input has 3 columns but dim_sum_per_rank[0] = 2",
        "PooledEmbeddingsAllToAll: 3 rows do not split evenly over 2 ranks; "
        "pass batch_size_per_rank",
        "alltoall_pooled: input has 4 rows but batch_size_per_rank [2, 1] sums to 3",
        "alltoallv: all tensors must share one dtype, got ['torch.float16', 'torch.float32']",
        "reduce_scatter_pooled: all tensors must share one dtype, "
        "got ['torch.float32', 'torch.float64']",
        "reduce_scatter_v_pooled: input has 4 rows, input_splits [1, 2] sum to 3",
        "reduce_scatter_v_pooled: input_splits [1, 1, 2] needs one entry per rank (world size 2)",
        "alltoall_sequence: 3 embedding rows but 2 ids were received (output_splits [1, 1])",
    ]
    assert [o[0] for o in outcomes] == ["ValueError"] * len(expected), outcomes
    assert [o[1] for o in outcomes] == expected
