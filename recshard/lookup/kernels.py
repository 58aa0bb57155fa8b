"""Lookup kernels: one module looks up every feature of a group of local tables at once.

Input: a KJT whose keys are the group's features in table order (stride B).
Output: pooled `[B, sum of the features' dims]`, or sequence `[N, D]` (one row per id). A
variable batch per feature (`stride_per_key_per_rank`) pools into fbgemm's flat rank-major
layout instead (`recshard.lookup.variable_batch`).

- `FbgemmFusedKernel`: fbgemm's SplitTableBatchedEmbeddingBagsCodegen, optimizer in backward.
- `TorchFusedKernel`: the same contract in pure torch (dims not divisible by 4, weighted mean
  pooling, or no fbgemm on the machine).
- `recshard.lookup.native_kernel.NativeFusedKernel`: recshard's own C++ kernel for the cases it
  covers (CPU, pooled, fp32, row-wise Adagrad), the torch kernel's contract.
- `DenseKernel`: ordinary parameters with autograd `.grad`, for any torch optimizer.
- `recshard.lookup.key_value.KeyValueKernel`: the torch fused kernel's lookup (`plain_lookup`)
  and update (`row_gradients`, `apply_row_update`) on a DRAM row cache of a table in files.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from recshard.lookup.fused_params import FusedOptimSpec, apply_row_update, fbgemm_optim_kwargs
from recshard.lookup.huge_pages import huge_page_zeros
from recshard.lookup.tables import LocalTable
from recshard.lookup.variable_batch import (
    from_rank_major,
    pad_lengths,
    padded_to_rank_major,
    to_rank_major,
)
from recshard.modules.embedding_configs import DATA_TYPE_TO_DTYPE, PoolingType
from recshard.sparse import KeyedJaggedTensor
from recshard.sparse.conversion import jagged_by_index
from recshard.sparse.jagged_ops import asynchronous_complete_cumsum
from recshard.types import EmbeddingComputeKernel


class LookupKernel(nn.Module):
    """Shared bookkeeping: tables, feature -> table map, per-feature output dims."""

    is_fused = False

    def __init__(self, tables: List[LocalTable], pooled: bool) -> None:
        super().__init__()
        self.tables = tables
        self.pooled = pooled
        self.pooling = tables[0].pooling
        self.feature_table = [i for i, t in enumerate(tables) for _ in t.feature_names]
        self.feature_dims = [tables[i].cols for i in self.feature_table]

    def table_weights(self) -> List[torch.Tensor]:
        """Each local table's `[rows, cols]` weight (views into the kernel's storage)."""
        raise NotImplementedError

    def _init_weights(self) -> None:
        for table, weight in zip(self.tables, self.table_weights()):
            if weight.numel():
                table.config.init_weight(weight)


def _mean_divisor(lengths: torch.Tensor) -> torch.Tensor:
    return lengths.clamp(min=1).unsqueeze(1).to(torch.float32)


def _tbe_rows(table: LocalTable) -> int:
    """The rows the TBE holds for `table`: a shard with no rows (row-wise over more ranks than
    the table has rows) gets one phantom row that no id reaches and no caller sees
    (`table_weights` and `optimizer_states` cut it off): fbgemm 1.8's CPU backward fails on a
    0-row table ("more than 2B rows")."""
    return max(table.rows, 1)


def _host_weights(
    tables: List[LocalTable], on_cuda: bool, dtype: torch.dtype
) -> Dict[str, torch.Tensor] | None:
    """On CPU, the TBE's weight storage (every table's rows x cols back to back, in the
    tables' dtype) on huge pages (`recshard.lookup.huge_pages`); fbgemm checks the size."""
    if on_cuda:
        return None
    return {"weights": huge_page_zeros(sum(_tbe_rows(t) * t.cols for t in tables), dtype)}


