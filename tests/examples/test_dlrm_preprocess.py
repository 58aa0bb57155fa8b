"""Criteo preprocessing and the binary loader on the real samples: the same rows and batches as
the TSV reader, resuming, frequency vocabularies, bad rows with file and line, .gz input."""

from __future__ import annotations

import gzip
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest
import torch
from multiprocess import run_ranks

from examples.dlrm.args import parse_args
from examples.dlrm.data.binary import BinaryCriteo, SplitArrays
from examples.dlrm.data.criteo import (
    FileShard,
    category_code,
    criteo_loader,
    is_eval_line,
    read_rows,
    sniff,
)
from examples.dlrm.data.criteo_spec import capped_num_embeddings
from examples.dlrm.data.preprocess import Manifest, VocabSettings, preprocess
from examples.dlrm.preprocess import main
from examples.dlrm.train import run
from recshard.datasets.utils import Batch

DATA_DIR = (Path(__file__).resolve().parents[2] / "../shared/data/criteo").resolve()
SAMPLES = [
    "deepctr_criteo_sample_200.csv",
    "paddlerec_part-0_100.txt",
    "pytorch-fm_fork_criteo_train_1000.txt",
]
SIZES = [1000] * 12 + [7, 1, 2, 50] * 3 + [10, 100]
HASH = VocabSettings("hash", SIZES, 0, 10)

pytestmark = pytest.mark.skipif(
    not all((DATA_DIR / n).is_file() for n in SAMPLES), reason="Criteo samples not on this machine"
)


def assert_same_batches(expected: List[Batch], actual: List[Batch]) -> None:
    assert len(expected) == len(actual) > 0
    for a, b in zip(expected, actual):
        assert torch.equal(a.labels, b.labels)
        assert torch.equal(a.dense_features, b.dense_features)
        assert a.sparse_features.keys() == b.sparse_features.keys()
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


@pytest.fixture(scope="module")
def hashed(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("criteo_bin"))
    preprocess([str(DATA_DIR)], out, HASH, workers=2)
    return out


@pytest.mark.parametrize("split", ["train", "eval"])
def test_binary_batches_equal_the_tsv_reader(hashed: str, split: str) -> None:
    expected = list(criteo_loader(str(DATA_DIR), SIZES, 16, split=split, num_workers=0))
    assert_same_batches(expected, list(BinaryCriteo(hashed, 16, split)))
    manifest = Manifest.load(hashed)
    assert sum(p.train_rows + p.eval_rows for p in manifest.parts) == 1300
    assert manifest.num_embeddings_per_feature == SIZES and manifest.id_dtype == "int32"


def _rows(batches: List[Batch]) -> List[Tuple]:
    """One tuple per sample: label, dense values, ids."""
    rows = []
    for b in batches:
        ids = b.sparse_features.values().view(len(SIZES), -1).T
        rows += [
            (int(b.labels[i]), *b.dense_features[i].tolist(), *ids[i].tolist())
            for i in range(b.batch_size)
        ]
    return rows


def test_ranks_read_their_own_slices_and_shuffling_permutes(hashed: str) -> None:
    everything = _rows(list(BinaryCriteo(hashed, 1, "train")))
    assert len(everything) == 1161
    per_rank = [_rows(list(BinaryCriteo(hashed, 10, "train", rank, 3))) for rank in range(3)]
    assert [len(r) for r in per_rank] == [380] * 3  # 387 rows each, 38 full batches
    for rank, rows in enumerate(per_rank):
        assert rows == everything[rank * 387 : rank * 387 + 380]
    shuffled = [
        _rows(list(BinaryCriteo(hashed, 10, "train", 1, 3, shuffle_buffer=100, seed=0, epoch=e)))
        for e in range(2)
    ]
    for rows in shuffled:
        assert sorted(rows) == sorted(per_rank[1]) and rows != per_rank[1]
    assert shuffled[0] != shuffled[1]  # another epoch, another order


