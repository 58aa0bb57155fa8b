"""The reset of rows given to new ids (`recshard.distributed.mc_reset`): the default init's
numbers are the same from C++ and from torch ops, bit for bit; a column shard's are its columns
of the whole rows'; `torch.manual_seed` fixes them; they lie in the table's init range; a table
with its own init_fn gets it; other rows and the optimizer state's other rows stay."""

from __future__ import annotations

import pytest
import torch

from recshard.distributed import mc_native
from recshard.distributed.mc_reset import draw_uniform, reset_evicted
from recshard.lookup.tables import LocalTable
from recshard.modules import EmbeddingBagConfig, PoolingType
from recshard.types import EmbeddingComputeKernel

CPU = torch.device("cpu")


def _config(dim: int, init_fn=None) -> EmbeddingBagConfig:  # noqa: ANN001
    return EmbeddingBagConfig(1000, dim, name="t", feature_names=["f"], init_fn=init_fn)


@pytest.mark.skipif(not mc_native.available(), reason="recshard.distributed._mc_index is not built")
@pytest.mark.parametrize("seed", [0, 1, 2**62 - 1, 123_456_789_012])
@pytest.mark.parametrize(
    "rows, dim, col_offset, cols", [(0, 8, 0, 8), (37, 64, 0, 64), (5, 12, 4, 5)]
)
def test_cpp_and_torch_draw_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch, seed: int, rows: int, dim: int, col_offset: int, cols: int
) -> None:
    config = _config(dim)
    native = draw_uniform(seed, rows, config, col_offset, cols, CPU)
    monkeypatch.setenv(mc_native.ENV, "0")
    torch_ops = draw_uniform(seed, rows, config, col_offset, cols, CPU)
    assert native.dtype == torch_ops.dtype == torch.float32
    assert native.shape == (rows, cols)
    assert torch.equal(native, torch_ops)


def test_a_column_shard_draws_its_columns_of_the_whole_rows() -> None:
    config = _config(16)
    whole = draw_uniform(7, 9, config, 0, 16, CPU)
    assert torch.equal(draw_uniform(7, 9, config, 5, 6, CPU), whole[:, 5:11])
    assert not torch.equal(draw_uniform(8, 9, config, 0, 16, CPU), whole)


def test_numbers_lie_in_the_init_range_and_look_uniform() -> None:
    config = _config(64)
    numbers = draw_uniform(3, 4000, config, 0, 64, CPU)
    assert config.weight_init_min is not None and config.weight_init_max is not None
    assert float(numbers.min()) >= config.weight_init_min
    assert float(numbers.max()) < config.weight_init_max
    fraction = (numbers - config.weight_init_min) / (
        config.weight_init_max - config.weight_init_min
    )
    counts = torch.histc(fraction, bins=10, min=0.0, max=1.0)
    assert float((counts / numbers.numel() - 0.1).abs().max()) < 0.01  # 256,000 numbers
    assert abs(float(numbers.mean()) - (config.weight_init_min + config.weight_init_max) / 2) < 1e-3


def _shard(config: EmbeddingBagConfig, col_offset: int, cols: int) -> LocalTable:
    return LocalTable(
        config, 20, cols, 0, col_offset, EmbeddingComputeKernel.FUSED, PoolingType.SUM
    )


def test_reset_redraws_the_rows_zeroes_their_state_and_is_seeded() -> None:
    config = _config(8)
    rows = torch.tensor([2, 3, 11])
    results = []
    for _ in range(2):
        torch.manual_seed(5)
        weights = [torch.full((20, 4), 9.0), torch.full((20, 4), 9.0)]
        state = torch.ones(20)
        shards = {"t": [(_shard(config, 0, 4), weights[0]), (_shard(config, 4, 4), weights[1])]}
        states = {"t": [(_shard(config, 0, 4), {"momentum": state})]}
        reset_evicted({"t": rows, "u": None}, shards, states, {"t": config}, True)
        results.append(torch.cat(weights, 1))
        kept = torch.ones(20, dtype=torch.bool)
        kept[rows] = False
        assert torch.equal(state[rows], torch.zeros(3)) and bool((state[kept] == 1).all())
        assert bool((results[-1][kept] == 9.0).all())
        assert bool((results[-1][rows].abs() <= config.weight_init_max).all())
    assert torch.equal(results[0], results[1])  # torch.manual_seed fixes the numbers
    # the two column shards hold the columns of one draw of whole rows
    assert torch.equal(results[0][rows], _whole_rows_drawn_like_reset(config, 3))


def _whole_rows_drawn_like_reset(config: EmbeddingBagConfig, rows: int) -> torch.Tensor:
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64))
    return draw_uniform(seed, rows, config, 0, config.embedding_dim, CPU)


def test_a_table_with_its_own_init_fn_gets_it() -> None:
    config = _config(4, init_fn=lambda w: w.fill_(0.25))
    weight = torch.zeros(20, 4)
    shards = {"t": [(_shard(config, 0, 4), weight)]}
    reset_evicted({"t": torch.tensor([1, 7])}, shards, {}, {"t": config}, True)
    assert torch.equal(weight[[1, 7]], torch.full((2, 4), 0.25))
    assert int((weight != 0).sum()) == 8
