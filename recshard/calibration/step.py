"""A real sharded module's per-step costs per sharding type (`StepCost`).

A sharded `EmbeddingBagCollection` costs more per step than its kernels' work and the bytes
on its links: per sharding group and per feature, the input dist's all-to-alls and splits, the
permutes, the output dist, the autograd nodes. This is timed on tables so small (64 rows, dim
16, batch 64, one id per bag) that their work is near zero, at two feature counts, and fitted
as `ms = ms_per_group + ms_per_feature features` per sharding type and phase. And per unit of
work: 12 modules of 8 and 24 real-sized tables (20 to 50 k rows, 1 to 20 ids per bag, dims 16
to 128, batches 256 to 2048) are timed per sharding type, and what the slowest rank takes
beyond the tiny probes' overhead is fitted per phase (`fit_work`) as `work_scale` times the
kernel and link fits' estimate for that rank (`plan_stats`) with its kernels' per-element part
(the update) times `element_scale` instead, plus `ms_per_shard` per shard it holds and
`ms_per_id` per id it looks up: copies and permutes scale with the work, the update with a
scale of its own (data-parallel's whole-table update costs a real module 2-3x the kernel
fits', its lookups ~1.3x), a real-sized table's own buffers and calls come with each shard, and
the input dist's per-id work is neither in the kernel fits nor on the wire. Table counts, dims
and ids per table vary across the modules to tell the terms apart. Both run on the job's own
ranks, so their links are in it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from recshard.calibration.fitting import WorkSample, fit_work
from recshard.calibration.kernels import LR
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.modules.embedding_configs import EmbeddingBagConfig
from recshard.modules.embedding_modules import EmbeddingBagCollection
from recshard.planner.cost.plan_stats import StepTerms, plan_stats
from recshard.planner.planner_types import ParameterConstraints, TableMeta, Topology
from recshard.planner.profile import STEP_TYPES, CalibrationProfile, StepCost
from recshard.planner.search.planner import EmbeddingShardingPlanner
from recshard.sparse import KeyedJaggedTensor
from recshard.types import ShardingEnv, ShardingPlan


@dataclass(frozen=True)
class StepProbe:
    """The probes' tables and steps: tiny ones for the fixed overhead, real-sized ones for the
    work scale."""

    features: Tuple[int, int] = (2, 16)
    rows: int = 64
    dim: int = 16
    batch: int = 64
    steps: int = 15
    warmup: int = 3
    # real-sized modules: tables of 20 to 50 k rows and 1 to 16 ids per bag, as a rank holds
    work_rows: Tuple[int, ...] = (20, 200, 2_000, 20_000, 50_000, 500, 5_000, 50_000) * 3
    # the 8-table modules: ids mostly to large tables; 24: as many ids as a Criteo-like set's
    # (~11 per table), many to small tables
    work_poolings: Tuple[int, ...] = (
        (1, 2, 4, 8, 16, 3, 6, 12) + (20, 16, 12, 4, 2, 20, 8, 10) + (16, 20, 8, 20, 12, 4, 20, 16)
    )
    # (dim, batch, tables): the first `tables` of work_rows / work_poolings; 12 modules, so
    # that 3 terms per type and phase are fitted on 12 points (on 4, they moved by 2x from
    # one calibration to the next)
    work: Tuple[Tuple[int, int, int], ...] = (
        (32, 256, 8),
        (16, 2048, 24),
        (128, 512, 24),
        (64, 2048, 24),
        (16, 512, 24),
        (128, 2048, 24),
        (64, 512, 8),
        (16, 256, 8),
        (128, 256, 8),
        (64, 1024, 24),
        (32, 2048, 8),
        (128, 1024, 8),
    )
    work_steps: int = 10
    budget_s: float = 0.4  # per module: more steps where they fit (at most max_steps)
    max_steps: int = 80

    @classmethod
    def quick(cls) -> StepProbe:
        return cls(
            features=(1, 3),
            steps=2,
            warmup=1,
            work_rows=(20, 2_000),
            work_poolings=(1, 4),
            work=((16, 64, 1), (16, 64, 2)),
            work_steps=2,
            budget_s=0.0,
        )


@dataclass(frozen=True)
class _Probe:
    """One probe module: its tables' rows and ids per bag, dim and batch."""

    rows: Tuple[int, ...]
    poolings: Tuple[int, ...]
    dim: int
    batch: int

    def metas(self) -> List[TableMeta]:
        return [
            TableMeta(f"t{i}", rows, self.dim, [f"f{i}"], pooling_factors=[float(pooling)])
            for i, (rows, pooling) in enumerate(zip(self.rows, self.poolings))
        ]


