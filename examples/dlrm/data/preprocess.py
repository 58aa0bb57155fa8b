"""Criteo TSV/CSV files -> per-split binary arrays that `binary.py` memory-maps.

Layout of an output directory:

    settings.json              how values became rows (checked on resume and by training)
    counts/<part>.npz          frequency mode: per-feature value counts of one file's train rows
    vocab.npz                  frequency mode: per feature, the sorted codes kept as rows
    parts/<part>.json          a finished file: its source and row/bad-row counts
    parts/<part>.<split>.{labels,dense,ids}.bin   uint8 [N], float32 [N, 13], int32/64 [N, 26]
    manifest.json              written last: settings, table sizes, id dtype, the
                               vocabulary's name (hash sizes or a digest), every part

Splits follow the reader: a line is "eval" when `is_eval_line(index, eval_every_n)`, else
"train". Categorical rows: with hashing, `criteo.hash_category`'s (0 = missing); with a
frequency-thresholded vocabulary, 0 = missing, 1 = out of vocabulary (values seen fewer than
`min_count` times in the train split of all files, or the vocabulary of another directory
for separate eval files), 2.. = the kept values in code order.
Files are converted in parallel; a file whose `parts/<part>.json` exists is not redone.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, List, Sequence

import numpy as np

from examples.dlrm.data.criteo_parse import CHUNK_BYTES, BadRow, ParsedRows, eval_mask, read_file
from examples.dlrm.data.criteo_spec import NUM_SPARSE

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"
SETTINGS = "settings.json"
MODES = ("hash", "frequency")
FIRST_BAD_KEPT = 5
_SUFFIXES = (".txt", ".tsv", ".csv")


@dataclass(frozen=True)
class VocabSettings:
    """How categorical values become rows, and how lines split into train/eval.

    `mode` "hash": `num_embeddings_per_feature` rows per table; "frequency": values seen
    at least `min_count` times get their own row (`num_embeddings_per_feature` is empty),
    counted here or, for eval files, taken from the directory `vocabulary_from`.
    """

    mode: str
    num_embeddings_per_feature: List[int]
    min_count: int
    eval_every_n: int
    vocabulary_from: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"vocabulary mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "hash" and (
            len(self.num_embeddings_per_feature) != NUM_SPARSE
            or min(self.num_embeddings_per_feature) < 1
        ):
            raise ValueError(
                f"hashing needs {NUM_SPARSE} table sizes >= 1, got "
                f"{self.num_embeddings_per_feature}"
            )
        if self.mode == "frequency" and self.min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {self.min_count}")
        if self.eval_every_n < 1:
            raise ValueError(f"eval_every_n must be >= 1, got {self.eval_every_n}")
        if self.vocabulary_from and self.mode != "frequency":
            raise ValueError("vocabulary_from needs the frequency mode")


@dataclass
class PartInfo:
    """One converted input file."""

    name: str
    source: str
    source_bytes: int
    train_rows: int
    eval_rows: int
    bad_rows: int
    first_bad: List[str] = field(default_factory=list)  # "path:line: why", the first few

    def rows(self, split: str) -> int:
        return self.train_rows if split == "train" else self.eval_rows


@dataclass
class Manifest:
    """What a preprocessed directory holds; `num_embeddings_per_feature` are its table sizes,
    `vocabulary` names the value -> row mapping (equal strings: the same rows)."""

    version: int
    settings: VocabSettings
    num_embeddings_per_feature: List[int]
    id_dtype: str
    vocabulary: str
    parts: List[PartInfo]

    @staticmethod
    def load(directory: str) -> Manifest:
        with open(os.path.join(directory, MANIFEST)) as f:
            raw = json.load(f)
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{directory}: preprocessed format version {raw.get('version')}, "
                f"this code reads {FORMAT_VERSION}; preprocess again"
            )
        return Manifest(
            raw["version"],
            VocabSettings(**raw["settings"]),
            raw["num_embeddings_per_feature"],
            raw["id_dtype"],
            raw["vocabulary"],
            [PartInfo(**p) for p in raw["parts"]],
        )


def list_input_files(inputs: Sequence[str]) -> List[str]:
    """Files named by `inputs` (files, directories, globs), `.gz` included, each dir sorted."""
    files: List[str] = []
    for item in inputs:
        if os.path.isdir(item):
            files += [
                os.path.join(item, n)
                for n in sorted(os.listdir(item))
                if n.removesuffix(".gz").endswith(_SUFFIXES)
            ]
        elif any(ch in item for ch in "*?["):
            files += sorted(glob.glob(item))
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise ValueError(f"no such file or directory: {item!r}")
    if not files:
        raise ValueError(f"no Criteo files (.txt, .tsv, .csv, optionally .gz) in {list(inputs)}")
    return files


def part_name(index: int, path: str) -> str:
    """A file's name in the output: its position and base name, filesystem-safe."""
    return f"{index:04d}-{re.sub(r'[^A-Za-z0-9._-]', '_', os.path.basename(path))}"