class FbgemmFusedKernel(LookupKernel):
    """One fbgemm TBE for the group; the optimizer update happens inside its backward.

    Weights in the tables' data type (FP32 or FP16: fbgemm's `weights_precision`), optimizer
    state in fp32 and pooled outputs in fp32 (fbgemm's and TorchRec's default `output_dtype`).
    """

    is_fused = True

    def __init__(
        self, tables: List[LocalTable], pooled: bool, spec: FusedOptimSpec, device: torch.device
    ) -> None:
        super().__init__(tables, pooled)
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode as FbgemmBoundsCheckMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.spec = spec
        on_cuda = device.type == "cuda"
        weights_dtype = DATA_TYPE_TO_DTYPE[tables[0].config.data_type]  # one per group
        kernel_location = {
            EmbeddingComputeKernel.FUSED: EmbeddingLocation.DEVICE,
            EmbeddingComputeKernel.FUSED_UVM: EmbeddingLocation.MANAGED,
            EmbeddingComputeKernel.FUSED_UVM_CACHING: EmbeddingLocation.MANAGED_CACHING,
        }
        specs = [
            (
                _tbe_rows(t),
                t.cols,
                kernel_location[t.compute_kernel] if on_cuda else EmbeddingLocation.HOST,
                ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU,
            )
            for t in tables
        ]
        pooling_mode = (
            PoolingMode.NONE
            if not pooled
            else PoolingMode.MEAN
            if self.pooling == PoolingType.MEAN
            else PoolingMode.SUM
        )
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            specs,
            feature_table_map=self.feature_table,
            pooling_mode=pooling_mode,
            device=device,
            table_names=[t.name for t in tables],
            # ids were checked (per the table's BoundsCheckMode) before the input dist, and
            # row-wise ids are rebased into range: no second pass over every id here
            bounds_check_mode=FbgemmBoundsCheckMode.NONE,
            preallocated_host_buffers=_host_weights(tables, on_cuda, weights_dtype),
            weights_precision=SparseType.from_dtype(weights_dtype),
            output_dtype=SparseType.FP32,
            **fbgemm_optim_kwargs(spec),
        )
        for param in self.tbe.parameters():  # updated in backward: no dense optimizer, no DDP
            param._in_backward_optimizers = True
        self._init_weights()

    def table_weights(self) -> List[torch.Tensor]:
        return [w[: t.rows] for t, w in zip(self.tables, self.tbe.split_embedding_weights())]

    def optimizer_states(self) -> List[Dict[str, torch.Tensor]]:
        """One dict per table (empty for SGD: fbgemm then returns no states at all)."""
        names = self.spec.state_names
        if not names:
            return [{} for _ in self.tables]
        return [
            {name: state[: t.rows] for name, state in zip(names, states)}
            for t, states in zip(self.tables, self.tbe.split_optimizer_states())
        ]

    def set_learning_rate(self, lr: float) -> None:
        self.tbe.set_learning_rate(lr)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if torch.is_inference_mode_enabled():  # fbgemm's training op has no inference kernel
            return plain_lookup(self.table_weights(), self, features)
        if self.pooled and features.variable_stride_per_key():  # `lookup.variable_batch`
            lengths = pad_lengths(features.lengths(), features.stride_per_key())
            pooled = self.tbe(
                features.values().long(),
                asynchronous_complete_cumsum(lengths.long()),
                per_sample_weights=features.weights_or_none(),
            )
            return padded_to_rank_major(
                pooled, features.stride_per_key_per_rank(), self.feature_dims
            )
        return self.tbe(
            features.values().long(),
            features.offsets().long(),
            per_sample_weights=features.weights_or_none(),
        )


class TorchFusedLookup(torch.autograd.Function):
    """Forward: `kernel.lookup`. Backward: `kernel.update` (sum gradients per unique row,
    update in place); no gradient flows on."""

    @staticmethod
    def forward(
        ctx,
        placeholder: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        kernel: LookupKernel,  # noqa: ANN001
        features: KeyedJaggedTensor,
    ) -> torch.Tensor:
        ctx.kernel, ctx.features = kernel, features
        return kernel.lookup(features)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # noqa: ANN001, ANN205
        weights_grad = ctx.kernel.update(ctx.features, grad_output, ctx.needs_input_grad[1])
        return None, weights_grad, None, None


