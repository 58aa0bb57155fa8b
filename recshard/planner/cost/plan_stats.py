"""A neutral yardstick for any sharding plan (the planner's own, a JSON one, a hand-written
one): per rank, the bytes it stores, the rows it looks up and bytes it reads per step, the
bytes it sends and receives per step, and the estimated step time; max and mean of each.

Traffic per step counts the input dist (ids, 8 bytes each plus 4 per weight), the output dist
forward and its gradient backward (`cols x 4` bytes per bag, fp32), and data-parallel's
gradient all-reduce (ring: `2 (W-1)/W` of what `data_parallel_exchange` sends: the fp32
gradient, or for large tables the rows in use, each way). Row-wise output is a
reduce-scatter / all-gather over all ranks (ring: `(W-1)/W` of the `W B cols` buffer each
way); table-row-wise reduces inside the host and exchanges across hosts among ranks of equal
local rank. Every rank is assumed to feed the same batch (`batch_size` samples).

Memory per rank is the storage estimate of its shards, the calibrated fixed growth of a rank
and, on cpu with two or more ranks on a host, what the shared-memory transport among them
keeps resident: at most its byte cap, `Topology.intra_host_transport_bytes` (0: the job runs
without it), held once the plan sends anything through it (any collective of the ranks of a
host, or of all ranks when there is one host). A module whose pooled tables span more than one
sharding (placed, row-wise, table-row-wise, data-parallel) also holds its outputs' join on
every rank (`module_join_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, List, Sequence, Tuple

from recshard.plan.sharding_types import ALL_SHARDING_TYPES, PLACED_TYPES, SEQUENCE_SHARDING_TYPES
from recshard.plan.validate import PlanValidationError, check_table_plan
from recshard.planner.cost.estimators import (
    EmbeddingPerfEstimator,
    data_parallel_exchange,
    optimizer_state_bytes,
    shard_traffic,
    table_workload,
    wire_id_bytes,
)
from recshard.planner.cost.step_model import StepTimePerfModel
from recshard.planner.cost.storage import EmbeddingStorageEstimator
from recshard.planner.planner_types import ROW_BLOCK_TYPES, TableMeta, Topology
from recshard.types import ParameterSharding, PipelineType, ShardingPlan, ShardingType

_GRAD_BYTES = 4.0
# a multi-sharding module's `[B, sum of dims]` copies (`recshard.distributed.pooled_output`):
# the shardings' outputs concatenated, reordered into key order, and that reorder's gradient
JOIN_COPIES = 3


@dataclass
class StepTerms:
    """One rank's estimated ms per step by phase: forward compute, forward communication
    (input dist + output dist), backward compute (+ update), backward communication."""

    fwd_compute: float = 0.0
    fwd_comms: float = 0.0
    bwd_compute: float = 0.0
    bwd_comms: float = 0.0


@dataclass
class RankLoad:
    """What one rank carries per step under a plan (bytes, ids, estimated ms)."""

    rank: int
    bytes_stored: float = 0.0  # weights and optimizer state
    memory: float = 0.0  # the storage estimate: + gradients, buffers in flight, fixed overhead
    storage: float = 0.0  # key_value tables' files on local storage (not in `memory`)
    transport_memory: float = 0.0  # the part of `memory` the shared-memory transport holds
    lookups: float = 0.0
    bytes_read: float = 0.0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    compute_ms: float = 0.0
    comms_ms: float = 0.0
    terms: StepTerms = field(default_factory=StepTerms)  # compute_ms + comms_ms by phase

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comms_ms


LOAD_FIELDS = [
    f.name for f in fields(RankLoad) if f.name not in ("rank", "terms", "transport_memory")
] + ["total_ms"]


@dataclass
class PlanStats:
    """Per-rank loads of one plan, the per-step fixed cost of its sharding groups, and the
    predicted step time (slowest rank + fixed cost)."""

    world_size: int
    batch_size: int
    fixed_ms: float
    ranks: List[RankLoad] = field(default_factory=list)

    def max(self, name: str) -> float:
        return max(getattr(r, name) for r in self.ranks)

    def mean(self, name: str) -> float:
        return sum(getattr(r, name) for r in self.ranks) / len(self.ranks)

    @property
    def predicted_step_ms(self) -> float:
        return self.max("total_ms") + self.fixed_ms

    def format(self) -> str:
        """Per-rank table with a max and a mean row (MiB, millions of ids, ms)."""
        header = [
            "rank",
            "stored MiB",
            "memory MiB",
            "storage MiB",
            "lookups M",
            "read MiB",
            "sent MiB",
            "recv MiB",
            "compute ms",
            "comms ms",
            "total ms",
        ]
        units = [2**20, 2**20, 2**20, 1e6, 2**20, 2**20, 2**20, 1.0, 1.0, 1.0]

        def row(label: str, values: Sequence[float]) -> List[str]:
            return [label] + [f"{v / u:.3f}" for v, u in zip(values, units)]

        rows = [row(str(r.rank), [getattr(r, n) for n in LOAD_FIELDS]) for r in self.ranks]
        rows.append(row("max", [self.max(n) for n in LOAD_FIELDS]))
        rows.append(row("mean", [self.mean(n) for n in LOAD_FIELDS]))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(
            f"per-step fixed cost (collective latency, kernel calls): "
            f"{self.fixed_ms:.3f} ms; predicted step time: "
            f"{self.predicted_step_ms:.3f} ms"
        )
        return "\n".join(lines)


def _find_table(
    tables: Dict[Tuple[str, str], TableMeta],
    by_name: Dict[str, List[TableMeta]],
    fqn: str,
    name: str,
) -> TableMeta:
    found = tables.get((fqn, name))
    if found is not None:
        return found
    candidates = by_name.get(name, [])
    if len(candidates) == 1:
        return candidates[0]
    where = f"'{fqn}.{name}'" if fqn else f"'{name}'"
    raise PlanValidationError(
        f"table {where}: in the plan but not among the tables given"
        if not candidates
        else f"table {where}: several tables of that name; give module paths"
    )


def match_plan(
    plan: ShardingPlan, tables: Sequence[TableMeta], topology: Topology
) -> List[Tuple[TableMeta, ParameterSharding]]:
    """Each plan entry with its table, checked by the plan rules (`check_table_plan`: known
    type and kernel, ranks inside the world and agreeing with the placements, shards that
    tile the table); every table planned exactly once. PlanValidationError names the table."""
    keyed = {(t.module_fqn, t.name): t for t in tables}
    by_name: Dict[str, List[TableMeta]] = {}
    for t in tables:
        by_name.setdefault(t.name, []).append(t)
    out: List[Tuple[TableMeta, ParameterSharding]] = []
    planned: Dict[int, str] = {}
    for fqn, module_plan in plan.plan.items():
        for name, ps in module_plan.items():
            table = _find_table(keyed, by_name, fqn, name)
            where = f"table '{fqn}.{name}'" if fqn else f"table '{name}'"
            if id(table) in planned:
                raise PlanValidationError(f"{where}: planned twice (also as {planned[id(table)]})")
            planned[id(table)] = where
            check_table_plan(
                table,
                ps,
                topology.world_size,
                topology.local_world_size,
                ALL_SHARDING_TYPES if table.pooled else SEQUENCE_SHARDING_TYPES,
                where=where,
                owner="a pooled table" if table.pooled else "a sequence table",
            )
            out.append((table, ps))
    missing = [t.key for t in tables if id(t) not in planned]
    if missing:
        raise PlanValidationError(
            f"table '{missing[0]}': among the tables but not in the plan"
            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return out


def module_join_bytes(
    matched: Sequence[Tuple[TableMeta, ParameterSharding]], batch_size: int
) -> float:
    """Bytes every rank holds to join the outputs of modules whose pooled tables span more
    than one sharding: `JOIN_COPIES x batch x (sum of the module's dims)` fp32 each (a 2 x 2
    ranks plan of 9 table-wise, 6 column-wise and 11 data-parallel tables at d128, batch 2048,
    measured 256 MB a rank where the estimate without the join said 170)."""
    kinds: Dict[str, set] = {}
    widths: Dict[str, int] = {}
    for table, ps in matched:
        if table.pooled:
            st = ShardingType(ps.sharding_type)
            kinds.setdefault(table.module_fqn, set()).add("placed" if st in PLACED_TYPES else st)
            widths[table.module_fqn] = widths.get(table.module_fqn, 0) + table.embedding_dim * len(
                table.feature_names
            )
    return sum(
        JOIN_COPIES * batch_size * widths[fqn] * _GRAD_BYTES
        for fqn, found in kinds.items()
        if len(found) > 1
    )


def _shards(ps: ParameterSharding, table: TableMeta, world: int) -> List[Tuple[int, int, int]]:
    """(rank, rows, cols) of every shard; data-parallel: the whole table on every rank."""
    if ps.sharding_type == "data_parallel":
        return [(r, table.num_embeddings, table.embedding_dim) for r in range(world)]
    return [(s.rank, s.shard_sizes[0], s.shard_sizes[1]) for s in ps.shards or []]


def plan_stats(
    plan: ShardingPlan,
    tables: Sequence[TableMeta],
    topology: Topology,
    batch_size: int = 512,
    pipeline_type: PipelineType = PipelineType.NONE,
) -> PlanStats:
    """The per-rank loads of `plan` for `tables` on `topology`, training under
    `pipeline_type`. The plan must plan every table once (matched by module path and name,
    or by name when unambiguous) and pass the plan rules (`match_plan`); PlanValidationError
    names the table otherwise."""
    world = topology.world_size
    perf_est = EmbeddingPerfEstimator(topology, batch_size)
    storage_est = EmbeddingStorageEstimator(topology, batch_size, pipeline_type)
    loads = [RankLoad(r) for r in range(world)]
    traffic = _Traffic(world, topology.local_world_size)
    groups = []
    matched = match_plan(plan, tables, topology)
    for table, ps in matched:
        groups.append(
            (ps.sharding_type, ps.compute_kernel, table.embedding_dim, len(table.feature_names))
        )
        s_w = table.data_type.element_size
        shards = _shards(ps, table, world)
        for rank, rows, cols in shards:
            load = loads[rank]
            perf = perf_est.estimate(
                table, ps.sharding_type, ps.compute_kernel, rows, cols, ps.cache_params
            )
            storage = storage_est.estimate(
                table, ps.sharding_type, ps.compute_kernel, rows, cols, ps.cache_params
            )
            ids_in, _ = shard_traffic(table, ps.sharding_type, rows, topology, batch_size)
            load.bytes_stored += rows * cols * s_w + optimizer_state_bytes(
                table.optimizer, rows, cols
            )
            load.memory += storage.hbm + storage.ddr
            load.storage += storage.storage
            load.lookups += ids_in
            load.bytes_read += ids_in * cols * s_w
            load.compute_ms += perf.fwd_compute + perf.bwd_compute
            load.comms_ms += perf.fwd_comms + perf.bwd_comms + perf.input_dist
            terms = load.terms
            terms.fwd_compute += perf.fwd_compute
            terms.fwd_comms += perf.fwd_comms + perf.input_dist
            terms.bwd_compute += perf.bwd_compute
            terms.bwd_comms += perf.bwd_comms
        traffic.add_table(table, ps, shards, batch_size)
    overhead = rank_overhead_bytes(topology) + module_join_bytes(matched, batch_size)
    resident = topology.transport_bytes_per_rank if traffic.uses_transport() else 0.0
    for load, sent, received in zip(loads, traffic.sent(), traffic.received()):
        load.bytes_sent, load.bytes_received = sent, received
        load.transport_memory = resident
        load.memory += overhead + resident
    fixed = StepTimePerfModel(topology).fixed_ms(groups)
    return PlanStats(world, batch_size, fixed, loads)


def rank_overhead_bytes(topology: Topology) -> float:
    """The measured fixed memory growth of a rank (calibrated on cpu:
    `MemoryCost.fixed_bytes_per_rank`); 0 without a cpu memory profile."""
    profile = topology.profile
    if (
        profile is None
        or profile.memory is None
        or topology.compute_device != "cpu"
        or profile.compute_device != "cpu"
    ):
        return 0.0
    return profile.memory.fixed_bytes_per_rank()


class _Flow:
    """Bytes each rank sends and receives per step in one collective call; "to every rank"
    amounts are kept as one scalar plus per-rank corrections so a table costs O(shards), not
    O(ranks^2)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._sent = [0.0] * world
        self._recv = [0.0] * world
        self._all_sent = 0.0
        self._all_recv = 0.0

    def sent(self) -> List[float]:
        return [s + self._all_sent for s in self._sent]

    def received(self) -> List[float]:
        return [r + self._all_recv for r in self._recv]

    def every_rank(self, amount: float) -> None:
        """Every rank sends and receives `amount`."""
        self._all_sent += amount
        self._all_recv += amount

    def own(self, rank: int, sent: float, received: float) -> None:
        self._sent[rank] += sent
        self._recv[rank] += received

    def one_to_all(self, owner: int, amount: float, ranks: range | None = None) -> None:
        """`owner` sends `amount` to every other rank (of `ranks`; default all)."""
        if ranks is None:
            self._all_recv += amount
            self._recv[owner] -= amount
            self._sent[owner] += amount * (self.world - 1)
            return
        for r in ranks:
            if r != owner:
                self._recv[r] += amount
                self._sent[owner] += amount

    def all_to_one(self, owner: int, amount: float) -> None:
        """Every other rank sends `amount` to `owner`."""
        self._all_sent += amount
        self._sent[owner] -= amount
        self._recv[owner] += amount * (self.world - 1)


