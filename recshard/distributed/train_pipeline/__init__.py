"""Train pipelines: overlap the input dist and device copy of the next batches with this step.

`TrainPipelineSparseDist` (and its eval twin `EvalPipelineSparseDist`) start batch i+1's input
dist and batch i+2's copy while batch i runs; `TrainPipelineBase` overlaps only the copy;
`PrefetchTrainPipelineSparseDist` also brings batch i+1's key-value rows into DRAM during batch i's
backward; `TrainPipelineSemiSync` also runs batch i+1's lookup and output dist during batch i's
backward (one-step-stale embeddings).
"""

from recshard.distributed.train_pipeline.pipelines import (
    EvalPipelineSparseDist,
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from recshard.distributed.train_pipeline.prefetch import PrefetchTrainPipelineSparseDist
from recshard.distributed.train_pipeline.semi_sync import (
    EmbeddingPipelinedForward,
    TrainPipelineSemiSync,
)
from recshard.distributed.train_pipeline.tracing import ArgInfo, trace_sharded_inputs
from recshard.distributed.train_pipeline.utils import (
    EmbeddingTrainPipelineContext,
    PipelinedForward,
    TrainPipelineContext,
)

__all__ = [
    "ArgInfo",
    "EmbeddingPipelinedForward",
    "EmbeddingTrainPipelineContext",
    "EvalPipelineSparseDist",
    "PipelinedForward",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "trace_sharded_inputs",
]
