"""Command-line arguments of `python -m examples.dlrm.train`, and the `--demo` preset."""

from __future__ import annotations

import argparse
from typing import List, Sequence

from examples.dlrm.data.binary import is_preprocessed
from examples.dlrm.data.criteo_spec import NUM_SPARSE, SPARSE_NAMES, capped_num_embeddings
from examples.dlrm.data.preprocess import Manifest, check_same_vocabulary, check_table_sizes
from examples.dlrm.mc import RAW_ID_SPACE
from examples.dlrm.sharding import OPTIMIZER_CHOICES, SHARDING_CHOICES

# What `--demo` changes (flags given explicitly still win): about a minute on 2 CPU ranks.
DEMO = dict(
    data="synthetic",
    steps=400,
    batch_size=512,
    embedding_dim=16,
    num_embeddings_per_feature="100000",
    dense_arch_layers="64,16",
    over_arch_layers="64,32,1",
    optimizer="rowwise_adagrad",
    lr=0.05,
    eval_every=100,
    eval_batches=20,
    sharding="auto",
    metrics_json="out/dlrm_demo_metrics.json",
)


def int_list(text: str) -> List[int]:
    """ "512,256,64" -> [512, 256, 64]."""
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def table_sizes(text: str) -> List[int]:
    """One size per categorical feature; a single value N caps Criteo's Kaggle sizes at N."""
    values = int_list(text)
    if len(values) == 1:
        return capped_num_embeddings(values[0])
    if len(values) != NUM_SPARSE:
        raise argparse.ArgumentTypeError(
            f"--num-embeddings-per-feature needs 1 or {NUM_SPARSE} values, got {len(values)}"
        )
    return values


