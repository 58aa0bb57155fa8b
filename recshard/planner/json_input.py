"""Reading the planner's JSON inputs (tables files, plan files) within fixed bounds, so a huge
or deeply nested file is refused at once with a clear error, not after minutes of parsing or
with a bare RecursionError."""

from __future__ import annotations

import json
import os
from typing import Any, List, Tuple

MAX_FILE_BYTES = 32 * 1024**2  # ~200 k tables in a plan file; a tables file's far more
MAX_DEPTH = 32  # a plan nests 6 deep, a tables file 5
MAX_TABLES = 100_000


class InputLimitError(ValueError):
    """A file is larger, deeper or has more tables than the planner reads."""


def read_bounded(path: str) -> bytes:
    """The bytes of `path`; InputLimitError if it holds more than `MAX_FILE_BYTES`."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise InputLimitError(
                f"{size} bytes, more than the {MAX_FILE_BYTES} a planner input may have"
            )
        return f.read(MAX_FILE_BYTES + 1)


def check_depth(data: Any) -> None:
    """InputLimitError if lists and objects nest more than `MAX_DEPTH` deep."""
    stack: List[Tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            if depth > MAX_DEPTH:
                raise InputLimitError(f"nested more than {MAX_DEPTH} levels deep")
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


def parse_json(text: str) -> Any:
    """`json.loads(text)` within `MAX_DEPTH` (deeper nesting than Python's recursion limit
    is refused as such, not as a RecursionError); JSONDecodeError as json raises it."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise InputLimitError(f"nested more than {MAX_DEPTH} levels deep") from None
    check_depth(data)
    return data


def check_table_count(count: int) -> None:
    """InputLimitError if `count` tables are more than `MAX_TABLES`."""
    if count > MAX_TABLES:
        raise InputLimitError(f"{count} tables, more than the {MAX_TABLES} the planner plans")
