"""Why the planner chose what it chose for one table (`recshard-plan --explain TABLE`).

Every option the enumerator priced for the table (sharding type, compute kernel, shard count)
is listed with its summed forward, backward and communication estimate and its memory, and
re-placed into the planner's final plan in place of the chosen one (the other tables keep
their options): the resulting estimated step time, or "does not fit", is what the choice was
weighed on. The chosen option is the one whose plan was fastest among those the search
reached; an alternative that re-places faster is reported as such (the search is heuristic).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

from recshard.planner.planner_types import PlannerError, ShardingOption, TableMeta
from recshard.planner.search.planner import EmbeddingShardingPlanner
from recshard.planner.search.stats import compress_ranks


@dataclass
class OptionCost:
    """One priced option of the table; ms summed over its shards, memory in bytes."""

    sharding_type: str
    compute_kernel: str
    num_shards: int
    fwd_ms: float
    bwd_ms: float
    comm_ms: float
    max_shard_ms: float
    memory: float
    plan_ms: float  # the plan's estimated step time with this option (inf: does not fit)
    ranks: List[int] | None = None
    chosen: bool = False
    storage: float = 0.0  # key_value files on local storage (`memory`: HBM + DRAM)

    @property
    def label(self) -> str:
        return f"{self.sharding_type}/{self.compute_kernel}/{self.num_shards}"


@dataclass
class Explanation:
    """The options of one table, best plan first, and the reason for the choice."""

    table: str
    plan_ms: float
    options: List[OptionCost] = field(default_factory=list)
    reason: str = ""

    @property
    def chosen(self) -> OptionCost:
        return next(o for o in self.options if o.chosen)

    def format(self) -> str:
        header = [
            "option (type/kernel/shards)",
            "fwd ms",
            "bwd ms",
            "comm ms",
            "max shard ms",
            "memory MiB",
            "storage MiB",
            "plan ms",
            "ranks",
        ]
        rows = []
        for o in self.options:
            plan = f"{o.plan_ms:.3f}" if math.isfinite(o.plan_ms) else "does not fit"
            rows.append(
                [
                    ("* " if o.chosen else "  ") + o.label,
                    f"{o.fwd_ms:.3f}",
                    f"{o.bwd_ms:.3f}",
                    f"{o.comm_ms:.3f}",
                    f"{o.max_shard_ms:.3f}",
                    f"{o.memory / 2**20:.3f}",
                    f"{o.storage / 2**20:.3f}",
                    plan,
                    compress_ranks(o.ranks) if o.ranks else "-",
                ]
            )
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines = [
            f"table '{self.table}': {len(self.options)} options priced; plan step "
            f"estimate {self.plan_ms:.3f} ms (* = chosen)"
        ]
        lines.append(
            "  ".join(
                h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))
            )
        )
        lines += [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
            for r in rows
        ]
        lines.append(self.reason)
        return "\n".join(lines)


def _find(space: List[List[ShardingOption]], name: str) -> int:
    matches = [i for i, opts in enumerate(space) if name in (opts[0].table.key, opts[0].table.name)]
    if len(matches) != 1:
        known = ", ".join(opts[0].table.key for opts in space[:20])
        raise PlannerError(
            f"--explain: table '{name}' "
            f"{'is ambiguous' if matches else 'not found'}; tables: {known}"
        )
    return matches[0]


def _same(a: ShardingOption, b: ShardingOption) -> bool:
    return (a.sharding_type, a.compute_kernel, a.num_shards) == (
        b.sharding_type,
        b.compute_kernel,
        b.num_shards,
    ) and [(s.rows, s.cols) for s in a.segments] == [(s.rows, s.cols) for s in b.segments]


def explain_table(
    planner: EmbeddingShardingPlanner, tables: Sequence[TableMeta], name: str
) -> Explanation:
    """Explain the choice for table `name` (key or name) in `planner`'s latest plan of
    `tables` (call `planner.plan_tables(tables)` first)."""
    best = planner.last_result
    if best is None:
        raise PlannerError("--explain needs a plan: call plan_tables first")
    space = planner.enumerator.enumerate_tables(tables)
    index = _find(space, name)
    capacity = best.extra["capacity"]
    chosen = best.proposal[index]
    out = Explanation(space[index][0].table.key, planner.performance_model.rate(best))
    for option in space[index]:
        is_chosen = _same(option, chosen)
        if is_chosen:
            plan_ms, ranks = out.plan_ms, best.ranks[index]
        else:
            proposal = list(best.proposal)
            proposal[index] = option
            result = planner.partitioner.partition(proposal, capacity)  # type: ignore[attr-defined]
            feasible = result.feasible
            plan_ms = planner.performance_model.rate(result) if feasible else math.inf
            ranks = result.ranks[index] if feasible else None
        out.options.append(_cost(option, plan_ms, ranks, is_chosen))
    out.options.sort(key=lambda o: (not o.chosen, o.plan_ms))
    out.reason = _reason(out)
    return out


def _cost(
    option: ShardingOption, plan_ms: float, ranks: List[int] | None, chosen: bool
) -> OptionCost:
    fwd = bwd = comm = 0.0
    for seg in option.segments:
        p, n = seg.perf, seg.count
        fwd += n * p.fwd_compute
        bwd += n * p.bwd_compute
        comm += n * (p.fwd_comms + p.bwd_comms + p.input_dist)
    return OptionCost(
        option.sharding_type,
        option.compute_kernel,
        option.num_shards,
        fwd,
        bwd,
        comm,
        option.max_perf,
        option.total_hbm + option.total_ddr,
        plan_ms,
        list(ranks) if ranks else None,
        chosen,
        sum(seg.count * seg.storage.storage for seg in option.segments),
    )


def _reason(out: Explanation) -> str:
    chosen = out.chosen
    others = [o for o in out.options if not o.chosen]
    fits = [o for o in others if math.isfinite(o.plan_ms)]
    lines = [f"chosen: {chosen.label}, plan estimate {chosen.plan_ms:.3f} ms."]
    if not others:
        return lines[0] + " It is the only option priced for this table."
    if fits:
        runner = min(fits, key=lambda o: o.plan_ms)
        gap = runner.plan_ms - chosen.plan_ms
        if gap >= 0:
            lines.append(
                f"Next best: {runner.label} at {runner.plan_ms:.3f} ms "
                f"(+{gap:.3f} ms, {100 * gap / max(chosen.plan_ms, 1e-12):.1f}% slower "
                "with the other tables as planned)."
            )
        else:
            lines.append(
                f"{runner.label} re-places {-gap:.3f} ms faster with the other "
                "tables as planned; the search chose the whole plan jointly and did "
                "not reach that combination."
            )
    unfit = len(others) - len(fits)
    if unfit:
        lines.append(f"{unfit} option(s) do not fit in memory with the other tables as planned.")
    return " ".join(lines)


def draw_explain_png(explanation: Explanation, measured: List[Dict[str, Any]], path: str) -> None:
    """Stacked fwd / bwd / comm estimates per option (chosen hatched); with `measured`
    records (JSON lines carrying `plan`, `predicted_ms`, `measured_ms`), a second panel of
    estimated vs measured step time per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if measured else 1
    fig, axes = plt.subplots(
        panels, 1, figsize=(max(7, 0.6 * len(explanation.options)), 4 * panels), squeeze=False
    )
    ax = axes[0][0]
    xs = list(range(len(explanation.options)))
    bottom = [0.0] * len(xs)
    for part in ("fwd_ms", "bwd_ms", "comm_ms"):
        values = [getattr(o, part) for o in explanation.options]
        bars = ax.bar(xs, values, bottom=bottom, label=f"estimated {part[:-3]}")
        for bar, option in zip(bars, explanation.options):
            if option.chosen:
                bar.set_hatch("//")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(
        xs, [o.label for o in explanation.options], rotation=30, ha="right", fontsize="small"
    )
    if max(bottom) > 50 * max(min(bottom), 1e-9):  # one option dwarfs the rest
        ax.set_yscale("log")
    ax.set_ylabel("ms per step (all shards)")
    ax.set_title(f"table '{explanation.table}': options priced (hatched: chosen)")
    ax.legend(fontsize="small")
    if measured:
        ax = axes[1][0]
        labels = [f"{r.get('workload', '')} {r['plan']}".strip() for r in measured]
        xs = list(range(len(measured)))
        ax.bar(
            [x - 0.2 for x in xs],
            [r["predicted_ms"] for r in measured],
            width=0.4,
            label="estimated",
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [r["measured_ms"] for r in measured],
            width=0.4,
            label="measured",
            hatch="..",
        )
        ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize="x-small")
        ax.set_ylabel("step ms")
        ax.set_title("estimated vs measured step time per plan")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def read_measurements(path: str) -> List[Dict[str, Any]]:
    """JSON-lines records with `plan`, `predicted_ms` and `measured_ms` (others skipped)."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e})") from e
            if isinstance(record, dict) and {"plan", "predicted_ms", "measured_ms"} <= set(record):
                records.append(record)
    if not records:
        raise ValueError(f"{path}: no records with 'plan', 'predicted_ms' and 'measured_ms'")
    return records
