"""Calibration: real kernel and link measurements (short budget) into a profile the
planner uses; profile file round trip; `recshard-plan calibrate` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recshard.calibration import CalibrationGrid, calibrate
from recshard.calibration.cli import main
from recshard.calibration.fitting import (
    fit_costs,
    fit_kernel,
    fit_link,
    fit_nonnegative,
    fit_rate,
)
from recshard.planner import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
    TableMeta,
    Topology,
)
from recshard.planner.cost.estimators import MODULE_OUTPUT_COPIES
from recshard.planner.profile import CalibrationProfile, KernelCost, LinkCost, MemoryCost
from recshard.types import PipelineType
from tests.multiprocess import run_ranks

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fits_recover_known_costs():
    points = [
        (ids, bags, 0.0, 0.5 + 2e-4 * ids + 1e-3 * bags)
        for ids in (100.0, 1000.0, 5000.0)
        for bags in (10.0, 200.0)
    ]
    per_id, per_bag, per_element, per_call = fit_costs(points, with_elements=False)
    assert per_id == pytest.approx(2e-4, rel=1e-6) and per_bag == pytest.approx(1e-3, rel=1e-6)
    assert per_call == pytest.approx(0.5, rel=1e-6) and per_element == 0.0
    latency, ms_per_byte = fit_link([(b, 0.05 + b / 2e6) for b in (1e3, 1e5, 1e7)])
    assert latency == pytest.approx(0.05, rel=1e-6) and 1 / ms_per_byte == pytest.approx(2e6)
    assert fit_rate([(4e6, 5.0), (16e6, 19.0)]) == (0.0, pytest.approx(24.0 / 20e6))


def test_an_id_is_priced_by_its_table_size():
    # two per-id costs told apart by which table size the ids went to
    x = [[ids, 0.0, bags] for ids in (1e3, 8e3) for bags in (10.0, 300.0)]
    x += [[0.0, ids, bags] for ids in (1e3, 8e3) for bags in (10.0, 300.0)]
    ms = [0.2 + 1e-5 * a + 4e-5 * b + 1e-4 * c for a, b, c in x]
    coef, per_call = fit_nonnegative(x, ms)
    assert coef == pytest.approx([1e-5, 4e-5, 1e-4]) and per_call == pytest.approx(0.2)
    # noise that makes one size's ids look free (more hot ids, less time: the fit drops the
    # hot term) gets one price for both, not a free hot id
    noisy = [0.3 - 1e-6 * a + 4e-5 * b + 1e-4 * c for a, b, c in x]
    assert fit_nonnegative(x, noisy)[0][0] == 0.0
    coef, _ = fit_kernel(x, noisy)
    assert coef[0] == coef[1] > 0
    assert fit_kernel(x, ms)[0] == pytest.approx([1e-5, 4e-5, 1e-4])  # told apart: kept
    cost = KernelCost(
        "fused",
        "bwd",
        64,
        1e-5,
        0.0,
        0.0,
        0.0,
        ms_per_id_cold=4e-5,
        hot_rows=2_000,
        cold_rows=200_000,
    )
    assert cost.id_ms(20) == cost.id_ms(2_000) == 1e-5
    assert cost.id_ms(200_000) == cost.id_ms(10**7) == 4e-5
    assert cost.id_ms(20_000) == pytest.approx(2.5e-5)  # half way in log rows
    # a profile without the cold cost (written before it) prices every id alike
    old = KernelCost("fused", "bwd", 64, 1e-5, 0.0)
    assert old.id_ms(10**7) == 1e-5
    profile = CalibrationProfile(
        "cpu",
        1,
        kernels=[
            cost,
            old.__class__(
                "fused",
                "fwd",
                64,
                1e-5,
                0.0,
                ms_per_id_cold=4e-5,
                hot_rows=2_000,
                cold_rows=200_000,
            ),
        ],
    )
    assert profile.kernel_ms("fused", "bwd", 128, 1e3, 0.0, rows=10**6) == pytest.approx(
        1e3 * 4e-5 * 2
    )  # wider rows scale the per-id cost, cold or not
    assert CalibrationProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


@pytest.mark.slow  # ~35-80 s: make test stays under 15 min
def test_calibrate_kernels_short_budget(tmp_path):
    profile = calibrate(budget_s=2.0, grid=CalibrationGrid.quick())
    assert profile.links == [] and profile.world_size == 1
    fused_bwd = profile.kernel_cost("fused", "bwd", 16)
    assert fused_bwd is not None and profile.kernel_cost("dense", "fwd", 32) is not None
    assert fused_bwd.ms_per_id_cold is not None and fused_bwd.hot_rows < fused_bwd.cold_rows
    # real work costs something: 10k ids forward + backward are not free
    assert (
        profile.kernel_ms("fused", "fwd", 32, 1e4, 1e3)
        + profile.kernel_ms("fused", "bwd", 32, 1e4, 1e3)
        > 0
    )
    path = str(tmp_path / "profile.json")
    profile.save(path)
    assert CalibrationProfile.load(path) == profile


def _calibrate_links(rank, world_size):
    profile = calibrate(budget_s=1.0, grid=CalibrationGrid.quick())
    return profile.to_dict()


@pytest.mark.slow  # ~35-80 s: make test stays under 15 min
def test_calibrate_links_across_two_hosts():
    profiles = run_ranks(4, _calibrate_links, timeout=300, env={"LOCAL_WORLD_SIZE": "2"})
    profile = CalibrationProfile.from_dict(profiles[0])
    assert {c.level for c in profile.links} == {"intra", "inter"}
    assert profile.local_world_size == 2


def _profile(per_id: float, inter_gbps: float = 1.0) -> CalibrationProfile:
    kernels = [
        KernelCost(k, phase, dim, per_id * dim / 64, 0.0, 1e-7 if k == "dense" else 0.0, 0.1)
        for k in ("fused", "dense")
        for phase in ("fwd", "bwd")
        for dim in (16, 64)
    ]
    links = [
        LinkCost(c, level, 2, 20.0 if level == "intra" else inter_gbps, 0.05)
        for c in ("all_to_all", "reduce_scatter", "all_gather")
        for level in ("intra", "inter")
    ]
    return CalibrationProfile("cpu", 1, 4, 2, kernels, links)


def test_profile_drives_estimates_and_flags_override():
    table = TableMeta("t", 100_000, 64, pooling_factors=[10.0])
    slow = EmbeddingPerfEstimator(Topology(2, profile=_profile(1e-4)), 512)
    fast = EmbeddingPerfEstimator(Topology(2, profile=_profile(1e-5)), 512)
    a = slow.estimate(table, "table_wise", "fused", 100_000, 64)
    b = fast.estimate(table, "table_wise", "fused", 100_000, 64)
    ids = 512 * 10 * 2  # both ranks' ids reach the one shard
    assert a.fwd_compute == pytest.approx(ids * 1e-4) and b.fwd_compute == pytest.approx(ids * 1e-5)
    # dim 32 interpolates between the measured 16 and 64
    mid = slow.estimate(
        TableMeta("m", 100_000, 32, pooling_factors=[10.0]), "table_wise", "fused", 100_000, 32
    )
    assert mid.fwd_compute == pytest.approx(ids * 1e-4 * 32 / 64)
    topo = Topology(4, local_world_size=2, profile=_profile(1e-5, inter_gbps=0.5))
    assert topo.inter_host_bw == pytest.approx(0.5e6) and topo.intra_host_bw == pytest.approx(20e6)
    overridden = Topology(4, local_world_size=2, inter_host_bw=7.0, profile=_profile(1e-5))
    assert overridden.inter_host_bw == pytest.approx(7e6)
    assert Topology(4).inter_host_bw == pytest.approx(3e6)  # no profile: today's default


def test_profile_file_errors_name_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"compute_device": "cpu", "torch_threads": 1, "bogus": 1}))
    with pytest.raises(ValueError, match="p.json: not a calibration profile"):
        CalibrationProfile.load(str(path))


@pytest.mark.slow
def test_cli_calibrate_under_torchrun(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "recshard.calibration",
            "-o",
            str(out),
            "--quick",
            "--budget",
            "2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    profile = CalibrationProfile.load(str(out))
    assert profile.world_size == 2 and profile.gbps("intra") > 0


@pytest.mark.slow  # ~30 s: make test stays under 15 min
def test_cli_calibrate_then_plan_with_profile(tmp_path):
    out = tmp_path / "profile.json"
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recshard.calibration",
            "-o",
            str(out),
            "--quick",
            "--budget",
            "2",
            "--storage",
            str(kv_dir),
            "--storage-mb",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["profile"] == str(out) and summary["storage_gbps"]["read"] > 0
    storage = CalibrationProfile.load(str(out)).storage
    assert storage is not None and storage.directory == str(kv_dir) and storage.write_gbps > 0
    assert os.listdir(kv_dir) == []  # the probe file is gone
    tables = tmp_path / "tables.json"
    tables.write_text(
        json.dumps(
            [{"name": "t", "num_embeddings": 1000, "embedding_dim": 16, "pooling_factor": 4}]
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recshard.planner",
            str(tables),
            "--world-size",
            "2",
            "--profile",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert "estimated step time" in proc.stdout


def test_calibrated_memory_scales_the_storage_estimate():
    table = TableMeta("t", 10_000, 64, pooling_factors=[10.0])
    plain = EmbeddingStorageEstimator(Topology(2), 512).estimate(
        table, "table_wise", "fused", 10_000, 64
    )
    profile = CalibrationProfile("cpu", 1, memory=MemoryCost(1.5, 100.0, 2.0))
    calibrated = EmbeddingStorageEstimator(Topology(2, profile=profile), 512).estimate(
        table, "table_wise", "fused", 10_000, 64
    )
    ids, bags = 2 * 512 * 10, 2 * 512
    weights = 10_000 * 64 * 4
    module = MODULE_OUTPUT_COPIES * 512 * 64 * 4  # the rank's own output, held 4 times
    assert calibrated.ddr == pytest.approx(
        1.5 * weights + ids * (8 + 100) + bags * 64 * 4 * 2 + module
    )
    assert plain.ddr == pytest.approx(weights + ids * 8 + 2 * bags * 64 * 4)
    # TrainPipelineSparseDist holds the next batch's ids too (TorchRec's factor 2)
    pipelined = EmbeddingStorageEstimator(
        Topology(2, profile=profile), 512, PipelineType.TRAIN_SPARSE_DIST
    )
    assert pipelined.estimate(table, "table_wise", "fused", 10_000, 64).ddr == pytest.approx(
        calibrated.ddr + ids * 8
    )
    # row-wise: the reduce-scatter's receive and the all-gather's send buffer hold every
    # rank's bags; the reduced output of the rank's own bags and its gradient hold whole rows
    own = 512 * 64 * 4
    row_wise = 1.5 * weights / 2 + (ids / 2) * (8 + 100) + bags * 64 * 4 * 2
    half = EmbeddingStorageEstimator(Topology(2, profile=profile), 512).estimate(
        table, "row_wise", "fused", 5_000, 64
    )
    assert half.ddr == pytest.approx(row_wise + 2 * bags * 64 * 4 + 2 * own)
    # table-row-wise on one host is row-wise; across 2 hosts x 2 ranks it also regroups the
    # rows before the host's reduce-scatter and sends the host's sums (2 own batches) across
    # hosts, held as a table-wise output is plus the sums and their gradient
    hosts = Topology(4, local_world_size=2, profile=profile)
    assert EmbeddingStorageEstimator(Topology(2, profile=profile), 512).estimate(
        table, "table_row_wise", "fused", 5_000, 64
    ).ddr == pytest.approx(half.ddr)
    quarter = EmbeddingStorageEstimator(hosts, 512).estimate(
        table, "table_row_wise", "fused", 5_000, 64
    )
    bags4 = 4 * 512
    assert quarter.ddr == pytest.approx(
        1.5 * weights / 2
        + (ids / 2 * 2) * (8 + 100)
        + bags4 * 64 * 4 * 2
        + 3 * bags4 * 64 * 4
        + (2 + MODULE_OUTPUT_COPIES) * 2 * own
    )


def test_recshard_plan_calibrate_is_the_calibration_command(tmp_path, capsys):
    """`recshard-plan calibrate` reaches the calibration command (its own argument checks)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "-o", str(tmp_path / "p.json"), "--budget", "nan"])
    assert exit_info.value.code == 2
    assert "--budget must be a finite number of seconds > 0, got nan" in capsys.readouterr().err
