"""Input checks shared by unsharded and sharded embedding modules.

Each raises ValueError naming the table/feature and the bad value. Sharded modules run them
before any collective, so a bad batch fails on its rank instead of hanging the others.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Set, Tuple

import torch

from recshard.sparse import KeyedJaggedTensor
from recshard.sparse.validation import int32_lengths_wrap, validate_kjt
from recshard.types import BoundsCheckMode

logger = logging.getLogger(__name__)

ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32,)  # what the lookup kernels take as per-id weights


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
    """lengths, values and weights agree, so bag offsets stay inside `values` (the lookup
    kernels do not check them): a few scalar comparisons on the per-key sums the lookup
    needs anyway (int32 lengths must also sum within int32), one min over lengths and, for
    offsets the KJT already holds (given by the caller, perhaps besides lengths), one
    `aminmax` over them and one comparison of their steps with the lengths. The full check
    (for its message naming key and numbers) only when these fail. The KJT constructor
    accepts these, as TorchRec's. Skipped where the data cannot be read (`data_unreadable`)."""
    if data_unreadable(kjt):
        return
    values, weights, lengths = kjt.values(), kjt.weights_or_none(), kjt.lengths()
    offsets = kjt.offsets_or_none()
    if (
        values.dim() != 1
        or sum(kjt.length_per_key()) != values.numel()
        or (weights is not None and (weights.dim() != 1 or weights.numel() != values.numel()))
        or (lengths.numel() > 0 and bool(lengths.min() < 0))
        or int32_lengths_wrap(kjt)
        or (
            offsets is not None
            and offsets.numel() > 0
            and (
                _offsets_leave_values(offsets, values.numel())
                or _offsets_disagree(offsets, kjt.lengths_or_none())
            )
        )
    ):
        try:
            validate_kjt(kjt)
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None


def _offsets_leave_values(offsets: torch.Tensor, num_values: int) -> bool:
    """Bag offsets not within `[0, num_values]` with both ends reached: one `aminmax`. Inside
    that range the kernels' reads stay in `values`; offsets that also decrease come with
    negative lengths when the lengths were derived from them (checked beside this), or
    disagree with lengths given beside them (`_offsets_disagree`)."""
    return [int(end) for end in torch.aminmax(offsets)] != [0, num_values]


def _offsets_disagree(offsets: torch.Tensor, lengths: torch.Tensor | None) -> bool:
    """Offsets given beside lengths that they do not match (one pass over the bags): the
    kernels read bags by offsets, MEAN divides by lengths, and other paths read bags by
    lengths, so they would silently disagree; decreasing offsets would read outside the
    feature's ids."""
    if lengths is None or lengths.numel() != offsets.numel() - 1:
        return lengths is not None
    return bool((offsets[1:] - offsets[:-1] != lengths).any())


def check_one_batch(kjt: KeyedJaggedTensor, owner: str) -> None:
    """A module that pools one batch per rank: features with different batch sizes (TorchRec's
    variable batch) or `inverse_indices` (its expansion) are refused, naming them. The
    unsharded and the sharded EmbeddingBagCollection take both."""
    strides = kjt.stride_per_key()
    if len(set(strides)) > 1:
        raise ValueError(
            f"{owner}: features have different batch sizes {dict(zip(kjt.keys(), strides))}; "
            "this module pools one batch per rank (a variable batch per feature is taken by "
            "EmbeddingBagCollection, unsharded or sharded)"
        )
    inverse = kjt.inverse_indices_or_none()
    if inverse is not None and inverse[1].numel():
        raise ValueError(
            f"{owner}: the input has inverse_indices (features {inverse[0]}); this module "
            "does not expand them (EmbeddingBagCollection does, unsharded or sharded)"
        )


