"""The codemod's table: where each TorchRec module path's names live in recshard (data only).

- `MODULE_MAP`: TorchRec module path -> the recshard module holding its public names.
- `ALSO_SEARCHED`: TorchRec modules re-export freely (`torchrec.distributed.planner.types`
  has `ShardingPlan`, `torchrec.distributed.embedding_types` has `ShardingType`); a name the
  mapped module lacks is looked up in these recshard modules next, by longest path prefix.
- `NOT_PROVIDED`: TorchRec paths (a module, or `module.name`) recshard deliberately does not
  provide, by longest prefix, with the reason and what to use instead. The codemod reports
  that reason for any use of them.
"""

from __future__ import annotations

from typing import Dict, Tuple

MODULE_MAP: Dict[str, str] = {
    "torchrec": "recshard",
    "torchrec.sparse": "recshard.sparse",
    "torchrec.sparse.jagged_tensor": "recshard.sparse",
    "torchrec.sparse.jagged_tensor_validator": "recshard.sparse.validation",
    "torchrec.modules": "recshard.modules",
    "torchrec.modules.embedding_configs": "recshard.modules.embedding_configs",
    "torchrec.modules.embedding_modules": "recshard.modules",
    "torchrec.modules.mlp": "recshard.modules.mlp",
    "torchrec.modules.crossnet": "recshard.modules.crossnet",
    "torchrec.modules.feature_processor": "recshard.modules.feature_processor",
    "torchrec.modules.feature_processor_": "recshard.modules.feature_processor_",
    "torchrec.modules.fp_embedding_modules": "recshard.modules.fp_embedding_modules",
    "torchrec.distributed.fp_embeddingbag": "recshard.distributed.fp_embeddingbag",
    "torchrec.modules.mc_modules": "recshard.modules.mc_modules",
    "torchrec.modules.mc_embedding_modules": "recshard.modules.mc_embedding_modules",
    "torchrec.distributed.mc_modules": "recshard.distributed.mc_modules",
    "torchrec.distributed.mc_embeddingbag": "recshard.distributed.mc_embeddingbag",
    "torchrec.distributed.mc_embedding": "recshard.distributed.mc_embedding",
    "torchrec.distributed.mc_embedding_modules": "recshard.distributed.mc_embedding_modules",
    "torchrec.distributed.grouped_position_weighted": (
        "recshard.distributed.grouped_position_weighted"
    ),
    "torchrec.modules.regroup": "recshard.modules.regroup",
    "torchrec.models": "recshard.models",
    "torchrec.models.dlrm": "recshard.models.dlrm",
    "torchrec.datasets": "recshard.datasets",
    "torchrec.datasets.random": "recshard.datasets.random",
    "torchrec.datasets.criteo": "recshard.datasets.criteo",
    "torchrec.datasets.utils": "recshard.datasets.utils",
    "torchrec.streamable": "recshard.types",
    "torchrec.types": "recshard",
    "torchrec.fx": "recshard.fx",
    "torchrec.fx.tracer": "recshard.fx",
    "torchrec.distributed": "recshard.distributed",
    "torchrec.distributed.model_parallel": "recshard.distributed",
    "torchrec.distributed.embeddingbag": "recshard.distributed",
    "torchrec.distributed.embedding": "recshard.distributed",
    "torchrec.distributed.quant_embeddingbag": "recshard.distributed",
    "torchrec.distributed.quant_embedding": "recshard.distributed",
    "torchrec.distributed.shard": "recshard.distributed.shard",
    "torchrec.distributed.train_pipeline": "recshard.distributed",
    "torchrec.distributed.train_pipeline.train_pipelines": "recshard.distributed",
    "torchrec.distributed.train_pipeline.utils": "recshard.distributed.train_pipeline",
    "torchrec.distributed.train_pipeline.pipeline_context": "recshard.distributed.train_pipeline",
    "torchrec.distributed.train_pipeline.tracing": "recshard.distributed.train_pipeline",
    "torchrec.distributed.train_pipeline.types": "recshard.distributed.train_pipeline",
    "torchrec.distributed.sharding_plan": "recshard.distributed.sharding_plan",
    "torchrec.distributed.types": "recshard.types",
    "torchrec.distributed.embedding_types": "recshard.distributed.embedding_types",
    "torchrec.distributed.embedding_sharding": "recshard.distributed.embedding_sharding",
    "torchrec.distributed.collective_utils": "recshard.distributed.collective_utils",
    "torchrec.distributed.comm": "recshard.distributed.comm",
    "torchrec.distributed.planner": "recshard.planner",
    "torchrec.distributed.planner.planners": "recshard.planner",
    "torchrec.distributed.planner.types": "recshard.planner",
    "torchrec.distributed.planner.storage_reservations": "recshard.planner",
    "torchrec.distributed.planner.enumerators": "recshard.planner",
    "torchrec.distributed.planner.partitioners": "recshard.planner",
    "torchrec.distributed.planner.perf_models": "recshard.planner",
    "torchrec.distributed.planner.proposers": "recshard.planner",
    "torchrec.distributed.planner.shard_estimators": "recshard.planner",
    "torchrec.distributed.planner.stats": "recshard.planner",
    "torchrec.distributed.fbgemm_qcomm_codec": "recshard.comm",
    "torchrec.distributed.dist_data": "recshard.comm",
    "torchrec.distributed.comm_ops": "recshard.comm",
    "torchrec.optim": "recshard.optim",
    "torchrec.optim.apply_optimizer_in_backward": "recshard.optim.apply_optimizer_in_backward",
    "torchrec.optim.keyed": "recshard.optim",
    "torchrec.optim.optimizers": "recshard.optim",
    "torchrec.optim.rowwise_adagrad": "recshard.optim",
    "torchrec.optim.fused": "recshard.optim",
    "torchrec.optim.warmup": "recshard.optim",
    "torchrec.optim.clipping": "recshard.optim",
    "torchrec.quant": "recshard.quant",
    "torchrec.quant.embedding_modules": "recshard.quant",
    "torchrec.inference.modules": "recshard.quant",
}

