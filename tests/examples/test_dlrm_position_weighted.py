"""`examples/dlrm/train.py --position-weighted FEATURES` on 2 gloo ranks: the named features go
through a sharded FeatureProcessedEmbeddingBagCollection, the pipeline gives the plain loop's
numbers, the position weights train (dense optimizer, DDP), and the planner plans it."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
from multiprocess import run_ranks
from test_dlrm_train import TINY

BASE = TINY + ["--steps", "3", "--batch-size", "32", "--eval-batches", "2", "--multi-hot", "3"]
FEATURES = "cat_0,cat_3"


def _train(rank: int, world_size: int, argvs: List[List[str]]) -> List[Dict[str, Any]]:
    from examples.dlrm.args import parse_args
    from examples.dlrm.train import run

    return [run(parse_args(argv)) for argv in argvs]


def _position_weights(rank: int, world_size: int, argv: List[str]) -> Dict[str, List[float]]:
    from examples.dlrm.args import parse_args
    from examples.dlrm.data.loaders import train_batches
    from examples.dlrm.train import Runner, build_training, init_distributed

    args = parse_args(argv)
    _, _, local_size, device = init_distributed(60)
    dmp, optimizer, _, _ = build_training(args, device, world_size, local_size)
    runner = Runner(dmp, optimizer, device, args.pipeline, lambda _: None)
    batches = train_batches(args, rank, world_size, 0, None)
    for _ in range(args.steps):
        runner.step(batches)
    return {n: p.tolist() for n, p in dmp.named_parameters() if "position_weights" in n}


def test_position_weighted_features_train_with_and_without_the_pipeline() -> None:
    argv = BASE + ["--position-weighted", FEATURES, "--sharding", "row_wise"]
    summaries = run_ranks(2, _train, [argv, argv + ["--no-pipeline"]], timeout=240)
    pipelined, plain = summaries[0]
    assert pipelined["evals"] == plain["evals"]
    assert pipelined["final_loss_ema"] == pipelined["final_loss_ema"]  # not NaN


@pytest.mark.parametrize("sharding", ["auto", "table_wise"])
def test_position_weights_move_and_agree_over_ranks(sharding: str) -> None:
    argv = BASE + ["--position-weighted", FEATURES, "--sharding", sharding]
    weights = run_ranks(2, _position_weights, argv, timeout=240)
    names = sorted(weights[0])
    assert names == [
        "model.sparse_arch.embedding_bag_collection._feature_processors.position_weights.cat_0",
        "model.sparse_arch.embedding_bag_collection._feature_processors.position_weights.cat_3",
    ]
    assert weights[0] == weights[1]  # replicated: DDP keeps them equal
    for values in weights[0].values():
        assert len(values) == 3 and values != [1.0, 1.0, 1.0]  # trained from their start at 1


def test_unknown_feature_is_refused() -> None:
    from examples.dlrm.model import build_dlrm
    from recshard import EmbeddingBagConfig

    tables = [EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["a"])]
    with pytest.raises(ValueError, match=r"\['b'\] are not sparse features"):
        build_dlrm(tables, 13, [8, 4], [8, 1], position_weighted={"b": 2})
