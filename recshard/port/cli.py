"""`python -m recshard.port [--check] FILES...` / `--report DIR`: port TorchRec scripts and
notebooks in place.

For each `.py` / `.ipynb` file: rewrite its torchrec imports to recshard's (or, with `--check`,
only say which files would change) and print every name that could not be mapped, with the
reason, as `FILE:LINE: NAME: REASON` (notebooks: `FILE:cell N:LINE`). `--report DIR` does the
same for every such file under DIR and ends with one summary block: per file, rewritten /
unchanged, and each unmapped name with its reason. Exit status 1 when a name is unmapped or
(with `--check`) a file would change, 2 when a path or pattern names no file, else 0.
"""

from __future__ import annotations

import argparse
import glob
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

from recshard.port.codemod import port_source
from recshard.port.notebook import port_notebook

SUFFIXES = (".py", ".ipynb")


def port_path(path: Path) -> Tuple[str, str, List[str]]:
    """`(old text, new text, report lines)` for one file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        new, cell_issues = port_notebook(text)
        report = [f"{path}:cell {cell}:{i.line}: {i.name}: {i.reason}" for cell, i in cell_issues]
        return text, new, report
    result = port_source(text)
    return text, result.code, [f"{path}:{i.line}: {i.name}: {i.reason}" for i in result.issues]


@dataclass
class FileOutcome:
    """What porting one file did: `changed` (rewritten, or would be with --check) and the
    unmapped-name lines."""

    path: Path
    changed: bool
    unmapped: List[str]


class NoFiles(Exception):
    """A path or pattern on the command line names no file; `str()` says which."""


def expand(paths: Sequence[str]) -> List[Path]:
    """The files named: each path as given, else as a glob pattern (a shell leaves a pattern
    that matches nothing as it is). `NoFiles` for one that names nothing."""
    files: List[Path] = []
    for given in paths:
        if Path(given).exists():
            files.append(Path(given))
            continue
        matches = sorted(glob.glob(given, recursive=True))
        if not matches:
            raise NoFiles(f"no file matches {given}")
        files += [Path(m) for m in matches]
    return files


def files_under(directory: Path) -> List[Path]:
    """The `.py` and `.ipynb` files under `directory`, sorted (hidden folders skipped)."""
    if not directory.is_dir():
        raise NoFiles(f"{directory} is not a directory")
    found = [
        p
        for p in sorted(directory.rglob("*"))
        if p.suffix in SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    ]
    if not found:
        raise NoFiles(f"no .py or .ipynb file under {directory}")
    return found


def port_file(path: Path, check: bool) -> FileOutcome:
    old, new, report = port_path(path)
    for line in report:
        print(line)
    if new != old:
        if check:
            print(f"would rewrite {path}")
        else:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote {path}")
    return FileOutcome(path, new != old, report)


def summary(outcomes: Sequence[FileOutcome], check: bool) -> List[str]:
    """The `--report` block: one line per file, its unmapped names indented under it."""
    verb = "would rewrite" if check else "rewritten"
    lines = ["", "recshard.port report"]
    for o in outcomes:
        state = verb if o.changed else "unchanged"
        extra = f", {len(o.unmapped)} unmapped" if o.unmapped else ""
        lines.append(f"{o.path}: {state}{extra}")
        lines += [f"    {line.split(': ', 1)[1]}" for line in o.unmapped]
    changed = sum(o.changed for o in outcomes)
    unmapped = sum(len(o.unmapped) for o in outcomes)
    lines.append(f"{len(outcomes)} files: {changed} {verb}, {unmapped} unmapped names")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recshard.port",
        description="Rewrite torchrec imports in Python files and notebooks to recshard's.",
    )
    parser.add_argument("files", nargs="*", help=".py or .ipynb files (or glob patterns)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="only report what would change and what cannot be mapped",
    )
    parser.add_argument(
        "--report",
        metavar="DIR",
        type=Path,
        help="port every .py / .ipynb file under DIR and end with a per-file summary",
    )
    args = parser.parse_args(argv)
    if not args.files and args.report is None:
        parser.error("give FILES or --report DIR")
    try:
        files = expand(args.files) + (files_under(args.report) if args.report else [])
    except NoFiles as err:
        print(f"recshard.port: {err}", file=sys.stderr)
        return 2
    for path in files:
        if path.suffix not in SUFFIXES:
            parser.error(f"{path}: only .py and .ipynb files can be ported")
    outcomes = [port_file(path, args.check) for path in files]
    if args.report is not None:
        print("\n".join(summary(outcomes, args.check)))
    failed = any(o.unmapped or (args.check and o.changed) for o in outcomes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
