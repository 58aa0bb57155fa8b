"""Input checks shared by unsharded and sharded embedding modules.

Each raises ValueError naming the table/feature and the bad value. Sharded modules run them
before any collective, so a bad batch fails on its rank instead of hanging the others.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Set, Tuple

import torch

from recshard.sparse import KeyedJaggedTensor
from recshard.sparse.validation import validate_kjt
from recshard.types import BoundsCheckMode

logger = logging.getLogger(__name__)

ID_DTYPES = (torch.int32, torch.int64)


def check_features(kjt: KeyedJaggedTensor, expected: List[str], owner: str) -> None:
    """The KJT must carry every feature the module reads, and nothing else."""
    keys = kjt.keys()
    present = set(keys)
    missing = [f for f in expected if f not in present]
    if missing:
        raise ValueError(
            f"{owner}: features {missing} are missing from the input KeyedJaggedTensor "
            f"(its keys: {keys})"
        )
    known = set(expected)
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(
            f"{owner}: the input has features {unknown} that no table reads "
            f"(tables read: {expected})"
        )


def data_unreadable(kjt: KeyedJaggedTensor) -> bool:
    """True while `torch.export` / `torch.compile` trace (a guard on data cannot be traced; the
    exported program runs without the data checks, as TorchRec's does) and on the `meta`
    device (shape inference): checks that read the ids are skipped there."""
    return torch.compiler.is_compiling() or kjt.values().is_meta


def check_layout(kjt: KeyedJaggedTensor, owner: str) -> None:
    """lengths, values and weights agree: a few scalar comparisons on the per-key sums the
    lookup needs anyway, and one min over lengths; the full check (for its message naming
    key and numbers) only when they do not. The KJT constructor accepts these, as TorchRec's.
    Skipped where the data cannot be read (`data_unreadable`)."""
    if data_unreadable(kjt):
        return
    values, weights, lengths = kjt.values(), kjt.weights_or_none(), kjt.lengths()
    if (
        values.dim() != 1
        or sum(kjt.length_per_key()) != values.numel()
        or (weights is not None and weights.numel() != values.numel())
        or (lengths.numel() > 0 and bool(lengths.min() < 0))
    ):
        try:
            validate_kjt(kjt)
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None


def check_dtypes_and_weights(kjt: KeyedJaggedTensor, is_weighted: bool, owner: str) -> None:
    if kjt.values().dtype not in ID_DTYPES:
        raise ValueError(f"{owner}: ids must be int32 or int64, got {kjt.values().dtype}")
    has_weights = kjt.weights_or_none() is not None
    if is_weighted and not has_weights:
        raise ValueError(f"{owner}: the collection is weighted but the input has no weights")
    if not is_weighted and has_weights:
        raise ValueError(
            f"{owner}: the input carries weights but the collection is unweighted "
            "(build it with is_weighted=True to use per-id weights)"
        )


def keys_with_bad_ids(kjt: KeyedJaggedTensor, rows_per_key: List[int]) -> List[int]:
    """Indices of keys holding an id outside [0, rows): one min and one max per key over
    views of `values`, then one comparison (no per-id temporaries on the good path)."""
    segments = torch.split(kjt.values(), kjt.length_per_key())
    nonempty = [i for i, segment in enumerate(segments) if segment.numel()]
    if not nonempty:
        return []
    lows = torch.stack([segments[i].min() for i in nonempty])
    highs = torch.stack([segments[i].max() for i in nonempty])
    bounds = torch.tensor([rows_per_key[i] for i in nonempty], device=highs.device)
    bad = (lows < 0) | (highs >= bounds)
    return [nonempty[j] for j in torch.nonzero(bad).flatten().tolist()]


def out_of_range_mask(kjt: KeyedJaggedTensor, rows_per_key: List[int]) -> torch.Tensor:
    """`[N]` True where an id is outside [0, rows) of its key (the slow, exact path)."""
    values = kjt.values()
    bounds = torch.repeat_interleave(
        torch.tensor(rows_per_key, dtype=torch.int64, device=values.device),
        torch.tensor(kjt.length_per_key(), device=values.device),
    )
    return (values < 0) | (values >= bounds)


def _key_of(kjt: KeyedJaggedTensor, position: int) -> int:
    offsets = kjt.offset_per_key()
    return next(i for i in range(len(kjt.keys())) if offsets[i] <= position < offsets[i + 1])


def find_out_of_range(
    kjt: KeyedJaggedTensor, rows_per_key: List[int]
) -> Optional[Tuple[int, int, int]]:
    """First id outside [0, rows) of its key: (key index, id, count of bad ids), or None."""
    if kjt.values().numel() == 0 or not keys_with_bad_ids(kjt, rows_per_key):
        return None
    bad = out_of_range_mask(kjt, rows_per_key)
    count = int(bad.sum())
    if count == 0:
        return None
    position = int(torch.nonzero(bad)[0])
    return _key_of(kjt, position), int(kjt.values()[position]), count


def check_ids(
    kjt: KeyedJaggedTensor, feature_to_table: Dict[str, Tuple[str, int]], owner: str
) -> None:
    """Every id must index a row of its table: `feature_to_table[f] = (table, rows)`.

    Skipped where the ids cannot be read (`data_unreadable`)."""
    if data_unreadable(kjt):
        return
    rows = [feature_to_table[k][1] for k in kjt.keys()]
    found = find_out_of_range(kjt, rows)
    if found is not None:
        key_index, bad_id, count = found
        feature = kjt.keys()[key_index]
        table, num_embeddings = feature_to_table[feature]
        raise ValueError(
            f"{owner}: table '{table}', feature '{feature}': id {bad_id} is outside "
            f"[0, {num_embeddings}) (num_embeddings={num_embeddings}; {count} bad id(s) in batch)"
        )


def bounds_check(
    kjt: KeyedJaggedTensor,
    feature_to_table: Dict[str, Tuple[str, int]],
    modes: Dict[str, BoundsCheckMode],
    owner: str,
    warned: Set[str],
) -> KeyedJaggedTensor:
    """Apply each table's bounds-check mode (default FATAL) to out-of-range ids.

    FATAL: ValueError naming table, feature, id and num_embeddings. WARNING: drop the bad ids
    and log once per table with the count. IGNORE: drop them silently. NONE: no check (the
    kernel sees the ids as they are). Dropping removes the id from its bag.
    """
    keys = kjt.keys()
    tables = [feature_to_table[k][0] for k in keys]
    key_modes = [modes.get(t, BoundsCheckMode.FATAL) for t in tables]
    if kjt.values().numel() == 0 or all(m == BoundsCheckMode.NONE for m in key_modes):
        return kjt
    unchecked = torch.iinfo(torch.int64).max
    rows = [feature_to_table[k][1] if m != BoundsCheckMode.NONE else unchecked
            for k, m in zip(keys, key_modes)]
    if not keys_with_bad_ids(kjt, rows):
        return kjt
    bad = out_of_range_mask(kjt, rows)
    fatal = torch.tensor([m == BoundsCheckMode.FATAL for m in key_modes], device=bad.device)
    per_value_fatal = torch.repeat_interleave(fatal, torch.tensor(kjt.length_per_key(), device=bad.device))
    fatal_bad = bad & per_value_fatal
    if bool(fatal_bad.any()):
        position = int(torch.nonzero(fatal_bad)[0])
        feature = keys[_key_of(kjt, position)]
        table, num_embeddings = feature_to_table[feature]
        raise ValueError(
            f"{owner}: table '{table}', feature '{feature}': id {int(kjt.values()[position])} is "
            f"outside [0, {num_embeddings}) (num_embeddings={num_embeddings}; "
            f"{int(fatal_bad.sum())} bad id(s) in batch)"
        )
    for index in torch.nonzero(bad).flatten().tolist():
        table = tables[_key_of(kjt, index)]
        if modes.get(table) == BoundsCheckMode.WARNING and table not in warned:
            warned.add(table)
            logger.warning("%s: table '%s' got ids outside [0, %d); dropping them "
                           "(bounds_check_mode=WARNING, %d bad id(s) in this batch; logged once)",
                           owner, table, feature_to_table[keys[_key_of(kjt, index)]][1], int(bad.sum()))
    return _drop(kjt, bad)


def _drop(kjt: KeyedJaggedTensor, bad: torch.Tensor) -> KeyedJaggedTensor:
    lengths = kjt.lengths()
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths.long())
    removed = torch.zeros_like(lengths).index_add_(0, bag[bad], torch.ones_like(bag[bad], dtype=lengths.dtype))
    keep = ~bad
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        kjt.keys(), kjt.values()[keep], None if weights is None else weights[keep],
        lengths=lengths - removed, stride=None if kjt.variable_stride_per_key() else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None,
        validate=False,
    )
