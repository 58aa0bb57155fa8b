"""Vectorized Criteo parsing: a file's bytes -> labels, log-dense values and category codes.

The rules are the line reader's (`criteo.py`, which stays the reference): fields split on the
file's separator, missing trailing fields are empty, dense `log(1 + max(x, 0))` (empty -> 0),
a categorical's code is its hex value (else crc32 of it), empty -> missing. Line `index`
counts the file's lines after the header, blank ones included, as `read_rows` does.

Most rows never touch Python: numpy finds line ends and separators in a chunk of bytes,
builds a `[lines, 40]` table of field spans, and decodes labels ("0"/"1"), decimal numbers
(`[-]digits[.digits]` with up to 15 digits, or integers up to 18: exactly the double
Python's `float` gives) and hex categoricals (1-8 digits). A row with anything else (a
"+", an exponent, spaces, a non-hex or longer category, more than 40 fields, a bad value)
goes through the reader's `parse_line` line by line, so its result, or its error and line
number, is the reader's. The log transform is numpy's `log1p`, which may differ from
`math.log1p` in the last bit of a double; rounded to float32 the two agreed on all of
4 million values tried (integers to 2 M and random decimals), and on every sample file.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, List, Tuple

import numpy as np

from examples.dlrm.data.criteo import NUM_FIELDS, category_code, parse_line, sniff
from examples.dlrm.data.criteo_spec import NUM_DENSE, NUM_SPARSE

CHUNK_BYTES = 4 << 20
_MAX_CODE = 1 << 64
_HEX = np.full(256, -1, dtype=np.int16)
for _digit, _char in enumerate(b"0123456789abcdef"):
    _HEX[_char] = _digit
    _HEX[ord(chr(_char).upper())] = _digit
_CR, _LF, _MINUS, _DOT, _ZERO, _NINE = 13, 10, 45, 46, 48, 57


@dataclass
class ParsedRows:
    """Rows of one chunk that parsed. `codes` is meaningful where `present`."""

    line_index: np.ndarray  # [N] int64: the line's index after the header
    labels: np.ndarray  # [N] uint8
    dense: np.ndarray  # [N, 13] float32, log(1 + max(x, 0))
    codes: np.ndarray  # [N, 26] uint64
    present: np.ndarray  # [N, 26] bool: False for a missing categorical


@dataclass
class BadRow:
    """A line that is not a Criteo row: its 1-based line number in the file and why."""

    line_no: int
    message: str


@dataclass
class ParsedChunk:
    rows: ParsedRows
    bad: List[BadRow] = field(default_factory=list)


def open_binary(path: str) -> BinaryIO:
    """The file's bytes, gunzipped when it ends with `.gz`."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_file(path: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[ParsedChunk]:
    """Parsed chunks of a whole file, in order (about `chunk_bytes` of text each)."""
    with open_binary(path) as f:
        try:
            first = f.readline()
        except (EOFError, OSError, zlib.error) as e:
            raise ValueError(
                f"{path}:1: the file ends early or is corrupt ({type(e).__name__}: {e})"
            ) from None
        if not first:
            return
        sep, header = sniff(first.decode("utf-8", errors="replace"))
        pending = b"" if header else first
        index = 0
        while True:
            try:
                data = f.read(chunk_bytes)
            except (EOFError, OSError, zlib.error) as e:
                line_no = index + 1 + int(header) + _count_lines(pending)
                raise ValueError(
                    f"{path}:{line_no}: the file ends early or is corrupt ({type(e).__name__}: {e})"
                ) from None
            text = pending + data
            cut = text.rfind(b"\n") + 1 if data else len(text)
            if cut == 0 and data:
                pending = text
                continue
            lines, pending = text[:cut], text[cut:]
            if lines:
                if not lines.endswith(b"\n"):
                    lines += b"\n"
                chunk = parse_chunk(lines, sep, index, 1 + int(header), path)
                index += _count_lines(lines)
                yield chunk
            if not data:
                return


def _count_lines(lines: bytes) -> int:
    return int(np.count_nonzero(_newlines_as_lf(np.frombuffer(lines, np.uint8)) == _LF))