ALSO_SEARCHED: Dict[str, Tuple[str, ...]] = {
    "torchrec.modules": ("recshard.modules", "recshard.sparse"),
    "torchrec.distributed": ("recshard.distributed", "recshard.types", "recshard.comm"),
    "torchrec.distributed.embeddingbag": (
        "recshard.distributed.embeddingbag",
        "recshard.distributed",
        "recshard.distributed.embedding_sharding",
        "recshard.types",
    ),
    "torchrec.distributed.embedding": (
        "recshard.distributed.embedding",
        "recshard.distributed",
        "recshard.distributed.embedding_sharding",
        "recshard.types",
    ),
    "torchrec.distributed.planner": ("recshard.planner", "recshard.types"),
    "torchrec.distributed.train_pipeline": (
        "recshard.distributed.train_pipeline",
        "recshard.types",
    ),
    "torchrec.quant": ("recshard.quant", "recshard.modules"),
    "torchrec.inference.modules": ("recshard.quant", "recshard.distributed"),
    "torchrec.optim": ("recshard.optim",),
    "torchrec.datasets": ("recshard.datasets.utils", "recshard.sparse"),
}

_KERNELS = (
    "TorchRec's kernel internals: recshard picks the kernel from the plan's compute_kernel and "
    "the sharder's fused_params (recshard.lookup is internal)"
)
_SHARDINGS = (
    "TorchRec's per-sharding-type classes: recshard takes the sharding type from the plan "
    "(ShardingType in ParameterSharding); recshard.sharding is internal"
)
_LATER = "recshard does not have it yet"
_INTERNAL = "TorchRec's own implementation detail, not part of a training script's API"
_FACTORY = (
    "TorchRec's internal factory of its per-sharding-type classes: recshard builds shardings "
    "from the plan inside the sharder; use EmbeddingBagCollectionSharder().shard(module, "
    "plan, env) or recshard.distributed.shard.shard"
)
_COMM_REQUESTS = (
    "recshard's comm ops take tensors and splits as arguments and return a "
    "recshard.types.Awaitable; there are no Request / *Info objects to build"
)

