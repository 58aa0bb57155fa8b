"""Cost model: time (`EmbeddingPerfEstimator`) and memory (`EmbeddingStorageEstimator`) of one
shard, and the memory held back for everything that is not a table (`StorageReservation`).

Both estimators see one shard of `rows x cols` of a table and work from bytes moved. Notation
(per training step, per rank): `B_f` batch size, `L_f` pooling factor, `P_f` poolings per
sample of feature f; `ids = sum_f L_f P_f B_f` ids looked up in the table per rank and
`bags = sum_f P_f B_f` pooled outputs (`bags = ids` for sequence tables); `W` ranks, `Lw` ranks
per host, `H = W / Lw` hosts; `s_w` bytes per weight element, `s_out` bytes per output element
(4, or 2 for 16-bit tables), 8 bytes per id (+4 per-id weight for weighted features).

What one shard receives and produces (`frac = rows / table rows`):
- table-wise, column-wise, table-column-wise: `ids_in = ids W`, `bags_out = bags W`
- row-wise: `ids_in = ids W frac`, `bags_out = bags W` (partial sums for every bag)
- table-row-wise: `ids_in = ids W frac`, `bags_out = bags W` (reduced inside the host first)
- data-parallel: `ids_in = ids`, `bags_out = bags` (the local batch)
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Tuple

import torch

from recshard.planner.cost.cache_stats import (
    cache_hit_rate,
    expected_lookups,
    touched_rows,
)
from recshard.planner.cost.key_value import KEY_VALUE, key_value_io_ms
from recshard.planner.planner_types import (
    ROW_BLOCK_TYPES,
    Perf,
    TableMeta,
    Topology,
)
from recshard.planner.profile import distinct_rows, working_rows
from recshard.types import ROW_EXCHANGE_MIN_BYTES, CacheParams, PipelineType
from recshard.wire_dtypes import id_wire_dtype

logger = logging.getLogger(__name__)

ID_BYTES = 8
PER_ID_WEIGHT_BYTES = 4
SECTOR_BYTES = 32  # a row read or write moves at least one 32-byte sector
# A sharded pooled module's step holds its rank's local output four times: the output dist's
# received buffer, the KeyedTensor built from it, their gradient, and the gradient sent back.
MODULE_OUTPUT_COPIES = 4
# batches of ids a rank holds at once under each training pipeline (TorchRec's factors): the
# one being looked up, and those the pipeline has already sent on ahead
INPUT_COPIES = {
    PipelineType.NONE: 1,
    PipelineType.TRAIN_BASE: 1,
    PipelineType.TRAIN_SPARSE_DIST: 2,
    PipelineType.TRAIN_PREFETCH_SPARSE_DIST: 3,
}

# Optimizer state of the fused (fbgemm) optimizers: (fp32 bytes per element, bytes per row).
_OPTIMIZER_STATE: Dict[str, Tuple[int, int]] = {
    "sgd": (0, 0),
    "exactsgd": (0, 0),
    "none": (0, 0),
    "larssgd": (0, 0),
    "adagrad": (4, 0),
    "exactadagrad": (4, 0),
    "rowwiseadagrad": (0, 4),
    "exactrowwiseadagrad": (0, 4),
    "exactrowwiseweightedadagrad": (0, 4),
    "emainplacerowwiseadagrad": (0, 4),
    "ensemblerowwiseadagrad": (4, 4),
    "adam": (8, 0),
    "lamb": (8, 0),
    "partialrowwiseadam": (4, 4),
    "partialrowwiselamb": (4, 4),
    "madgrad": (8, 4),
    "shampoo": (8, 0),
    "shampoov2": (8, 0),
}
_warned: set = set()


def optimizer_state_bytes(optimizer: str | None, rows: int, cols: int) -> float:
    """Bytes of optimizer state for a `rows x cols` shard: 0 for SGD (and no optimizer),
    `4 rows cols` for Adagrad, `4 rows` for row-wise Adagrad, `8 rows cols` for Adam/LAMB,
    `4 rows cols + 4 rows` for the partial row-wise ones. Unknown names count as Adam + a row
    state, with a warning."""
    key = (optimizer or "exact_sgd").replace("_", "").lower()
    if key not in _OPTIMIZER_STATE:
        if key not in _warned:
            _warned.add(key)
            logger.warning("unknown optimizer %r: counting 8 bytes/element + 4/row", optimizer)
        per_elem, per_row = 8, 4
    else:
        per_elem, per_row = _OPTIMIZER_STATE[key]
    return float(rows) * (cols * per_elem + per_row)


def table_workload(table: TableMeta, batch_size: int) -> Tuple[float, float]:
    """(ids, bags) one rank feeds into `table` per step (see the module docstring)."""
    n = len(table.feature_names)
    pooling = table.pooling_factors or [1.0] * n
    poolings = table.num_poolings or [1.0] * n
    batches = table.batch_sizes or [batch_size] * n
    ids = sum(lf * pf * bf for lf, pf, bf in zip(pooling, poolings, batches))
    bags = sum(pf * bf for pf, bf in zip(poolings, batches)) if table.pooled else ids
    return float(ids), float(bags)


def shard_traffic(
    table: TableMeta,
    sharding_type: str,
    rows: int,
    topology: Topology,
    batch_size: int,
    workload: Tuple[float, float] | None = None,
) -> Tuple[float, float]:
    """(ids_in, bags_out) of one shard holding `rows` of the table's rows."""
    ids, bags = workload or table_workload(table, batch_size)
    world = topology.world_size
    if sharding_type == "data_parallel":
        return ids, bags
    if sharding_type in ROW_BLOCK_TYPES:
        ids_in = ids * world * rows / table.num_embeddings
        return ids_in, (bags * world if table.pooled else ids_in)
    return ids * world, bags * world


