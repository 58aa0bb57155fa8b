"""The documented torchrec.distributed helpers recshard provides behave as TorchRec's:
collective_utils (on the default group and a sub-group, an error on the invoked rank raised
on every rank), comm's node layout, a custom DataParallelWrapper, KJTOneToAll /
SeqEmbeddingsAllToOne / KJTListAwaitable, and the small types."""

from __future__ import annotations

import os
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch.nn.parallel import DistributedDataParallel

from recshard import KeyedJaggedTensor
from recshard.comm import KJTOneToAll, SeqEmbeddingsAllToOne
from recshard.distributed import DataParallelWrapper, DistributedModelParallel
from recshard.distributed.collective_utils import (
    invoke_on_rank_and_broadcast_result,
    is_leader,
    run_on_leader,
)
from recshard.distributed.comm import get_group_rank, get_local_rank, get_num_groups
from recshard.distributed.embedding_sharding import KJTList, KJTListAwaitable
from recshard.distributed.embedding_types import compute_kernel_to_embedding_location
from recshard.types import (
    ComputeKernel,
    EmbeddingComputeKernel,
    NoWait,
    NullShardingContext,
    ParameterStorage,
    ShardingEnv,
)


def collectives(rank: int, ws: int) -> Dict[str, object]:
    world = dist.group.WORLD
    odd = dist.new_group([1, 2])  # a sub-group whose rank 0 is global rank 1
    out: Dict[str, object] = {"leader": is_leader(world), "leader2": is_leader(world, 2)}
    out["drawn"] = invoke_on_rank_and_broadcast_result(world, 1, lambda: f"from {rank}")

    @run_on_leader(world, 2)
    def plan(scale: int) -> List[int]:
        return [rank * scale]

    out["decorated"] = plan(10)
    if rank in (1, 2):
        out["sub"] = invoke_on_rank_and_broadcast_result(odd, 1, lambda: rank)
        out["sub_leader"] = is_leader(odd)
    try:
        invoke_on_rank_and_broadcast_result(world, 0, lambda: 1 // (rank - rank))
    except RuntimeError as err:
        out["error"] = str(err)
    return out


def test_collective_utils_run_once_and_broadcast() -> None:
    results = run_ranks(3, collectives, timeout=120)
    for rank, out in enumerate(results):
        assert out["leader"] == (rank == 0) and out["leader2"] == (rank == 2)
        assert out["drawn"] == "from 1"
        assert out["decorated"] == [20]
        assert "rank 0 failed in <lambda>: ZeroDivisionError" in out["error"], out["error"]
        if rank in (1, 2):
            assert out["sub"] == 2  # rank 1 of the sub-group is global rank 2
            assert out["sub_leader"] == (rank == 1)
    assert is_leader(None) and not is_leader(None, 1)


def layout(rank: int, ws: int) -> tuple:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ.pop("LOCAL_RANK", None)
    return get_group_rank(), get_local_rank(), get_num_groups()


def test_comm_node_layout_as_torchrun_numbers_it() -> None:
    assert run_ranks(4, layout, timeout=120) == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]


def test_comm_helpers_take_explicit_world_and_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert get_group_rank(8, 5) == 1 and get_num_groups(8) == 2
    assert get_local_rank(8, 5) == 3  # the launcher's LOCAL_RANK wins
    monkeypatch.setenv("LOCAL_RANK", "9")  # not below the node size: from the rank
    assert get_local_rank(8, 6) == 2


class _Recording(DataParallelWrapper):
    """Wraps the dense part in DDP with find_unused_parameters and says it did."""

    calls: List[int] = []

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        self.calls.append(env.world_size)
        dmp._dmp_wrapped_module = DistributedDataParallel(
            dmp._dmp_wrapped_module, process_group=env.pg, find_unused_parameters=True
        )


