"""TorchRec's numbers against recshard's: one seeded script, run as written under TorchRec and
ported by `python -m recshard.port` alone under recshard.

`benchmarks/torchrec_numbers.py.txt` is TorchRec usage as its examples and tests write it (EBC
and KJT forward/backward, weighted; FP-EBC with PositionWeightedModule and
PositionWeightedModuleCollection and its split(); a VBE KJT through the unsharded EBC; the
tutorial's quantize_dynamic flow, its state dict loaded and the module sharded; the MC-EBC's
MCH remap; DMP loops on 2 gloo ranks with RowWiseAdagrad in backward over a table-, row-,
column-wise and data-parallel plan, SUM or MEAN, and over an FP-EBC). This driver
runs it with VENV's python (TorchRec 1.9.2), ports a copy, runs that with this python starting
from TorchRec's run's initial weights (state_dict) and the same seeded inputs, and prints one
JSON line per value not exactly equal (within `--rtol/--atol`, or different: max abs
difference; or produced by one side only) and one per case with the counts. Results and what
they mean: docs/porting.md ("TorchRec's numbers, side by side").

    python -m benchmarks.torchrec_numbers --venv /tmp/torchrec-venv
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import torch

from benchmarks.torchrec_server import emit

SCRIPT = Path(__file__).with_name("torchrec_numbers.py.txt")
ROOT = Path(__file__).resolve().parent.parent
CASES = ["ebc", "fp", "vbe", "quant", "mc", "dmp", "dmp_mean", "dmp_fp"]
Values = Dict[str, torch.Tensor]


def run_side(python: str, script: Path, out: Path, init: Path | None, env: Dict[str, str]) -> None:
    """Run `script OUT [INIT]` with `python`; its stderr tail on failure."""
    command = [python, str(script), str(out)] + ([str(init)] if init else [])
    done = subprocess.run(command, cwd=script.parent, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def port(script: Path, env: Dict[str, str]) -> str:
    """Port `script` in place with the codemod alone; its report (unmapped names)."""
    done = subprocess.run(
        [sys.executable, "-m", "recshard.port", str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    return (done.stdout + done.stderr).strip()


def assemble(per_rank: List[Dict[str, Any]]) -> Values:
    """One case's values: plain tensors per rank (`rank<r>/name` when several ranks), sharded
    state (`(size, [(offsets, shard)])`) put together into the global tensor; a region two
    ranks hold differently, or one no rank holds, is NaN."""
    out: Values = {}
    for rank, values in enumerate(per_rank):
        for name, value in values.items():
            if isinstance(value, torch.Tensor) or isinstance(value, str):
                key = name if len(per_rank) == 1 else f"rank{rank}/{name}"
                out[key] = value
                continue
            size, shards = value
            if name not in out:
                out[name] = torch.full(size, float("nan"))
                out[f"{name}#held"] = torch.zeros(size, dtype=torch.bool)
            for offsets, shard in shards:
                region = tuple(slice(o, o + n) for o, n in zip(offsets, shard.shape))
                held, full = out[f"{name}#held"][region], out[name][region]
                clash = held & (full != shard.to(full.dtype))
                full.copy_(shard.to(full.dtype))
                full[clash] = float("nan")
                held.fill_(True)
    for key in [k for k in out if k.endswith("#held")]:
        held = out.pop(key)
        out[key[: -len("#held")]][~held] = float("nan")
    return out


def load_case(out: Path, case: str) -> Values:
    files = sorted(out.glob(f"{case}.rank*.pt")) or [out / f"{case}.pt"]
    return assemble([torch.load(f, weights_only=True) for f in files])


def torchrec_optimizer_keys(theirs: Values, ours: Values) -> Values:
    """TorchRec's fused optimizer state in recshard's layout (the keys are the same,
    `<fqn>.<table>.momentum1`): a column-sharded table's one `[rows x shards]` accumulator cut
    into recshard's `momentum1@col<offset>`, in column order (a documented difference)."""
    out: Values = {}
    for name, value in theirs.items():
        columns = sorted(
            (k for k in ours if k.startswith(f"{name}@col")), key=lambda k: int(k.split("@col")[1])
        )
        if name in ours or not columns:
            out[name] = value
            continue
        for key, block in zip(columns, value.chunk(len(columns))):
            out[key] = block
    return out