def check_variable_batch(kjt: KeyedJaggedTensor, owner: str) -> None:
    """A variable batch per feature (TorchRec's VBE) as a sharded pooled module takes it: one
    row of `stride_per_key_per_rank` per feature, as many lengths as the batch sizes add up
    to, and features of different batch sizes brought to one batch by `inverse_indices`
    (`[features, B_out]`, row f in `[0, batch of f)`), naming the feature and the numbers."""
    keys, strides = kjt.keys(), kjt.stride_per_key()
    if kjt.variable_stride_per_key():
        rows = kjt.stride_per_key_per_rank()
        if len(rows) != len(keys):
            raise ValueError(
                f"{owner}: stride_per_key_per_rank has {len(rows)} rows for the "
                f"{len(keys)} features {keys}"
            )
        negative = {k: row for k, row in zip(keys, rows) if any(b < 0 for b in row)}
        if negative:
            raise ValueError(f"{owner}: negative batch sizes in stride_per_key_per_rank {negative}")
    num_lengths = kjt.lengths().numel()
    if kjt.variable_stride_per_key() and num_lengths != sum(strides):
        raise ValueError(
            f"{owner}: the batch sizes per feature {dict(zip(keys, strides))} add up to "
            f"{sum(strides)} bags but lengths has {num_lengths} entries"
        )
    inverse = kjt.inverse_indices_or_none()
    if inverse is None or not inverse[1].numel():
        if len(set(strides)) > 1:
            raise ValueError(
                f"{owner}: features have different batch sizes {dict(zip(keys, strides))} and "
                "the input has no inverse_indices to bring them to one batch (TorchRec's "
                "variable batch)"
            )
        return
    names, indices = inverse
    missing = [k for k in keys if k not in names]
    if missing:
        raise ValueError(
            f"{owner}: inverse_indices have no rows for features {missing} (their keys: {names})"
        )
    if indices.dim() != 2 or indices.size(0) != len(names) or indices.is_floating_point():
        raise ValueError(
            f"{owner}: inverse_indices must be an integer [{len(names)} keys, batch] tensor, "
            f"got {indices.dtype} of shape {tuple(indices.shape)}"
        )
    if data_unreadable(kjt):
        return
    at = {name: i for i, name in enumerate(names)}
    rows_of_keys = indices.index_select(
        0, torch.tensor([at[k] for k in keys], device=indices.device)
    )
    bounds = torch.tensor(strides, device=indices.device).unsqueeze(1)
    bad = (rows_of_keys < 0) | (rows_of_keys >= bounds)
    if bool(bad.any()):
        key, position = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"{owner}: feature '{keys[key]}': inverse index {int(rows_of_keys[key, position])} "
            f"at position {position} is outside its batch of {strides[key]}"
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
    if has_weights and kjt.weights().dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{owner}: per-id weights must be float32, got {kjt.weights().dtype}")


def keys_with_bad_ids(kjt: KeyedJaggedTensor, rows_per_key: List[int]) -> List[int]:
    """Indices of keys holding an id outside [0, rows): one `aminmax` pass per key over
    views of `values`, then one comparison (no per-id temporaries on the good path)."""
    segments = torch.split(kjt.values(), kjt.length_per_key())
    nonempty = [i for i, segment in enumerate(segments) if segment.numel()]
    if not nonempty:
        return []
    extremes = [torch.aminmax(segments[i]) for i in nonempty]
    lows = torch.stack([low for low, _ in extremes])
    highs = torch.stack([high for _, high in extremes])
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
) -> Tuple[int, int, int] | None:
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


def check_ids_per_key(
    kjt: KeyedJaggedTensor,
    rows_per_key: torch.Tensor,
    feature_to_table: Dict[str, Tuple[str, int]],
    owner: str,
) -> None:
    """Every id of key k in [0, rows_per_key[k]) (`[keys]`, the KJT's key order): one min and
    one fbgemm bounds check over all keys, no Python per key; when they refuse the batch,
    `check_ids` names table, feature and id. Skipped where the data cannot be read."""
    if data_unreadable(kjt):
        return
    values = kjt.values()
    key_offsets = torch.tensor(kjt.offset_per_key(), dtype=values.dtype, device=values.device)
    try:
        check_rows_per_key(values, key_offsets, rows_per_key.to(values.device))
    except RuntimeError:
        check_ids(kjt, feature_to_table, owner)
        raise