NOT_PROVIDED: Dict[str, str] = {
    "torchrec.metrics": "TorchRec's RecMetrics: use torchmetrics (AUROC, NE)",
    "torchrec.inference": (
        "TorchScript / C++ serving (torch.package, predict factories); the quantized "
        "modules are in recshard.quant"
    ),
    "torchrec.ir": "TorchRec's export IR serializers: use torch.export",
    "torchrec.schema": "TorchRec's API-compatibility tests, not a library API",
    "torchrec.test_utils": "TorchRec's own test helpers, not a library API",
    "torchrec.linter": "TorchRec's own development linter, not a library API",
    "torchrec.pt2": "TorchRec's torch.compile helpers: recshard's KJT compiles as it is",
    "torchrec.tensor_types": _LATER,
    "torchrec.utils": _INTERNAL,
    "torchrec.fx.utils": _INTERNAL,
    "torchrec.sparse.tensor_dict": _LATER,
    "torchrec.datasets.movielens": _LATER,
    "torchrec.datasets.scripts": "TorchRec's dataset preprocessing scripts: use "
    "examples/dlrm's preprocessing",
    "torchrec.models.deepfm": _LATER,
    "torchrec.models.experimental": _LATER,
    "torchrec.modules.activation": _LATER,
    "torchrec.modules.deepfm": _LATER,
    "torchrec.modules.embedding_tower": _LATER,
    "torchrec.modules.fused_embedding_modules": (
        "fused unsharded modules: apply_optimizer_in_backward on an EmbeddingBagCollection "
        "does the same"
    ),
    "torchrec.modules.hash_mc_evictions": _LATER,
    "torchrec.modules.hash_mc_metrics": _LATER,
    "torchrec.modules.hash_mc_modules": _LATER,
    "torchrec.modules.itep_embedding_modules": _LATER,
    "torchrec.modules.itep_modules": _LATER,
    "torchrec.modules.keyed_jagged_tensor_pool": _LATER,
    "torchrec.modules.lazy_extension": _LATER,
    "torchrec.modules.mc_adapter": _LATER,
    "torchrec.modules.object_pool": _LATER,
    "torchrec.modules.object_pool_lookups": _LATER,
    "torchrec.modules.pruning_logger": _INTERNAL,
    "torchrec.modules.tensor_pool": _LATER,
    "torchrec.modules.utils": _INTERNAL,
    "torchrec.optim.semi_sync": _LATER,
    "torchrec.quant.utils": _INTERNAL,
    "torchrec.distributed.sharding": _SHARDINGS,
    "torchrec.distributed.batched_embedding_kernel": _KERNELS,
    "torchrec.distributed.embedding_kernel": _KERNELS,
    "torchrec.distributed.embedding_lookup": _KERNELS,
    "torchrec.distributed.quant_embedding_kernel": _KERNELS,
    "torchrec.distributed.fused_params": _KERNELS,
    "torchrec.distributed.embedding_dim_bucketer": _KERNELS,
    "torchrec.distributed.composable": _KERNELS,
    "torchrec.distributed.shards_wrapper": (
        "TorchRec's DTensor local-shards wrapper: recshard's sharded state_dict holds "
        "ShardedTensor / DTensor values directly"
    ),
    "torchrec.distributed.tensor_sharding": _SHARDINGS,
    "torchrec.distributed.global_settings": _INTERNAL,
    "torchrec.distributed.logger": _INTERNAL,
    "torchrec.distributed.logging_handlers": _INTERNAL,
    "torchrec.distributed.torchrec_logger": _INTERNAL,
    "torchrec.distributed.torchrec_logging_handlers": _INTERNAL,
    "torchrec.distributed.utils": _INTERNAL,
    "torchrec.distributed.infer_utils": _INTERNAL,
    "torchrec.distributed.quant_state": _INTERNAL,
    "torchrec.distributed.model_tracker": _LATER,
    "torchrec.distributed.object_pool": _LATER,
    "torchrec.distributed.tensor_pool": _LATER,
    "torchrec.distributed.keyed_jagged_tensor_pool": _LATER,
    "torchrec.distributed.itep_embeddingbag": _LATER,
    "torchrec.distributed.hash_mc_embedding": _LATER,
    "torchrec.distributed.embedding_tower_sharding": _LATER,
    "torchrec.distributed.fused_embedding": (
        "fused unsharded modules: shard an EmbeddingCollection with EmbeddingCollectionSharder"
    ),
    "torchrec.distributed.fused_embeddingbag": (
        "fused unsharded modules: shard an EmbeddingBagCollection with "
        "EmbeddingBagCollectionSharder"
    ),
    "torchrec.distributed.planner.constants": (
        "TorchRec's hardware constants: recshard's planner reads a calibration profile"
    ),
    "torchrec.distributed.planner.utils": _INTERNAL,
    "torchrec.distributed.train_pipeline.postproc": _LATER,
    "torchrec.distributed.train_pipeline.pipeline_stage": _LATER,
    "torchrec.distributed.train_pipeline.runtime_forwards": _INTERNAL,
    # pending: being built (managed collision, feature processors, the rest of the
    # documented torchrec.distributed reference)
    # names of the documented torchrec.distributed reference (tests/port/
    # torchrec_distributed_names.txt) that recshard deliberately lacks
    "torchrec.distributed.embedding_sharding.bucketize_kjt_before_all2all": (
        "TorchRec's row-wise input-dist step: recshard's row-wise sharding bucketizes ids "
        "itself (plan the table row_wise())"
    ),
    "torchrec.distributed.embeddingbag.construct_output_kt": _INTERNAL
    + " (the sharded EBC builds its KeyedTensor itself, in the unsharded key order)",
    "torchrec.distributed.embeddingbag.create_embedding_bag_sharding": _FACTORY,
    "torchrec.distributed.embeddingbag.create_sharding_infos_by_sharding": _FACTORY,
    "torchrec.distributed.embedding.create_embedding_sharding": _FACTORY,
    "torchrec.distributed.quant_embeddingbag.create_infer_embedding_bag_sharding": _FACTORY,
    "torchrec.distributed.embeddingbag.replace_placement_with_meta_device": _INTERNAL
    + " (recshard shards meta-device modules without rewriting plan placements)",
    "torchrec.distributed.shard._shard_modules": (
        "TorchRec's private helper (its tutorial calls it): use "
        "recshard.distributed.shard.shard_modules, the same call without planner="
    ),
    "torchrec.distributed.types.ModuleShardingPlan": (
        "a module's plan is a plain dict {table: ParameterSharding}: "
        "recshard.types.EmbeddingModuleShardingPlan"
    ),
    "torchrec.distributed.embeddingbag.EmbeddingBagCollectionAwaitable": (
        "the sharded EBC's output dist returns a recshard.types.LazyAwaitable[KeyedTensor]"
    ),
    **{
        f"torchrec.distributed.comm_ops.{name}": _COMM_REQUESTS
        for name in (
            "Request",
            "All2AllPooledInfo",
            "VariableBatchAll2AllPooledInfo",
            "All2AllSequenceInfo",
            "All2AllVInfo",
            "All2AllDenseInfo",
            "ReduceScatterInfo",
            "ReduceScatterBaseInfo",
            "ReduceScatterVInfo",
            "AllGatherBaseInfo",
        )
    },
}