class TorchFusedKernel(LookupKernel):
    """The fused contract in pure torch: weights are buffers, updated during backward."""

    is_fused = True

    def __init__(
        self, tables: List[LocalTable], pooled: bool, spec: FusedOptimSpec, device: torch.device
    ) -> None:
        super().__init__(tables, pooled)
        self.spec = spec
        self.lr = spec.learning_rate
        self._allocate(device)
        self._init_weights()

    def _allocate(self, device: torch.device) -> None:
        """Weights and optimizer state, one buffer each per table."""
        for i, t in enumerate(self.tables):
            dtype = DATA_TYPE_TO_DTYPE[t.config.data_type]
            self.register_buffer(
                f"weight_{i}", torch.empty(t.rows, t.cols, dtype=dtype, device=device)
            )
            for name in self.spec.state_names:
                shape = self.spec.state_shape(t.rows, t.cols)
                self.register_buffer(f"{name}_{i}", torch.zeros(shape, device=device))

    def table_weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight_{i}") for i in range(len(self.tables))]

    def optimizer_states(self) -> List[Dict[str, torch.Tensor]]:
        return [
            {n: getattr(self, f"{n}_{i}") for n in self.spec.state_names}
            for i in range(len(self.tables))
        ]

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        placeholder = torch.empty(
            0, requires_grad=torch.is_grad_enabled(), device=features.device()
        )
        return TorchFusedLookup.apply(placeholder, features.weights_or_none(), self, features)

    def lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return plain_lookup(self.table_weights(), self, features)

    def update(
        self, features: KeyedJaggedTensor, grad_output: torch.Tensor, weights_grad: bool = False
    ) -> torch.Tensor | None:
        """Per table: gradient rows of every id, summed per unique id, then one update.
        `weights_grad`: also return the gradient of the per-sample weights (see
        `row_gradients`)."""
        weights = self.table_weights()
        grads, sample_grad = row_gradients(
            self, features, grad_output, weights if weights_grad else None
        )
        states = self.optimizer_states()
        with torch.no_grad():
            for t_index, (unique, grad) in grads.items():
                apply_row_update(
                    self.spec, self.lr, weights[t_index], states[t_index], unique, grad
                )
        return sample_grad


