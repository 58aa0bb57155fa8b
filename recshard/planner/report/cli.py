"""`recshard-plan TABLES_FILE [--world-size N ...] [-o plan.json] [--png plan.png]`

Plans embedding tables described in a file, without a model, and prints the planner's
per-rank and per-table tables. The file is JSON (or YAML when PyYAML is installed): a list of
tables, or {"tables": [...], "optimizer": ..., "batch_size": ...}. A table::

    {"name": "user_id", "num_embeddings": 10000000, "embedding_dim": 128,
     "feature_names": ["user_id"], "pooling_factor": 1.0, "data_type": "FP32",
     "weighted": false, "pooled": true, "module": "sparse_arch.ebc",
     "optimizer": "exact_row_wise_adagrad",
     "constraints": {"sharding_types": ["table_wise", "row_wise"], "compute_kernels": ["fused"],
                     "min_partition": 32, "enforce_hbm": true,
                     "cache_params": {"load_factor": 0.2}}}

`recshard-plan calibrate -o profile.json` measures this machine and job (`recshard.calibration`);
`--profile profile.json` plans with those costs. `--explain TABLE` prints every option priced
for TABLE and why the chosen one won (`--png` then draws it, and with `--measured FILE`,
estimated vs measured step times). `--plan existing.json` prints per-rank statistics of an
existing plan (`plan_stats`) without planning.

Exit status: 0 planned; 1 a malformed or unreadable file; 2 a bad argument, a number that
is not finite or out of range (in a flag or a file), a file over the planner's limits
(`json_input`: size, nesting depth, table count), or no plan fits. Errors are one line on
stderr, `error: ...` (argparse's: `recshard-plan: error: ...`).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any, Callable, Dict, List, NoReturn, Sequence, Tuple

from recshard.planner.cost.plan_stats import PlanStats, plan_stats
from recshard.planner.cost.reservation import StorageReservation
from recshard.planner.cost.storage import EmbeddingStorageEstimator
from recshard.planner.json_input import InputLimitError
from recshard.planner.plan_io import PlanValidationError, load_plan, save_plan
from recshard.planner.planner_types import (
    GIB,
    PlannerError,
    TableMeta,
    Topology,
)
from recshard.planner.profile import CalibrationProfile
from recshard.planner.report.explain import draw_explain_png, explain_table, read_measurements
from recshard.planner.report.tables_file import (
    InputError,
    NumberError,
    is_int,
    parse_tables,
    read_tables_file,
)
from recshard.planner.search.enumerator import EmbeddingEnumerator
from recshard.planner.search.partitioners import GreedyPerfPartitioner, MemoryBalancedPartitioner
from recshard.planner.search.planner import EmbeddingShardingPlanner
from recshard.planner.search.stats import PlannerStats
from recshard.types import PipelineType


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (exit status 2, as argparse's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind: type, low: float, strict: bool) -> Callable[[str], float]:
    """An argparse type: a finite `kind` above `low` (`strict`) or at least `low`."""
    bound = f"> {low:g}" if strict else f">= {low:g}"
    what = f"{'an integer' if kind is int else 'a finite number'} {bound}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


POSITIVE_INT = _number(int, 0, strict=True)
NON_NEGATIVE_INT = _number(int, 0, strict=False)
POSITIVE = _number(float, 0, strict=True)
NON_NEGATIVE = _number(float, 0, strict=False)


def check_arguments(args: argparse.Namespace, data: Dict[str, Any]) -> Tuple[int, int]:
    """The world and batch sizes, from the flags or the file, must be integers >= 1 (the
    flags' other numbers are checked as they are parsed). Returns (world size, batch size)."""
    world_size = args.world_size if args.world_size is not None else data.get("world_size", 1)
    batch_size = args.batch_size if args.batch_size is not None else data.get("batch_size", 512)
    for what, value in (
        ("--world-size / world_size", world_size),
        ("--batch-size / batch_size", batch_size),
        ("--local-world-size", args.local_world_size),
    ):
        if value is not None and (not is_int(value) or value < 1):
            raise NumberError(f"{what} must be an integer >= 1, got {value!r}")
    return world_size, batch_size


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="recshard-plan",
        description="Plan how embedding tables are sharded over ranks, from a tables file.",
    )
    p.add_argument("tables_file", help="JSON (or YAML) list of tables")
    p.add_argument(
        "--world-size", type=POSITIVE_INT, default=None, help="ranks (default: file or 1)"
    )
    p.add_argument(
        "--local-world-size",
        type=POSITIVE_INT,
        default=None,
        help="ranks per host (default: all ranks on one host)",
    )
    p.add_argument("--compute-device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--hbm-gb", type=NON_NEGATIVE, default=None, help="HBM per rank, GiB (cuda)")
    p.add_argument("--ddr-gb", type=NON_NEGATIVE, default=None, help="DDR per rank, GiB")
    p.add_argument(
        "--storage-gb",
        type=NON_NEGATIVE,
        default=None,
        help="local storage per rank for key_value tables, GiB (cpu; default none)",
    )
    p.add_argument("--batch-size", type=POSITIVE_INT, default=None, help="samples per rank (512)")
    p.add_argument(
        "--optimizer",
        default=None,
        help="fused optimizer for tables without one, e.g. exact_row_wise_adagrad",
    )
    p.add_argument(
        "--dense-gb",
        type=NON_NEGATIVE,
        default=0.0,
        help="per-rank memory reserved for the dense model, GiB (0)",
    )
    p.add_argument(
        "--kjt-gb",
        type=NON_NEGATIVE,
        default=None,
        help="per-rank memory reserved for input batches, GiB (default: estimated)",
    )
    p.add_argument(
        "--balance-memory",
        action="store_true",
        help="after balancing time, even out memory (within 2%% of the best time)",
    )
    p.add_argument("--timeout", type=POSITIVE, default=None, help="stop searching after N s")
    p.add_argument(
        "--max-table-rows",
        type=NON_NEGATIVE_INT,
        default=0,
        help="print at most N rows of the per-table table (0: all)",
    )
    p.add_argument("-o", "--output", default=None, help="write the plan as JSON here")
    p.add_argument("--png", default=None, help="draw per-rank memory and time here")
    p.add_argument("-v", "--verbose", action="store_true", help="log the planner's progress")
    p.add_argument(
        "--profile",
        default=None,
        help="calibration profile from `recshard-plan calibrate` (default: built-in costs)",
    )
    p.add_argument(
        "--intra-host-gbps",
        type=POSITIVE,
        default=None,
        help="bandwidth between ranks of a host, GB/s (overrides the profile)",
    )
    p.add_argument(
        "--inter-host-gbps",
        type=POSITIVE,
        default=None,
        help="bandwidth per rank between hosts, GB/s (overrides the profile)",
    )
    p.add_argument(
        "--explain",
        default=None,
        metavar="TABLE",
        help="print every option priced for TABLE and why the chosen one won",
    )
    p.add_argument(
        "--measured",
        default=None,
        metavar="FILE",
        help="with --explain --png: JSON lines with plan / predicted_ms / "
        "measured_ms (benchmarks/planner_accuracy.py) drawn beside the estimates",
    )
    p.add_argument(
        "--plan",
        default=None,
        metavar="PLAN_JSON",
        help="print per-rank statistics of this plan instead of planning",
    )
    p.add_argument(
        "--pipeline-type",
        default=PipelineType.NONE.value,
        choices=[t.value for t in PipelineType],
        help="the training pipeline: how many batches of ids a rank holds "
        "(none: 1, train_sparse_dist: 2, train_prefetch_sparse_dist: 3)",
    )
    return p


