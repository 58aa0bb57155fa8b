"""Communication layer: collectives with autograd, KJT and embedding dist modules, codecs."""

from recshard.comm.codecs import (  # noqa: F401
    BF16CommCodec,
    CastCommCodec,
    CommOp,
    CommType,
    FP16CommCodec,
    NoOpQuantizedCommCodec,
    QCommsConfig,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    codecs_from_registry,
    get_qcomm_codecs_registry,
)
from recshard.comm.dist_data import (  # noqa: F401
    EmbeddingsAllToOne,
    EmbeddingsAllToOneReduce,
    PooledEmbeddingsAllGather,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    SequenceEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsAllToAll,
)
from recshard.comm.kjt import (  # noqa: F401
    KJTAllToAll,
    KJTAllToAllSplitsAwaitable,
    KJTAllToAllTensorsAwaitable,
)
from recshard.comm.one_to_all import KJTList, KJTOneToAll, SeqEmbeddingsAllToOne  # noqa: F401
from recshard.comm.ops import (  # noqa: F401
    all_gather_base_pooled,
    alltoall_pooled,
    alltoall_sequence,
    alltoallv,
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_pooled,
    variable_batch_alltoall_pooled,
)
from recshard.comm.request import (  # noqa: F401
    comm_payload_bytes,
    get_gradient_division,
    reset_comm_payload_bytes,
    set_gradient_division,
)
from recshard.comm.row_average import average_rows_over_ranks  # noqa: F401
