"""An unsharded quantized state dict loads into sharded quantized modules (TorchRec's
`dmp.load_state_dict(qebc.state_dict())`), and `torchrec.distributed.shard`'s `shard` /
`shard_modules` shard a quantized or float collection: outputs then equal the unsharded
module's, at world size 2."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from multiprocess import run_ranks
from test_quant_torchrec_layout import as_torchrec_layout
from torch import nn
from torch.quantization import MinMaxObserver, PlaceholderObserver, quantize_dynamic

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recshard.distributed import DistributedModelParallel
from recshard.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from recshard.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recshard.modules.embedding_configs import QuantConfig
from recshard.quant import QuantEmbeddingBagCollection
from recshard.types import ShardingPlan

Q = "quant"


def tables() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=11, embedding_dim=8, name="t0", feature_names=["f0"]),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=16, name="t1", feature_names=["f1"]),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t2", feature_names=["f2"]),
    ]


class Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ebc = EmbeddingBagCollection(tables())

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


def quantized(seed: int) -> nn.Module:
    """TorchRec's tutorial flow: quantize_dynamic with an int8 weight observer."""
    qconfig = QuantConfig(
        activation=PlaceholderObserver.with_args(dtype=torch.float),
        weight=MinMaxObserver.with_args(dtype=torch.qint8),
    )
    return quantize_dynamic(
        Model(seed),
        qconfig_spec={EmbeddingBagCollection: qconfig},
        mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection},
        inplace=False,
    )


def batch(rank: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 4, (3 * 3,), generator=g)
    sizes = [11, 7, 5]
    values = torch.cat(
        [
            torch.randint(0, n, (int(lengths[3 * i : 3 * i + 3].sum()),), generator=g)
            for i, n in enumerate(sizes)
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], values, lengths)


PLANS = {
    "table_wise": {
        "t0": table_wise(1, compute_kernel=Q),
        "t1": table_wise(0, compute_kernel=Q),
        "t2": table_wise(1, compute_kernel=Q),
    },
    "row_wise": {n: row_wise(compute_kernel=Q) for n in ("t0", "t1", "t2")},
    "mixed": {
        "t0": column_wise([1, 0], compute_kernel=Q),
        "t1": row_wise(compute_kernel=Q),
        "t2": data_parallel(compute_kernel=Q),
    },
}


def load_then_compare(rank: int, ws: int, torchrec_layout: bool = False) -> Dict[str, float]:
    """`torchrec_layout`: the state given as TorchRec keeps it (each table's fbgemm rows in
    one `weight`, tests/quant/test_quant_torchrec_layout.py)."""
    source = quantized(seed=1)  # the state to load
    state = as_torchrec_layout(source.state_dict()) if torchrec_layout else source.state_dict()
    worst = {}
    for kind, per_table in PLANS.items():
        target = quantized(seed=2)  # other weights: the load must replace every shard
        plan = ShardingPlan(
            {"ebc": construct_module_sharding_plan(target.ebc, per_table, world_size=ws)}
        )
        dmp = DistributedModelParallel(
            target,
            plan=plan,
            sharders=[QuantEmbeddingBagCollectionSharder()],
            init_data_parallel=False,
        )
        kjt = batch(rank)
        with torch.no_grad():
            before = (dmp(kjt) - source(kjt)).abs().max().item()
            dmp.load_state_dict(state)
            after = (dmp(kjt) - source(kjt)).abs().max().item()
        assert before > 1e-3, (kind, before)  # the weights did differ
        worst[kind] = after
    return worst


@pytest.mark.parametrize("torchrec_layout", [False, True])
def test_unsharded_quant_state_dict_loads_into_sharded_modules(torchrec_layout: bool) -> None:
    for rank, worst in enumerate(run_ranks(2, load_then_compare, torchrec_layout, timeout=300)):
        for kind, err in worst.items():
            assert err < 1e-5, (rank, kind, err)


def shard_one_and_all(rank: int, ws: int) -> Dict[str, float]:
    from recshard.distributed.shard import shard, shard_modules

    qmodel = quantized(seed=3)
    one = shard(qmodel.ebc, row_wise(compute_kernel=Q), device=torch.device("cpu"))
    mixed = shard(
        qmodel.ebc,
        {
            "t0": table_wise(1, compute_kernel=Q),
            "t1": construct_module_sharding_plan(
                qmodel.ebc, {"t1": column_wise([0, 1], compute_kernel=Q)}, world_size=ws
            )["t1"],
            "t2": data_parallel(compute_kernel=Q),
        },
        device=torch.device("cpu"),
    )
    float_model = Model(seed=4)
    reference = Model(seed=4)
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                float_model.ebc,
                {"t0": row_wise(), "t1": table_wise(0), "t2": column_wise([1, 0])},
                world_size=ws,
            )
        }
    )
    replaced = shard_modules(float_model, plan=plan, device=torch.device("cpu"))
    assert replaced is float_model and type(float_model.ebc).__name__.startswith("Sharded")
    kjt = batch(rank)
    with torch.no_grad():
        want_q, want_f = qmodel(kjt), reference(kjt)
        return {
            "row_wise": (one(kjt).wait().values() - want_q).abs().max().item(),
            "mixed": (mixed(kjt).wait().values() - want_q).abs().max().item(),
            "shard_modules": (float_model(kjt) - want_f).abs().max().item(),
        }


def test_shard_and_shard_modules_equal_the_unsharded_module() -> None:
    for rank, worst in enumerate(run_ranks(2, shard_one_and_all, timeout=300)):
        for kind, err in worst.items():
            assert err < 1e-5, (rank, kind, err)