def _probe_plan(sharding_type: str, probe: _Probe, topology: Topology) -> ShardingPlan:
    kernel = ["dense"] if sharding_type == "data_parallel" else ["fused"]
    forced = {
        m.name: ParameterConstraints(
            sharding_types=[sharding_type],
            compute_kernels=kernel,
            min_partition=max(probe.dim // 4, 1),
        )
        for m in probe.metas()
    }
    return EmbeddingShardingPlanner(
        topology, probe.batch, constraints=forced, debug=False
    ).plan_tables(probe.metas())


def _time_plan(
    plan: ShardingPlan,
    probe: _Probe,
    group: dist.ProcessGroup,
    steps: int,
    warmup: int,
    budget_s: float = 0.0,
    max_steps: int = 0,
) -> Tuple[float, float]:
    """Slowest rank's median ms of the forward and of backward + update, every rank
    stepping together: `steps` steps, or more (up to `max_steps`) where they fit in
    `budget_s` (small modules' medians steady with more steps, for little time)."""
    configs = [
        EmbeddingBagConfig(
            num_embeddings=m.num_embeddings,
            embedding_dim=m.embedding_dim,
            name=m.name,
            feature_names=list(m.feature_names),
        )
        for m in probe.metas()
    ]
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": LR}
    )
    module = sharder.shard(
        EmbeddingBagCollection(configs, device="meta"),
        plan.plan[""],
        ShardingEnv.from_process_group(group),
    )
    dense = [
        p
        for p in module.parameters()
        if p.requires_grad and not getattr(p, "_in_backward_optimizers", False)
    ]
    sgd = torch.optim.SGD(dense, lr=LR) if dense else None
    g = torch.Generator().manual_seed(dist.get_rank(group))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [c.feature_names[0] for c in configs],
        torch.cat(
            [
                torch.randint(0, rows, (probe.batch * pooling,), generator=g)
                for rows, pooling in zip(probe.rows, probe.poolings)
            ]
        ),
        torch.tensor(probe.poolings, dtype=torch.int32).repeat_interleave(probe.batch),
        stride=probe.batch,
    )
    fwd, bwd = [], []
    total = warmup + steps
    step = 0
    while step < total:
        dist.barrier(group)
        t0 = time.perf_counter()
        pooled = module(kjt)
        t1 = time.perf_counter()
        pooled.values().sum().backward()
        if sgd is not None:
            sgd.step()
            sgd.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if step >= warmup:
            fwd.append(1e3 * (t1 - t0))
            bwd.append(1e3 * (t2 - t1))
        elif step == warmup - 1:  # as many steps as fill `budget_s` on the slowest rank
            last = torch.tensor([t2 - t0], dtype=torch.float64)
            dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group)
            total = warmup + max(steps, min(max_steps, int(budget_s / max(last.item(), 1e-6))))
        step += 1
    slowest = torch.tensor([statistics.median(fwd), statistics.median(bwd)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest[0].item(), slowest[1].item()


def measure_fixed_costs(
    group: dist.ProcessGroup, topology: Topology, probe: StepProbe
) -> List[StepCost]:
    """Per sharding type and phase, one group's fixed ms and ms per feature, from the tiny
    probes (work scale 1, nothing per shard or id yet)."""
    fixed: List[StepCost] = []
    for sharding_type in STEP_TYPES:
        times = [
            _time_plan(
                _probe_plan(sharding_type, tiny, topology),
                tiny,
                group,
                probe.steps,
                probe.warmup,
                probe.budget_s,
                probe.max_steps,
            )
            for tiny in (
                _Probe((probe.rows,) * n, (1,) * n, probe.dim, probe.batch) for n in probe.features
            )
        ]
        f0, f1 = probe.features
        for p, phase in enumerate(("fwd", "bwd")):
            per_feature = max((times[1][p] - times[0][p]) / (f1 - f0), 0.0)
            fixed.append(
                StepCost(
                    sharding_type, phase, max(times[0][p] - per_feature * f0, 0.0), per_feature
                )
            )
    return fixed


def measure_work(group: dist.ProcessGroup, costed: Topology, probe: StepProbe) -> List[WorkSample]:
    """The real-sized probe modules of every sharding type, timed against `costed`'s
    estimate (its profile's kernel and link fits and fixed step costs)."""
    assert costed.profile is not None
    no_update = Topology(
        costed.world_size,
        costed.compute_device,
        local_world_size=costed.local_world_size,
        profile=_without_element_costs(costed.profile),
    )
    samples: List[WorkSample] = []
    for dim, batch, tables in probe.work:
        work = _Probe(probe.work_rows[:tables], probe.work_poolings[:tables], dim, batch)
        for sharding_type in STEP_TYPES:
            plan = _probe_plan(sharding_type, work, costed)
            measured = _time_plan(
                plan, work, group, probe.work_steps, probe.warmup, probe.budget_s, probe.max_steps
            )
            slowest = max(
                plan_stats(plan, work.metas(), costed, batch).ranks, key=lambda r: r.total_ms
            )
            rest = next(
                r
                for r in plan_stats(plan, work.metas(), no_update, batch).ranks
                if r.rank == slowest.rank
            )
            modelled = (_phase_ms(slowest.terms, "fwd"), _phase_ms(slowest.terms, "bwd"))
            modelled_rest = (_phase_ms(rest.terms, "fwd"), _phase_ms(rest.terms, "bwd"))
            shards = float(_shards_on(plan, slowest.rank))
            for p, phase in enumerate(("fwd", "bwd")):
                overhead = costed.profile.step_ms_phase(sharding_type, phase, len(work.rows))
                samples.append(
                    WorkSample(
                        sharding_type,
                        phase,
                        modelled[p],
                        shards,
                        slowest.lookups,
                        measured[p] - overhead,
                        max(modelled[p] - modelled_rest[p], 0.0),
                    )
                )
    return samples


def _phase_ms(terms: StepTerms, phase: str) -> float:
    if phase == "fwd":
        return terms.fwd_compute + terms.fwd_comms
    return terms.bwd_compute + terms.bwd_comms


def _without_element_costs(profile: CalibrationProfile) -> CalibrationProfile:
    """`profile` with its kernels' per-element costs 0: the estimate without the update."""
    return replace(profile, kernels=[replace(k, ms_per_element=0.0) for k in profile.kernels])


def fit_step_costs(fixed: Sequence[StepCost], samples: Sequence[WorkSample]) -> List[StepCost]:
    """`fixed` with each (type, phase)'s work scale, update scale, ms per shard and ms per id
    fitted on its samples (`fit_work`)."""
    out = []
    for cost in fixed:
        scale, element_scale, per_shard, per_id = fit_work(
            [s for s in samples if (s.sharding_type, s.phase) == (cost.sharding_type, cost.phase)]
        )
        out.append(
            replace(
                cost,
                work_scale=scale,
                element_scale=element_scale,
                ms_per_shard=per_shard,
                ms_per_id=per_id,
            )
        )
    return out


def measure_step_costs(
    group: dist.ProcessGroup, profile: CalibrationProfile, probe: StepProbe | None = None
) -> List[StepCost]:
    """Per sharding type and phase, the fixed overhead of one group per step and the work
    scale (see the module docstring), on top of `profile`'s kernel and link fits. Every rank
    of `group` must call this."""
    probe = probe or StepProbe()
    topology = Topology(
        dist.get_world_size(group), "cpu", local_world_size=profile.local_world_size
    )
    fixed = measure_fixed_costs(group, topology, probe)
    costed = Topology(
        topology.world_size,
        "cpu",
        local_world_size=profile.local_world_size,
        profile=replace(profile, steps=fixed),
    )
    out = fit_step_costs(fixed, measure_work(group, costed, probe))
    # the same samples on every rank, but least squares may round differently per process
    shared = [out]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    return shared[0]


def _shards_on(plan: ShardingPlan, rank: int) -> int:
    """Shards of `plan` held by `rank` (a data-parallel table: one on every rank)."""
    return sum(
        1
        if ps.sharding_type == "data_parallel"
        else sum(1 for s in ps.shards or [] if s.rank == rank)
        for ps in plan.plan[""].values()
    )
