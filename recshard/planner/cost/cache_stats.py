"""What the planner knows about a table's ids from `CacheParams` (TorchRec's contract): the
distinct rows a batch touches (`CacheStatistics.expected_lookups`, distinct rows of a global
batch) and how well a UVM cache of `load_factor` of the rows serves them. Without `stats`, ids
are priced as uniform draws (`distinct_rows`) and a cache's hits as Zipf(1)-like."""

from __future__ import annotations

import math

from recshard.planner.planner_types import TableMeta
from recshard.planner.profile import distinct_rows
from recshard.types import CacheParams, CacheStatistics

DEFAULT_CACHE_LOAD_FACTOR = 0.2


def expected_lookups(table: TableMeta, stats: CacheStatistics) -> float:
    """`stats.expected_lookups` (distinct rows of a global batch), checked: a number between 0
    and the table's rows."""
    value = float(stats.expected_lookups)
    if not 0.0 <= value <= table.num_embeddings:  # also refuses NaN
        raise ValueError(
            f"table '{table.key}': cache_params.stats.expected_lookups must be the distinct rows "
            f"of a global batch, between 0 and its {table.num_embeddings} rows; got {value}"
        )
    return value


def touched_rows(
    table: TableMeta, cache_params: CacheParams | None, rows: int, ids_in: float, global_ids: float
) -> float:
    """Expected distinct rows among the `ids_in` ids a `rows`-row shard of `table` receives
    per step, of the `global_ids` ids of a global batch. With `cache_params.stats`: its
    `expected_lookups` times the shard's share `ids_in / global_ids` (a row block's share of
    the rows, the whole table's distinct rows for the other types); without:
    `distinct_rows(rows, ids_in)`, as if ids were uniform (skewed ids touch fewer rows)."""
    stats = cache_params.stats if cache_params is not None else None
    if stats is None:
        return distinct_rows(rows, ids_in)
    return expected_lookups(table, stats) * ids_in / global_ids if global_ids > 0 else 0.0


def cache_load_factor(cache_params: CacheParams | None) -> float:
    """`cache_params.load_factor`, or `DEFAULT_CACHE_LOAD_FACTOR` when not given."""
    if cache_params is None or cache_params.load_factor is None:
        return DEFAULT_CACHE_LOAD_FACTOR
    return float(cache_params.load_factor)


def cache_hit_rate(cache_params: CacheParams | None, rows: int) -> float:
    """Expected hit rate of a UVM cache holding `load_factor` of `rows` rows: with
    `cache_params.stats`, `1 - stats.expected_miss_rate(load_factor)` (measured on the data);
    without, for ids drawn Zipf(1)-like (a few hot rows), caching the hottest `lf rows` hits
    `ln(1 + lf rows) / ln(1 + rows)` of lookups (0.2 of 1e6 rows: 0.88)."""
    if cache_params is not None and cache_params.stats is not None:
        return 1.0 - float(cache_params.stats.expected_miss_rate(cache_load_factor(cache_params)))
    if rows <= 1:
        return 1.0
    return math.log1p(cache_load_factor(cache_params) * rows) / math.log1p(rows)
