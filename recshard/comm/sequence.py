"""Sequence embeddings `[N, D]` (one row per id) back to the ranks that sent the ids: the KJT
all-to-all reversed (`kjt.py` brought the ids; its splits and `recat` say where each row goes).
The function with autograd (TorchRec's `comm_ops` name) and the `nn.Module` over it (its
`dist_data` name); backward runs the transposed all-to-all (`request.py`).
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch import nn

from recshard.comm.args import check, default_group, one_entry_per_rank, per_rank
from recshard.comm.codecs import QuantizedCommCodecs
from recshard.comm.pg import HoldsGroup
from recshard.comm.recat import get_recat
from recshard.comm.request import AllToAllV, CommRequest
from recshard.sparse.jagged_ops import asynchronous_complete_cumsum, expand_into_jagged_permute
from recshard.types import Awaitable, NoWait


def alltoall_sequence(
    a2a_sequence_embs_tensor: torch.Tensor,
    forward_recat_tensor: torch.Tensor,
    backward_recat_tensor: torch.Tensor | None,
    lengths_after_sparse_data_all2all: torch.Tensor,
    input_splits: List[int],
    output_splits: List[int],
    variable_batch_size: bool = False,
    group: dist.ProcessGroup | None = None,
    codecs: QuantizedCommCodecs | None = None,
) -> Awaitable[torch.Tensor]:
    """Per-id embeddings back to the ranks that sent the ids: the sparse all-to-all reversed.

    Input `[N_recv, D]`: one row per id of the KJT this rank received, feature-major.
    `lengths_after_sparse_data_all2all`: that KJT's lengths. `input_splits` /
    `output_splits`: ids the sparse all-to-all sent to / received from each rank.
    `forward_recat_tensor` reorders feature-major into rank-major units: with
    `variable_batch_size=False` a unit is one (feature, source rank) block of equal batch
    size (`[F_local * W]`); with True a unit is one bag (`[F_local * sum(B)]`).
    Output `[N_sent, D]`: rows in the order the ids were sent. The backward reorder comes from
    autograd; `backward_recat_tensor` is accepted for TorchRec compatibility.
    """
    pg = default_group(group)
    world_size = dist.get_world_size(pg)
    x = a2a_sequence_embs_tensor
    check(x.dim() == 2, f"alltoall_sequence: expected [N, D] embeddings, got {tuple(x.shape)}")
    one_entry_per_rank(
        "alltoall_sequence", world_size, input_splits=input_splits, output_splits=output_splits
    )
    check(
        x.size(0) == sum(output_splits),
        f"alltoall_sequence: {x.size(0)} embedding rows but {sum(output_splits)} ids were "
        f"received (output_splits {output_splits})",
    )
    if world_size == 1:
        return NoWait(x)
    units = forward_recat_tensor.numel()
    if units > 0 and x.size(0) > 0:
        lengths = lengths_after_sparse_data_all2all.reshape(units, -1).sum(1)
        in_offsets = asynchronous_complete_cumsum(lengths)
        out_offsets = asynchronous_complete_cumsum(lengths[forward_recat_tensor.long()])
        rows = expand_into_jagged_permute(
            forward_recat_tensor.to(in_offsets.dtype), in_offsets, out_offsets, x.size(0)
        )
        x = x.index_select(0, rows.long())
    dim = x.size(1)
    a2a = AllToAllV(
        pg,
        [n * dim for n in output_splits],
        [n * dim for n in input_splits],
        codecs,
        name="alltoall_sequence",
    )
    return CommRequest(a2a, x.reshape(-1), lambda flat: flat.view(-1, dim))


class SequenceEmbeddingsAllToAll(HoldsGroup, nn.Module):
    """Per-id embeddings back to the ranks whose batches the ids came from.

    Call with the metadata of the `KJTAllToAll` that brought the ids here (its tensors
    awaitable `aw` and output KJT `kjt`):
    `seq_a2a(embs, kjt.lengths(), aw.input_splits["values"], aw.output_splits["values"],
    batch_size_per_rank=aw.stride_per_rank, sparse_features_recat=aw.recat)`.
    `embs [N_recv, D]`: one row per value of `kjt`, in its order. Result `[N_sent, D]`: one
    row per value of the KJT this rank sent, in its order (then `index_select`ed by
    `unbucketize_permute_tensor` if given, which row-wise sharding uses).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        features_per_rank: List[int],
        device: torch.device | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self.pg = pg
        self._features_per_rank = per_rank(
            features_per_rank, pg, "SequenceEmbeddingsAllToAll: features_per_rank"
        )
        self._codecs = codecs

    def forward(
        self,
        local_embs: torch.Tensor,
        lengths: torch.Tensor,
        input_splits: List[int],
        output_splits: List[int],
        unbucketize_permute_tensor: torch.Tensor | None = None,
        batch_size_per_rank: List[int] | None = None,
        sparse_features_recat: torch.Tensor | None = None,
    ) -> Awaitable[torch.Tensor]:
        world_size, rank = dist.get_world_size(self.pg), dist.get_rank(self.pg)
        num_local = self._features_per_rank[rank]
        variable = batch_size_per_rank is not None and len(set(batch_size_per_rank)) > 1
        recat = sparse_features_recat
        if recat is None:
            recat = get_recat(num_local, world_size, 1, local_embs.device, batch_size_per_rank)
        variable = variable or recat.numel() != num_local * world_size
        forward_recat = torch.argsort(recat.long()).to(torch.int32)
        awaitable = alltoall_sequence(
            local_embs,
            forward_recat,
            recat,
            lengths,
            input_splits,
            output_splits,
            variable_batch_size=variable,
            group=self.pg,
            codecs=self._codecs,
        )
        if unbucketize_permute_tensor is not None:
            permute = unbucketize_permute_tensor.long()
            awaitable.callbacks.append(lambda embs: embs.index_select(0, permute))
        return awaitable
