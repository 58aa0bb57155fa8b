"""Constraints read as TorchRec reads them: `compute_kernels=["dense"]` gives a
data-parallel table (on every rank), and a model-parallel dense table only when the
constraints rule data-parallel out."""

from __future__ import annotations

from recshard import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.distributed import EmbeddingBagCollectionSharder
from recshard.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology


def _plan(constraints: dict) -> dict:
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=16,
                num_embeddings=1000 * (i + 1),
                feature_names=[f"f{i}"],
            )
            for i in range(3)
        ]
    )
    planner = EmbeddingShardingPlanner(
        Topology(world_size=2, compute_device="cpu"), constraints=constraints, debug=False
    )
    return planner.plan(ebc, [EmbeddingBagCollectionSharder()]).plan[""]


def test_dense_constraint_gives_data_parallel_on_every_rank() -> None:
    plan = _plan(
        {name: ParameterConstraints(compute_kernels=["dense"]) for name in ("t0", "t1", "t2")}
    )
    for name, entry in plan.items():
        assert (entry.sharding_type, entry.compute_kernel) == ("data_parallel", "dense"), name
        assert sorted(entry.ranks) == [0, 1], name


def test_model_parallel_dense_only_when_data_parallel_is_ruled_out() -> None:
    plan = _plan(
        {"t0": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["dense"])}
    )
    assert (plan["t0"].sharding_type, plan["t0"].compute_kernel) == ("table_wise", "dense")
