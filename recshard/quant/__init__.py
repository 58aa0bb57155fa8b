"""Quantized embeddings for inference: INT8/INT4/INT2/FP16 rows in fbgemm's layout.

    from recshard.quant import quantize_embeddings
    model = quantize_embeddings(model, torch.quint4x2)     # every EBC/EC -> quantized twin
    # or, as in TorchRec's tutorial:
    qconfig = QuantConfig(
        activation=PlaceholderObserver.with_args(dtype=torch.float),
        weight=PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    torch.quantization.quantize_dynamic(
        model,
        qconfig_spec={EmbeddingBagCollection: qconfig},
        mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection},
    )

Sharded inference: `recshard.distributed.QuantEmbeddingBagCollectionSharder` (every sharding
type) and `QuantEmbeddingCollectionSharder` (data-parallel, table-wise, column-wise, row-wise),
with plans whose compute_kernel is "quant"; DistributedModelParallel picks them by default.
`EmbeddingBagCollection` / `EmbeddingCollection` here are the quantized classes, TorchRec's names
at `torchrec.quant(.embedding_modules)`.
"""

from recshard.quant.config import QuantConfig
from recshard.quant.embedding_modules import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    quantize_embeddings,
)
from recshard.quant.embedding_modules import QuantEmbeddingBagCollection as EmbeddingBagCollection
from recshard.quant.embedding_modules import QuantEmbeddingCollection as EmbeddingCollection
from recshard.quant.kernel import QuantLookup, QuantTable
from recshard.quant.rowwise import dequantize_rows, max_row_error, quantize_rows

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "QuantConfig",
    "QuantLookup",
    "QuantTable",
    "dequantize_rows",
    "max_row_error",
    "quantize_embeddings",
    "quantize_rows",
]
