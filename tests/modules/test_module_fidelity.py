"""EBC / EC behaviour TorchRec's module tests rely on: shared tables, key order, is_weighted,
need_indices, devices, `meta` forward (shape inference), reset_parameters; and recshard.fx
tracing of models holding them."""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
)
from recshard.distributed import DistributedModelParallel
from recshard.fx import Tracer, is_fx_tracing, symbolic_trace

META = torch.device("meta")


def bag_tables() -> list:
    return [
        EmbeddingBagConfig(
            name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1", "f3"]
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"]),
    ]


def seq_tables() -> list:
    return [
        EmbeddingConfig(name="t1", embedding_dim=5, num_embeddings=10, feature_names=["f1", "f2"]),
        EmbeddingConfig(name="t2", embedding_dim=5, num_embeddings=10, feature_names=["f3"]),
    ]


def weighted_kjt() -> KeyedJaggedTensor:
    """Keys in an order other than the configs' (f2 before f3)."""
    return KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7]),
        offsets=torch.tensor([0, 2, 4, 6, 8, 10, 12]),
        weights=torch.tensor([0.1, 0.2, 0.4, 0.5, 0.4, 0.3, 0.2, 0.9, 0.1, 0.3, 0.4, 0.7]),
    )


def seq_kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([0, 1, 2, 3, 8]),
        offsets=torch.tensor([0, 2, 3, 3, 4, 4, 5]),
    )


def test_shared_table_features_keep_config_order() -> None:
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name="t", embedding_dim=3, num_embeddings=10, feature_names=["f1", "f2"]
            )
        ]
    )
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f2", "f1"], values=torch.arange(8), offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8])
    )
    out = ebc(kjt)
    assert out.values().shape == (3, 6) and out.keys() == ["f1", "f2"]
    assert out.offset_per_key() == [0, 3, 6]
    weight = ebc.embedding_bags["t"].weight
    torch.testing.assert_close(out["f1"][2], weight[5] + weight[6] + weight[7])  # f1's 3rd bag
    torch.testing.assert_close(out["f2"][0], weight[0] + weight[1])


def test_shared_feature_gives_one_output_per_table() -> None:
    """A feature several tables read: one output per table, keyed `feature@table`."""
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"]),
            EmbeddingBagConfig(
                name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f1", "g"]
            ),
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["g", "f1"], values=torch.tensor([5, 1, 2, 3]), lengths=torch.tensor([1, 0, 2, 1])
    )
    out = ebc(kjt)
    assert out.keys() == ["f1@t1", "f1@t2", "g"] and out.offset_per_key() == [0, 3, 7, 11]
    t1, t2 = ebc.embedding_bags["t1"].weight, ebc.embedding_bags["t2"].weight
    torch.testing.assert_close(out["f1@t1"][0], t1[1] + t1[2])
    torch.testing.assert_close(out["f1@t2"][1], t2[3])
    ec = EmbeddingCollection(
        seq_tables()
        + [EmbeddingConfig(name="t3", embedding_dim=5, num_embeddings=4, feature_names=["f2"])],
        need_indices=True,
    )
    seq = ec(seq_kjt())
    assert list(seq) == ["f1", "f2@t1", "f3", "f2@t3"]
    assert seq["f2@t1"].weights().tolist() == seq["f2@t3"].weights().tolist() == [3]
    torch.testing.assert_close(seq["f2@t3"].values(), ec.embeddings["t3"].weight[[3]])
    bad = KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([0, 7, 1]),
        lengths=torch.tensor([1, 0, 1, 0, 1, 0]),
    )
    with pytest.raises(ValueError, match=r"table 't3', feature 'f2': id 7 is outside \[0, 4\)"):
        ec(bad)  # a shared feature's ids must fit its smallest table


