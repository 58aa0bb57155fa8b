"""A whole LFU eviction in one C++ call (`NativeIdIndex.evict_lfu`, taken by
`MCHManagedCollisionModule` after `use_kernels` when its policy is LFU without a threshold
filter) against the module's torch path: after every step of many, with small buckets (ties,
free rows, more new ids than rows), a slice of the buckets and hits, the same ids hold the same
rows with the same counts, the same rows are handed to the embedding module, the same counters;
and the buffers it refuses."""

from __future__ import annotations

from typing import Tuple

import pytest
import torch

from recshard.distributed import mc_library, mc_native
from recshard.modules.mc_eviction import DistanceLFU_EvictionPolicy, average_threshold_filter
from recshard.modules.mc_index import LfuEviction
from recshard.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from recshard.sparse import JaggedTensor
from tests.distributed.mc_cases import bucket_universe, skewed_ids

pytestmark = pytest.mark.skipif(
    not mc_library.available(), reason="recshard.distributed._mc_index is not built"
)


def _module(
    zch: int, buckets: int, bucket_range: Tuple[int, int] | None, interval: int, native: bool
) -> MCHManagedCollisionModule:
    module = MCHManagedCollisionModule(
        zch,
        "cpu",
        LFU_EvictionPolicy(),
        interval,
        2**40,
        buckets=buckets,
        bucket_range=bucket_range,
    )
    if native:
        module.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
        assert module._lfu_index is not None  # the one-call eviction is the path under test
    return module


def _agree_on_a_step(
    native: MCHManagedCollisionModule,
    reference: MCHManagedCollisionModule,
    ids: torch.Tensor,
    step: int,
) -> None:
    """`ids` through both modules, then an eviction: the same rows, ids, counts, evictions."""
    features = {"f": JaggedTensor(ids, lengths=torch.tensor([ids.numel()]))}
    got, want = native(features)["f"].values(), reference(features)["f"].values()
    assert torch.equal(got, want), f"step {step}: remapped rows differ"
    assert torch.equal(native._mch_raw_ids, reference._mch_raw_ids), f"step {step}: ids"
    assert torch.equal(native._mch_counts, reference._mch_counts), f"step {step}: counts"
    evicted, want_evicted = native.evict(), reference.evict()
    assert (evicted is None) == (want_evicted is None), f"step {step}: evicted rows"
    if evicted is not None:
        assert evicted.tolist() == want_evicted.tolist(), f"step {step}: evicted rows"


@pytest.mark.parametrize(
    "zch, buckets, bucket_range, interval",
    [(40, 1, None, 1), (60, 4, None, 3), (90, 6, (2, 5), 2), (8, 8, None, 1), (2000, 3, None, 2)],
)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("spread", [False, True])
def test_one_call_lfu_eviction_matches_the_torch_path(
    zch: int,
    buckets: int,
    bucket_range: Tuple[int, int] | None,
    interval: int,
    seed: int,
    spread: bool,
) -> None:
    """`spread`: ids scattered over [0, 2**40) (each of their low five bytes differs: a fill's radix
    sort of the new ids runs all its passes), else small consecutive ids."""
    gen = torch.Generator().manual_seed(seed)
    native = _module(zch, buckets, bucket_range, interval, True)
    reference = _module(zch, buckets, bucket_range, interval, False)
    universe = bucket_universe(native, spread)
    for step in range(12):
        # skewed draws from a small universe: repeats, hits, ties among counts
        n = int(torch.randint(0, 3 * zch, (1,), generator=gen))
        ids = skewed_ids(gen, universe, max(n, 1), 0.5 + 0.1 * seed)[:n]
        _agree_on_a_step(native, reference, ids, step)
        assert native.metrics(reset=False) == reference.metrics(reset=False), f"step {step}"
        assert native.history_length() == reference.history_length()
    # the index still answers every id as the rows say
    native.validate_state()
    again = native({"f": JaggedTensor(universe, lengths=torch.tensor([universe.numel()]))})
    assert torch.equal(
        again["f"].values(),
        reference({"f": JaggedTensor(universe, lengths=torch.tensor([universe.numel()]))})[
            "f"
        ].values(),
    )


@pytest.mark.parametrize(
    "policy",
    [
        LFU_EvictionPolicy(threshold_filtering_func=average_threshold_filter),
        DistanceLFU_EvictionPolicy(),
    ],
)
def test_other_policies_keep_the_torch_eviction(policy: object) -> None:
    module = MCHManagedCollisionModule(10, "cpu", policy, 1, 2**40)  # type: ignore[arg-type]
    module.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
    assert module._lfu_index is None


