"""Preprocess Criteo TSV/CSV once, train from binary arrays: `python -m examples.dlrm.preprocess`.

    python -m examples.dlrm.preprocess --input day_0.gz day_1.gz --output criteo_bin
    python -m examples.dlrm.train --data criteo --data-path criteo_bin ...

Run it again with the same arguments to resume: finished files are not redone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

from tqdm import tqdm

from examples.dlrm.args import table_sizes
from examples.dlrm.data.criteo_spec import NUM_SPARSE
from examples.dlrm.data.preprocess import VocabSettings, list_input_files, preprocess
from examples.dlrm.mc import RAW_ID_SPACE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.dlrm.preprocess",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="Criteo files (TSV as released, or CSV with a header; .gz too), "
        "directories of them, or globs",
    )
    p.add_argument("--output", required=True, help="directory for the arrays and manifest")
    p.add_argument(
        "--vocab",
        choices=["hash", "frequency", "raw"],
        default="hash",
        help="hash: values hashed into --num-embeddings-per-feature rows (as the "
        "TSV reader does); frequency: a row per value seen at least "
        "--min-count times in the train split, the rest share one OOV row; raw: each "
        "32-bit value kept as its own id (value + 1, 0 missing) for train --managed-collision",
    )
    p.add_argument(
        "--num-embeddings-per-feature",
        type=table_sizes,
        default="100000",
        help="hash: 26 table sizes, or one value N = Criteo Kaggle's sizes capped at N",
    )
    p.add_argument(
        "--min-count",
        type=int,
        default=3,
        help="frequency: rows for values seen at least this many times",
    )
    p.add_argument(
        "--vocab-from",
        default="",
        help="frequency: use the vocabulary of this preprocessed (training) "
        "directory instead of counting, e.g. for separate eval files",
    )
    p.add_argument(
        "--eval-every-n",
        type=int,
        default=10,
        help="about one line in N goes to the eval split (the TSV reader's rule)",
    )
    p.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="files converted in parallel"
    )
    p.add_argument("--strict", action="store_true", help="a bad row is an error")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sizes = {"hash": args.num_embeddings_per_feature, "raw": [RAW_ID_SPACE] * NUM_SPARSE}
    settings = VocabSettings(
        "frequency" if args.vocab == "frequency" else "hash",  # raw: hashing that keeps ids
        sizes.get(args.vocab, []),
        args.min_count if args.vocab == "frequency" else 0,
        args.eval_every_n,
        os.path.abspath(args.vocab_from) if args.vocab_from else "",
    )
    files = list_input_files(args.input)
    stages = 2 if args.vocab == "frequency" and not args.vocab_from else 1
    total = stages * sum(os.path.getsize(f) for f in files)
    bar: Any = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="preprocess",
        file=sys.stderr,
        disable=args.no_progress,
        dynamic_ncols=True,
    )
    with bar:
        manifest = preprocess(
            files,
            args.output,
            settings,
            workers=args.workers,
            strict=args.strict,
            progress=lambda _stage, n: bar.update(n),
        )
    for part in manifest.parts:
        line = f"{part.source}: {part.train_rows} train + {part.eval_rows} eval rows"
        if part.bad_rows:
            line += f", {part.bad_rows} bad rows skipped, first: " + "; ".join(part.first_bad)
        print(line)
    rows = sum(p.train_rows + p.eval_rows for p in manifest.parts)
    bad = sum(p.bad_rows for p in manifest.parts)
    print(
        f"{rows} rows in {args.output} ({bad} bad rows skipped; tables "
        f"{','.join(map(str, manifest.num_embeddings_per_feature))}, ids {manifest.id_dtype})"
    )


if __name__ == "__main__":
    main()