def _newlines_as_lf(buf: np.ndarray) -> np.ndarray:
    """Lone carriage returns become line feeds (Python's universal newlines)."""
    cr = np.flatnonzero(buf == _CR)
    if cr.size == 0:
        return buf
    nxt = np.append(buf, np.uint8(0))[cr + 1]
    lone = cr[nxt != _LF]
    if lone.size == 0:
        return buf
    buf = buf.copy()
    buf[lone] = _LF
    return buf


def parse_chunk(
    lines: bytes, sep: str, first_index: int, line_offset: int, path: str
) -> ParsedChunk:
    """Parse complete lines (ending with a newline); line `i` of them has index
    `first_index + i` and 1-based line number `index + line_offset`."""
    buf = _newlines_as_lf(np.frombuffer(lines, np.uint8))
    ends = np.flatnonzero(buf == _LF)
    starts = np.concatenate(([0], ends[:-1] + 1))
    ends = ends - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == _CR))
    num_lines = ends.size
    delims = np.flatnonzero((buf == ord(sep)) | (buf == _LF))  # in order: line i's seps, LF
    is_lf = buf[delims] == _LF
    line_of_delim = np.cumsum(is_lf) - is_lf
    seps, line_of_sep = delims[~is_lf], line_of_delim[~is_lf]
    count = np.bincount(line_of_sep, minlength=num_lines)
    fits = count < NUM_FIELDS
    keep = fits[line_of_sep]
    seps, line_of_sep = seps[keep], line_of_sep[keep]
    rank = np.arange(seps.size) - (np.cumsum(count * fits) - count * fits)[line_of_sep]
    span_start = np.repeat(ends[:, None], NUM_FIELDS, axis=1)
    span_end = span_start.copy()
    span_start[:, 0] = starts
    span_end[line_of_sep, rank] = seps
    span_start[line_of_sep, rank + 1] = seps + 1
    span_len = span_end - span_start

    label_len = span_len[:, 0]
    label_char = buf[np.minimum(span_start[:, 0], buf.size - 1)]
    labels_ok = (label_len == 1) & ((label_char == _ZERO) | (label_char == _ZERO + 1))
    chunk = _ChunkBytes(buf, sep)
    dense_values, dense_ok = _decimals(
        chunk, span_start[:, 1 : 1 + NUM_DENSE], span_len[:, 1 : 1 + NUM_DENSE]
    )
    codes, codes_ok = _hex_codes(
        chunk, span_start[:, 1 + NUM_DENSE :], span_len[:, 1 + NUM_DENSE :]
    )
    blank = ends == starts
    fast = fits & labels_ok & dense_ok.all(1) & codes_ok.all(1) & ~blank

    rows = ParsedRows(
        line_index=first_index + np.flatnonzero(fast),
        labels=(label_char[fast] - _ZERO).astype(np.uint8),
        dense=np.log1p(np.maximum(dense_values[fast], 0.0)).astype(np.float32),
        codes=codes[fast],
        present=span_len[fast, 1 + NUM_DENSE :] > 0,
    )
    slow = np.flatnonzero(~fast & ~blank)
    if slow.size == 0:
        return ParsedChunk(rows)
    return _merge_slow(
        rows, lines, sep, starts[slow], ends[slow], first_index + slow, line_offset, path
    )