def row_gradients(
    kernel: LookupKernel,
    features: KeyedJaggedTensor,
    grad_output: torch.Tensor,
    table_weights: List[torch.Tensor] | None = None,
) -> Tuple[Dict[int, Tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Per table index with ids: (unique ids, their summed gradient `[len(unique), cols]`)
    from the lookup's output gradient, as a dense optimizer would see it. With
    `table_weights` (rows before the update), also the gradient of the per-sample weights
    (`[num ids]`: each id's row dotted with its bag's output gradient), for weights that a
    feature processor computed; else None."""
    per_table_ids: Dict[int, List[torch.Tensor]] = {}
    per_table_grads: Dict[int, List[torch.Tensor]] = {}
    sample_grads: List[torch.Tensor] = []
    columns = 0
    offsets = features.offset_per_key()
    variable = kernel.pooled and features.variable_stride_per_key()
    grad_blocks = (
        from_rank_major(grad_output, features.stride_per_key_per_rank(), kernel.feature_dims)
        if variable
        else []
    )
    for index, (jt, t_index, dim) in enumerate(
        zip(jagged_by_index(features), kernel.feature_table, kernel.feature_dims)
    ):
        ids = jt.values().long()
        if kernel.pooled:
            grad = grad_blocks[index] if variable else grad_output[:, columns : columns + dim]
            columns += dim
            lengths = jt.lengths()
            bag = torch.repeat_interleave(  # output_size: no device sync for the count
                torch.arange(lengths.numel(), device=lengths.device),
                lengths.long(),
                output_size=ids.numel(),
            )
            mean = kernel.pooling == PoolingType.MEAN
            if table_weights is not None:  # MEAN divides the dot product (as the C++ kernel)
                dot = (grad.index_select(0, bag) * table_weights[t_index][ids]).sum(dim=1)
                sample_grads.append(dot / _mean_divisor(lengths)[bag, 0] if mean else dot)
            if mean:
                grad = grad / _mean_divisor(lengths)
            rows_grad = grad.index_select(0, bag)
            if jt.weights_or_none() is not None:
                rows_grad = rows_grad * jt.weights().unsqueeze(1)
        else:
            rows_grad = grad_output[offsets[index] : offsets[index + 1]]
        per_table_ids.setdefault(t_index, []).append(ids)
        per_table_grads.setdefault(t_index, []).append(rows_grad)
    sample_grad = torch.cat(sample_grads) if table_weights is not None and sample_grads else None
    out: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for t_index, ids_list in per_table_ids.items():
            ids = torch.cat(ids_list)
            if ids.numel() == 0:
                continue
            unique, inverse = torch.unique(ids, return_inverse=True)
            grad = torch.zeros(
                unique.numel(),
                kernel.tables[t_index].cols,
                dtype=grad_output.dtype,
                device=grad_output.device,
            )
            grad.index_add_(0, inverse, torch.cat(per_table_grads[t_index]))
            out[t_index] = (unique, grad)
    return out, sample_grad


WeightsInUse = Callable[[List[torch.Tensor], List[torch.Tensor]], List[torch.Tensor]]


class DenseKernel(LookupKernel):
    """Weights are `nn.Parameter`s (`weight_<i>`): gradients land in `.grad`.

    `weights_in_use(weights, ids)`, when set, maps the tables' weights to the tensors the
    lookup reads, given every id looked up in each table this step (while autograd records):
    the data-parallel sharding averages gradients over ranks through it.
    """

    def __init__(self, tables: List[LocalTable], pooled: bool, device: torch.device) -> None:
        super().__init__(tables, pooled)
        self.weights = nn.ParameterList(
            nn.Parameter(
                torch.empty(
                    t.rows, t.cols, dtype=DATA_TYPE_TO_DTYPE[t.config.data_type], device=device
                )
            )
            for t in tables
        )
        self.weights_in_use: WeightsInUse | None = None
        self._init_weights()

    def table_weights(self) -> List[torch.Tensor]:
        return list(self.weights)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        weights = self.table_weights()
        if self.weights_in_use is not None and torch.is_grad_enabled():
            ids: List[List[torch.Tensor]] = [[] for _ in weights]
            for jt, t_index in zip(jagged_by_index(features), self.feature_table):
                ids[t_index].append(jt.values().long())
            weights = self.weights_in_use(weights, [torch.cat(table_ids) for table_ids in ids])
        return plain_lookup(weights, self, features)


def plain_lookup(
    weights: List[torch.Tensor], kernel: LookupKernel, features: KeyedJaggedTensor
) -> torch.Tensor:
    """Look up every feature with torch ops; pooled `[B, sum dims]` or sequence `[N, D]`, in
    fp32 whatever the tables' dtype (as fbgemm's kernel returns them): fp16/bf16 rows are
    gathered and widened before pooling, so sums accumulate in fp32."""
    outputs: List[torch.Tensor] = []
    for jt, t_index in zip(jagged_by_index(features), kernel.feature_table):
        weight = weights[t_index]
        ids = jt.values().long()
        if weight.dtype != torch.float32:  # the rows read, widened; ids index them in order
            weight = weight.index_select(0, ids).float()
            ids = torch.arange(ids.numel(), device=ids.device)
        if not kernel.pooled:
            outputs.append(F.embedding(ids, weight))
            continue
        psw: torch.Tensor | None = jt.weights_or_none()
        pooled = (
            F.embedding_bag(
                ids,
                weight,
                jt.offsets().long(),
                mode="sum",
                per_sample_weights=psw,
                include_last_offset=True,
            )
            if weight.numel()
            else torch.zeros(
                jt.lengths().numel(), weight.size(1), dtype=weight.dtype, device=weight.device
            )
        )
        if kernel.pooling == PoolingType.MEAN:
            pooled = pooled / _mean_divisor(jt.lengths())
        outputs.append(pooled)
    if kernel.pooled and features.variable_stride_per_key():
        return to_rank_major(outputs, features.stride_per_key_per_rank(), features.device())
    if not outputs:
        return torch.empty(features.stride(), 0, device=features.device())
    return torch.cat(outputs, dim=1 if kernel.pooled else 0)