def test_resume_skips_finished_files_and_refuses_other_settings(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = preprocess([str(DATA_DIR)], str(out), HASH)
    parts = sorted((out / "parts").glob("*.bin"))
    stamps = {p: p.stat().st_mtime_ns for p in parts}
    (out / "parts" / f"{first.parts[1].name}.json").unlink()  # as if killed during file 2
    seen: List[int] = []
    again = preprocess([str(DATA_DIR)], str(out), HASH, progress=lambda _s, n: seen.append(n))
    assert again == first and len(seen) == 3
    redone = [p for p in parts if p.stat().st_mtime_ns != stamps[p]]
    assert redone and all(first.parts[1].name in p.name for p in redone)
    with pytest.raises(ValueError, match="holds data preprocessed with"):
        preprocess([str(DATA_DIR)], str(out), VocabSettings("hash", SIZES, 0, 5))


def _codes_by_line(path: Path) -> List[Tuple[int, List[int | None]]]:
    """(line index, categorical codes) of every row, straight from the text."""
    lines = path.read_text().splitlines()
    sep, header = sniff(lines[0])
    rows = []
    for index, line in enumerate(lines[int(header) :]):
        values = line.split(sep)[14:]
        rows.append((index, [category_code(v) for v in values + [""] * (26 - len(values))]))
    return rows


def test_frequency_vocabulary_maps_rare_values_to_one_row(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    settings = VocabSettings("frequency", [], 3, 10)
    manifest = preprocess([str(DATA_DIR)], str(tmp_path), settings)
    by_file = [_codes_by_line(DATA_DIR / n) for n in SAMPLES]
    counts = [Counter() for _ in range(26)]
    for rows in by_file:
        for index, codes in rows:
            if not is_eval_line(index, 10):
                for f, code in enumerate(codes):
                    if code is not None:
                        counts[f][code] += 1
    vocab = [sorted(c for c, n in counts[f].items() if n >= 3) for f in range(26)]
    assert manifest.num_embeddings_per_feature == [2 + len(v) for v in vocab]
    assert any(len(v) < len(counts[f]) for f, v in enumerate(vocab))  # some values are rare
    expected = {"train": [], "eval": []}
    for rows in by_file:
        for index, codes in rows:
            ids = [
                0 if c is None else (2 + vocab[f].index(c) if c in vocab[f] else 1)
                for f, c in enumerate(codes)
            ]
            expected["eval" if is_eval_line(index, 10) else "train"].append(ids)
    for split in ("train", "eval"):
        _, _, ids = SplitArrays(str(tmp_path), manifest, split).read(0, len(expected[split]))
        assert ids.tolist() == expected[split]
    assert (np.array(expected["eval"]) == 1).any()  # unseen in train -> the OOV row

    # separate eval files take the training vocabulary; training refuses any other one
    source = DATA_DIR / SAMPLES[1]
    shared = VocabSettings("frequency", [], 3, 10, str(tmp_path))
    evaluation = preprocess([str(source)], str(tmp_path / "ev"), shared)
    own = preprocess([str(source)], str(tmp_path / "own"), settings)
    assert evaluation.vocabulary == manifest.vocabulary != own.vocabulary
    rows = by_file[1]
    _, _, ids = SplitArrays(str(tmp_path / "ev"), evaluation, "train").read(0, 89)
    assert ids[:, 0].tolist() == [
        0 if c is None else (2 + vocab[0].index(c) if c in vocab[0] else 1)
        for index, (c, *_) in rows
        if not is_eval_line(index, 10)
    ]
    sizes = ",".join(map(str, manifest.num_embeddings_per_feature))
    argv = ["--data", "criteo", "--data-path", str(tmp_path), "--num-embeddings-per-feature", sizes]
    assert parse_args(argv + ["--eval-data-path", str(tmp_path / "ev")]).data == "criteo"
    hashed_alike = VocabSettings("hash", manifest.num_embeddings_per_feature, 0, 10)
    preprocess([str(source)], str(tmp_path / "hashed"), hashed_alike)  # same sizes, other rows
    with pytest.raises(SystemExit):
        parse_args(argv + ["--eval-data-path", str(tmp_path / "hashed")])
    assert "--vocab-from TRAINING_DIR" in capsys.readouterr().err


def _corrupt_copy(tmp_path: Path) -> Path:
    lines = (DATA_DIR / "paddlerec_part-0_100.txt").read_text().splitlines()
    lines[3] = "\t".join(lines[3].split("\t")[:6]) + "\t1e"  # cut inside a number
    lines[6] = lines[6] + "\textra"  # 41 fields
    lines[9] = "\t".join(["1", "abc"] + lines[9].split("\t")[2:])  # non-numeric dense
    path = tmp_path / "in" / "corrupt.tsv"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_rows_reported_with_file_and_line(tmp_path: Path) -> None:
    path = _corrupt_copy(tmp_path)
    manifest = preprocess([str(path)], str(tmp_path / "out"), HASH)
    part = manifest.parts[0]
    assert part.bad_rows == 3 and part.train_rows + part.eval_rows == 97
    assert [m.split(": ")[0] for m in part.first_bad] == [f"{path}:{n}" for n in (4, 7, 10)]
    assert "41 fields" in part.first_bad[1] and "bad label or dense" in part.first_bad[2]
    with pytest.raises(ValueError, match=f"--strict.*{path}:4: bad label or dense"):
        preprocess([str(path)], str(tmp_path / "strict"), HASH, strict=True)


def test_gzip_input_and_truncated_gzip(tmp_path: Path) -> None:
    source = DATA_DIR / "pytorch-fm_fork_criteo_train_1000.txt"
    packed = tmp_path / "in" / "day.txt.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(source.read_bytes()))
    manifest = preprocess([str(packed.parent)], str(tmp_path / "gz"), HASH, chunk_bytes=4096)
    plain = preprocess([str(source)], str(tmp_path / "plain"), HASH)
    for split in ("train", "eval"):
        arrays = [
            SplitArrays(str(tmp_path / d), m, split)
            for d, m in (("gz", manifest), ("plain", plain))
        ]
        assert len(arrays[0]) == len(arrays[1]) > 0
        for a, b in zip(arrays[0].read(0, len(arrays[0])), arrays[1].read(0, len(arrays[1]))):
            assert np.array_equal(a, b)
    cut = tmp_path / "cut" / "day.txt.gz"
    cut.parent.mkdir()
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{cut}:\d+: .*ends early"):
        preprocess([str(cut)], str(tmp_path / "cut_out"), HASH, chunk_bytes=4096)


def test_cli_writes_arrays_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:

    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(DATA_DIR / "paddlerec_part-0_100.txt", inputs)
    corrupt = _corrupt_copy(tmp_path / "c")
    os.replace(corrupt, inputs / "corrupt.tsv")
    main(
        [
            "--input",
            str(inputs),
            "--output",
            str(tmp_path / "out"),
            "--no-progress",
            "--num-embeddings-per-feature",
            "1000",
            "--workers",
            "2",
        ]
    )
    text = capsys.readouterr().out
    assert f"{inputs / 'corrupt.tsv'}: " in text and "3 bad rows skipped, first: " in text
    assert f"{inputs / 'corrupt.tsv'}:4:" in text and "197 rows in" in text


TINY = [
    "--embedding-dim",
    "8",
    "--num-embeddings-per-feature",
    "500",
    "--dense-arch-layers",
    "16,8",
    "--over-arch-layers",
    "16,1",
    "--no-progress",
    "--data",
    "criteo",
    "--batch-size",
    "16",
    "--num-workers",
    "0",
    "--seed",
    "3",
]


def _train(rank: int, world_size: int, argvs: List[List[str]]) -> List[dict]:

    return [run(parse_args(argv)) for argv in argvs]


def test_training_on_preprocessed_data_matches_the_tsv_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:

    out = str(tmp_path / "bin")
    preprocess([str(DATA_DIR)], out, VocabSettings("hash", capped_num_embeddings(500), 0, 10))
    steps = ["--steps", "6", "--eval-batches", "3", "--eval-every", "3"]
    tsv, binary = run_ranks(
        1,
        _train,
        [TINY + ["--data-path", str(DATA_DIR)] + steps, TINY + ["--data-path", out] + steps],
        timeout=240,
    )[0]
    assert binary["steps"] == 6 and binary["final_eval"]["samples"] == 48
    assert binary["evals"] == tsv["evals"] and binary["final_loss_ema"] == tsv["final_loss_ema"]
    two = run_ranks(
        2, _train, [TINY + ["--data-path", out, "--shuffle-buffer", "64"] + steps], timeout=240
    )
    assert [s[0]["steps"] for s in two] == [6, 6]
    assert two[0][0]["final_eval"] == two[1][0]["final_eval"]
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--data-path", out, "--num-embeddings-per-feature", "400"])
    assert "pass --num-embeddings-per-feature 500,500," in capsys.readouterr().err


def test_parser_agrees_with_the_reader_on_odd_values(tmp_path: Path) -> None:
    """Numbers and categories of every shape the fast path decodes or hands to `parse_line`,
    blank lines, CRLF and lone CR line ends: the same rows and line indices as `read_rows`."""
    dense_values = [
        "-1",
        "007",
        "1.5",
        "-0.25",
        "1e3",
        " 3",
        "+4",
        "12345678",
        "123456789",
        "1234567890123456789",
        "0.1234567890123456",
        ".5",
        "5.",
    ]
    categories = [
        "ABCDEF12",
        "a",
        "123456789",
        "zz",
        "0x1f",
        "",
        "05db9164",
        "FFFFFFFF",
        "ffffffffffffffff",
        "1_0",
    ] + [""] * 16
    good = "\t".join(["1"] + dense_values + categories)
    lines = [
        good,
        "",
        "0\t2",
        "   ",
        "\t".join(["0"] * 14 + ["c0ffee"]) + "\r",
        "1\t3\r0\t4",
        good.upper().replace("E3", "e3"),
    ]
    path = tmp_path / "odd.tsv"
    path.write_bytes(("\n".join(lines) + "\n").encode())
    expected = list(read_rows(FileShard(str(path)), SIZES))
    out = str(tmp_path / "out")
    manifest = preprocess([str(path)], out, VocabSettings("hash", SIZES, 0, 1))
    labels, dense, ids = SplitArrays(out, manifest, "eval").read(0, len(expected))
    assert manifest.parts[0].bad_rows == 0 and len(expected) == 6
    assert labels.tolist() == [r[0] for r in expected]
    assert np.array_equal(dense, np.array([r[1] for r in expected], np.float32))
    assert ids.tolist() == [r[2] for r in expected]
