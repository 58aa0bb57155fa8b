"""`python -m recshard.port [--check] FILES...`: port TorchRec scripts and notebooks in place.

For each `.py` / `.ipynb` file: rewrite its torchrec imports to recshard's (or, with `--check`,
only say which files would change) and print every name that could not be mapped, with the
reason, as `FILE:LINE: NAME: REASON` (notebooks: `FILE:cell N:LINE`). Exit status 1 when a
name is unmapped or (with `--check`) a file would change, else 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

from recshard.port.codemod import port_source
from recshard.port.notebook import port_notebook


def port_path(path: Path) -> Tuple[str, str, List[str]]:
    """`(old text, new text, report lines)` for one file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        new, cell_issues = port_notebook(text)
        report = [f"{path}:cell {cell}:{i.line}: {i.name}: {i.reason}" for cell, i in cell_issues]
        return text, new, report
    result = port_source(text)
    return text, result.code, [f"{path}:{i.line}: {i.name}: {i.reason}" for i in result.issues]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recshard.port",
        description="Rewrite torchrec imports in Python files and notebooks to recshard's.",
    )
    parser.add_argument("files", nargs="+", type=Path, help=".py or .ipynb files")
    parser.add_argument(
        "--check",
        action="store_true",
        help="only report what would change and what cannot be mapped",
    )
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        if path.suffix not in (".py", ".ipynb"):
            parser.error(f"{path}: only .py and .ipynb files can be ported")
        old, new, report = port_path(path)
        for line in report:
            print(line)
        failed |= bool(report)
        if new == old:
            continue
        if args.check:
            print(f"would rewrite {path}")
            failed = True
        else:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