def torchrec_quant_rows(theirs: Values, ours: Values) -> Values:
    """TorchRec's quantized table buffers in recshard's names (a documented difference): its
    `weight` holds fbgemm's whole rows (fp16 scale, fp16 bias, the codes, padding to 16
    bytes); recshard's `weight` the codes, `weight_qscale` / `weight_qbias` the rest."""
    out: Values = {}
    for name, value in theirs.items():
        scale = f"{name}_qscale"
        if scale not in ours or not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
            out[name] = value
            continue
        codes = ours[name].shape[1]
        out[name] = value[:, 4 : 4 + codes].contiguous()
        out[scale] = value[:, 0:2].contiguous().view(torch.float16).reshape(-1)
        out[f"{name}_qbias"] = value[:, 2:4].contiguous().view(torch.float16).reshape(-1)
    return out


def compare(name: str, a: Any, b: Any, rtol: float, atol: float) -> Dict[str, Any]:
    """One value, TorchRec's `a` against recshard's `b`."""
    record: Dict[str, Any] = dict(value=name)
    if isinstance(a, str) or isinstance(b, str):
        return dict(record, verdict="equal" if a == b else "different", torchrec=a, recshard=b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return dict(
            record,
            verdict="different",
            torchrec=f"{a.dtype}{list(a.shape)}",
            recshard=f"{b.dtype}{list(b.shape)}",
        )
    if a.is_floating_point():  # NaN: a region neither side's ranks held
        if torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()):
            return dict(record, verdict="equal")
    elif torch.equal(a, b):
        return dict(record, verdict="equal")
    if not a.is_floating_point():  # ids, counts, quantized rows
        return dict(record, verdict="different", differing=int((a != b).sum()), of=a.numel())
    diff = float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())
    close = torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return dict(record, verdict="close" if close else "different", max_abs_diff=diff)


def compare_case(case: str, ours: Values, theirs: Values, rtol: float, atol: float) -> None:
    """A JSON line per value that is not exactly equal, and the case's counts."""
    theirs = torchrec_quant_rows(torchrec_optimizer_keys(theirs, ours), ours)
    counts = {"equal": 0, "close": 0, "different": 0, "torchrec_only": 0, "recshard_only": 0}
    for name in sorted(set(theirs) | set(ours)):
        if name not in ours or name not in theirs:
            side = "torchrec_only" if name in theirs else "recshard_only"
            counts[side] += 1
            emit(dict(bench="torchrec_numbers", case=case, value=name, verdict=side))
            continue
        record = compare(name, theirs[name], ours[name], rtol, atol)
        counts[record["verdict"]] += 1
        if record["verdict"] != "equal":
            emit(dict(bench="torchrec_numbers", case=case, **record))
    emit(dict(bench="torchrec_numbers_case", case=case, **counts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", type=Path, required=True, help="a venv with TorchRec")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument(
        "--atol",
        type=float,
        default=1e-5,
        help="Adagrad's first step, lr * g / sqrt(g^2), turns the last bits of a gradient "
        "summed in another order into ~1e-6 weight differences",
    )
    p.add_argument("--keep", type=Path, default=None, help="keep scripts and results here")
    args = p.parse_args()
    python = args.venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"--venv {args.venv}: no {python} (recipe in ../shared/TARGETS.md)")
    work = Path(tempfile.mkdtemp(prefix="torchrec_numbers_")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    theirs, ours = work / "torchrec", work / "recshard"
    for side in (theirs, ours):
        side.mkdir(exist_ok=True)
        shutil.copy(SCRIPT, side / "torchrec_numbers_script.py")
    report = port(ours / "torchrec_numbers_script.py", env)
    emit(
        dict(
            bench="torchrec_numbers_setup",
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(sys.argv),
            rtol=args.rtol,
            atol=args.atol,
            port_report=report,
        )
    )
    run_side(str(python), theirs / "torchrec_numbers_script.py", theirs / "out", None, env)
    run_side(sys.executable, ours / "torchrec_numbers_script.py", ours / "out", theirs / "out", env)
    for case in CASES:
        compare_case(
            case,
            load_case(ours / "out", case),
            load_case(theirs / "out", case),
            args.rtol,
            args.atol,
        )
    if args.keep is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