def part_path(directory: str, name: str, split: str, array: str) -> str:
    return os.path.join(directory, "parts", f"{name}.{split}.{array}.bin")


@dataclass(frozen=True)
class _FileJob:
    """One file for a worker process: count its values, or convert it."""

    path: str
    name: str
    output: str
    settings: VocabSettings
    id_dtype: str
    strict: bool
    chunk_bytes: int


def _chunks(job: _FileJob, bad: List[BadRow]) -> Iterable[ParsedRows]:
    """The file's parsed rows; bad rows go to `bad` (or raise when strict)."""
    for chunk in read_file(job.path, job.chunk_bytes):
        if chunk.bad and job.strict:
            raise ValueError(f"bad row (--strict): {chunk.bad[0].message}")
        bad += chunk.bad
        yield chunk.rows


def _count_file(job: _FileJob) -> str:
    """Per-feature counts of the values in the file's train rows -> counts/<part>.npz."""
    target = os.path.join(job.output, "counts", f"{job.name}.npz")
    if os.path.exists(target):
        return target
    pieces: List[List[np.ndarray]] = [[] for _ in range(NUM_SPARSE)]
    for rows in _chunks(job, []):
        train = ~eval_mask(rows.line_index, job.settings.eval_every_n)
        for f in range(NUM_SPARSE):
            values = rows.codes[train & rows.present[:, f], f]
            pieces[f].append(np.stack(np.unique(values, return_counts=True)).astype(np.uint64))
    merged = {f"f{f}": _merge_counts(pieces[f]) for f in range(NUM_SPARSE)}
    _atomic_npz(target, merged)
    return target


def _merge_counts(pieces: List[np.ndarray]) -> np.ndarray:
    """`[2, K]` (code, count) pieces -> one `[2, K']` with summed counts, codes sorted."""
    if not pieces:
        return np.zeros((2, 0), np.uint64)
    both = np.concatenate(pieces, axis=1)
    codes, inverse = np.unique(both[0], return_inverse=True)
    counts = np.bincount(inverse, weights=both[1], minlength=codes.size).astype(np.uint64)
    return np.stack([codes, counts])


def _atomic_npz(target: str, arrays: dict) -> None:
    tmp = target + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, target)


def build_vocabulary(output: str, names: Sequence[str], min_count: int) -> List[np.ndarray]:
    """Per feature, the sorted codes seen >= `min_count` times over all files -> vocab.npz."""
    vocab = []
    counts = [np.load(os.path.join(output, "counts", f"{n}.npz")) for n in names]
    for f in range(NUM_SPARSE):
        merged = _merge_counts([c[f"f{f}"] for c in counts])
        vocab.append(merged[0][merged[1] >= min_count])
    save_vocabulary(output, vocab)
    return vocab


def save_vocabulary(output: str, vocab: List[np.ndarray]) -> None:
    _atomic_npz(os.path.join(output, "vocab.npz"), {f"f{f}": v for f, v in enumerate(vocab)})


def load_vocabulary(output: str) -> List[np.ndarray]:
    with np.load(os.path.join(output, "vocab.npz")) as z:
        return [z[f"f{f}"] for f in range(NUM_SPARSE)]