class _ChunkBytes:
    """A chunk's bytes and what the field decoders share.

    `words[e]` is the 8 bytes that end at offset `e` as one big-endian uint64 (bytes before
    the chunk read as 0), so a field of up to 8 bytes is checked and decoded right-aligned in
    a few 64-bit operations (SWAR). `odd` lists the offsets of bytes that are neither hex
    digits nor separators nor line ends (few: signs, dots, junk): a field holds none of them
    when `odd` has no entry in `[start, end)`.
    """

    def __init__(self, buf: np.ndarray, sep: str) -> None:
        self.buf = buf
        padded = np.concatenate([np.zeros(8, np.uint8), buf])
        self.words = np.ndarray((buf.size + 1,), ">u8", padded, 0, (1,))
        usual = _HEX >= 0
        usual[[ord(sep), _LF, _CR]] = True
        self.odd = np.flatnonzero(~usual[buf])

    def low_bytes(self, end: np.ndarray, count: np.ndarray) -> np.ndarray:
        """The `count` (<= 8) bytes before each `end`, right-aligned in a uint64, others 0."""
        return self.words[end].astype(np.uint64) & _LOW_BYTES[np.minimum(count, 8)]

    def all_hex(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Whether each field `[start, end)` is hex digits only (given it spans no separator)."""
        return np.searchsorted(self.odd, start) == np.searchsorted(self.odd, end)


def _u64(value: int) -> np.uint64:
    return np.uint64(value)


_LOW_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)
_BYTES_0F, _BYTES_F0 = _u64(0x0F0F0F0F0F0F0F0F), _u64(0xF0F0F0F0F0F0F0F0)
_BYTES_30, _BYTES_06 = _u64(0x3030303030303030), _u64(0x0606060606060606)


def _hex_codes(
    chunk: _ChunkBytes, start: np.ndarray, length: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """Fields as uint64 hex values and whether each is empty or 1-8 hex digits."""
    end = start + length
    ok = (length == 0) | ((length <= 8) & chunk.all_hex(start, end))
    x = chunk.low_bytes(end, length)
    # '0'-'9' -> low nibble; 'a'-'f' / 'A'-'F' (bit 6 set) -> low nibble + 9
    v = (x & _BYTES_0F) + _u64(9) * ((x >> _u64(6)) & _u64(0x0101010101010101))
    v = (v | (v >> _u64(4))) & _u64(0x00FF00FF00FF00FF)
    v = (v | (v >> _u64(8))) & _u64(0x0000FFFF0000FFFF)
    v = (v | (v >> _u64(16))) & _u64(0x00000000FFFFFFFF)
    return np.where(ok, v, _u64(0)), ok


def _decimals(
    chunk: _ChunkBytes, start: np.ndarray, length: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """Fields as float64 (empty -> 0) and whether each decoded exactly as Python's `float`:
    `[-]` and 1-8 digits here (SWAR), other plain decimals by `_plain_decimals`."""
    buf = chunk.buf
    minus = (length > 0) & (buf[np.minimum(start, buf.size - 1)] == _MINUS)
    num_digits = length - minus
    mask = _LOW_BYTES[np.minimum(num_digits, 8)]
    x = chunk.words[start + length].astype(np.uint64) & mask | (_BYTES_30 & ~mask)
    # every byte 0x30-0x39: high nibble 3, and adding 6 to the low nibble does not carry
    digits = ((x & _BYTES_F0) == _BYTES_30) & (((x + _BYTES_06) & _BYTES_F0) == _BYTES_30)
    v = x & _BYTES_0F
    v = ((v >> _u64(8)) * _u64(10) + v) & _u64(0x00FF00FF00FF00FF)
    v = ((v >> _u64(16)) * _u64(100) + v) & _u64(0x0000FFFF0000FFFF)
    v = ((v >> _u64(32)) * _u64(10000) + v) & _u64(0x00000000FFFFFFFF)
    ok = (length == 0) | ((num_digits >= 1) & (num_digits <= 8) & digits)
    values = np.where(ok, np.where(minus, -v.astype(np.float64), v.astype(np.float64)), 0.0)
    flat = np.flatnonzero(~ok.reshape(-1))
    if flat.size:
        values.reshape(-1)[flat], ok.reshape(-1)[flat] = _plain_decimals(
            buf, start.reshape(-1)[flat], length.reshape(-1)[flat]
        )
    return values, ok


def _plain_decimals(
    buf: np.ndarray, start: np.ndarray, length: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """`[N]` fields as float64 and whether each is `[-]digits[.digits]` with <= 15 digits
    (or an integer with <= 18): then `mantissa / 10**fraction_digits` is exactly the
    correctly rounded double Python's `float` gives."""
    width = int(min(length.max(initial=0), 20))
    pos = np.arange(width)
    chars = buf[np.minimum(start[:, None] + pos, buf.size - 1)]
    inside = pos < length[:, None]
    digit = inside & (chars >= _ZERO) & (chars <= _NINE)
    dot = inside & (chars == _DOT)
    sign = np.zeros_like(inside)
    sign[:, 0] = inside[:, 0] & (chars[:, 0] == _MINUS)
    num_digits = digit.sum(1)
    num_frac = (digit & (np.cumsum(dot, 1) > 0)).sum(1)
    plain = ~(inside & ~digit & ~dot & ~sign).any(1) & (dot.sum(1) <= 1)
    small = (num_digits <= 15) | ((num_frac == 0) & (num_digits <= 18))
    ok = plain & (num_digits > 0) & small & (length <= 20)
    mantissa = np.zeros(length.shape, np.int64)
    for p in range(width):
        mantissa = np.where(
            digit[:, p], mantissa * 10 + (chars[:, p].astype(np.int64) - _ZERO), mantissa
        )
    values = mantissa.astype(np.float64) / np.power(10.0, num_frac)
    return np.where(ok, np.where(sign[:, 0], -values, values), 0.0), ok


def _merge_slow(
    rows: ParsedRows,
    lines: bytes,
    sep: str,
    starts: np.ndarray,
    ends: np.ndarray,
    indices: np.ndarray,
    line_offset: int,
    path: str,
) -> ParsedChunk:
    """Parse the rows the fast path left line by line and merge them in line order."""
    bad: List[BadRow] = []
    parsed: List[Tuple[int, int, List[float], List[int], List[bool]]] = []
    for start, end, index in zip(starts.tolist(), ends.tolist(), indices.tolist()):
        line_no = index + line_offset
        try:
            text = lines[start:end].decode("utf-8")
        except UnicodeDecodeError as e:
            bad.append(BadRow(line_no, f"{path}:{line_no}: not UTF-8 ({e.reason})"))
            continue
        if not text.strip():  # blank, skipped as the reader skips it
            continue
        try:
            label, dense, codes, present = _parse_slow_line(text, sep, f"{path}:{line_no}")
        except ValueError as e:
            bad.append(BadRow(line_no, str(e)))
            continue
        parsed.append((index, label, dense, codes, present))
    if not parsed:
        return ParsedChunk(rows, bad)
    slow = ParsedRows(
        line_index=np.array([p[0] for p in parsed], np.int64),
        labels=np.array([p[1] for p in parsed], np.uint8),
        dense=np.array([p[2] for p in parsed], np.float64).astype(np.float32),
        codes=np.array([p[3] for p in parsed], np.uint64),
        present=np.array([p[4] for p in parsed], bool),
    )
    order = np.argsort(np.concatenate([rows.line_index, slow.line_index]), kind="stable")
    merged = ParsedRows(
        *(
            np.concatenate([a, b])[order]
            for a, b in (
                (rows.line_index, slow.line_index),
                (rows.labels, slow.labels),
                (rows.dense, slow.dense),
                (rows.codes, slow.codes),
                (rows.present, slow.present),
            )
        )
    )
    return ParsedChunk(merged, bad)


def _parse_slow_line(
    text: str, sep: str, where: str
) -> Tuple[int, List[float], List[int], List[bool]]:
    """One line by the reader's rules: (label, log-dense values, codes, present)."""
    label, dense, _ = parse_line(text, sep, [1] * NUM_SPARSE, where)  # validates, as the reader
    values = text.split(sep)[1 + NUM_DENSE :]
    values += [""] * (NUM_SPARSE - len(values))
    codes, present = [], []
    for value in values:
        code = category_code(value)
        if code is not None and not 0 <= code < _MAX_CODE:
            raise ValueError(
                f"{where}: categorical value {value!r} is a hex number outside [0, 2**64)"
            )
        codes.append(0 if code is None else code)
        present.append(code is not None)
    return label, dense, codes, present


def eval_mask(line_index: np.ndarray, eval_every_n: int) -> np.ndarray:
    """`is_eval_line` for many line indices: `[N]` bool."""
    return np.fromiter(
        (zlib.crc32(i.to_bytes(8, "little")) % eval_every_n == 0 for i in line_index.tolist()),
        dtype=bool,
        count=line_index.size,
    )
