"""The reset of rows given to new ids (`recshard.distributed.mc_reset.reset_evicted`): the
default init's numbers are the same from C++ and from torch ops, bit for bit (whole rows,
column shards at odd offsets); a column shard's are its columns of the whole rows'; a rank's
shards of one table draw from one seed; `torch.manual_seed` fixes them; they lie in the init
range and look uniform; a table with its own init_fn gets it; other rows and the optimizer
state's other rows stay."""

from __future__ import annotations

from typing import Callable, List, Tuple

import pytest
import torch

from recshard.distributed import mc_library
from recshard.distributed.mc_reset import draw_into, reset_evicted, uniform_draw
from recshard.lookup.tables import LocalTable
from recshard.modules import EmbeddingBagConfig, PoolingType
from recshard.types import EmbeddingComputeKernel


def _config(dim: int, init_fn: Callable[[torch.Tensor], None] | None = None) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(1000, dim, name="t", feature_names=["f"], init_fn=init_fn)


def _shard(config: EmbeddingBagConfig, rows: int, col_offset: int, cols: int) -> LocalTable:
    return LocalTable(
        config, rows, cols, 0, col_offset, EmbeddingComputeKernel.FUSED, PoolingType.SUM
    )


def _reset(
    config: EmbeddingBagConfig, table_rows: int, rows: torch.Tensor, cuts: List[Tuple[int, int]]
) -> torch.Tensor:
    """The table's weights (9.0 everywhere) after a reset of `rows` with `torch.manual_seed(5)`,
    held as column shards `cuts` (`(col_offset, cols)`), put back side by side."""
    torch.manual_seed(5)
    shards = [(_shard(config, table_rows, o, c), torch.full((table_rows, c), 9.0)) for o, c in cuts]
    reset_evicted({"t": rows, "u": None}, {"t": shards}, {}, {"t": config})
    return torch.cat([weight for _, weight in shards], 1)


@pytest.mark.skipif(
    not mc_library.available(), reason="recshard.distributed._mc_index is not built"
)
@pytest.mark.parametrize(
    "dim, cuts", [(8, [(0, 8)]), (64, [(0, 64)]), (12, [(0, 3), (3, 5), (8, 4)]), (7, [(0, 7)])]
)
def test_cpp_and_torch_ops_draw_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch, dim: int, cuts: List[Tuple[int, int]]
) -> None:
    config = _config(dim)
    rows = torch.tensor([40, 3, 17, 0, 99, 41])
    native = _reset(config, 100, rows, cuts)
    monkeypatch.setenv(mc_library.ENV, "0")
    torch_ops = _reset(config, 100, rows, cuts)
    assert torch.equal(native, torch_ops)
    assert bool((native[rows] != 9.0).all())


@pytest.mark.parametrize("native", [True, False])
def test_column_shards_hold_the_columns_of_one_draw_of_whole_rows(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    if not native:
        monkeypatch.setenv(mc_library.ENV, "0")
    config = _config(16)
    rows = torch.tensor([2, 3, 11])
    whole = _reset(config, 20, rows, [(0, 16)])
    assert torch.equal(_reset(config, 20, rows, [(0, 5), (5, 6), (11, 5)]), whole)
    assert torch.equal(_reset(config, 20, rows, [(0, 16)]), whole)  # manual_seed fixes them
    torch.manual_seed(6)
    other = [(_shard(config, 20, 0, 16), torch.full((20, 16), 9.0))]
    reset_evicted({"t": rows}, {"t": other}, {}, {"t": config})
    assert not torch.equal(other[0][1], whole)


def test_numbers_lie_in_the_init_range_and_look_uniform() -> None:
    config = _config(64)
    numbers = _reset(config, 4000, torch.arange(4000), [(0, 64)])
    low, high = config.weight_init_min, config.weight_init_max
    assert low is not None and high is not None
    assert float(numbers.min()) >= low and float(numbers.max()) < high
    counts = torch.histc((numbers - low) / (high - low), bins=10, min=0.0, max=1.0)
    assert float((counts / numbers.numel() - 0.1).abs().max()) < 0.01  # 256,000 numbers
    assert abs(float(numbers.mean()) - (low + high) / 2) < 1e-3


def test_other_rows_and_their_optimizer_state_stay() -> None:
    config = _config(4)
    rows = torch.tensor([1, 7])
    weight, state = torch.full((20, 4), 9.0), torch.ones(20)
    shard = _shard(config, 20, 0, 4)
    reset_evicted({"t": rows}, {"t": [(shard, weight)]}, {"t": [(shard, {"sum": state})]},
                  {"t": config})  # fmt: skip
    kept = torch.ones(20, dtype=torch.bool)
    kept[rows] = False
    assert bool((weight[kept] == 9.0).all()) and bool((weight[rows] != 9.0).all())
    assert bool((state[kept] == 1.0).all()) and bool((state[rows] == 0.0).all())


def test_a_table_with_its_own_init_fn_gets_it() -> None:
    config = _config(4, init_fn=lambda w: w.fill_(0.25))
    weight = torch.zeros(20, 4)
    shards = {"t": [(_shard(config, 20, 0, 4), weight)]}
    reset_evicted({"t": torch.tensor([1, 7])}, shards, {}, {"t": config})
    assert torch.equal(weight[[1, 7]], torch.full((2, 4), 0.25))
    assert int((weight != 0).sum()) == 8


def _random_init(w: torch.Tensor) -> None:
    w.uniform_(-1.0, 1.0)  # draws from torch's generator between the default tables' seeds


@pytest.mark.parametrize("native", [True, False])
def test_many_tables_draw_what_one_table_at_a_time_drew(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """Default-init tables (one with two column shards, one with none here, one with no rows
    to reset) around tables with an init_fn that draws from torch's generator: every table's
    numbers, and the generator after, as a seed drawn per table in table order gives them
    (the reset before its seeds were drawn together and its draws made in one call)."""
    if not native:
        monkeypatch.setenv(mc_library.ENV, "0")
    names = ["a", "b", "c", "d", "e", "f"]
    configs = {
        n: EmbeddingBagConfig(
            30, 6, name=n, feature_names=[n], init_fn=_random_init if n in "ce" else None
        )
        for n in names
    }
    cuts = {"a": [(0, 6)], "b": [(0, 2), (2, 4)], "c": [(0, 6)], "d": [], "e": [(0, 6)]}
    cuts["f"] = [(0, 6)]
    rows = {n: torch.tensor([3, 29, 0, 11 + k]) for k, n in enumerate(names)}
    evictions = {**rows, "f": None}

    def shards() -> dict:
        return {
            n: [(_shard(configs[n], 30, o, c), torch.full((30, c), 9.0)) for o, c in cuts[n]]
            for n in names
        }

    torch.manual_seed(11)
    got = shards()
    reset_evicted(evictions, got, {}, configs)
    after = torch.rand(3)
    torch.manual_seed(11)
    want = shards()
    for n in names:  # one table at a time: a seed per default-init table with shards here
        if evictions[n] is None or not want[n]:
            continue
        if configs[n].init_fn is not None:
            reset_evicted({n: rows[n]}, {n: want[n]}, {}, {n: configs[n]})
            continue
        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu"))
        for local, weight in want[n]:
            draw_into(uniform_draw(seed, configs[n], local.col_offset, weight, rows[n]))
    assert torch.equal(torch.rand(3), after)
    for n in names:
        for (_, mine), (_, theirs) in zip(got[n], want[n]):
            assert torch.equal(mine, theirs), n
    assert bool((got["f"][0][1] == 9.0).all()) and bool((got["a"][0][1][rows["a"]] != 9.0).all())
