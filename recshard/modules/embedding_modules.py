"""Unsharded EmbeddingBagCollection and EmbeddingCollection.

They are the user's model-building blocks (DistributedModelParallel replaces them by sharded
versions) and the numerical reference every sharded path is tested against. What they share
(tables in kernel groups, names, input checks) is in `embedding_tables.py`.
"""

from __future__ import annotations

from itertools import chain
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from recshard.modules.embedding_configs import (
    DeviceLike,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from recshard.modules.embedding_tables import (
    EmbeddingTables,
    TableGroupSpan,
    TableSpan,
    flat_rows,
    one_torch_call_serves,
    pad_to_one_batch,
)
from recshard.modules.lookups import pooled_lookup, sequence_lookup
from recshard.modules.table_groups import (
    fbgemm_kernels_apply,
    grouped_pooled_lookup,
    grouped_sequence_lookup,
    table_weights,
)
from recshard.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recshard.sparse.keyed_tensor import offsets_from_sizes

# EC groups stop growing at this many bytes of weights: a group's per-step buffers (rows
# `[N, D]`, the flat gradient) past glibc's mmap threshold are page-faulted anew every step,
# which cost more than the per-table calls saved (criteo_like EC: 2x slower uncapped)
EC_MAX_GROUP_BYTES = 16 << 20


class EmbeddingBagCollection(EmbeddingTables):
    """Pooled embeddings: one vector per (feature, sample), returned as a `KeyedTensor`
    `[B, sum of dims]` whose keys are the features in config order.

    Several features may share a table. Any `embedding_dim >= 1` works. On CPU (float32) one
    fbgemm kernel call pools every feature of the tables sharing a pooling type and data type
    (`table_groups.py`); elsewhere one `torch.embedding_bag` call per group whose tables
    share a dim (`one_torch_call_serves`), per table on `meta` and under export.
    """

    _tables_attr = "embedding_bags"

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: DeviceLike = None,
    ) -> None:
        super().__init__(tables, group_key=lambda t: (t.pooling, t.data_type))
        self._is_weighted = is_weighted
        self.embedding_bags = nn.ModuleDict()
        for config, weight in zip(tables, self._new_weights(device)):
            # MEAN is pooled as SUM and divided here: torch's MEAN bag refuses per-id weights.
            # `_weight` given: torch's default init (slow on meta, and overwritten) is skipped
            self.embedding_bags[config.name] = nn.EmbeddingBag(
                config.num_embeddings,
                config.embedding_dim,
                mode="sum",
                include_last_offset=True,
                _weight=weight,
            )
        self._storage.bind(table_weights(self.embedding_bags))
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        # output columns in config order, from the lookup order's columns (None: the same)
        column_at = offsets_from_sizes(
            [s.config.embedding_dim for g in self._groups for s in g.tables for _ in range(s.count)]
        )
        columns = [
            column_at[at] + d
            for at, dim in zip(self._lookup_position, self._dims)
            for d in range(dim)
        ]
        # host metadata, moved to the data's device per call (the module may move after build)
        self._columns = (
            None if columns == list(range(len(columns))) else torch.tensor(columns, device="cpu")
        )
        self._lookup_dims = torch.tensor(
            [
                s.config.embedding_dim
                for g in self._groups
                for s in g.tables
                for _ in range(s.count)
            ],
            device="cpu",
        )

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """`[B, sum of dims]`; with `inverse_indices` (TorchRec's variable batch: each feature
        pooled at its own batch size, then row b of feature f is its pooled row
        `inverse[f, b]`) B is the inverse indices' batch."""
        ordered = self._prepare(features, self._is_weighted)
        inverse = features.inverse_indices_or_none()
        strides = ordered.stride_per_key()
        if len(set(strides)) > 1:
            if inverse is None:
                raise ValueError(
                    f"EmbeddingBagCollection: features have different batch sizes "
                    f"{dict(zip(ordered.keys(), strides))} and the input has no inverse_indices "
                    "to bring them to one batch (TorchRec's variable batch)"
                )
            ordered = pad_to_one_batch(ordered)
        weights, flats = self._weights_and_flats()
        with self._explained_id_errors(features):
            pooled = [
                self._pool(ordered, group, flat, weights[group.table_slice])
                for group, flat in zip(self._groups, flats)
            ]
        values = torch.cat(pooled, dim=1) if len(pooled) > 1 else pooled[0]
        if inverse is not None and inverse[1].numel():
            values = self._expand(values, inverse, strides)
        if self._columns is not None:
            values = values.index_select(1, self._columns.to(values.device))
        return KeyedTensor(self._embedding_names, self._dims, values)

    def _expand(
        self, pooled: torch.Tensor, inverse: Tuple[List[str], torch.Tensor], strides: List[int]
    ) -> torch.Tensor:
        """`[B_out, sum of dims]`: row b of each lookup key's columns is its pooled row
        `inverse[key, b]`, one gather. Inverse keys are feature names, in any order."""
        names, indices = inverse
        row_of = {name: i for i, name in enumerate(names)}
        missing = [f for f in dict.fromkeys(self._key_order) if f not in row_of]
        if missing:
            raise ValueError(
                f"EmbeddingBagCollection: inverse_indices have no rows for features "
                f"{missing} (their keys: {names})"
            )
        rows = indices.index_select(
            0, torch.tensor([row_of[f] for f in self._key_order], device=indices.device)
        )  # [F, B_out]
        bounds = torch.tensor(strides, device=rows.device).unsqueeze(1)
        bad = (rows < 0) | (rows >= bounds)
        if bool(bad.any()):
            key, position = (int(i) for i in torch.nonzero(bad)[0])
            raise ValueError(
                f"EmbeddingBagCollection: feature '{self._key_order[key]}': inverse index "
                f"{int(rows[key, position])} at position {position} is outside its batch of "
                f"{strides[key]}"
            )
        row_index = rows.to(pooled.device).repeat_interleave(
            self._lookup_dims.to(pooled.device), dim=0, output_size=pooled.size(1)
        )
        return pooled.gather(0, row_index.t())

    def _pool(
        self,
        features: KeyedJaggedTensor,
        group: TableGroupSpan,
        flat: torch.Tensor | None,
        weights: Sequence[nn.Parameter],
    ) -> torch.Tensor:
        """`[B, sum of the group's feature dims]`, features side by side in lookup order;
        `weights`: the group's Parameters."""
        entry_at = features.lengths_offset_per_key()
        e0, e1 = entry_at[group.first], entry_at[group.first + group.count]
        if fbgemm_kernels_apply(flat):
            sums = grouped_pooled_lookup(
                group.layout,
                flat,
                weights,
                features.values(),
                features.offsets()[e0 : e1 + 1],
                features.weights_or_none(),
            )
        elif one_torch_call_serves(flat, group):  # one torch call: [count * B, D] -> [B, count * D]
            v0, v1 = (
                features.offset_per_key()[group.first],
                features.offset_per_key()[group.first + group.count],
            )
            per_id_weights = features.weights_or_none()
            sums = pooled_lookup(
                flat.view(-1, group.dim),
                flat_rows(features, group, flat.device.type == "cpu"),
                features.offsets()[e0:e1] - v0,
                None if per_id_weights is None else per_id_weights[v0:v1],
                weights,
            )
            batch = features.stride()
            sums = sums.view(group.count, batch, -1).transpose(0, 1).reshape(batch, -1)
        else:  # one torch call per table
            sums = torch.cat(
                [
                    self._pool_table(features, span, weight)
                    for span, weight in zip(group.tables, weights)
                ],
                dim=1,
            )
        if not group.mean:
            return sums
        counts = features.lengths()[e0:e1].clamp(min=1).view(group.count, -1).t()  # [B, count]
        return sums / counts.repeat_interleave(
            group.feature_dims.to(counts.device), dim=1, output_size=sums.size(1)
        ).to(sums.dtype)

    def _pool_table(
        self, features: KeyedJaggedTensor, span: TableSpan, weight: torch.Tensor
    ) -> torch.Tensor:
        """`[B, count * D]`: one table's features pooled side by side by torch's kernel, one
        call over their ids (on `meta`, under export, and for groups of several dims off
        fbgemm's CPU kernels)."""
        value_at, entry_at = features.offset_per_key(), features.lengths_offset_per_key()
        v0, v1 = value_at[span.first], value_at[span.first + span.count]
        e0, e1 = entry_at[span.first], entry_at[span.first + span.count]
        per_id_weights = features.weights_or_none()
        sums = pooled_lookup(
            weight,
            features.values()[v0:v1],
            features.offsets()[e0:e1] - v0,
            None if per_id_weights is None else per_id_weights[v0:v1],
        )
        if span.count == 1:
            return sums
        batch = features.stride()
        return sums.view(span.count, batch, -1).transpose(0, 1).reshape(batch, -1)


