"""QuantConfig: TorchRec's qconfig for embedding modules, read by `from_float`, so
`torch.quantization.quantize_dynamic(model, qconfig_spec={EmbeddingBagCollection: qconfig},
mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection})` converts a model as in
TorchRec's tutorial. A plain `torch.quantization.QConfig` works too (no per-table dtypes)."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple

import torch


class QuantConfig(NamedTuple):
    """`weight().dtype`: how rows are stored (`torch.qint8`, `torch.quint4x2`, ...);
    `activation().dtype`: the output dtype; `per_table_weight_dtype`: overrides by table."""

    activation: Any  # an observer class or partial, e.g. PlaceholderObserver.with_args(...)
    weight: Any
    per_table_weight_dtype: Dict[str, torch.dtype] | None = None


def dtypes_from_qconfig(qconfig: Any) -> Tuple[torch.dtype, Dict[str, torch.dtype], torch.dtype]:  # noqa: ANN401
    """(weight dtype, per-table weight dtypes, output dtype) of a QuantConfig or QConfig."""
    per_table = getattr(qconfig, "per_table_weight_dtype", None) or {}
    return qconfig.weight().dtype, dict(per_table), qconfig.activation().dtype
