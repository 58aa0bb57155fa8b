"""DLRM's pairwise interaction on one core: the torch path (bmm, gather) vs recshard's kernels.

    python -m benchmarks.interaction                  # batch 2048, 26 features of dim 64
    python -m benchmarks.interaction --quick          # tiny sizes (smoke test)

One process, one torch thread. Per path, the CPU time (`time.process_time`) of the forward
and of forward + backward (`torch.autograd.grad` of both inputs), medians of `--steps`, the
two paths interleaved; `same_bytes` says whether the outputs and gradients agree bit for bit
and `kernels` whether the kernels ran (their probe passed for this shape). Every line on
stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

from benchmarks.compare_torchrec import emit
from recshard.models import interaction

Path = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _step(
    path: Path,
    dense: torch.Tensor,
    sparse: torch.Tensor,
    positions: torch.Tensor,
    grad: torch.Tensor,
    backward: bool,
) -> Tuple[torch.Tensor, ...]:
    """One forward (and backward): the output and, with `backward`, both gradients."""
    dense, sparse = dense.detach().requires_grad_(), sparse.detach().requires_grad_()
    out = path(dense, sparse, positions)
    if not backward:
        return (out.detach(),)
    return (out.detach(), *torch.autograd.grad(out, (dense, sparse), grad))


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.steps = 64, 3
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(args.batch, args.dim, generator=generator)
    sparse = torch.randn(args.batch, args.features, args.dim, generator=generator)
    n = args.features + 1
    rows, cols = torch.triu_indices(n, n, offset=1, device="cpu")
    positions = rows * n + cols
    grad = torch.randn(args.batch, args.dim + positions.numel(), generator=generator)
    paths: Dict[str, Path] = {
        "torch": interaction.torch_interaction,
        "recshard": interaction.pairwise_interaction,
    }
    results = {
        name: _step(path, dense, sparse, positions, grad, True) for name, path in paths.items()
    }
    same = all(
        torch.equal(a.view(torch.int32), b.view(torch.int32))
        for a, b in zip(results["torch"], results["recshard"])
    )
    times: Dict[str, List[float]] = {f"{p}_{w}": [] for p in paths for w in ("fwd", "fwd_bwd")}
    for _ in range(args.steps):
        for name, path in paths.items():
            for what, backward in (("fwd", False), ("fwd_bwd", True)):
                start = time.process_time()
                _step(path, dense, sparse, positions, grad, backward)
                times[f"{name}_{what}"].append((time.process_time() - start) * 1e3)
    medians = {f"{k}_ms": round(statistics.median(v), 2) for k, v in times.items()}
    emit(
        dict(
            bench="interaction",
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            load_average=os.getloadavg(),
            batch=args.batch,
            features=args.features,
            dim=args.dim,
            kernels=interaction._kernels_apply(dense, sparse),
            same_bytes=same,
            **medians,
            fwd_speedup=round(medians["torch_fwd_ms"] / medians["recshard_fwd_ms"], 2),
            fwd_bwd_speedup=round(medians["torch_fwd_bwd_ms"] / medians["recshard_fwd_bwd_ms"], 2),
        )
    )


if __name__ == "__main__":
    main()
