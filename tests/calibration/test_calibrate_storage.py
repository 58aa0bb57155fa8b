"""The storage probe of `recshard-plan calibrate --storage DIR`: real reads and write-backs on a
small probe file, nothing left behind, the rate carried by the profile into the planner's
`Topology.storage_bw`, and bad directories refused before anything is measured."""

from __future__ import annotations

import os

import pytest

from recshard.calibration.cli import main
from recshard.calibration.storage import measure_storage
from recshard.planner import Topology
from recshard.planner.profile import CalibrationProfile


def test_probe_measures_rows_and_cleans_up(tmp_path):
    (tmp_path / "kept").write_text("a file of the user's")
    cost = measure_storage(str(tmp_path), file_bytes=1 << 20, seconds=0.2)
    assert os.listdir(tmp_path) == ["kept"]  # the probe's directory and files are gone
    assert cost.read_gbps > 0 and cost.write_gbps > 0 and cost.row_bytes == 256
    assert cost.file_bytes == 1 << 20 and cost.directory == str(tmp_path)
    assert min(cost.read_gbps, cost.write_gbps) <= cost.gbps <= max(cost.read_gbps, cost.write_gbps)

    profile = CalibrationProfile("cpu", 1, storage=cost)
    path = tmp_path / "profile.json"
    profile.save(str(path))
    loaded = CalibrationProfile.load(str(path))
    assert loaded.storage == cost
    measured = Topology(world_size=2, profile=loaded)
    default = Topology(world_size=2)
    assert measured.storage_bw == pytest.approx(default.storage_bw * cost.gbps)  # default 1 GB/s
    given = Topology(world_size=2, profile=loaded, storage_bw=3.0)  # given beats measured
    assert given.storage_bw == pytest.approx(default.storage_bw * 3.0)


def test_probe_refuses_a_directory_it_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="cannot write in .*missing"):
        measure_storage(str(tmp_path / "missing"), file_bytes=1 << 20, seconds=0.1)
    with pytest.raises(ValueError, match="file_bytes must be at least"):
        measure_storage(str(tmp_path), file_bytes=4096, seconds=0.1)


def test_cli_refuses_bad_storage_flags_before_measuring(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "-o", out, "--storage", str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "-o", out, "--storage", str(tmp_path), "--storage-mb", "0"])
    assert exit_info.value.code == 2 and "--storage-mb must be" in capsys.readouterr().err
    assert not os.path.exists(out)