def gib(value: float | None) -> float | None:
    """GiB -> bytes (None stays None)."""
    return None if value is None else value * GIB


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        print(
            "error: the planner measures nothing: calibrate with `recshard-plan calibrate` "
            "or `python -m recshard.calibration`",
            file=sys.stderr,
        )
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "error: --png needs matplotlib (pip install matplotlib, or recshard[plot])",
                file=sys.stderr,
            )
            return 1
    try:
        data = read_tables_file(args.tables_file)
        tables, constraints = parse_tables(data, args.optimizer)
        world_size, batch_size = check_arguments(args, data)
        topology = Topology(
            world_size=world_size,
            compute_device=args.compute_device,
            hbm_cap=gib(args.hbm_gb),
            ddr_cap=gib(args.ddr_gb),
            storage_cap=gib(args.storage_gb),
            local_world_size=args.local_world_size,
            intra_host_bw=args.intra_host_gbps,
            inter_host_bw=args.inter_host_gbps,
            profile=CalibrationProfile.load(args.profile) if args.profile else None,
        )
        measured = read_measurements(args.measured) if args.measured else []
        pipeline = PipelineType(args.pipeline_type)
        if args.plan:
            print(existing_plan_stats(args.plan, tables, topology, batch_size, pipeline).format())
            return 0
    except NumberError as e:
        print(f"error: {args.tables_file}: {e}", file=sys.stderr)
        return 2
    except InputError as e:
        print(f"error: {args.tables_file}: {e}", file=sys.stderr)
        return 1
    except InputLimitError as e:  # the plan file's (its message names it)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or args.tables_file}: {e.strerror or e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    enumerator = EmbeddingEnumerator(
        topology,
        batch_size,
        constraints,
        storage_estimator=(EmbeddingStorageEstimator(topology, batch_size, pipeline)),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        enumerator=enumerator,
        storage_reservation=StorageReservation(gib(args.dense_gb), gib(args.kjt_gb)),
        partitioner=MemoryBalancedPartitioner() if args.balance_memory else GreedyPerfPartitioner(),
        constraints=constraints,
        debug=False,
        timeout_seconds=args.timeout,
    )
    try:
        plan = planner.plan_tables(tables)
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats = planner.last_stats
    assert stats is not None
    print(stats.format(args.max_table_rows))
    if args.output:
        save_plan(plan, args.output, metadata=_metadata(stats))
        print(f"plan written to {args.output}")
    if args.explain:
        try:
            explanation = explain_table(planner, tables, args.explain)
        except PlannerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(explanation.format())
    if args.png:
        if args.explain:
            draw_explain_png(explanation, measured, args.png)
        else:
            draw_png(stats, args.png)
        print(f"chart written to {args.png}")
    return 0