class EmbeddingCollection(EmbeddingTables):
    """Sequence embeddings: one vector per id, returned as `{feature: JaggedTensor}` with
    values `[N_f, D]` and the input's lengths. On CPU (float32) one lookup (and one fbgemm
    backward call) serves every table sharing a dim and data type, up to
    `EC_MAX_GROUP_BYTES` of weights per group; elsewhere one torch call per group (per table
    on `meta` and under export).
    Each feature's output is a view of its group's rows."""

    _tables_attr = "embeddings"

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: DeviceLike = None,
        need_indices: bool = False,
    ) -> None:
        for config in tables:
            if config.pooling != PoolingType.NONE:
                raise ValueError(
                    f"table '{config.name}': EmbeddingCollection tables are unpooled "
                    f"(pooling NONE), got {config.pooling.value}"
                )
        super().__init__(
            tables,
            group_key=lambda t: (t.embedding_dim, t.data_type),
            max_group_bytes=EC_MAX_GROUP_BYTES,
        )
        self._need_indices = need_indices
        self.embeddings = nn.ModuleDict()
        for config, weight in zip(tables, self._new_weights(device)):
            self.embeddings[config.name] = nn.Embedding(
                config.num_embeddings, config.embedding_dim, _weight=weight
            )
        self._storage.bind(table_weights(self.embeddings))

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        ordered = self._prepare(features, is_weighted=False)
        ids_per_key = ordered.values().split(ordered.length_per_key())
        lengths_per_key = ordered.lengths().split(ordered.stride_per_key())
        weights, flats = self._weights_and_flats()
        with self._explained_id_errors(features):
            per_key = list(
                chain.from_iterable(
                    self._lookup(ordered, group, flat, weights[group.table_slice])
                    for group, flat in zip(self._groups, flats)
                )
            )
        return {
            name: JaggedTensor(
                per_key[k],
                weights=ids_per_key[k] if self._need_indices else None,
                lengths=lengths_per_key[k],
            )
            for name, k in zip(self._embedding_names, self._lookup_position)
        }

    def _lookup(
        self,
        features: KeyedJaggedTensor,
        group: TableGroupSpan,
        flat: torch.Tensor | None,
        weights: Sequence[nn.Parameter],
    ) -> Sequence[torch.Tensor]:
        """`[N_f, D]` per key of the group: one lookup over their ids, split (views);
        `weights`: the group's Parameters."""
        value_at, length_per_key = features.offset_per_key(), features.length_per_key()
        if fbgemm_kernels_apply(flat):
            rows = grouped_sequence_lookup(
                group.layout, flat, weights, flat_rows(features, group, True)
            )
        elif one_torch_call_serves(flat, group):
            rows = sequence_lookup(
                flat.view(-1, group.dim),
                flat_rows(features, group, flat.device.type == "cpu"),
                weights,
            )
        else:  # one torch call per table
            rows = torch.cat(
                [
                    sequence_lookup(
                        weight,
                        features.values()[value_at[span.first] : value_at[span.first + span.count]],
                    )
                    for span, weight in zip(group.tables, weights)
                ]
            )
        return rows.split(length_per_key[group.first : group.first + group.count])
