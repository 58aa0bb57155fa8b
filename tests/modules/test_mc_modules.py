"""Managed collision (recshard.modules.mc_modules / mc_embedding_modules), unsharded: against a
pure-Python reference of each policy, and the properties users rely on."""

from __future__ import annotations

from typing import List

import pytest
import torch

from recshard.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from recshard.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from recshard.modules.mc_modules import (
    FREE,
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
    average_threshold_filter,
)
from recshard.sparse import JaggedTensor, KeyedJaggedTensor
from tests.modules.mc_reference import ReferenceZCH

POLICIES = {
    "lfu": lambda: LFU_EvictionPolicy(),
    "lru": lambda: LRU_EvictionPolicy(decay_exponent=1.0),
    "dlfu": lambda: DistanceLFU_EvictionPolicy(decay_exponent=1.5),
}


def _zipf_ids(gen: torch.Generator, n: int, universe: int) -> List[int]:
    ranks = torch.randint(1, universe + 1, (n,), generator=gen).double()
    skewed = (universe / ranks).floor().long() % universe  # heavy head, long tail
    return (skewed * 7919 % 100_003).tolist()


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("zch_size,buckets,interval", [(13, 1, 1), (17, 3, 2), (10, 4, 3)])
def test_module_matches_the_python_reference(
    policy: str, zch_size: int, buckets: int, interval: int
) -> None:
    decay = 1.5 if policy == "dlfu" else 1.0
    ref = ReferenceZCH(zch_size, buckets, interval, policy, decay)
    mc = MCHManagedCollisionModule(
        zch_size, "cpu", POLICIES[policy](), interval, input_hash_size=100_003, buckets=buckets
    )
    gen = torch.Generator().manual_seed(zch_size * 31 + buckets)
    evicted_any = False
    for step in range(30):
        ids = _zipf_ids(gen, 24, 60)
        training = step % 7 != 6
        mc.train(training)
        out = mc({"f": JaggedTensor(torch.tensor(ids), lengths=torch.tensor([len(ids)]))})
        assert out["f"].values().tolist() == ref.step(ids, training), f"step {step}"
        evicted = mc.evict()
        assert sorted(set(ref.evicted)) == (evicted.tolist() if evicted is not None else [])
        evicted_any |= bool(ref.evicted)
        ref.evicted = []
        assert mc._mch_raw_ids.tolist() == [FREE if i is None else i for i in ref.ids]
    assert evicted_any


def test_an_id_keeps_its_row_while_it_stays_and_no_row_has_two_ids() -> None:
    mc = MCHManagedCollisionModule(50, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=10**6)
    gen = torch.Generator().manual_seed(0)
    rows_of: dict = {}
    for _ in range(40):
        ids = torch.randint(0, 200, (64,), generator=gen)
        rows = mc({"f": JaggedTensor(ids, lengths=torch.tensor([64]))})["f"].values()
        mc.evict()
        held = mc._mch_raw_ids[mc._mch_raw_ids != FREE]
        assert held.numel() == held.unique().numel()  # one row per id, one id per row
        for raw, row in list(rows_of.items()):
            if int(mc._mch_raw_ids[row]) != raw:
                del rows_of[raw]  # evicted: its row went to another id
        for raw, row in zip(ids.tolist(), rows.tolist()):
            if row != 49:  # not the reserved default row
                assert rows_of.setdefault(raw, row) == row, (raw, rows_of[raw], row)
                assert int(mc._mch_raw_ids[row]) == raw


def test_lfu_keeps_frequent_ids() -> None:
    mc = MCHManagedCollisionModule(11, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=10**6)
    hot = list(range(1000, 1005))
    for step in range(20):
        cold = [10_000 + step * 10 + k for k in range(8)]
        mc({"f": JaggedTensor(torch.tensor(hot * 3 + cold), lengths=torch.tensor([23]))})
    rows = mc.remap({"f": JaggedTensor(torch.tensor(hot), lengths=torch.tensor([5]))})
    assert 10 not in rows["f"].values().tolist()  # no hot id fell to the default row
    assert set(mc._mch_raw_ids.tolist()) >= set(hot)


def test_eval_mode_neither_counts_nor_evicts() -> None:
    mc = MCHManagedCollisionModule(8, "cpu", LRU_EvictionPolicy(), 1, input_hash_size=100).eval()
    out = mc({"f": JaggedTensor(torch.tensor([1, 2, 3]), lengths=torch.tensor([3]))})
    assert out["f"].values().tolist() == [7, 7, 7]
    assert mc.evict() is None and int(mc._current_iter_tensor) == 0


def test_threshold_filter_keeps_rare_ids_out() -> None:
    policy = LFU_EvictionPolicy(threshold_filtering_func=average_threshold_filter)
    mc = MCHManagedCollisionModule(8, "cpu", policy, 1, input_hash_size=100)
    ids = torch.tensor([5, 5, 5, 5, 6, 7, 8])
    out = mc({"f": JaggedTensor(ids, lengths=torch.tensor([7]))})["f"].values().tolist()
    assert out[0] != 7 and out[4:] == [7, 7, 7]