def vocabulary_name(settings: VocabSettings, vocab: List[np.ndarray] | None) -> str:
    """ "hash:<sizes>", or "frequency:<sha256 of the kept codes>"."""
    if vocab is None:
        return "hash:" + ",".join(map(str, settings.num_embeddings_per_feature))
    digest = hashlib.sha256()
    for kept in vocab:
        digest.update(np.int64(kept.size).tobytes() + kept.astype("<u8").tobytes())
    return "frequency:" + digest.hexdigest()


def rows_of(
    rows: ParsedRows, settings: VocabSettings, vocab: List[np.ndarray] | None
) -> np.ndarray:
    """Table rows of every categorical value: `[N, 26]` int64."""
    if settings.mode == "hash":
        sizes = np.array(settings.num_embeddings_per_feature, np.uint64)
        hashed = (1 + rows.codes % np.maximum(sizes - 1, 1)).astype(np.int64)
        return np.where(rows.present & (sizes > 1), hashed, 0)
    assert vocab is not None
    ids = np.empty(rows.codes.shape, np.int64)
    for f, kept in enumerate(vocab):
        codes = rows.codes[:, f]
        pos = np.searchsorted(kept, codes)
        found = (
            kept[np.minimum(pos, max(kept.size - 1, 0))] == codes
            if kept.size
            else np.zeros(codes.shape, bool)
        )
        ids[:, f] = np.where(rows.present[:, f], np.where(found, pos + 2, 1), 0)
    return ids


def _convert_file(job: _FileJob) -> PartInfo:
    """Write the file's train/eval arrays under parts/, then its parts/<part>.json."""
    vocab = load_vocabulary(job.output) if job.settings.mode == "frequency" else None
    outputs = {
        (s, a): open(part_path(job.output, job.name, s, a) + ".tmp", "wb")
        for s in SPLITS
        for a in ("labels", "dense", "ids")
    }
    bad: List[BadRow] = []
    counts = {s: 0 for s in SPLITS}
    try:
        for rows in _chunks(job, bad):
            ids = rows_of(rows, job.settings, vocab).astype(job.id_dtype)
            is_eval = eval_mask(rows.line_index, job.settings.eval_every_n)
            for split, mask in (("train", ~is_eval), ("eval", is_eval)):
                outputs[split, "labels"].write(rows.labels[mask].tobytes())
                outputs[split, "dense"].write(rows.dense[mask].tobytes())
                outputs[split, "ids"].write(ids[mask].tobytes())
                counts[split] += int(mask.sum())
    finally:
        for f in outputs.values():
            f.close()
    for (split, array), f in outputs.items():
        os.replace(f.name, part_path(job.output, job.name, split, array))
    info = PartInfo(
        job.name,
        os.path.abspath(job.path),
        os.path.getsize(job.path),
        counts["train"],
        counts["eval"],
        len(bad),
        [b.message for b in bad[:FIRST_BAD_KEPT]],
    )
    _write_json(os.path.join(job.output, "parts", f"{job.name}.json"), asdict(info))
    return info


def _write_json(target: str, value: dict) -> None:
    tmp = target + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, target)


def _finished_part(output: str, name: str, path: str) -> PartInfo | None:
    """The part's info if this exact file was already converted."""
    marker = os.path.join(output, "parts", f"{name}.json")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        info = PartInfo(**json.load(f))
    same = info.source == os.path.abspath(path) and info.source_bytes == os.path.getsize(path)
    return info if same else None


def _check_settings(output: str, settings: VocabSettings) -> None:
    """Record the settings; an output made with other settings is refused (no mixing)."""
    target = os.path.join(output, SETTINGS)
    if os.path.exists(target):
        with open(target) as f:
            previous = VocabSettings(**json.load(f))
        if previous != settings:
            raise ValueError(
                f"{output} holds data preprocessed with {previous}, not {settings}; "
                "use another --output or the same settings"
            )
        return
    _write_json(target, asdict(settings))


