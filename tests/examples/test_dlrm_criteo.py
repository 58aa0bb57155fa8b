"""The Criteo reader on the real sample files (TSV, truncated-row TSV, CSV with a header)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from examples.dlrm.data import NUM_SPARSE, SPARSE_NAMES
from examples.dlrm.data.criteo import (
    CriteoIterDataset,
    FileShard,
    collate_rows,
    criteo_loader,
    hash_category,
    list_files,
    parse_line,
    read_rows,
    split_shards,
)

DATA_DIR = (Path(__file__).resolve().parents[2] / "../shared/data/criteo").resolve()
# file -> (rows, positives)
SAMPLES = {
    "paddlerec_part-0_100.txt": (100, 29),
    "pytorch-fm_fork_criteo_train_1000.txt": (1000, 205),
    "deepctr_criteo_sample_200.csv": (200, 49),
}
SIZES = [1000] * 12 + [7, 1, 2, 50] * 3 + [10, 100]


def _sample(name: str) -> Path:
    path = DATA_DIR / name
    if not path.is_file():
        pytest.skip(f"Criteo sample {path} is not on this machine")
    return path


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_files_parse(name: str) -> None:
    path = _sample(name)
    rows = list(read_rows(FileShard(str(path)), SIZES))
    expected_rows, expected_pos = SAMPLES[name]
    assert len(rows) == expected_rows
    assert sum(r[0] for r in rows) == expected_pos
    for _label, dense, ids in rows:
        assert len(dense) == 13 and len(ids) == NUM_SPARSE
        assert all(v >= 0.0 and math.isfinite(v) for v in dense)
        assert all(0 <= i < n for i, n in zip(ids, SIZES))
    # every file has missing values: some dense zeros and some categoricals on the missing row
    assert any(0.0 in dense for _, dense, _ in rows)
    assert any(0 in ids[:12] for _, _, ids in rows if len(ids))


def test_splits_partition_the_lines() -> None:
    path = str(_sample("pytorch-fm_fork_criteo_train_1000.txt"))
    train = list(read_rows(FileShard(path), SIZES, split="train"))
    evals = list(read_rows(FileShard(path), SIZES, split="eval"))
    assert len(train) + len(evals) == 1000 and 70 <= len(evals) <= 130
    # readers that take every 2nd line (2 ranks, one file) each get about half the eval lines
    halves = [list(read_rows(FileShard(path, 2, r), SIZES, split="eval")) for r in range(2)]
    assert sorted(len(h) for h in halves)[0] >= len(evals) // 3
    assert sorted(map(str, halves[0] + halves[1])) == sorted(map(str, evals))


def test_truncated_row_pads_missing_categoricals() -> None:
    fields = ["1", "3", "", "-5", "2.0"] + [""] * 9 + ["05db9164", "zz"]
    label, dense, ids = parse_line("\t".join(fields), "\t", SIZES, "x:1")
    assert label == 1
    assert dense[:4] == [math.log1p(3.0), 0.0, 0.0, math.log1p(2.0)]
    assert ids[0] == 1 + int("05db9164", 16) % (SIZES[0] - 1)
    assert 1 <= ids[1] < SIZES[1]  # not hex: crc32-hashed, still in range
    assert ids[2:] == [0] * (NUM_SPARSE - 2)


def test_bad_rows_name_the_line() -> None:
    with pytest.raises(ValueError, match="f.tsv:7: label must be 0 or 1"):
        parse_line("2\t1", "\t", SIZES, "f.tsv:7")
    with pytest.raises(ValueError, match="f.tsv:3: 41 fields"):
        parse_line("\t".join(["0"] * 41), "\t", SIZES, "f.tsv:3")
    with pytest.raises(ValueError, match="f.tsv:4: bad label or dense"):
        parse_line("0\tabc", "\t", SIZES, "f.tsv:4")


def test_hash_category_range() -> None:
    assert hash_category("", 100) == 0
    assert hash_category("ffffffff", 1) == 0
    values = [f"{v:08x}" for v in range(0, 2**32, 2**22 + 1)]
    rows = {hash_category(v, 17) for v in values}
    assert rows == set(range(1, 17))


def test_shards_cover_every_line_once() -> None:
    path = str(_sample("paddlerec_part-0_100.txt"))
    seen = []
    for rank in range(2):
        for worker in range(3):
            shards = split_shards(split_shards([FileShard(path)], rank, 2), worker, 3)
            seen += [tuple(r[2]) + (r[0],) for s in shards for r in read_rows(s, SIZES)]
    everything = [tuple(r[2]) + (r[0],) for r in read_rows(FileShard(path), SIZES)]
    assert sorted(seen) == sorted(everything)
    many = [FileShard(f"f{i}") for i in range(5)]
    assert [s.path for s in split_shards(many, 1, 2)] == ["f1", "f3"]


def test_loader_builds_batches_with_workers() -> None:
    _sample("deepctr_criteo_sample_200.csv")
    loader = criteo_loader(str(DATA_DIR), SIZES, batch_size=32, rank=1, world_size=2, num_workers=2)
    batches = list(loader)
    # 3 files over 2 ranks: rank 1 reads the 2nd file (100 rows), its 2 workers 50 rows each,
    # and each worker drops its partial batch
    assert len(batches) == 2 and all(b.batch_size == 32 for b in batches)
    batch = batches[0]
    assert batch.dense_features.shape == (32, 13)
    assert batch.sparse_features.keys() == SPARSE_NAMES
    assert batch.sparse_features.lengths().eq(1).all()
    values = batch.sparse_features.values().view(NUM_SPARSE, 32)
    assert (values < torch.tensor(SIZES).unsqueeze(1)).all()


def test_collate_and_dataset_agree() -> None:
    path = str(_sample("paddlerec_part-0_100.txt"))
    rows = list(CriteoIterDataset([path], SIZES, split="all"))
    batch = collate_rows(rows[:4])
    assert batch.labels.tolist() == [r[0] for r in rows[:4]]
    assert batch.sparse_features["cat_3"].values().tolist() == [r[2][3] for r in rows[:4]]
    assert list_files(str(DATA_DIR)) == sorted(str(DATA_DIR / n) for n in SAMPLES)
