"""The memory a shard needs and where it lives (DDR, HBM, local storage): the planner's
storage estimate, beside `estimators.EmbeddingPerfEstimator`'s time."""

from __future__ import annotations

from typing import Dict

from recshard.planner.cost.cache_stats import cache_load_factor, touched_rows
from recshard.planner.cost.estimators import (
    INPUT_COPIES,
    MODULE_OUTPUT_COPIES,
    TableFacts,
    optimizer_state_bytes,
    shard_traffic,
    table_facts,
)
from recshard.planner.cost.key_value import KEY_VALUE, key_value_storage
from recshard.planner.planner_types import ROW_BLOCK_TYPES, Storage, TableMeta, Topology
from recshard.types import ROW_EXCHANGE_MIN_BYTES, CacheParams, PipelineType


class EmbeddingStorageEstimator:
    """Memory of one shard (bytes) and where it lives.

    - weights = rows cols s_w; optimizer state from the table's optimizer (taken from the
      sharder's fused_params, counted whether or not an optimizer is attached yet; see
      `optimizer_state_bytes`); dense kernel and data-parallel add an fp32 gradient
      `4 rows cols` (data-parallel twice: DDP keeps a bucket copy).
    - io = c ids_in id_bytes + 2 bags_out cols s_out (the output and its gradient), `c` the
      batches of ids a rank holds under `pipeline_type` (`INPUT_COPIES`, TorchRec's factors:
      1 without a pipeline, 2 for TrainPipelineSparseDist, whose next batch is in flight).
    - quant kernel (inference): no optimizer state; 4 bytes per row of fp16 scale and bias.
    - calibrated (`topology.profile.memory`, cpu), fused kernel: weights count `weight_factor`
      times (the build's growth per byte of weights: 1.00 on cpu), and the step's transient
      is the measured `bytes_per_id ids_in + bytes_per_output_byte bags_out cols 4` (the
      output and its gradient), plus the `c` batches of ids; every kernel and type, calibrated
      on cpu: plus `_module_buffers` (not measured on cuda). Data-parallel, calibrated on
      cpu: one gradient (averaged in backward, no DDP bucket) plus the flattened copy the
      shared all-reduce of tables under `ROW_EXCHANGE_MIN_BYTES` makes (its measured peak).
      `plan_stats` adds the per-rank fixed growth (`MemoryCost.fixed_bytes_per_rank`).
    - cpu: everything in DDR. cuda, fused/dense: everything in HBM. fused_uvm: weights and
      state in DDR, io in HBM. fused_uvm_caching: weights and state in DDR; HBM holds the cache
      `lf weights`, its index `rows (4 + 16 lf)` and io. key_value (cpu): its cache, index and
      io in DDR, weights and state on local storage (`recshard.planner.cost.key_value`).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = 512,
        pipeline_type: PipelineType = PipelineType.NONE,
    ) -> None:
        self.topology = topology
        self.batch_size = batch_size
        self.pipeline_type = pipeline_type
        self._facts: Dict[int, TableFacts] = {}

    def estimate(
        self,
        table: TableMeta,
        sharding_type: str,
        compute_kernel: str,
        rows: int,
        cols: int,
        cache_params: CacheParams | None = None,
    ) -> Storage:
        """Storage of one `rows x cols` shard of `table` (formulas in the class docstring)."""
        topo = self.topology
        facts = table_facts(self._facts, table, self.batch_size)
        ids_in, bags_out = shard_traffic(
            table, sharding_type, rows, topo, self.batch_size, facts.workload
        )
        weights = float(rows) * cols * facts.s_w
        state = optimizer_state_bytes(table.optimizer, rows, cols)
        if compute_kernel == "quant":  # inference: no optimizer; per-row fp16 scale + bias
            weights, state = weights + 4.0 * rows, 0.0
        elif compute_kernel == "dense" or sharding_type == "data_parallel":
            copies = 2 if sharding_type == "data_parallel" else 1
            state += copies * 4.0 * rows * cols
        ids = INPUT_COPIES[self.pipeline_type] * ids_in * facts.id_bytes
        io = ids + 2 * bags_out * cols * facts.s_out
        memory = topo.profile.memory if topo.profile is not None else None
        if memory is not None and topo.compute_device == topo.profile.compute_device == "cpu":
            if compute_kernel == "fused" and sharding_type != "data_parallel":
                weights *= memory.weight_factor
                io = (
                    ids
                    + ids_in * memory.bytes_per_id
                    + bags_out * cols * 4.0 * memory.bytes_per_output_byte
                )
            io += self._module_buffers(table, sharding_type, cols, bags_out, facts)
            if sharding_type == "data_parallel" and 4.0 * rows * cols >= ROW_EXCHANGE_MIN_BYTES:
                state -= 4.0 * rows * cols  # averaged in place, no flattened copy
        if compute_kernel == KEY_VALUE:
            global_ids = facts.workload[0] * topo.world_size
            touched = touched_rows(table, cache_params, rows, ids_in, global_ids)
            row_state = optimizer_state_bytes(table.optimizer, rows, 0)  # per-row part
            return key_value_storage(rows, weights, state, io, cache_params, touched, row_state)
        if topo.compute_device == "cpu":
            return Storage(0.0, weights + state + io)
        if compute_kernel == "fused_uvm":
            return Storage(io, weights + state)
        if compute_kernel == "fused_uvm_caching":
            lf = cache_load_factor(cache_params)
            return Storage(lf * weights + rows * (4 + 16 * lf) + io, weights + state)
        return Storage(weights + state + io, 0.0)

    def _module_buffers(
        self, table: TableMeta, sharding_type: str, cols: int, bags_out: float, facts: TableFacts
    ) -> float:
        """This shard's part of the module's step buffers as `recshard.comm` keeps them
        (measured at 2 and 4 ranks, 1 and 2 hosts). Table-/column-wise: `MODULE_OUTPUT_COPIES`
        own outputs. Row-wise (table-row-wise on one host): the reduce-scatter's receive and
        the all-gather's send buffer (`bags_out cols` each), the reduced own output and its
        gradient in whole columns. Table-row-wise across hosts: also the rows regrouped for
        the host's reduce-scatter; the host's sums (`hosts` own outputs) held as a table-wise
        output is, plus the sums and their gradient. Sequence, data-parallel: none."""
        if not table.pooled or sharding_type == "data_parallel":
            return 0.0  # data-parallel has no output dist: its output is the kernel's own
        own = facts.workload[1] * cols * facts.s_out
        gathered = bags_out * cols * facts.s_out
        if sharding_type not in ROW_BLOCK_TYPES:
            return MODULE_OUTPUT_COPIES * own
        hosts = self.topology.num_hosts
        if sharding_type == "row_wise" or hosts == 1:
            return 2 * gathered + 2 * own
        return 3 * gathered + (2 + MODULE_OUTPUT_COPIES) * hosts * own