def _mc_ebc(zch: int, buckets: int, interval: int, return_remapped: bool = False):
    tables = [
        EmbeddingBagConfig(
            zch, 4, name="t0", feature_names=["a", "b"], init_fn=lambda w: w.fill_(0.5)
        ),
        EmbeddingBagConfig(
            zch + 3, 4, name="t1", feature_names=["c"], init_fn=lambda w: w.fill_(-1.0)
        ),
    ]
    ebc = EmbeddingBagCollection(tables)
    mcc = ManagedCollisionCollection(
        {
            t.name: MCHManagedCollisionModule(
                t.num_embeddings,
                "cpu",
                LFU_EvictionPolicy(),
                interval,
                1000,
                buckets=buckets,
                name=t.name,
            )
            for t in tables
        },
        tables,
    )
    return ManagedCollisionEmbeddingBagCollection(
        ebc, mcc, return_remapped_features=return_remapped
    )


def _kjt(values: List[int], lengths: List[int], keys=("a", "b", "c")) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        list(keys), torch.tensor(values), torch.tensor(lengths)
    )


def test_eviction_resets_the_rows_given_to_new_ids() -> None:
    model = _mc_ebc(6, 1, 1, return_remapped=True)
    weight = model._embedding_bag_collection.embedding_bags["t0"].weight
    with torch.no_grad():
        weight.uniform_(2.0, 3.0)
    _, remapped = model(_kjt([11, 12, 11, 40], [1, 1, 1, 0, 1, 0]))
    rows = remapped["a"].values().tolist() + remapped["b"].values().tolist()
    assert rows[0] == rows[2] and rows[0] != rows[1] and 5 not in rows
    assert torch.all(weight[rows] == 0.5)  # the table's init_fn, not the old weights
    untouched = [r for r in range(5) if r not in rows]
    assert torch.all(weight[untouched] >= 2.0)


def test_return_remapped_features_and_keys() -> None:
    model = _mc_ebc(6, 2, 1, return_remapped=True)
    out, remapped = model(_kjt([3, 4, 5, 6, 7], [2, 0, 1, 1, 1, 0], keys=("c", "a", "b")))
    assert remapped.keys() == ["a", "b", "c"] and out.keys() == ["a", "b", "c"]
    assert _mc_ebc(6, 2, 1)(_kjt([1], [1, 0, 0, 0, 0, 0]))[1] is None