def test_one_call_eviction_refuses_what_would_break_it() -> None:
    index = mc_native.NativeIdIndex()
    raw_ids = torch.full((6,), 2**63 - 1, dtype=torch.int64)
    index.rebuild(raw_ids, 0)
    counts = torch.zeros(6, dtype=torch.int64)
    starts = torch.tensor([0, 3, 6])
    ids = torch.tensor([4, 5, 4])
    with pytest.raises(ValueError, match="counts must have 6 elements"):
        index.evict_lfu(LfuEviction(ids, raw_ids, counts[:5], starts, 2, 0, 0))
    with pytest.raises(ValueError, match="ids seen must be a contiguous 1-D torch.int64"):
        index.evict_lfu(LfuEviction(ids.int(), raw_ids, counts, starts, 2, 0, 0))
    with pytest.raises(RuntimeError, match="arguments the library refused"):
        index.evict_lfu(LfuEviction(ids, raw_ids, counts, torch.tensor([0, 3, 5]), 2, 0, 0))
    with pytest.raises(RuntimeError, match="not holding its bucket"):  # id 4: bucket 0
        index.evict_lfu(LfuEviction(ids, raw_ids[:3], counts[:3], starts[:2].clone(), 2, 1, 0))
    rows, evicted = index.evict_lfu(LfuEviction(ids, raw_ids, counts, starts, 2, 0, 0))
    # bucket 0 (rows 0, 1; row 2 reserved): id 4, seen twice, gets the lowest ranked free row,
    # the last; bucket 1: id 5 gets row 4
    free = 2**63 - 1
    assert rows.tolist() == [1, 4] and evicted == 0
    assert raw_ids.tolist() == [free, 4, free, free, 5, free]
    assert counts.tolist() == [0, 2, 0, 0, 1, 0]
    assert len(index) == 2
    assert index.find(torch.tensor([4, 5, 6]))[1].tolist()[:2] == [1, 4]


@pytest.mark.parametrize("hash_size", [2**63 - 1, 2**40])
@pytest.mark.parametrize("buckets", [1, 5, 16])
def test_fills_of_hundreds_of_ids_up_to_int64_max_match_the_torch_path(
    hash_size: int, buckets: int
) -> None:
    """Ids over the whole input range (the top byte set, hash_size - 1, 2**32 +- 1), power-of-two
    bucket counts (the modulo as a mask) and not; fills of hundreds of new ids per bucket (the
    radix sort, uniform counts: every score pass skipped) and skewed draws after (held rows
    contest): the torch path's rows, ids, counts and evictions after every step."""
    gen = torch.Generator().manual_seed(buckets)
    native = MCHManagedCollisionModule(
        2048, "cpu", LFU_EvictionPolicy(), 1, hash_size, buckets=buckets
    )
    native.use_kernels(mc_native.NativeIdIndex(), mc_native.native_contest)
    reference = MCHManagedCollisionModule(
        2048, "cpu", LFU_EvictionPolicy(), 1, hash_size, buckets=buckets
    )
    edges = torch.tensor([hash_size - 1, hash_size - 2, 0, 1, 2**62, 2**32 - 1, 2**32])
    universe = torch.cat([torch.randint(0, hash_size, (3000,), generator=gen), edges])
    universe = universe[universe < hash_size]
    for step, n in enumerate([600, 2500, 3000, 400, 5000]):
        skew = 1.0 / (torch.arange(universe.numel()) + 1.0) if step % 2 else None
        weights = torch.ones(universe.numel()) if skew is None else skew
        ids = universe[torch.multinomial(weights, n, replacement=True, generator=gen)]
        _agree_on_a_step(native, reference, ids, step)
    native.validate_state()


def _crafted_counts(kind: str, gen: torch.Generator, rows: int) -> torch.Tensor:
    """Row counts of one kind (see the test below), hits of a step still far from overflow."""
    small = torch.randint(1, 4, (rows,), generator=gen)
    pick = torch.randint(0, 4, (rows,), generator=gen)
    if kind == "ties":
        return small
    if kind == "negative":
        return small - 4
    if kind == "large":
        large = torch.tensor([2**40, 2**63 - 1 - 10**6])[pick % 2]
        return torch.where(pick == 0, small, large + small)
    wide = torch.randint(-(2**62), 2**62, (rows,), generator=gen)  # "wide"
    return torch.where(pick == 0, wide, small)


@pytest.mark.parametrize("kind", ["ties", "negative", "large", "wide"])
def test_contests_of_large_tied_buckets_and_extreme_counts_match_the_torch_path(
    kind: str,
) -> None:
    """Buckets of a thousand rows whose counts are rewritten before each step after two fills:
    most tied at a few counts (the contest's tallies by score, the byte of the held ids that
    drops most tied rows, new ids tied by the hundred of which a few win), negative, around
    2**40 and INT64_MAX - 10**6 (tallied from a negative lowest score; rows out of reach), and
    spread over +-2**62 (a span of scores the tallies refuse: the comparison path)."""
    gen = torch.Generator().manual_seed(len(kind))
    native = _module(3000, 3, None, 1, True)
    reference = _module(3000, 3, None, 1, False)
    universe = torch.arange(20000) * 2_654_435_761_987 % (2**40)
    weights = 1.0 / (torch.arange(universe.numel()) + 1.0) ** 0.8
    for step in range(8):
        if step >= 2:
            counts = _crafted_counts(kind, gen, native._mch_counts.numel())
            native._mch_counts.copy_(counts)
            reference._mch_counts.copy_(counts)
        ids = universe[torch.multinomial(weights, 2500, replacement=True, generator=gen)]
        _agree_on_a_step(native, reference, ids, step)
    native.validate_state()