def check_rows_per_key(
    ids: torch.Tensor, key_offsets: torch.Tensor, rows_per_key: torch.Tensor
) -> None:
    """RuntimeError unless every id of key k (ids `[key_offsets[k], key_offsets[k+1])`) is in
    [0, rows_per_key[k]): one min (fbgemm's check lets -1 through, its "pruned row" mark)
    and fbgemm's bounds check, what its TBE runs before a lookup."""
    if ids.numel() and bool(ids.min() < 0):
        raise RuntimeError(f"negative id {int(ids.min())}")
    torch.ops.fbgemm.bounds_check_indices(
        rows_per_key.to(torch.int64),
        ids,
        key_offsets.to(ids.dtype),
        0,
        torch.zeros(1, dtype=torch.int64, device=ids.device),
    )


class InputKeyOrder:
    """The order a module reads its features in (`order`, a feature may repeat), and each
    input key order's permutation into it: checked (`check_features`) and computed once per
    input key order, so a call costs one dict lookup."""

    def __init__(self, feature_names: List[str], order: List[str], owner: str) -> None:
        self._feature_names = feature_names
        self._order = order
        self._owner = owner
        self._permutations: Dict[Tuple[str, ...], List[int] | None] = {}

    def permutation(self, kjt: KeyedJaggedTensor) -> List[int] | None:
        """Indices that put `kjt`'s keys in the module's order (None when they are)."""
        keys = tuple(kjt.keys())
        if keys not in self._permutations:
            check_features(kjt, self._feature_names, self._owner)
            index = {k: i for i, k in enumerate(keys)}
            permutation = [index[f] for f in self._order]
            self._permutations[keys] = (
                None if permutation == list(range(len(keys))) else permutation
            )
        return self._permutations[keys]


def check_input(
    kjt: KeyedJaggedTensor,
    feature_names: List[str],
    feature_to_table: Dict[str, Tuple[str, int]],
    is_weighted: bool,
    owner: str,
) -> None:
    """Every check of an unsharded collection's input (float or quantized), in order: keys,
    dtypes and weights, layout, ids in range, finite weights."""
    check_features(kjt, feature_names, owner)
    check_dtypes_and_weights(kjt, is_weighted, owner)
    check_layout(kjt, owner)
    check_ids(kjt, feature_to_table, owner)
    check_weights(kjt, feature_to_table, owner)


def nonfinite_weight_mask(kjt: KeyedJaggedTensor) -> torch.Tensor | None:
    """`[N]` True where a per-id weight is NaN or infinite; None when all are finite (one
    reduction on the good path)."""
    weights = kjt.weights_or_none()
    if weights is None or bool(torch.isfinite(weights).all()):
        return None
    return ~torch.isfinite(weights)


def check_weights(
    kjt: KeyedJaggedTensor, feature_to_table: Dict[str, Tuple[str, int]], owner: str
) -> None:
    """Every per-id weight must be finite (one NaN would poison the table's gradient).

    Skipped where the weights cannot be read (`data_unreadable`)."""
    if data_unreadable(kjt):
        return
    bad = nonfinite_weight_mask(kjt)
    if bad is not None:
        raise _weight_error(kjt, bad, feature_to_table, owner)


def _weight_error(
    kjt: KeyedJaggedTensor,
    bad: torch.Tensor,
    feature_to_table: Dict[str, Tuple[str, int]],
    owner: str,
) -> ValueError:
    position = int(torch.nonzero(bad)[0])
    key_index = _key_of(kjt, position)
    feature = kjt.keys()[key_index]
    return ValueError(
        f"{owner}: table '{feature_to_table[feature][0]}', feature '{feature}': weight "
        f"{float(kjt.weights()[position])} at position "
        f"{position - kjt.offset_per_key()[key_index]} "
        f"of the feature's values is not finite ({int(bad.sum())} non-finite weight(s) in batch)"
    )