def custom_wrapper(rank: int, ws: int) -> tuple:
    from dmp_cases import TinyDLRM, batch_for

    torch.manual_seed(0)
    wrapper = _Recording()
    dmp = DistributedModelParallel(TinyDLRM(), data_parallel_wrapper=wrapper)
    dense, kjt, labels = batch_for(0, rank, ws)
    dmp(dense, kjt, labels).backward()
    grad = next(p for n, p in dmp.named_parameters() if "ebc" not in n).grad
    gathered = [torch.empty_like(grad) for _ in range(ws)]
    dist.all_gather(gathered, grad)
    return (
        wrapper.calls,
        isinstance(dmp._dmp_wrapped_module, DistributedDataParallel),
        all(torch.equal(g, gathered[0]) for g in gathered),
    )


def test_a_custom_data_parallel_wrapper_is_used() -> None:
    for calls, wrapped, grads_equal in run_ranks(2, custom_wrapper, timeout=120):
        assert calls == [2] and wrapped and grads_equal


def test_kjt_one_to_all_splits_keys_in_order() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b", "c"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 1, 2, 0, 1, 0])
    )
    pieces = KJTOneToAll([2, 1], world_size=2)(kjt)
    assert isinstance(pieces, KJTList) and len(pieces) == 2
    assert pieces[0].keys() == ["a", "b"] and pieces[1].keys() == ["c"]
    assert pieces[0].values().tolist() == [1, 2, 3, 4] and pieces[1].values().tolist() == [5]
    assert [list(p.keys()) for p in pieces] == [["a", "b"], ["c"]]
    with pytest.raises(ValueError, match="splits \\[2\\] for world_size 2"):
        KJTOneToAll([2], world_size=2)
    with pytest.raises(ValueError, match="cover 2 keys, the batch has 3"):
        KJTOneToAll([1, 1], world_size=2)(kjt)


def test_seq_embeddings_all_to_one_and_kjt_list_awaitable() -> None:
    tensors = [torch.ones(2, 3), torch.zeros(1, 3)]
    moved = SeqEmbeddingsAllToOne(torch.device("cpu"), world_size=2)(tensors)
    assert [t.shape for t in moved] == [(2, 3), (1, 3)] and torch.equal(moved[0], tensors[0])
    with pytest.raises(ValueError, match="expected 3 tensors, got 2"):
        SeqEmbeddingsAllToOne(torch.device("cpu"), world_size=3)(tensors)
    kjt = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([7]), torch.tensor([1]))
    ctx = NullShardingContext()
    waited = KJTListAwaitable([NoWait(kjt), NoWait(kjt)], ctx).wait()
    assert isinstance(waited, KJTList) and list(waited) == [kjt, kjt]
    ctx.record_stream(None)  # carries nothing


def test_small_types_and_kernel_locations() -> None:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    assert ParameterStorage("hbm") is ParameterStorage.HBM and ParameterStorage.DDR.value == "ddr"
    assert ComputeKernel.DEFAULT.value == "default"
    expected = {
        EmbeddingComputeKernel.DENSE: EmbeddingLocation.DEVICE,
        EmbeddingComputeKernel.FUSED: EmbeddingLocation.DEVICE,
        EmbeddingComputeKernel.QUANT: EmbeddingLocation.DEVICE,
        EmbeddingComputeKernel.FUSED_UVM: EmbeddingLocation.MANAGED,
        EmbeddingComputeKernel.FUSED_UVM_CACHING: EmbeddingLocation.MANAGED_CACHING,
    }
    for kernel, location in expected.items():
        assert compute_kernel_to_embedding_location(kernel) == location
    assert compute_kernel_to_embedding_location("fused_uvm") == EmbeddingLocation.MANAGED


def test_sharded_module_contexts_have_torchrec_names() -> None:
    from recshard.distributed.embedding import EmbeddingCollectionContext
    from recshard.distributed.embeddingbag import EmbeddingBagCollectionContext

    # one per-batch context for both collections; the EC's also carries index dedup's state
    assert issubclass(EmbeddingCollectionContext, EmbeddingBagCollectionContext)
    assert EmbeddingCollectionContext().deduplicated is None
    context = EmbeddingBagCollectionContext()
    assert context.sharding_contexts == []
