"""Build the shardings of a collection from its per-table plan.

Table-wise, column-wise and table-column-wise tables share ONE placed sharding (one KJT
all-to-all and one pooled all-to-all for all of them); row-wise, table-row-wise and
data-parallel tables get one sharding each. Fewer collectives per step than one per type.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from recshard.comm.codecs import CommOp, codecs_from_registry
from recshard.lookup.grouped import GroupedLookup
from recshard.plan.sharding_types import PLACED_TYPES
from recshard.sharding.common import (
    EmbeddingSharding,
    LookupFactory,
    TableSpec,
    with_embedding_names,
)
from recshard.sharding.data_parallel import DataParallelPooledSharding
from recshard.sharding.placed import PlacedPooledSharding
from recshard.sharding.row_wise import RowWisePooledSharding
from recshard.types import ShardingEnv, ShardingType


def build_pooled_shardings(
    specs: List[TableSpec],
    env: ShardingEnv,
    device: torch.device,
    is_weighted: bool,
    qcomm_codecs_registry: Dict[str, Any] | None = None,
    make_lookup: LookupFactory = GroupedLookup,
) -> Dict[str, EmbeddingSharding]:
    """Shardings keyed by name ("placed", "row_wise", "table_row_wise", "data_parallel"),
    each looking up its local shards with `make_lookup`."""
    by_kind: Dict[str, List[TableSpec]] = {}
    for spec in with_embedding_names(specs):
        st = ShardingType(spec.sharding.sharding_type)
        kind = "placed" if st in PLACED_TYPES else st.value
        by_kind.setdefault(kind, []).append(spec)
    a2a_codecs = codecs_from_registry(qcomm_codecs_registry, CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
    rs_codecs = codecs_from_registry(qcomm_codecs_registry, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
    shardings: Dict[str, EmbeddingSharding] = {}
    if "placed" in by_kind:
        shardings["placed"] = PlacedPooledSharding(
            by_kind["placed"], env, device, is_weighted, a2a_codecs, make_lookup
        )
    for kind, within_node in (("row_wise", False), ("table_row_wise", True)):
        if kind in by_kind:
            shardings[kind] = RowWisePooledSharding(
                by_kind[kind],
                env,
                device,
                is_weighted,
                within_node,
                rs_codecs,
                a2a_codecs,
                make_lookup,
            )
    if "data_parallel" in by_kind:
        shardings["data_parallel"] = DataParallelPooledSharding(
            by_kind["data_parallel"], env, device, is_weighted, True, make_lookup
        )
    return shardings