def data_parallel_exchange(
    table: TableMeta,
    world: int,
    batch_size: int,
    workload: Tuple[float, float] | None = None,
    cache_params: CacheParams | None = None,
) -> Tuple[float, int]:
    """(bytes all-reduced, collectives) per step to average a data-parallel table's gradient.
    Below `ROW_EXCHANGE_MIN_BYTES` of fp32 gradient: the whole gradient, in an all-reduce
    shared with the kernel's other small tables (0 collectives of its own). At or above: a
    one-byte-per-row all-reduce of the rows in use, then the gradient of those rows, or the
    whole gradient when more than half are in use (2 collectives). Rows in use: the distinct
    rows of a global batch, `cache_params.stats.expected_lookups` when given, else those of
    `W ids` uniform draws (`distinct_rows`)."""
    rows, cols = table.num_embeddings, table.embedding_dim
    stats = cache_params.stats if cache_params is not None else None
    lookups = None if stats is None else expected_lookups(table, stats)
    grad = 4.0 * rows * cols
    if grad < ROW_EXCHANGE_MIN_BYTES:
        return grad, 0
    ids, _ = workload or table_workload(table, batch_size)
    used = distinct_rows(rows, world * ids) if lookups is None else lookups
    return float(rows) + (grad if 2 * used > rows else 4.0 * used * cols), 2


class TableFacts:
    """Per-table numbers both estimators reuse for every shard of every option."""

    __slots__ = ("table", "workload", "s_w", "s_out", "id_bytes")

    def __init__(self, table: TableMeta, batch_size: int) -> None:
        self.table = table
        self.workload = table_workload(table, batch_size)
        self.s_w = table.data_type.element_size
        # float tables (FP16 too) return fp32 rows, as fbgemm's and TorchRec's output_dtype
        self.s_out = 4.0 if self.s_w >= 2 else 2.0
        self.id_bytes = ID_BYTES + (PER_ID_WEIGHT_BYTES if table.is_weighted else 0)


def wire_id_bytes(rows: int, weighted: bool) -> float:
    """Bytes one id of a `rows`-row shard takes in the KJT all-to-all: checked ids travel in the
    narrowest integer type of their range (`recshard.comm.wire`), per-id weights as fp32."""
    return float(
        id_wire_dtype(rows, torch.int64).itemsize + (PER_ID_WEIGHT_BYTES if weighted else 0)
    )


