"""The sharded EBC's output for a variable batch per feature (TorchRec's VBE) and for
`inverse_indices`: each feature pooled at its own batch size, then row b of feature f is its
pooled row `inverse[f, b]`, as the unsharded `EmbeddingBagCollection` (and TorchRec) return it.

A sharding whose routed ids had a variable batch (`variable_batch_per_feature` in its
context) returns a flat tensor: for each entry `(feature, column offset, width)` of its
`output_columns`, this rank's `B_f` rows of that width. Other shardings return `[B, cols]`.
Each entry becomes one `[B_f, width]` piece (a view); the pieces are expanded by their
feature's inverse indices (one `index_select` each; none without inverse indices) and laid
side by side in the module's column order: one copy of the output, and autograd carries the
gradient back through the same views.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from recshard.distributed.input_dist import EmbeddingModuleContext
from recshard.sharding.common import EmbeddingSharding, EmbeddingShardingContext


class VariableBatchOutput:
    """Where each column of the module's output comes from in its shardings' outputs.

    `embedding_features[i]`: the input feature that output key `embedding_names[i]` pools
    (the key itself, or the shared feature of `feature@table`): its inverse indices expand it.
    """

    def __init__(
        self,
        shardings: Sequence[EmbeddingSharding],
        embedding_names: List[str],
        embedding_features: List[str],
    ) -> None:
        self._columns = [list(s.output_columns) for s in shardings]
        found: Dict[str, List[Tuple[int, int, int]]] = {}  # name -> (col offset, sharding, entry)
        for si, columns in enumerate(self._columns):
            for ei, (name, col_offset, _) in enumerate(columns):
                found.setdefault(name, []).append((col_offset, si, ei))
        self._order = [(si, ei) for name in embedding_names for _, si, ei in sorted(found[name])]
        self.embedding_features = embedding_features
        source = dict(zip(embedding_names, embedding_features))
        self._features = [[source[name] for name, _, _ in columns] for columns in self._columns]

    def __call__(
        self,
        parts: Sequence[torch.Tensor],
        contexts: Sequence[EmbeddingShardingContext],
        inverse_indices: Tuple[List[str], torch.Tensor] | None,
    ) -> torch.Tensor:
        """`[B_out, sum of dims]` from the shardings' outputs (flat or `[B, cols]`)."""
        rows: Dict[str, torch.Tensor] = {}
        if inverse_indices is not None:
            names, indices = inverse_indices
            rows = {name: row.long() for name, row in zip(names, indices.unbind(0))}
        pieces: List[List[torch.Tensor]] = []
        for part, ctx, columns in zip(parts, contexts, self._columns):
            widths = [width for _, _, width in columns]
            if ctx.variable_batch_per_feature:
                batches = ctx.batch_size_per_feature_pre_a2a
                blocks = part.reshape(-1).split([b * w for b, w in zip(batches, widths)])
                pieces.append([blk.view(b, w) for blk, b, w in zip(blocks, batches, widths)])
            else:
                pieces.append(list(part.split(widths, dim=1)))
        out = [
            pieces[si][ei]
            if not rows
            else pieces[si][ei].index_select(0, rows[self._features[si][ei]])
            for si, ei in self._order
        ]
        return torch.cat(out, dim=1)


def expand_rows(
    values: torch.Tensor,
    embedding_dims: List[int],
    embedding_features: List[str],
    inverse_indices: Tuple[List[str], torch.Tensor],
) -> torch.Tensor:
    """`[B, sum of dims]` in the module's key order -> `[B_out, ...]`: row b of each key's
    columns is its row `inverse[feature of the key, b]` (inverse indices on a fixed batch)."""
    names, indices = inverse_indices
    rows = {name: row.long() for name, row in zip(names, indices.unbind(0))}
    return torch.cat(
        [
            block.index_select(0, rows[feature])
            for block, feature in zip(values.split(embedding_dims, dim=1), embedding_features)
        ],
        dim=1,
    )


def needs_variable_batch_output(ctx: EmbeddingModuleContext) -> bool:
    """Some sharding returned a variable batch, or the batch has inverse indices."""
    return ctx.inverse_indices is not None or any(
        c.variable_batch_per_feature for c in ctx.sharding_contexts
    )
