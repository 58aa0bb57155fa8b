"""Input checks shared by unsharded and sharded embedding modules.

Each raises ValueError naming the table/feature and the bad value. Sharded modules run them
before any collective, so a bad batch fails on its rank instead of hanging the others.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from recshard.sparse import KeyedJaggedTensor

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


def find_out_of_range(
    kjt: KeyedJaggedTensor, rows_per_key: List[int]
) -> Optional[Tuple[int, int, int]]:
    """First id outside [0, rows) of its key: (key index, id, count of bad ids), or None.

    One vectorized comparison over all values (no per-feature Python loop).
    """
    values = kjt.values()
    if values.numel() == 0:
        return None
    lpk = kjt.length_per_key()
    bounds = torch.repeat_interleave(
        torch.tensor(rows_per_key, dtype=values.dtype, device=values.device),
        torch.tensor(lpk, device=values.device),
    )
    bad = (values < 0) | (values >= bounds)
    count = int(bad.sum())
    if count == 0:
        return None
    position = int(torch.nonzero(bad)[0])
    offsets = kjt.offset_per_key()
    key_index = next(i for i in range(len(lpk)) if offsets[i] <= position < offsets[i + 1])
    return key_index, int(values[position]), count


def check_ids(
    kjt: KeyedJaggedTensor, feature_to_table: Dict[str, Tuple[str, int]], owner: str
) -> None:
    """Every id must index a row of its table: `feature_to_table[f] = (table, rows)`."""
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
