"""Communication layer, by what it carries: pooled embeddings (`pooled.py`, `pooled_reduce.py`),
sequence embeddings (`sequence.py`) and KeyedJaggedTensors (`kjt.py`), each collective a
function with autograd beside its TorchRec-named module, all over one async core
(`request.py`) and one transport seam (`transport.py`); codecs, process groups.

TorchRec's `torchrec.distributed.dist_data` and `comm_ops` names are importable from here."""

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
from recshard.comm.kjt import (  # noqa: F401
    KJTAllToAll,
    KJTAllToAllSplitsAwaitable,
    KJTAllToAllTensorsAwaitable,
)
from recshard.comm.one_to_all import (  # noqa: F401
    EmbeddingsAllToOne,
    EmbeddingsAllToOneReduce,
    KJTList,
    KJTOneToAll,
    SeqEmbeddingsAllToOne,
)
from recshard.comm.pooled import (  # noqa: F401
    PooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsAllToAll,
    alltoall_pooled,
    alltoallv,
    variable_batch_alltoall_pooled,
)
from recshard.comm.pooled_reduce import (  # noqa: F401
    PooledEmbeddingsAllGather,
    PooledEmbeddingsReduceScatter,
    VariableBatchPooledEmbeddingsReduceScatter,
    all_gather_base_pooled,
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
)
from recshard.comm.request import (  # noqa: F401
    comm_payload_bytes,
    get_gradient_division,
    reset_comm_payload_bytes,
    set_gradient_division,
)
from recshard.comm.row_average import average_rows_over_ranks  # noqa: F401
from recshard.comm.sequence import SequenceEmbeddingsAllToAll, alltoall_sequence  # noqa: F401