def existing_plan_stats(
    path: str,
    tables: List[TableMeta],
    topology: Topology,
    batch_size: int,
    pipeline_type: PipelineType = PipelineType.NONE,
) -> PlanStats:
    """`plan_stats` of the plan file at `path`; its errors (the file's, or the plan's against
    the tables: see `match_plan`) start with the file's name."""
    plan = load_plan(path)  # names the file itself
    try:
        return plan_stats(plan, tables, topology, batch_size, pipeline_type)
    except PlanValidationError as e:
        raise PlanValidationError(f"{path}: {e}") from e


def _metadata(stats: PlannerStats) -> Dict[str, Any]:
    return {
        "world_size": stats.world_size,
        "local_world_size": stats.local_world_size,
        "compute_device": stats.compute_device,
        "batch_size": stats.batch_size,
        "estimated_max_rank_ms": stats.max_time,
        "estimated_mean_rank_ms": stats.mean_time,
        "imbalance": stats.imbalance,
        "generator": "recshard-plan",
    }


def draw_png(stats: PlannerStats, path: str) -> None:
    """Bar charts of per-rank memory (GiB, with capacity) and estimated time (ms, by part)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ranks = [r.rank for r in stats.ranks]
    fig, (mem_ax, time_ax) = plt.subplots(2, 1, figsize=(max(6, len(ranks) * 0.25), 7))
    hbm = [r.hbm / GIB for r in stats.ranks]
    ddr = [r.ddr / GIB for r in stats.ranks]
    mem_ax.bar(ranks, hbm, label="HBM")
    mem_ax.bar(ranks, ddr, bottom=hbm, label="DDR")
    cap = stats.ranks[0].hbm_cap if stats.compute_device == "cuda" else stats.ranks[0].ddr_cap
    mem_ax.axhline(
        cap / GIB,
        linestyle="--",
        color="gray",
        label=f"{'HBM' if stats.compute_device == 'cuda' else 'DDR'} for tables",
    )
    mem_ax.set_ylabel("GiB")
    mem_ax.set_title("memory per rank")
    mem_ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    bottom = [0.0] * len(ranks)
    for part in ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist"):
        values = [getattr(r, part) for r in stats.ranks]
        time_ax.bar(ranks, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    time_ax.set_ylabel("estimated ms per step")
    time_ax.set_xlabel("rank")
    time_ax.set_title(f"estimated time per rank (imbalance {stats.imbalance:.3f})")
    time_ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in (mem_ax, time_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
