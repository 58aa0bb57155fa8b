"""QuantConfig (defined with the embedding configs, TorchRec's home for it), read by `from_float`,
so `torch.quantization.quantize_dynamic(model, qconfig_spec={EmbeddingBagCollection: qconfig},
mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection})` converts a model as in
TorchRec's tutorial. A plain `torch.quantization.QConfig` works too (no per-table dtypes)."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from recshard.modules.embedding_configs import QuantConfig

__all__ = ["QuantConfig", "dtypes_from_qconfig"]


def dtypes_from_qconfig(qconfig: Any) -> Tuple[torch.dtype, Dict[str, torch.dtype], torch.dtype]:  # noqa: ANN401
    """(weight dtype, per-table weight dtypes, output dtype) of a QuantConfig or QConfig."""
    per_table = getattr(qconfig, "per_table_weight_dtype", None) or {}
    return qconfig.weight().dtype, dict(per_table), qconfig.activation().dtype