def bounds_check(
    kjt: KeyedJaggedTensor,
    feature_to_table: Dict[str, Tuple[str, int]],
    modes: Dict[str, BoundsCheckMode],
    owner: str,
    warned: Set[Tuple[str, str]],
) -> KeyedJaggedTensor:
    """Apply each table's bounds-check mode (default FATAL) to out-of-range ids and to
    non-finite (NaN, inf) per-id weights.

    FATAL: ValueError naming table, feature and the id (and num_embeddings) or the weight and
    its position. WARNING: drop the bad ids and log once per table and kind with the count.
    IGNORE: drop them silently. NONE: no check (the kernel sees the input as it is). Dropping
    removes the id from its bag.
    """
    keys = kjt.keys()
    tables = [feature_to_table[k][0] for k in keys]
    key_modes = [modes.get(t, BoundsCheckMode.FATAL) for t in tables]
    if kjt.values().numel() == 0 or all(m == BoundsCheckMode.NONE for m in key_modes):
        return kjt
    unchecked = torch.iinfo(torch.int64).max
    rows = [
        feature_to_table[k][1] if m != BoundsCheckMode.NONE else unchecked
        for k, m in zip(keys, key_modes)
    ]
    bad_weight = nonfinite_weight_mask(kjt)
    if not keys_with_bad_ids(kjt, rows) and bad_weight is None:
        return kjt
    device = kjt.values().device
    per_key_lengths = torch.tensor(kjt.length_per_key(), device=device)

    def per_value(flags: List[bool]) -> torch.Tensor:
        return torch.repeat_interleave(
            torch.tensor(flags, device=device), per_key_lengths, output_size=kjt.values().numel()
        )

    bad_id = out_of_range_mask(kjt, rows)
    if bad_weight is not None:
        bad_weight = bad_weight & per_value([m != BoundsCheckMode.NONE for m in key_modes])
    fatal = per_value([m == BoundsCheckMode.FATAL for m in key_modes])
    fatal_bad = bad_id & fatal
    if bool(fatal_bad.any()):
        position = int(torch.nonzero(fatal_bad)[0])
        feature = keys[_key_of(kjt, position)]
        table, num_embeddings = feature_to_table[feature]
        raise ValueError(
            f"{owner}: table '{table}', feature '{feature}': id {int(kjt.values()[position])} is "
            f"outside [0, {num_embeddings}) (num_embeddings={num_embeddings}; "
            f"{int(fatal_bad.sum())} bad id(s) in batch)"
        )
    if bad_weight is not None and bool((bad_weight & fatal).any()):
        raise _weight_error(kjt, bad_weight & fatal, feature_to_table, owner)
    bad = bad_id if bad_weight is None else bad_id | bad_weight
    for kind, mask in (
        ("ids outside [0, num_embeddings)", bad_id),
        ("non-finite per-id weights", bad_weight),
    ):
        if mask is None:
            continue
        for key_index, segment in enumerate(torch.split(mask, kjt.length_per_key())):
            table = tables[key_index]
            if (
                modes.get(table) == BoundsCheckMode.WARNING
                and (table, kind) not in warned
                and bool(segment.any())
            ):
                warned.add((table, kind))
                logger.warning(
                    "%s: table '%s' (num_embeddings=%d) got %s; dropping them "
                    "(bounds_check_mode=WARNING, %d in this batch; logged once)",
                    owner,
                    table,
                    feature_to_table[keys[key_index]][1],
                    kind,
                    int(mask.sum()),
                )
    return _drop(kjt, bad)


def _drop(kjt: KeyedJaggedTensor, bad: torch.Tensor) -> KeyedJaggedTensor:
    lengths = kjt.lengths()
    bag = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths.long()
    )
    removed = torch.zeros_like(lengths).index_add_(
        0, bag[bad], torch.ones_like(bag[bad], dtype=lengths.dtype)
    )
    keep = ~bad
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        kjt.keys(),
        kjt.values()[keep],
        None if weights is None else weights[keep],
        lengths=lengths - removed,
        stride=None if kjt.variable_stride_per_key() else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank()
        if kjt.variable_stride_per_key()
        else None,
        validate=False,
    )
