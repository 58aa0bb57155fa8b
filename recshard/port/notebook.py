"""Porting Jupyter notebooks: the code cells go through the codemod as one program (an
`import torchrec` in one cell governs `torchrec.X` uses in the next), the rest of the file as is.

Shell (`!pip install torchrec`) and magic (`%time`) lines are not Python: they are masked while
the code is parsed and put back unchanged; one that installs torchrec is reported. Cells of a
cell magic (`%%bash`) are left alone.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

from recshard.port.codemod import Issue, port_source

_MASK = "#__recshard_port_masked_line_{}__"
_BOUNDARY = "\n#__recshard_port_cell_boundary__\n"
_INSTALLS_TORCHREC = re.compile(r"^\s*!.*\bpip3?\b.*\binstall\b.*\btorchrec\b")

CellIssue = Tuple[int, Issue]  # (cell index, issue with the cell's line number)


def _mask(source: str, masked: List[str]) -> str:
    lines = source.split("\n")
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("!", "%")):
            masked.append(line)
            lines[i] = _MASK.format(len(masked) - 1)
    return "\n".join(lines)


def _unmask(source: str, masked: List[str]) -> str:
    for i, line in enumerate(masked):
        source = source.replace(_MASK.format(i), line, 1)
    return source


def _install_issues(index: int, source: str) -> List[CellIssue]:
    return [
        (
            index,
            Issue(
                number,
                "pip install torchrec",
                "a shell line installs torchrec: install recshard instead",
            ),
        )
        for number, line in enumerate(source.split("\n"), start=1)
        if _INSTALLS_TORCHREC.match(line)
    ]


def port_cells(sources: List[str]) -> Tuple[List[str], List[CellIssue]]:
    """Code cells' sources, ported together, and the issues by (cell, line in the cell)."""
    masked: List[str] = []
    python = [not s.lstrip().startswith("%%") for s in sources]
    combined = "".join(
        _mask(s, masked) + _BOUNDARY if ok else _BOUNDARY for s, ok in zip(sources, python)
    )
    result = port_source(combined)
    pieces = _unmask(result.code, masked).split(_BOUNDARY)[: len(sources)]
    starts, line = [], 1
    for source, ok in zip(sources, python):
        starts.append(line)
        line += (source.count("\n") if ok else 0) + 2
    issues: List[CellIssue] = []
    for issue in result.issues:
        cell = max(i for i, start in enumerate(starts) if start <= issue.line)
        issues.append((cell, Issue(issue.line - starts[cell] + 1, issue.name, issue.reason)))
    for index, source in enumerate(sources):
        issues.extend(_install_issues(index, source))
    ported = [piece if ok else source for piece, source, ok in zip(pieces, sources, python)]
    return ported, sorted(issues, key=lambda item: (item[0], item[1].line))


def port_notebook(text: str) -> Tuple[str, List[CellIssue]]:
    """A notebook's JSON text, ported, and the issues as `(cell index, issue)`. Unchanged
    notebooks come back byte for byte; changed ones keep nbformat's 1-space indent."""
    notebook: Dict[str, Any] = json.loads(text)
    cells = [
        (i, c) for i, c in enumerate(notebook.get("cells", [])) if c.get("cell_type") == "code"
    ]
    sources = [
        c["source"] if isinstance(c["source"], str) else "".join(c["source"]) for _, c in cells
    ]
    ported, issues = port_cells(sources)
    issues = [(cells[k][0], issue) for k, issue in issues]
    if ported == sources:
        return text, issues
    for (_, cell), new in zip(cells, ported):
        cell["source"] = new if isinstance(cell["source"], str) else new.splitlines(keepends=True)
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", issues
