"""Train DLRM with sharded embeddings: `torchrun --nproc_per_node 2 -m examples.dlrm.train --demo`.

One step, end to end: a `Batch` from `data/` is copied to the device; inside
`DistributedModelParallel`, the sharded EmbeddingBagCollection sends each feature's ids to the
ranks holding its rows (input all-to-all), looks them up in fused TBE kernels, and sends the
pooled vectors back (output all-to-all); the dense arch runs under DDP. `backward()` updates
the tables inside the kernels (fused optimizer); `optimizer.step()` updates the dense rest.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist

from examples.dlrm.args import parse_args
from examples.dlrm.checkpointing import Progress, resume, save_progress
from examples.dlrm.data.criteo_spec import NUM_DENSE, SPARSE_NAMES
from examples.dlrm.data.loaders import eval_batches, train_batches
from examples.dlrm.mc import ManagedCollisionLog
from examples.dlrm.metrics import EvalMetrics
from examples.dlrm.model import build_dlrm
from examples.dlrm.peers import naming_unreachable_peers
from examples.dlrm.sharding import dense_optimizer_factory, make_plan, make_sharders, plan_table
from recshard import EmbeddingBagConfig
from recshard.datasets.utils import Batch
from recshard.distributed import DefaultDataParallelWrapper, DistributedModelParallel
from recshard.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter


def init_distributed(timeout_s: float) -> Tuple[int, int, int, torch.device]:
    """Join (or reuse) the default process group: NCCL with one GPU per rank when CUDA is
    there, else gloo on CPU. Without torchrun, a one-rank group. Returns
    (rank, world size, local world size, device)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m examples.dlrm.train`
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % local_size)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world_size, local_size, device


def make_tables(args: argparse.Namespace) -> List[EmbeddingBagConfig]:
    """One table per sparse feature: `--num-embeddings-per-feature` rows, or the zch size
    under `--managed-collision`."""
    sizes = args.num_embeddings_per_feature
    if args.managed_collision is not None:
        sizes = [args.managed_collision] * len(SPARSE_NAMES)
    return [
        EmbeddingBagConfig(
            num_embeddings=rows,
            embedding_dim=args.embedding_dim,
            name=f"t_{feature}",
            feature_names=[feature],
        )
        for feature, rows in zip(SPARSE_NAMES, sizes)
    ]


def position_weighted_features(args: argparse.Namespace) -> Dict[str, int] | None:
    """`--position-weighted a,b` -> {a: multi_hot, b: multi_hot} (bags hold up to --multi-hot
    ids), None without the option."""
    if not args.position_weighted:
        return None
    return {f.strip(): args.multi_hot for f in args.position_weighted.split(",") if f.strip()}


def build_training(
    args: argparse.Namespace, device: torch.device, world_size: int, local_size: int
) -> Tuple[DistributedModelParallel, CombinedOptimizer, List[EmbeddingBagConfig], str]:
    """The DLRM built on `meta`, sharded and materialized by DMP, its optimizers, its tables
    and a line about the plan."""
    torch.manual_seed(args.seed)
    tables = make_tables(args)
    model = build_dlrm(
        tables,
        NUM_DENSE,
        args.dense_arch_layers,
        args.over_arch_layers,
        args.interaction,
        device="meta",
        dcn_num_layers=args.dcn_num_layers,
        dcn_low_rank_dim=args.dcn_low_rank_dim,
        position_weighted=position_weighted_features(args),
        managed_collision=None
        if args.managed_collision is None
        else (args.mc_eviction_interval, world_size),
    )
    key_value: Dict[str, Any] = {}
    if args.key_value_tables or args.dram_budget is not None:
        key_value["cache_load_factor"] = args.cache_load_factor
        if args.kv_dir:
            key_value["ssd_storage_directory"] = args.kv_dir
    sharders = make_sharders(args.optimizer, args.lr, args.eps, args.comm_precision, key_value)
    plan, plan_note = make_plan(
        args.sharding,
        model,
        tables,
        world_size,
        local_size,
        args.kernel,
        sharders,
        args.batch_size,
        pooling_factor=(1 + args.multi_hot) / 2,
        device_type=device.type,
        plan_path=args.plan,
        key_value_tables=args.key_value_tables,
        dram_budget_gib=args.dram_budget,
        kv_dir=args.kv_dir,
    )
    # DDP re-lays its gradient buckets after the first step, which changes the order gloo sums
    # them in; a resumed run would sum its first step differently from the uninterrupted one.
    # With checkpoints, keep the first layout (find_unused_parameters skips the re-layout).
    wrapper = DefaultDataParallelWrapper(find_unused_parameters=args.checkpoint_dir is not None)
    dmp = DistributedModelParallel(
        model,
        device=device,
        plan=plan,
        sharders=sharders,
        init_data_parallel=not args.tp_over_arch,
        data_parallel_wrapper=wrapper,
    )
    if args.tp_over_arch:  # the over arch's first two layers tensor-parallel over all ranks
        from examples.dlrm.tp import to_tensor_parallel

        to_tensor_parallel(dmp.module)
        dmp.init_data_parallel()
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        dense_optimizer_factory(args.optimizer, args.lr, args.eps),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), tables, plan_note


def _pipeline_classes(key_value: bool) -> Tuple[Any, Any] | None:
    """(train, eval) pipelines; with key_value tables the train one prefetches their rows."""
    try:  # TorchRec's module path
        from recshard.distributed.train_pipeline import (
            EvalPipelineSparseDist,
            PrefetchTrainPipelineSparseDist,
            TrainPipelineSparseDist,
        )
    except ImportError:
        return None
    train = PrefetchTrainPipelineSparseDist if key_value else TrainPipelineSparseDist
    return train, EvalPipelineSparseDist


class Runner:
    """One training step and one eval pass, pipelined (`TrainPipelineSparseDist`: batch i+1's
    copy and input all-to-all overlap batch i; with key_value tables
    `PrefetchTrainPipelineSparseDist`, which also reads its rows from storage) or plain.
    `step` returns `(loss, logits, labels)` of one batch and raises StopIteration at the end of
    the data."""

    def __init__(
        self,
        dmp: DistributedModelParallel,
        optimizer: CombinedOptimizer,
        device: torch.device,
        pipeline: bool,
        say: Callable[[str], None],
    ) -> None:
        self.dmp, self.optimizer, self.device = dmp, optimizer, device
        key_value = any(
            ps.compute_kernel == "key_value" for m in dmp.plan.plan.values() for ps in m.values()
        )
        classes = _pipeline_classes(key_value) if pipeline else None
        if pipeline and classes is None:
            say("notice: recshard has no TrainPipelineSparseDist; --pipeline runs the plain loop")
        self.pipelined = classes is not None
        if classes is not None:
            self._train = classes[0](dmp, optimizer, device)
            self._eval = classes[1](dmp, None, device)

    def step(self, batches: Iterator[Batch]) -> Any:
        if self.pipelined:
            return self._train.progress(batches)
        batch = next(batches).to(self.device, non_blocking=True)
        self.optimizer.zero_grad()
        loss, output = self.dmp(batch)
        loss.backward()
        self.optimizer.step()
        return output

    def evaluate(self, batches: Iterator[Batch], metrics: EvalMetrics) -> Dict[str, float]:
        """AUC, accuracy, NE and log loss over every rank's eval batches (collective)."""
        self.dmp.eval()
        metrics.reset()
        seen = 0
        with torch.no_grad():
            while True:
                try:
                    if self.pipelined:
                        _, logits, labels = self._eval.progress(batches)
                    else:
                        _, (_, logits, labels) = self.dmp(next(batches).to(self.device))
                except StopIteration:
                    break
                metrics.update(logits, labels)
                seen += 1
        self.dmp.train()
        if seen == 0:  # every rank stops together (equal synthetic counts, or the rank vote)
            nan = float("nan")
            return {"auc": nan, "accuracy": nan, "ne": nan, "log_loss": nan, "samples": 0}
        return metrics.compute()


def _progress_bar(total: int | None, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=0.5,
        file=sys.stderr,
    )


def _fmt(metrics: Dict[str, float]) -> str:
    return (
        f"auc {metrics['auc']:.4f}  accuracy {metrics['accuracy']:.4f}  "
        f"ne {metrics['ne']:.4f}  log_loss {metrics['log_loss']:.4f}  "
        f"({metrics['samples']} samples)"
    )


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Train and evaluate as `args` says; every rank returns the run's summary."""
    t_start = time.perf_counter()
    rank, world_size, local_size, device = init_distributed(args.pg_timeout)
    is_main = rank == 0

    def say(text: str) -> None:
        if is_main:
            print(text, flush=True)

    sync_group = dist.new_group(backend="gloo") if world_size > 1 else None
    t_build = time.perf_counter()
    dmp, optimizer, tables, plan_note = build_training(args, device, world_size, local_size)
    build_s = time.perf_counter() - t_build
    say(
        f"DLRM on {world_size} rank(s), {device.type}, backend {dist.get_backend()}: "
        f"{len(tables)} tables, {sum(t.num_embeddings for t in tables):,} rows x "
        f"{args.embedding_dim}, interaction {args.interaction}, optimizer {args.optimizer}, "
        f"lr {args.lr}, batch {args.batch_size}/rank ({args.batch_size * world_size} global)"
    )
    say(
        f"sharding plan ({plan_note}; model built and sharded in {build_s:.1f}s):\n"
        f"{plan_table(dmp.plan, tables)}"
    )

    if args.save_plan and is_main:
        from recshard.planner import save_plan

        save_plan(dmp.plan, args.save_plan, {"world_size": world_size, "note": plan_note})
        say(f"plan saved to {args.save_plan}")
    if args.kernel == "dense" and args.optimizer == "rowwise_adagrad":
        say(
            "notice: dense-kernel tables are updated by torch Adagrad (element-wise), not "
            "row-wise Adagrad"
        )
    progress = Progress()
    if args.resume:  # on by default with --checkpoint-dir: a restarted job continues
        restored = resume(args.checkpoint_dir, dmp, optimizer, device, say)
        if restored is None:
            say(f"no checkpoint in {args.checkpoint_dir}: starting from scratch")
        else:
            progress = restored
            say(f"resumed from {args.checkpoint_dir} at step {progress.step}")
    start_step, history, losses = progress.step, progress.evals, progress.losses

    metrics = EvalMetrics(device)
    runner = Runner(dmp, optimizer, device, args.pipeline, say)
    bar = _progress_bar(args.steps, start_step, is_main and not args.no_progress)
    batches = train_batches(args, rank, world_size, start_step, sync_group)
    step, loss_ema, train_s, eval_s = start_step, None, 0.0, 0.0
    t0 = time.perf_counter()

    pending: List[torch.Tensor] = []  # losses not yet read (a GPU sync): read in batches

    def read_losses() -> None:
        losses.extend(float(v) for v in pending)
        pending.clear()

    def checkpoint() -> None:
        read_losses()
        if args.checkpoint_dir:
            save_progress(
                args.checkpoint_dir, dmp, optimizer, Progress(step, history, losses), device
            )

    mc_log = ManagedCollisionLog() if args.managed_collision is not None else None

    def log_mc() -> None:  # collective: every rank collects the MC metrics
        if mc_log is not None:
            text = mc_log.report(dmp, step)
            if bar is not None:
                bar.write(text)
            else:
                say(text)

    def eval_now(final: bool) -> None:
        nonlocal t0, eval_s
        if not args.mc_log_every or final:
            log_mc()  # before eval: its lookups are not training's
        t_eval = time.perf_counter()
        result = runner.evaluate(eval_batches(args, rank, world_size, sync_group), metrics)
        if result["samples"] == 0:
            say(
                "warning: no eval batch: some rank's share of the eval split (per DataLoader "
                "worker) is smaller than --batch-size; use a smaller --batch-size, fewer "
                "--num-workers, or --eval-data-path"
            )
        history.append({"step": step, **result})
        line = f"eval{' (final)' if final else ''} @ step {step}: {_fmt(result)}"
        if bar is not None:
            bar.write(line)
        else:
            say(line)
        eval_s += time.perf_counter() - t_eval
        checkpoint()
        t0 = time.perf_counter()

    while True:
        try:
            loss, _, _ = runner.step(batches)
        except StopIteration:
            break
        step += 1
        pending.append(loss.detach())
        if len(pending) == 100:
            read_losses()
        # an on-device running mean: reading it (a GPU sync) only every 10 steps
        loss_ema = loss.detach() if loss_ema is None else loss_ema * 0.9 + loss.detach() * 0.1
        if bar is not None:
            if step % 10 == 0 or step == start_step + 1:
                elapsed = train_s + time.perf_counter() - t0
                rate = (step - start_step) * args.batch_size * world_size / max(elapsed, 1e-9)
                bar.set_postfix(
                    loss=f"{float(loss_ema):.4f}", samples_per_s=f"{rate:,.0f}", refresh=False
                )
            bar.update(1)
        if args.mc_log_every and step % args.mc_log_every == 0 and step != args.steps:
            log_mc()
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            train_s += time.perf_counter() - t0  # eval time is not training time
            eval_now(final=False)
        elif args.checkpoint_every and step % args.checkpoint_every == 0 and step != args.steps:
            train_s += time.perf_counter() - t0
            checkpoint()
            t0 = time.perf_counter()
    train_s += time.perf_counter() - t0
    if bar is not None:
        bar.close()
    eval_now(final=True)

    steps_run = step - start_step
    samples = steps_run * args.batch_size * world_size
    summary: Dict[str, Any] = {
        "world_size": world_size,
        "device": device.type,
        "backend": dist.get_backend(),
        "pipeline": runner.pipelined,
        "steps": step,
        "steps_this_run": steps_run,
        "global_samples": samples,
        "train_seconds": train_s,
        "samples_per_s": samples / train_s if train_s > 0 else 0.0,
        "final_loss_ema": None if loss_ema is None else float(loss_ema),
        "final_eval": history[-1],
        "evals": history,
        "build_seconds": build_s,
        "eval_seconds": eval_s,
        "wall_seconds": time.perf_counter() - t_start,
        "losses": losses,
    }
    if mc_log is not None:
        summary["managed_collision"] = mc_log.summary()
    say(_summary_text(summary))
    if args.metrics_json and is_main:
        _write_metrics(Path(args.metrics_json), args, summary, dmp.plan)
        say(f"metrics written to {args.metrics_json}")
    return summary


def _summary_text(summary: Dict[str, Any]) -> str:
    final = summary["final_eval"]
    history = ", ".join(f"{e['step']}: {e['auc']:.4f}" for e in summary["evals"])
    return "\n".join(
        [
            "summary",
            f"  steps        {summary['steps']} ({summary['steps_this_run']} this run, "
            f"{summary['global_samples']:,} samples over {summary['world_size']} rank(s))",
            f"  train time   {summary['train_seconds']:.1f} s, {summary['samples_per_s']:,.0f} "
            f"samples/s ({'pipelined' if summary['pipeline'] else 'plain loop'})",
            f"  wall time    {summary['wall_seconds']:.1f} s "
            f"(build {summary['build_seconds']:.1f} s, "
            f"eval {summary['eval_seconds']:.1f} s, train {summary['train_seconds']:.1f} s)",
            f"  final eval   {_fmt(final)}",
            f"  AUC by step  {history}",
        ]
        + _mc_summary_lines(summary.get("managed_collision"))
    )


def _mc_summary_lines(tables: Dict[str, Dict[str, float]] | None) -> List[str]:
    if not tables:
        return []
    lookups = sum(t["lookups"] for t in tables.values())
    hits = sum(t["hits"] for t in tables.values())
    evicted = int(sum(t["evicted"] for t in tables.values()))
    rate = hits / lookups if lookups else 0.0
    return [f"  managed collision  {evicted:,} ids evicted, training hit rate {rate:.4f}"]


def _write_metrics(
    path: Path, args: argparse.Namespace, summary: Dict[str, Any], plan: Any
) -> None:
    from recshard.planner import plan_to_dict

    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"config": dict(vars(args)), **summary, "plan": plan_to_dict(plan)}
    path.write_text(json.dumps(record, indent=2, default=str))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        init_distributed(args.pg_timeout)
        with naming_unreachable_peers():  # a lost peer is named in the error
            run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