def name_list(text: str) -> List[str]:
    """ "t_cat_0, t_cat_2" -> ["t_cat_0", "t_cat_2"]."""
    return [v for v in text.replace(" ", "").split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.dlrm.train",
        description="Train DLRM with sharded embedding tables (recshard). Launch with torchrun, "
        "e.g. torchrun --standalone --nproc_per_node 2 -m examples.dlrm.train --demo. "
        "Without torchrun it runs as a single rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="preset: synthetic data, small model, ~1 minute on 2 CPU ranks, ends with "
        f"the eval AUC (sets {', '.join(sorted(DEMO))} unless given)",
    )
    g = p.add_argument_group("training length")
    g.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps (batches per rank); synthetic data needs it "
        "(default 1000 there); with Criteo data it stops early or cycles the files",
    )
    g.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="passes over the Criteo train split when --steps is not given",
    )
    g.add_argument("--batch-size", type=int, default=512, help="samples per rank per step")
    g = p.add_argument_group("model")
    g.add_argument("--embedding-dim", type=int, default=64, help="dimension of every table")
    g.add_argument(
        "--num-embeddings-per-feature",
        type=table_sizes,
        default="100000",
        help=f"rows per table: {NUM_SPARSE} comma-separated values, or one value N = "
        "Criteo Kaggle's sizes capped at N",
    )
    g.add_argument(
        "--dense-arch-layers",
        type=int_list,
        default="512,256,64",
        help="dense MLP sizes; the last must equal --embedding-dim",
    )
    g.add_argument(
        "--over-arch-layers",
        type=int_list,
        default="512,512,256,1",
        help="over MLP sizes; the last must be 1",
    )
    g.add_argument(
        "--interaction",
        choices=["dot", "dcn"],
        default="dot",
        help="pairwise dot products (DLRM) or a low-rank DCN-v2 cross network",
    )
    g.add_argument("--dcn-num-layers", type=int, default=3, help="DCN cross layers")
    g.add_argument("--dcn-low-rank-dim", type=int, default=64, help="DCN low-rank dimension")
    g.add_argument(
        "--position-weighted",
        default=None,
        metavar="FEATURES",
        help="comma list of sparse features (e.g. cat_0,cat_5) whose ids are weighted by "
        "their position in the bag (FeatureProcessedEmbeddingBagCollection with "
        "PositionWeightedModuleCollection; max_feature_length = --multi-hot)",
    )
    g.add_argument(
        "--managed-collision",
        type=int,
        default=None,
        metavar="ZCH_SIZE",
        help="train on raw ids: every table has ZCH_SIZE rows behind an MCH managed-collision "
        "module (DistanceLFU eviction) that gives frequent ids rows of their own; Criteo "
        "values are read as raw 32-bit ids (preprocess with --vocab raw), synthetic ids "
        "are drawn from --num-embeddings-per-feature",
    )
    g.add_argument(
        "--mc-eviction-interval",
        type=int,
        default=100,
        help="managed collision: steps between evictions",
    )
    g.add_argument(
        "--mc-log-every",
        type=int,
        default=0,
        help="managed collision: log per-table evictions, rows in use and hit rate every N "
        "steps (0: at every eval)",
    )
    g = p.add_argument_group("sharding and optimizer")
    g.add_argument(
        "--sharding",
        choices=SHARDING_CHOICES,
        default="auto",
        help="auto = recshard's planner; otherwise every table sharded this way "
        "(table_wise: tables round-robin over ranks)",
    )
    g.add_argument(
        "--plan",
        default=None,
        help="sharding plan JSON (from recshard-plan or a previous run); overrides --sharding",
    )
    g.add_argument(
        "--save-plan",
        default=None,
        help="write the plan this run uses as JSON (rank 0), for --plan later",
    )
    g.add_argument(
        "--kernel",
        choices=["fused", "dense"],
        default="fused",
        help="fused: fbgemm TBE with the optimizer in backward; dense: autograd "
        "weights updated by the dense optimizer (data_parallel is always dense)",
    )
    g.add_argument(
        "--key-value-tables",
        type=name_list,
        default=[],
        help="tables kept in files on local storage behind a DRAM row cache "
        "(compute_kernel key_value, cpu), e.g. t_cat_0,t_cat_2, or 'all'",
    )
    g.add_argument(
        "--dram-budget",
        type=float,
        default=None,
        help="GiB of DRAM per rank for the tables, their optimizer state and step buffers: "
        "the planner (--sharding auto) plans tables that do not fit it key_value",
    )
    g.add_argument(
        "--kv-dir",
        default=None,
        help="directory for key_value tables' files (ssd_storage_directory; @local_rank is "
        "each rank's local rank); default: a fresh temporary directory",
    )
    g.add_argument(
        "--cache-load-factor",
        type=float,
        default=0.2,
        help="share of a key_value table's rows its DRAM cache holds",
    )
    g.add_argument(
        "--optimizer",
        choices=OPTIMIZER_CHOICES,
        default="rowwise_adagrad",
        help="embedding optimizer; the dense arch uses SGD, or Adagrad for both Adagrad choices",
    )
    g.add_argument("--lr", type=float, default=0.05, help="learning rate (embeddings and dense)")
    g.add_argument("--eps", type=float, default=1e-8, help="Adagrad epsilon")
    g.add_argument(
        "--comm-precision",
        choices=["fp32", "fp16", "bf16"],
        default="fp32",
        help="precision of the pooled embedding all-to-alls / reduce-scatters on "
        "the wire, forward and backward (halves their bytes)",
    )
    g.add_argument(
        "--tp-over-arch",
        action="store_true",
        help="run the over arch's first two layers as a column->row tensor-parallel "
        "pair over all ranks on the global batch (recshard.parallel); trains "
        "like the data-parallel over arch",
    )
    g.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TrainPipelineSparseDist: overlap the next batch's copy and input "
        "all-to-all with this batch's compute",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        choices=["synthetic", "criteo"],
        default="synthetic",
        help="built-in synthetic Criteo-like data or Criteo TSV/CSV files",
    )
    g.add_argument(
        "--data-path",
        default=None,
        help="Criteo file, directory or glob; every 10th line is held out for eval "
        "unless --eval-data-path is given; or a directory written by "
        "python -m examples.dlrm.preprocess (detected, read memory-mapped)",
    )
    g.add_argument("--eval-data-path", default=None, help="separate Criteo eval files")
    g.add_argument(
        "--shuffle-buffer",
        type=int,
        default=0,
        help="preprocessed data: shuffle the training rows within buffers of this "
        "many rows (0: file order, as the TSV reader)",
    )
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader workers (Criteo)")
    g.add_argument(
        "--multi-hot",
        type=int,
        default=1,
        help="synthetic: up to this many ids per feature and sample",
    )
    g.add_argument("--zipf-alpha", type=float, default=1.1, help="synthetic: id skew")
    g = p.add_argument_group("evaluation, checkpoints, output")
    g.add_argument(
        "--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)"
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        default=50,
        help="eval batches per rank (synthetic; for Criteo an upper bound, 0 = all)",
    )
    g.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save a sharded checkpoint here at every eval and at the end",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="also checkpoint every N steps (model, both optimizers, step, data "
        "position, RNG state, per-step losses)",
    )
    g.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="continue from the newest complete checkpoint in --checkpoint-dir, if "
        "any (default with --checkpoint-dir, so a job restarted by torchrun "
        "--max-restarts continues); --no-resume starts over",
    )
    g.add_argument("--seed", type=int, default=0, help="model init and data seed")
    g.add_argument(
        "--metrics-json",
        default=None,
        help="write the run's config, plan, throughput and eval metrics here (rank 0)",
    )
    g.add_argument(
        "--pg-timeout",
        type=float,
        default=300.0,
        help="seconds before a collective waiting on a dead rank fails",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, apply `--demo` under explicit flags, and check the combination."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.demo:
        parser.set_defaults(**DEMO)
        args = parser.parse_args(argv)
    if args.data == "criteo" and not args.data_path:
        parser.error("--data criteo needs --data-path")
    if args.data == "synthetic" and args.steps is None:
        args.steps = 1000
    _check_managed_collision(parser, args)
    if args.data == "criteo":
        try:
            manifests = {
                p: Manifest.load(p)
                for p in (args.data_path, args.eval_data_path)
                if is_preprocessed(p)
            }
            for path, manifest in manifests.items():
                check_table_sizes(manifest, args.num_embeddings_per_feature, path)
            if len(manifests) == 2:
                check_same_vocabulary(*manifests.values(), args.eval_data_path)
        except ValueError as e:
            parser.error(str(e))
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.resume is None:
        args.resume = args.checkpoint_dir is not None
    if args.dense_arch_layers[-1] != args.embedding_dim:
        parser.error(
            f"--dense-arch-layers must end with --embedding-dim {args.embedding_dim}, "
            f"got {args.dense_arch_layers}"
        )
    if args.over_arch_layers[-1] != 1:
        parser.error(f"--over-arch-layers must end with 1, got {args.over_arch_layers}")
    _check_key_value(parser, args)
    for name in ("batch_size", "embedding_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _check_managed_collision(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A positive zch size and interval, a sharding MC tables take; Criteo ids read raw."""
    if args.managed_collision is None:
        return
    if args.managed_collision < 1:
        parser.error(f"--managed-collision must be >= 1 rows, got {args.managed_collision}")
    if args.mc_eviction_interval < 1 or args.mc_log_every < 0:
        parser.error("--mc-eviction-interval must be >= 1 and --mc-log-every >= 0")
    if args.sharding == "data_parallel" or args.kernel == "dense":
        parser.error(
            "--managed-collision tables are model-parallel with --kernel fused, not "
            f"{args.sharding} / {args.kernel}"
        )
    if args.position_weighted or args.key_value_tables or args.dram_budget is not None:
        parser.error("--managed-collision does not combine with --position-weighted or key_value")
    if args.data == "criteo":  # the readers keep each 32-bit value as its own id
        args.num_embeddings_per_feature = [RAW_ID_SPACE] * NUM_SPARSE


def _check_key_value(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--key-value-tables` names real tables (`all`: every one) of a model-parallel fused
    plan; `--dram-budget` goes to the planner; the cache share is in (0, 1]."""
    names = [f"t_{f}" for f in SPARSE_NAMES]
    if args.key_value_tables == ["all"]:
        args.key_value_tables = names
    unknown = sorted(set(args.key_value_tables) - set(names))
    if unknown:
        parser.error(f"--key-value-tables: no table {unknown}; tables are t_cat_0 .. t_cat_25")
    if args.key_value_tables and (args.sharding == "data_parallel" or args.kernel == "dense"):
        parser.error("--key-value-tables needs a model-parallel sharding and --kernel fused")
    if args.dram_budget is not None and (args.sharding != "auto" or args.plan):
        parser.error("--dram-budget is the planner's: use it with --sharding auto, no --plan")
    if args.dram_budget is not None and not args.dram_budget > 0:
        parser.error(f"--dram-budget must be > 0 GiB, got {args.dram_budget}")
    if not 0.0 < args.cache_load_factor <= 1.0:
        parser.error(f"--cache-load-factor must be in (0, 1], got {args.cache_load_factor}")