class _SharedFeatureModel(nn.Module):
    """An EBC and an EC each reading feature `f` with two tables (a, b); `g` with one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"]
                ),
                EmbeddingBagConfig(
                    name="b", embedding_dim=3, num_embeddings=6, feature_names=["g", "f"]
                ),
            ]
        )
        self.ec = EmbeddingCollection(
            [
                EmbeddingConfig(
                    name="c", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"]
                ),
                EmbeddingConfig(name="d", embedding_dim=4, num_embeddings=6, feature_names=["f"]),
            ]
        )

    def forward(self, kjt: KeyedJaggedTensor) -> tuple:
        return self.ebc(kjt), self.ec(kjt)


def _shard_shared_feature(rank: int, world_size: int) -> Dict[str, object]:
    """DMP with the default planner over a model whose collections share a feature: each
    rank's outputs equal the unsharded modules' on its batch, keys included."""
    reference = _SharedFeatureModel()
    dmp = DistributedModelParallel(_SharedFeatureModel())
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["g", "f"],
        values=torch.tensor([4, 1, 2, 3]) + rank,
        lengths=torch.tensor([1, 0, 2, 1]),
    )
    pooled, sequence = dmp(kjt)
    ref_pooled, ref_sequence = reference(kjt)
    return {
        "keys": (pooled.keys(), list(sequence)),
        "ref_keys": (ref_pooled.keys(), list(ref_sequence)),
        "pooled_equal": torch.allclose(pooled.values(), ref_pooled.values()),
        "sequence_equal": all(
            torch.allclose(sequence[k].values(), ref_sequence[k].values())
            and torch.equal(sequence[k].lengths(), ref_sequence[k].lengths())
            for k in ref_sequence
        ),
    }


def test_sharding_a_shared_feature_gives_torchrec_outputs() -> None:
    """Sharding a feature several tables read works under DMP's own plan (TorchRec allows
    it); every sharding type is checked in tests/distributed/test_sharded_e{b,}c.py."""
    for result in run_ranks(2, _shard_shared_feature, timeout=180):
        assert result["keys"] == result["ref_keys"] == (["f@a", "g", "f@b"], ["f@c", "g", "f@d"])
        assert result["pooled_equal"] and result["sequence_equal"]


def test_weighted_output_follows_the_configs() -> None:
    ebc = EmbeddingBagCollection(bag_tables(), is_weighted=True)
    assert ebc.is_weighted()
    out = ebc(weighted_kjt())
    assert out.values().shape == (2, 10) and out.keys() == ["f1", "f3", "f2"]
    assert out.offset_per_key() == [0, 3, 6, 10]
    t2 = ebc.embedding_bags["t2"].weight
    torch.testing.assert_close(out["f2"][0], 0.4 * t2[4] + 0.3 * t2[3])  # ids 4, 3


def test_need_indices_returns_the_ids_as_weights() -> None:
    kjt = seq_kjt()
    out = EmbeddingCollection(seq_tables(), need_indices=True)(kjt)
    assert list(out) == ["f1", "f2", "f3"]
    for key, ids in {"f1": [0, 1, 2], "f2": [3], "f3": [8]}.items():
        assert out[key].weights().tolist() == ids and out[key].values().shape == (len(ids), 5)
    plain = EmbeddingCollection(seq_tables())(kjt)
    assert plain["f1"].weights_or_none() is None


def test_device_argument_and_context_manager() -> None:
    config = bag_tables()[:1]
    assert EmbeddingBagCollection(config, device=META).device == META
    with torch.device("meta"):
        ebc = EmbeddingBagCollection(config)
        ec = EmbeddingCollection(seq_tables())
    assert ebc.device == META and ebc.embedding_bags["t1"].weight.device == META
    assert ec.embeddings["t1"].weight.device == META
    assert EmbeddingBagCollection(config).device == torch.device("cpu")


def test_duplicate_table_names_fail() -> None:
    twice = [
        bag_tables()[0],
        EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=4, feature_names=["g"]),
    ]
    with pytest.raises(ValueError, match=r"duplicate table names \['t1'\]"):
        EmbeddingBagCollection(twice)


def test_forward_on_meta_infers_shapes() -> None:
    ebc = EmbeddingBagCollection(bag_tables(), is_weighted=True, device=META)
    out = ebc(weighted_kjt().to(META))
    assert out.values().device == META and out.values().shape == (2, 10)
    assert out.keys() == ["f1", "f3", "f2"] and out.offset_per_key() == [0, 3, 6, 10]
    ec = EmbeddingCollection(seq_tables(), device=META, need_indices=True)
    seq = ec(seq_kjt().to(META))
    assert {k: tuple(v.values().shape) for k, v in seq.items()} == {
        "f1": (3, 5),
        "f2": (1, 5),
        "f3": (1, 5),
    }
    assert seq["f1"].values().device == META


def test_reset_parameters_materializes_and_redraws() -> None:
    ebc = EmbeddingBagCollection(bag_tables(), device=META)
    ebc.reset_parameters()
    weights = {name: bag.weight.detach().clone() for name, bag in ebc.embedding_bags.items()}
    assert all(w.device.type == "cpu" and torch.isfinite(w).all() for w in weights.values())
    bound = (1 / 10) ** 0.5  # TorchRec's default init: uniform(+-sqrt(1 / num_embeddings))
    assert all(w.abs().max() <= bound for w in weights.values())
    ebc.reset_parameters()
    assert not torch.equal(ebc.embedding_bags["t1"].weight, weights["t1"])


class _Ranker(nn.Module):
    """Dense + sparse: an EBC's pooled values and an EC's summed sequence, then a linear."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(bag_tables(), is_weighted=True, device=device)
        self.ec = EmbeddingCollection(seq_tables(), device=device)
        self.over = nn.Linear(10 + 5 + 2, 1, device=device)

    def forward(
        self, dense: torch.Tensor, pooled_ids: KeyedJaggedTensor, seq_ids: KeyedJaggedTensor
    ) -> torch.Tensor:
        pooled = self.ebc(pooled_ids).values()
        sequences: Dict[str, JaggedTensor] = self.ec(seq_ids)
        first = sequences["f1"].to_padded_dense(2).sum(1).sum(1, keepdim=True)  # [B, 1]
        return self.over(torch.cat([pooled, first.expand(-1, 5), dense], dim=1))


def test_symbolic_trace_keeps_embedding_modules_as_leaves() -> None:
    torch.manual_seed(0)
    model = _Ranker()
    traced = symbolic_trace(model)
    targets = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert targets == ["ebc", "ec", "over"]
    args = (torch.randn(2, 2), weighted_kjt(), seq_kjt())
    torch.testing.assert_close(traced(*args), model(*args))
    traced(*args).sum().backward()  # gradients reach the tables through the graph
    assert model.ebc.embedding_bags["t1"].weight.grad is not None
    assert not is_fx_tracing()


def test_tracer_leaf_modules_and_direct_trace() -> None:
    model = _Ranker()
    graph = Tracer(leaf_modules=["Linear"]).trace(model)
    assert "over" in [n.target for n in graph.nodes if n.op == "call_module"]
    traced = symbolic_trace(model.ebc)
    out = traced(weighted_kjt())
    assert out.keys() == ["f1", "f3", "f2"]
    torch.testing.assert_close(out.values(), model.ebc(weighted_kjt()).values())