def test_mc_ec_returns_rows_per_id() -> None:
    tables = [EmbeddingConfig(9, 3, name="t", feature_names=["f"])]
    mcc = ManagedCollisionCollection(
        {"t": MCHManagedCollisionModule(9, "cpu", DistanceLFU_EvictionPolicy(), 2, 100)}, tables
    )
    model = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables), mcc, True)
    out, remapped = model(_kjt([1, 2, 3], [2, 1], keys=("f",)))
    assert out["f"].values().shape == (3, 3) and remapped["f"].values().tolist() == [8, 8, 8]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MCHManagedCollisionModule(0, "cpu", LFU_EvictionPolicy(), 1), "zch_size"),
        (
            lambda: MCHManagedCollisionModule(4, "cpu", LFU_EvictionPolicy(), 1, buckets=5),
            "buckets",
        ),
        (lambda: MCHManagedCollisionModule(4, "cpu", LFU_EvictionPolicy(), 0), "eviction_interval"),
        (
            lambda: ManagedCollisionCollection(
                {"t": MCHManagedCollisionModule(12, "cpu", LFU_EvictionPolicy(), 1)},
                [EmbeddingBagConfig(10, 4, name="t")],
            ),
            "table 't' has 10 rows but its managed collision module maps to 12",
        ),
        (lambda: LRU_EvictionPolicy(float("nan")), "LRU_EvictionPolicy: decay_exponent"),
        (lambda: DistanceLFU_EvictionPolicy(float("nan")), "DistanceLFU_EvictionPolicy: decay"),
    ],
)
def test_bad_configuration_is_rejected(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("bad", [-3, 1000, 5000])
def test_ids_outside_input_hash_size_are_rejected(bad: int) -> None:
    model = _mc_ebc(6, 1, 1)
    with pytest.raises(
        ValueError, match=f"feature 'b'.*id {bad} is outside .0, input_hash_size=1000"
    ):
        model(_kjt([1, bad, 2], [1, 0, 1, 0, 1, 0]))


def test_input_hash_func_is_applied_and_checked() -> None:
    mc = MCHManagedCollisionModule(
        8, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=16, input_hash_func=lambda v, n: v % n
    )
    out = mc({"f": JaggedTensor(torch.tensor([3, 19]), lengths=torch.tensor([2]))})["f"].values()
    assert out[0] == out[1] != 7
    broken = MCHManagedCollisionModule(
        8, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=16, input_hash_func=lambda v, n: v
    )
    with pytest.raises(ValueError, match="id 19 \\(after input_hash_func\\)"):
        broken({"f": JaggedTensor(torch.tensor([3, 19]), lengths=torch.tensor([2]))})


def test_state_dict_round_trip_keeps_rows_and_rejects_foreign_state() -> None:
    a = MCHManagedCollisionModule(12, "cpu", DistanceLFU_EvictionPolicy(), 1, 1000, buckets=3)
    a({"f": JaggedTensor(torch.arange(30) * 7 % 997, lengths=torch.tensor([30]))})
    b = MCHManagedCollisionModule(12, "cpu", DistanceLFU_EvictionPolicy(), 1, 1000, buckets=3)
    b.load_state_dict(a.state_dict())
    probe = {"f": JaggedTensor(torch.arange(40) * 7 % 997, lengths=torch.tensor([40]))}
    assert torch.equal(a.eval().remap(probe)["f"].values(), b.eval().remap(probe)["f"].values())
    assert set(a.state_dict()) == {
        "_mch_raw_ids",
        "_mch_counts",
        "_mch_last_access_iter",
        "_current_iter_tensor",
        "_history_accumulator",
        "_history_last_access_iter",
    }
    other = MCHManagedCollisionModule(12, "cpu", DistanceLFU_EvictionPolicy(), 1, 1000, buckets=4)
    with pytest.raises(ValueError, match="outside the rows of their bucket"):
        other.load_state_dict(a.state_dict())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_state_dict_taken_between_evictions_resumes_exactly(policy: str) -> None:
    """The ids counted since the last eviction are state: a copy made between evictions (and
    a bucket slice of it) evicts as the original does."""

    def make() -> MCHManagedCollisionModule:
        return MCHManagedCollisionModule(9, "cpu", POLICIES[policy](), 4, 10**6, buckets=3)

    def batch(step: int) -> dict:
        ids = torch.tensor(_zipf_ids(torch.Generator().manual_seed(step), 20, 40))
        return {"f": JaggedTensor(ids, lengths=torch.tensor([20]))}

    straight, copy = make(), make()
    for step in range(6):  # evicts at 4; 5 and 6 pending
        straight(batch(step))
    assert straight._history_accumulator.numel() == 40
    copy.load_state_dict(straight.state_dict())
    part = copy.rebuild_with_bucket_range(1, 2)
    assert bool((part._history_accumulator % 3 == 1).all())
    for step in range(6, 12):
        want = straight(batch(step))["f"].values()
        assert torch.equal(copy(batch(step))["f"].values(), want), step
        mine = batch(step)["f"].values()
        mine = mine[mine % 3 == 1]
        part_rows = part({"f": JaggedTensor(mine, lengths=torch.tensor([mine.numel()]))})
        assert torch.equal(part_rows["f"].values(), want[batch(step)["f"].values() % 3 == 1])
    assert torch.equal(copy._mch_raw_ids, straight._mch_raw_ids)
    assert not torch.equal(make()._mch_raw_ids, straight._mch_raw_ids)


def test_a_bucket_slice_maps_like_the_whole() -> None:
    whole = MCHManagedCollisionModule(11, "cpu", LFU_EvictionPolicy(), 1, 1000, buckets=3)
    ids = torch.arange(60) * 13 % 1000
    whole({"f": JaggedTensor(ids, lengths=torch.tensor([60]))})
    part = whole.rebuild_with_bucket_range(1, 3)
    assert part.row_range() == (4, 11)
    mine = ids[ids % 3 != 0]
    probe = {"f": JaggedTensor(mine, lengths=torch.tensor([mine.numel()]))}
    assert torch.equal(whole.remap(probe)["f"].values(), part.remap(probe)["f"].values())


def test_metrics_count_lookups_hits_admissions_and_evictions() -> None:
    mc = MCHManagedCollisionModule(4, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=100)

    def step(ids: List[int]) -> dict:
        mc({"f": JaggedTensor(torch.tensor(ids), lengths=torch.tensor([len(ids)]))})
        return mc.metrics()

    first = step([1, 1, 2, 3])  # 3 slots: 1, 2, 3 admitted into free rows, then remapped
    assert first == {
        "lookups": 4,
        "hits": 4,
        "hit_rate": 1.0,
        "admitted": 3,
        "evicted": 0,
        "rows_in_use": 3,
        "open_slots": 0,
    }
    second = step([5, 5, 5, 7])  # 5 (count 3) beats 2 or 3 (count 1); 7 (count 1) ties: kept out
    assert (second["admitted"], second["evicted"], second["hits"], second["lookups"]) == (
        1,
        1,
        3,
        4,
    )