# The group of ranks a collective runs in (what decides whether the intra-host transport
# carries it): all ranks, the ranks of one host, or none of the transport's (the backend's own
# all-reduce, table-row-wise's all-to-all across hosts).
_WORLD, _HOST, _BACKEND = "world", "host", "backend"


class _Traffic:
    """Bytes each rank sends and receives per step, by collective call: a call is one sharding
    group's (module, `PLACED_TYPES` together, other types each alone: as
    `recshard.sharding.build` groups tables) use of one call site."""

    def __init__(self, world: int, local_world_size: int) -> None:
        self.world, self.lw = world, local_world_size
        self._flows: Dict[Tuple[str, str, str, str], _Flow] = {}  # in issue order

    def _flow(self, ranks: str, site: str, fqn: str, sharding_type: str) -> _Flow:
        group = "placed" if ShardingType(sharding_type) in PLACED_TYPES else sharding_type
        key = (ranks, site, fqn, group)
        if key not in self._flows:
            self._flows[key] = _Flow(self.world)
        return self._flows[key]

    def sent(self) -> List[float]:
        return [sum(v) for v in zip(*(f.sent() for f in self._flows.values()))] or [
            0.0
        ] * self.world

    def received(self) -> List[float]:
        return [sum(v) for v in zip(*(f.received() for f in self._flows.values()))] or [
            0.0
        ] * self.world

    def uses_transport(self) -> bool:
        """Whether any call goes through the intra-host transport: a collective of two or
        more ranks on one host (all ranks when there is one host)."""
        carried = {_WORLD: self.world > 1 and self.world == self.lw, _HOST: self.lw > 1}
        return any(carried.get(ranks, False) for ranks, _, _, _ in self._flows)

    def add_table(
        self,
        table: TableMeta,
        ps: ParameterSharding,
        shards: List[Tuple[int, int, int]],
        batch_size: int,
    ) -> None:
        world, fqn = self.world, table.module_fqn
        ids, bags = table_workload(table, batch_size)
        st = ps.sharding_type
        if st == "data_parallel":
            if world > 1:
                exchanged, _ = data_parallel_exchange(
                    table, world, batch_size, cache_params=ps.cache_params
                )
                self._flow(_BACKEND, "all_reduce", fqn, st).every_rank(
                    2.0 * (world - 1) / world * exchanged
                )  # ring
            return
        rows_split = st in ROW_BLOCK_TYPES
        out_site = "pooled" if table.pooled else "sequence"
        for rank, rows, cols in shards:
            share = rows / table.num_embeddings if rows_split else 1.0
            self._flow(_WORLD, "input_dist", fqn, st).all_to_one(
                rank, ids * share * wire_id_bytes(rows, table.is_weighted)
            )
            out = cols * _GRAD_BYTES
            if not table.pooled:  # sequence: per-id rows back, per-id grads in
                self._flow(_WORLD, out_site, fqn, st).one_to_all(rank, ids * share * out)
                self._flow(_WORLD, out_site + "_bwd", fqn, st).all_to_one(rank, ids * share * out)
            elif not rows_split:  # a2a of the pooled output, its gradient back
                self._flow(_WORLD, out_site, fqn, st).one_to_all(rank, bags * out)
                self._flow(_WORLD, out_site + "_bwd", fqn, st).all_to_one(rank, bags * out)
        if rows_split and table.pooled:
            self._pooled_rows(st, fqn, table, shards, bags)

    def _pooled_rows(
        self, st: str, fqn: str, table: TableMeta, shards: List[Tuple[int, int, int]], bags: float
    ) -> None:
        """Row-wise: reduce-scatter (fwd) + all-gather (bwd) over all ranks, `(W-1)/W` of the
        `W B cols` buffer each way. Table-row-wise: the same inside the owners' host (over
        all ranks when there is one host), then an a2a across hosts."""
        world, lw = self.world, self.lw
        cols = table.embedding_dim
        buffer = world * bags * cols * _GRAD_BYTES
        if st == "row_wise":
            for site in ("reduce_scatter", "reduce_scatter_bwd"):
                self._flow(_WORLD, site, fqn, st).every_rank((world - 1) / world * buffer)
            return
        host = _WORLD if world == lw else _HOST
        for rank, _, _ in shards:
            ring = (lw - 1) / lw * buffer
            for site in ("reduce_scatter", "reduce_scatter_bwd"):
                self._flow(host, site, fqn, st).own(rank, ring, ring)
            local = rank % lw
            peers = range(local, world, lw)  # equal local rank on every host
            amount = bags * cols * _GRAD_BYTES
            self._flow(_BACKEND, "cross_a2a", fqn, st).one_to_all(rank, amount, peers)  # fwd
            back = self._flow(_BACKEND, "cross_a2a_bwd", fqn, st)
            for r in peers:  # bwd: the gradients come back
                if r != rank:
                    back.own(r, amount, 0.0)
                    back.own(rank, 0.0, amount)