def table_facts(cache: Dict[int, TableFacts], table: TableMeta, batch_size: int) -> TableFacts:
    facts = cache.get(id(table))
    if facts is None or facts.table is not table:
        if len(cache) > 4096:
            cache.clear()
        facts = cache[id(table)] = TableFacts(table, batch_size)
    return facts


class EmbeddingPerfEstimator:
    """Time of one shard per step (ms): compute from bytes moved at the kernel's memory
    bandwidth, communication from bytes over the links each sharding type's collectives use.

    Kernel bandwidth `bw`: fused = HBM (cuda) or DDR (cpu) bandwidth; dense = half of it;
    fused_uvm = host<->device bandwidth x uvm_efficiency; fused_uvm_caching = harmonic mix,
    `1 / (hit / hbm + (1 - hit) / uvm)` with `hit = cache_hit_rate(cache_params, rows)`;
    key_value (cpu) = fused on its DRAM cache, plus its storage reads and write-backs
    (`recshard.planner.cost.key_value`).
    With `row = ceil(cols s_w / 32) 32` bytes per row access and `out = cols s_out`:
    - fwd_compute = (ids_in (id_bytes + row) + bags_out out) / bw   (+4 bytes/id if weighted)
    - bwd_compute, fused = (bags_out out + ids_in (2 row + 2 state_row)) / bw, where the fused
      optimizer reads and writes each looked-up row and its state (`state_row` = optimizer
      state bytes per row); weighted features add `ids_in row` for the per-id weight grads.
    - bwd_compute, dense kernel and data-parallel = (bags_out out + ids_in row + rows cols
      (2 s_w + 4 + 2 state_elem)) / bw: a dense gradient and a full-table optimizer step.
    - input_dist = ids_in wire_id_bytes(rows) / a2a_bw (ids narrowed to the shard's row range
      on the wire; data-parallel: 0)
    - fwd_comms = bwd_comms: table-wise/column-wise a2a of `bags_out out`; row-wise
      reduce-scatter (fwd) / all-gather (bwd) of `bags_out out` over all ranks;
      table-row-wise reduce-scatter in the host then a2a of the `1/Lw` slice across hosts;
      sequence tables use a2a. Data-parallel: fwd 0, bwd an all-reduce of the fp32 gradient
      `4 rows cols`, or of large tables' rows in use (`data_parallel_exchange`), at a
      profile's timed backend all-reduce rate (gloo's, not the shm transport's) relative to
      its all-to-all's, each all-reduce of its own adding its latency (calibrated only).
    Link models (W ranks, Lw per host, H hosts; bandwidth counts bytes leaving a rank): a2a of
    `n` bytes sends `(Lw-1)/W n` inside the host and `(W-Lw)/W n` across hosts; a flat ring
    reduce-scatter / all-gather (what row-wise runs) sends `(W-1)/W n` over its slowest link
    (inter-host when H > 1); all-reduce twice that.
    With a calibration profile (`topology.profile`, same compute device), the fused and dense
    kernels' compute is its measured per-id / per-bag / per-element fit instead (per id: by
    the shard's rows, `KernelCost.id_ms`; elements: the
    shard's for the dense kernel, its distinct rows looked up times cols for the fused, from
    `cache_params.stats` when given (`touched_rows`); backward
    scaled by `(row + state_row) / row` for optimizer state beyond exact SGD); the per-call
    terms and collective latencies are per step, not per shard (`StepTimePerfModel`), and a
    profile that measured a real sharded module scales each phase by its `work_scale` (the
    kernels' per-element part, the update, by its `element_scale`) and adds its
    `ms_per_shard + ms_per_id ids_in` to each phase's compute.
    """

    def __init__(self, topology: Topology, batch_size: int = 512) -> None:
        self.topology = topology
        self.batch_size = batch_size
        self._facts: Dict[int, TableFacts] = {}
        topo = topology
        world, lw = topo.world_size, topo.local_world_size
        self._a2a_s_per_byte = (lw - 1) / world / topo.intra_host_bw + (
            world - lw
        ) / world / topo.inter_host_bw
        ring_bw = topo.inter_host_bw if topo.num_hosts > 1 else topo.intra_host_bw
        self._ring_s_per_byte = (world - 1) / world / ring_bw
        profile = topo.profile
        self._profile = (
            profile if profile and profile.compute_device == topo.compute_device else None
        )
        self._allreduce_ms, self._allreduce_s_per_byte = 0.0, 2 * self._ring_s_per_byte  # a ring
        if profile is not None and world > 1:
            multi_host = topo.num_hosts > 1
            level = "inter" if multi_host else "intra"
            measured, a2a_gbps = profile.link("all_reduce", level), profile.gbps(level)
            if measured is not None and a2a_gbps:
                self._allreduce_ms = measured.latency_ms
                self._allreduce_s_per_byte = self._ring_s_per_byte * a2a_gbps / measured.gbps
            else:  # an older profile: the ring's two halves
                self._allreduce_ms = sum(
                    profile.latency_ms(c, multi_host) or 0.0
                    for c in ("reduce_scatter", "all_gather")
                )

    def kernel_bw(
        self, kernel: str, cache_params: CacheParams | None = None, rows: int = 1
    ) -> float:
        """Bytes/ms a compute kernel streams embedding rows at (`rows`: of the shard)."""
        topo = self.topology
        fast = topo.hbm_mem_bw if topo.compute_device == "cuda" else topo.ddr_mem_bw
        uvm = topo.hbm_to_ddr_mem_bw * topo.uvm_efficiency
        if kernel in ("fused", "quant", KEY_VALUE):  # quant: inference lookups of packed rows;
            # key_value: its DRAM cache (storage is priced on top, `key_value_io_ms`)
            return fast
        if kernel == "dense":
            return 0.5 * fast
        if kernel == "fused_uvm":
            return uvm
        if kernel == "fused_uvm_caching":
            hit = cache_hit_rate(cache_params, rows)
            return 1.0 / (hit / fast + (1.0 - hit) / uvm)
        raise ValueError(f"no bandwidth model for compute kernel {kernel!r}")

    def estimate(
        self,
        table: TableMeta,
        sharding_type: str,
        compute_kernel: str,
        rows: int,
        cols: int,
        cache_params: CacheParams | None = None,
    ) -> Perf:
        """Perf of one `rows x cols` shard of `table` (formulas in the class docstring)."""
        topo = self.topology
        if cache_params is not None and cache_params.stats is not None:
            expected_lookups(table, cache_params.stats)  # bad stats fail whatever the option
        facts = table_facts(self._facts, table, self.batch_size)
        ids_in, bags_out = shard_traffic(
            table, sharding_type, rows, topo, self.batch_size, facts.workload
        )
        bw = self.kernel_bw(compute_kernel, cache_params, rows)
        s_w = facts.s_w
        row = math.ceil(cols * s_w / SECTOR_BYTES) * SECTOR_BYTES
        out_bytes = bags_out * cols * facts.s_out
        id_bytes = ids_in * facts.id_bytes
        fwd_compute = (id_bytes + ids_in * row + out_bytes) / bw
        state_row = optimizer_state_bytes(table.optimizer, 1, cols)
        dense_update = compute_kernel == "dense" or sharding_type == "data_parallel"
        if dense_update:
            full_update = rows * (cols * (2 * s_w + 4) + 2 * state_row)
            bwd_compute = (out_bytes + ids_in * row + full_update) / bw
        else:
            bwd_compute = (out_bytes + ids_in * (2 * row + 2 * state_row)) / bw
        update = (0.0, 0.0)  # the kernels' per-element part of fwd / bwd compute (measured only)
        if self._profile is not None and compute_kernel in ("fused", "dense") and rows > 0:
            updated = (
                float(rows)
                if dense_update
                else touched_rows(
                    table, cache_params, rows, ids_in, facts.workload[0] * topo.world_size
                )
            )
            measured = self._measured(
                compute_kernel, dense_update, updated, rows, cols, ids_in, bags_out, state_row / row
            )
            if measured is not None:
                fwd_compute, bwd_compute, update = measured
        if table.is_weighted:
            bwd_compute += ids_in * row / bw
        if compute_kernel == KEY_VALUE:
            read_ms, write_ms = key_value_io_ms(
                table,
                cache_params,
                rows,
                ids_in,
                facts.workload[0] * topo.world_size,
                row + state_row,
                topo,
            )
            fwd_compute += read_ms
            bwd_compute += write_ms
        if sharding_type == "data_parallel":
            exchanged, collectives = data_parallel_exchange(
                table, topo.world_size, self.batch_size, facts.workload, cache_params
            )
            comms = exchanged * self._allreduce_s_per_byte + collectives * self._allreduce_ms
            return self._scaled(
                sharding_type, Perf(fwd_compute, 0.0, bwd_compute, comms, 0.0), ids_in, update
            )
        input_dist = ids_in * wire_id_bytes(rows, table.is_weighted) * self._a2a_s_per_byte
        if not table.pooled or sharding_type in ("table_wise", "column_wise", "table_column_wise"):
            comms = out_bytes * self._a2a_s_per_byte
        elif sharding_type == "row_wise":
            comms = out_bytes * self._ring_s_per_byte
        else:  # table_row_wise: reduce-scatter inside the host, then a2a across hosts
            lw, hosts = topo.local_world_size, topo.num_hosts
            comms = out_bytes * (lw - 1) / lw / topo.intra_host_bw
            comms += out_bytes / lw * (hosts - 1) / hosts / topo.inter_host_bw
        return self._scaled(
            sharding_type, Perf(fwd_compute, comms, bwd_compute, comms, input_dist), ids_in, update
        )

    def _scaled(
        self, sharding_type: str, perf: Perf, ids_in: float, update: Tuple[float, float]
    ) -> Perf:
        """`perf` with each phase times the profile's measured `work_scale` of the type (its
        kernels' per-element part `update` times its `element_scale`), plus its measured cost
        per shard and per id looked up."""
        profile = self._profile
        if profile is None or not profile.steps:
            return perf
        fwd = profile.work_scale(sharding_type, "fwd")
        bwd = profile.work_scale(sharding_type, "bwd")
        fwd_update = update[0] * (profile.element_scale(sharding_type, "fwd") - fwd)
        bwd_update = update[1] * (profile.element_scale(sharding_type, "bwd") - bwd)
        return Perf(
            perf.fwd_compute * fwd + fwd_update + profile.shard_ms(sharding_type, "fwd", ids_in),
            perf.fwd_comms * fwd,
            perf.bwd_compute * bwd + bwd_update + profile.shard_ms(sharding_type, "bwd", ids_in),
            perf.bwd_comms * bwd,
            perf.input_dist * fwd,
        )

    def _measured(
        self,
        kernel: str,
        dense_update: bool,
        updated: float,
        rows: int,
        cols: int,
        ids_in: float,
        bags_out: float,
        state_ratio: float,
    ) -> Tuple[float, float, Tuple[float, float]] | None:
        """(fwd, bwd, their per-element parts) ms from the calibration profile (`updated`:
        rows the update touches, `rows`: the shard's); None if it lacks the kernel. A sparse
        update's ids cost what they cost in a table of their `working_rows`: skewed ids touch
        a hot set that stays in cache."""
        profile = self._profile
        assert profile is not None
        measured_kernel = "dense" if dense_update else kernel
        id_rows = float(rows) if dense_update else working_rows(rows, updated, ids_in)
        fwd = profile.kernel_ms(
            measured_kernel, "fwd", cols, ids_in, bags_out, updated * cols, id_rows
        )
        bwd = profile.kernel_ms(
            measured_kernel, "bwd", cols, ids_in, bags_out, updated * cols, id_rows
        )
        if fwd is None or bwd is None:
            return None
        elements = updated * cols
        fwd_update = profile.kernel_ms(measured_kernel, "fwd", cols, 0.0, 0.0, elements) or 0.0
        bwd_update = profile.kernel_ms(measured_kernel, "bwd", cols, 0.0, 0.0, elements) or 0.0
        ratio = 1.0 + state_ratio
        return fwd, bwd * ratio, (fwd_update, bwd_update * ratio)