def preprocess(
    inputs: Sequence[str],
    output: str,
    settings: VocabSettings,
    workers: int = 1,
    strict: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    progress: Callable[[str, int], None] | None = None,
) -> Manifest:
    """Convert every input file (resuming a previous run into `output`) and write the manifest.

    `progress(stage, source_bytes)` is called as each file finishes a stage.
    """
    files = list_input_files(inputs)
    for sub in ("parts", "counts"):
        os.makedirs(os.path.join(output, sub), exist_ok=True)
    _check_settings(output, settings)
    names = [part_name(i, p) for i, p in enumerate(files)]
    done = {n: _finished_part(output, n, p) for n, p in zip(names, files)}
    id_dtype = "int32"
    sizes = list(settings.num_embeddings_per_feature)
    jobs = [
        _FileJob(p, n, output, settings, id_dtype, strict, chunk_bytes)
        for p, n in zip(files, names)
    ]
    counting = settings.mode == "frequency" and not settings.vocabulary_from
    stages = ("count", "convert") if counting else ("convert",)
    for path in (p for n, p in zip(names, files) if done[n] is not None):
        for stage in stages:
            if progress:
                progress(stage, os.path.getsize(path))
    vocab = None
    if settings.vocabulary_from:
        vocab = load_vocabulary(settings.vocabulary_from)
        save_vocabulary(output, vocab)
    elif settings.mode == "frequency":
        _run(_count_file, [j for j in jobs if done[j.name] is None], workers, progress, "count")
        vocab = build_vocabulary(output, names, settings.min_count)
    if vocab is not None:
        sizes = [2 + v.size for v in vocab]
    if max(sizes) > np.iinfo(np.int32).max:
        id_dtype = "int64"
    jobs = [
        _FileJob(j.path, j.name, output, settings, id_dtype, strict, chunk_bytes)
        for j in jobs
        if done[j.name] is None
    ]
    for info in _run(_convert_file, jobs, workers, progress, "convert"):
        done[info.name] = info
    parts = [done[n] for n in names]
    for info in parts:
        if info is not None and info.bad_rows:
            logger.warning(
                "%s: %d bad rows, first: %s", info.source, info.bad_rows, "; ".join(info.first_bad)
            )
    manifest = Manifest(
        FORMAT_VERSION, settings, sizes, id_dtype, vocabulary_name(settings, vocab), parts
    )
    _write_json(os.path.join(output, MANIFEST), asdict(manifest))
    return manifest


def _run(
    fn: Callable[[_FileJob], object],
    jobs: List[_FileJob],
    workers: int,
    progress: Callable[[str, int], None] | None,
    stage: str,
) -> List:
    """`fn` over the jobs, in worker processes when `workers > 1`; results in job order."""
    results = []
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            results.append(fn(job))
            if progress:
                progress(stage, os.path.getsize(job.path))
        return results
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        futures = {pool.submit(fn, job): job for job in jobs}
        for future in as_completed(futures):
            future.result()
            if progress:
                progress(stage, os.path.getsize(futures[future].path))
        return [future.result() for future in futures]


def check_table_sizes(
    manifest: Manifest, num_embeddings_per_feature: Sequence[int], where: str
) -> None:
    """Training must use the tables the data was made for."""
    if list(num_embeddings_per_feature) != manifest.num_embeddings_per_feature:
        sizes = ",".join(map(str, manifest.num_embeddings_per_feature))
        raise ValueError(
            f"{where} was preprocessed for tables of {manifest.num_embeddings_per_feature} rows "
            f"({manifest.settings.mode}), not {list(num_embeddings_per_feature)}: pass "
            f"--num-embeddings-per-feature {sizes}"
        )


def check_same_vocabulary(train: Manifest, evaluation: Manifest, where: str) -> None:
    """Eval data must map values to the rows the model trained."""
    if train.vocabulary != evaluation.vocabulary:
        raise ValueError(
            f"{where} maps categorical values to rows by {evaluation.vocabulary}, the training "
            f"data by {train.vocabulary}; preprocess it with the same hashing sizes, or with "
            "--vocab frequency --vocab-from TRAINING_DIR"
        )
