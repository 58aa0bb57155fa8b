"""Dense tensor-parallel layers over a model-parallel process group.

Every layer and primitive takes `pg` (None: the default group) and, without an initialized
process group, behaves as its single-process counterpart.
"""

from recshard.parallel.cross_entropy import ParallelCrossEntropyLoss, vocab_parallel_cross_entropy
from recshard.parallel.dropout import ParallelDropout
from recshard.parallel.embedding import ParallelEmbedding, VocabParallelEmbedding
from recshard.parallel.init import shard_init_helper_
from recshard.parallel.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelClassifier,
)
from recshard.parallel.mappings import (
    mp_all_gather,
    mp_copy,
    mp_gather,
    mp_reduce,
    mp_reduce_scatter,
    mp_scatter,
)
from recshard.parallel.parallel_linear import ParallelLinear
from recshard.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    parallelize_module,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelEmbedding",
    "VocabParallelEmbedding",
    "ParallelCrossEntropyLoss",
    "vocab_parallel_cross_entropy",
    "VocabParallelClassifier",
    "ParallelLinear",
    "ParallelDropout",
    "shard_init_helper_",
    "mp_copy",
    "mp_reduce",
    "mp_scatter",
    "mp_gather",
    "mp_reduce_scatter",
    "mp_all_gather",
    "parallelize_module",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "Replicate",
    "Shard",
]
