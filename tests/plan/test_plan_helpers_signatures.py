"""The manual plan helpers called as a TorchRec user calls them: TorchRec's positional order
and keywords, the sharder deciding module type, sharding types and the default kernel, and a
clear error for every argument recshard cannot honour."""

from __future__ import annotations

import inspect
from typing import Dict, List

import pytest
import torch

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from recshard.distributed import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recshard.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recshard.plan.validate import PlanValidationError
from recshard.quant import QuantEmbeddingBagCollection
from recshard.types import ParameterSharding

# TorchRec 1.8's parameters, in order, with their defaults (recshard's keyword-only additions
# and its own table_column_wise are listed separately)
TORCHREC_SIGNATURES = {
    table_wise: [("rank", inspect.Parameter.empty), ("device", None), ("compute_kernel", None)],
    row_wise: [("sizes_placement", None), ("compute_kernel", None), ("num_buckets", None)],
    column_wise: [
        ("ranks", None),
        ("size_per_rank", None),
        ("compute_kernel", None),
        ("device_types", None),
    ],
    table_row_wise: [("host_index", inspect.Parameter.empty)],
    data_parallel: [],
    construct_module_sharding_plan: [
        ("module", inspect.Parameter.empty),
        ("per_param_sharding", inspect.Parameter.empty),
        ("sharder", None),
        ("local_size", None),
        ("world_size", None),
        ("device_type", None),
    ],
}


def _ebc(device: str = "meta") -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=16, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"]
            )
            for i in range(4)
        ],
        device=device,
    )


def _plan(
    per_table: Dict,
    sharder: object | None = None,
    world_size: int = 4,
    local_size: int = 2,
    module: torch.nn.Module | None = None,
) -> Dict[str, ParameterSharding]:
    return construct_module_sharding_plan(
        module or _ebc(), per_table, sharder, local_size, world_size, "cpu"
    )


def _ranks(ps: ParameterSharding) -> List[int]:
    return [s.rank for s in ps.shards or []]


@pytest.mark.parametrize("helper", list(TORCHREC_SIGNATURES), ids=lambda h: h.__name__)
def test_positional_parameters_are_torchrecs(helper) -> None:
    params = [
        p
        for p in inspect.signature(helper).parameters.values()
        if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    assert [(p.name, p.default) for p in params] == TORCHREC_SIGNATURES[helper]


def test_recshard_additions_are_keyword_only() -> None:
    for helper in (data_parallel, table_row_wise):
        extra = inspect.signature(helper).parameters["compute_kernel"]
        assert extra.kind == inspect.Parameter.KEYWORD_ONLY, helper.__name__


def test_positional_and_keyword_calls_build_the_same_plan() -> None:
    positional = _plan(
        {
            "t0": table_wise(3, "cpu", "dense"),
            "t1": row_wise(None, "dense"),
            "t2": column_wise([1, 0], None, "dense", ["cpu", "cpu"]),
            "t3": table_row_wise(1),
        },
        EmbeddingBagCollectionSharder(),
    )
    keyword = _plan(
        {
            "t0": table_wise(rank=3, device="cpu", compute_kernel="dense"),
            "t1": row_wise(compute_kernel="dense"),
            "t2": column_wise(ranks=[1, 0], compute_kernel="dense", device_types=["cpu", "cpu"]),
            "t3": table_row_wise(host_index=1),
        },
        sharder=EmbeddingBagCollectionSharder(),
    )
    assert positional == keyword
    assert {
        n: (ps.sharding_type, ps.compute_kernel, _ranks(ps)) for n, ps in positional.items()
    } == {
        "t0": ("table_wise", "dense", [3]),
        "t1": ("row_wise", "dense", [0, 1, 2, 3]),
        "t2": ("column_wise", "dense", [1, 0]),
        "t3": ("table_row_wise", "fused", [2, 3]),  # the sharder's default kernel
    }
    assert [str(s.placement) for s in positional["t0"].shards] == ["rank:3/cpu"]


def test_recshard_helpers_keep_their_keywords() -> None:
    plan = _plan(
        {
            "t0": data_parallel(compute_kernel="dense"),
            "t1": table_row_wise(0, compute_kernel="dense"),
            "t2": table_column_wise(1, [1], "dense"),
        }
    )
    assert [(ps.sharding_type, ps.compute_kernel, _ranks(ps)) for ps in plan.values()] == [
        ("data_parallel", "dense", []),
        ("table_row_wise", "dense", [0, 1]),
        ("table_column_wise", "dense", [3]),
    ]


def test_the_sharder_picks_the_default_kernel() -> None:
    qebc = QuantEmbeddingBagCollection.from_float(_ebc("cpu"), torch.qint8)
    quant = _plan(
        {"t0": table_wise(0), "t1": row_wise(), "t2": data_parallel()},
        QuantEmbeddingBagCollectionSharder(),
        module=qebc,
    )
    assert {ps.compute_kernel for ps in quant.values()} == {"quant"}
    floats = _plan({"t0": table_wise(0), "t1": data_parallel()}, EmbeddingBagCollectionSharder())
    assert [ps.compute_kernel for ps in floats.values()] == ["fused", "dense"]


def test_the_sharder_decides_what_is_allowed() -> None:
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=16, embedding_dim=8, name="s0", feature_names=["g0"])],
        device="meta",
    )
    with pytest.raises(
        ValueError,
        match="EmbeddingCollectionSharder shards EmbeddingCollection, not EmbeddingBagCollection",
    ):
        _plan({"t0": table_wise(0)}, EmbeddingCollectionSharder())
    with pytest.raises(
        PlanValidationError,
        match=r"table 's0': EmbeddingCollectionSharder does not support table_row_wise",
    ):
        _plan({"s0": table_row_wise(0)}, EmbeddingCollectionSharder(), module=ec)
    with pytest.raises(
        PlanValidationError, match=r"table 't0': EmbeddingBagCollectionSharder .*'quant'"
    ):
        _plan({"t0": table_wise(0, compute_kernel="quant")}, EmbeddingBagCollectionSharder())


@pytest.mark.parametrize(
    "per_table, error",
    [
        (
            {"t0": table_wise(0, "cuda")},
            r"table 't0': shard device \['cuda'\] differs from the plan's "
            r"device_type 'cpu'",
        ),
        # the old recshard call table_wise(rank, kernel) is caught, not read as a device
        ({"t0": table_wise(0, "fused")}, r"table 't0': shard device \['fused'\]"),
        (
            {"t1": column_wise([0, 1], device_types=["cpu", "cuda"])},
            r"table 't1': shard device \['cuda'\]",
        ),
        (
            {"t1": column_wise([0, 1], device_types=["cpu"])},
            r"table 't1': 1 device types for 2 shards",
        ),
    ],
)
def test_devices_other_than_the_plans_are_errors(per_table: Dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        _plan(per_table)


@pytest.mark.parametrize(
    "make, error",
    [
        (
            lambda: row_wise(([8, 8], "cpu")),
            r"row_wise: sizes_placement=\(\[8, 8\], 'cpu'\) is not supported",
        ),
        (lambda: row_wise(num_buckets=4), r"row_wise: num_buckets=4 is not supported"),
        (
            lambda: column_wise(size_per_rank=[4, 4]),
            r"column_wise: size_per_rank=\[4, 4\] is not supported",
        ),
        (lambda: column_wise(), r"column_wise: pass `ranks`"),
        (lambda: table_wise(0, None, "magic"), r"'magic' is not a valid EmbeddingComputeKernel"),
    ],
)
def test_unsupported_arguments_are_errors(make, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        make()
