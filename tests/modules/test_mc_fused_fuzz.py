"""Property tests of managed collision's fused remap (`recshard.modules.mc_fused.FusedRemap`,
over `recshard.modules.mc_bucket_index.BucketIndex`) against plain dicts, across inserts and
evictions: drawn tables (sizes, buckets, eviction intervals and policies), drawn batches of
ids (repeats, ids of several tables whose salted values meet, ids at the ends of int64), each
step checked against the pure-Python reference (`tests/modules/mc_reference.py`). After every
step: each id's row is the reference's, and no row is held by two ids."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recshard.modules.mc_bucket_index import SLOTS, BucketIndex
from recshard.modules.mc_fused import FusedRemap, table_salts
from recshard.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHManagedCollisionModule,
)
from recshard.sparse import JaggedTensor
from tests.modules.mc_reference import ReferenceZCH

FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
POLICIES = {
    "lfu": (LFU_EvictionPolicy, 1.0),
    "lru": (lambda: LRU_EvictionPolicy(decay_exponent=1.0), 1.0),
    "dlfu": (lambda: DistanceLFU_EvictionPolicy(decay_exponent=1.5), 1.5),
}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@st.composite
def bucket_entries(draw: st.DrawFn) -> Dict[Tuple[int, int], int]:
    """(key, tag) -> row: keys from a small pool (repeats across tags), the ends of int64, and
    keys crowding one bucket past its SLOTS."""
    crowd = _keys_of_one_bucket(3 * SLOTS)
    pool = st.one_of(
        st.integers(-5, 5),
        st.sampled_from([INT64_MIN, INT64_MAX, INT64_MIN + 1, 0]),
        st.sampled_from(crowd),
        st.integers(INT64_MIN, INT64_MAX),
    )
    pairs = draw(st.lists(st.tuples(pool, st.integers(0, 3)), max_size=60, unique=True))
    rows = draw(st.permutations(range(len(pairs))))
    return {pair: row * 5 + 2 for pair, row in zip(pairs, rows)}


def _keys_of_one_bucket(count: int) -> List[int]:
    """Keys whose mixed values share their top 32 bits: one bucket at any index size."""
    inverse = pow(0x9E3779B97F4A7C15, -1, 2**64)
    mixed = [((0x0BAD << 32) | j) * inverse % 2**64 for j in range(count)]
    return [m - 2**64 if m >= 2**63 else m for m in mixed]


def _index(entries: Dict[Tuple[int, int], int]) -> BucketIndex:
    keys = torch.tensor([k for k, _ in entries], dtype=torch.int64)
    tags = torch.tensor([t for _, t in entries], dtype=torch.int64)
    rows = torch.tensor(list(entries.values()), dtype=torch.int64)
    return BucketIndex(keys, tags, rows)


def _check_index(index: BucketIndex, entries: Dict[Tuple[int, int], int], extra: list) -> None:
    queries = list(entries) + extra
    keys = torch.tensor([k for k, _ in queries], dtype=torch.int64)
    tags = torch.tensor([t for _, t in queries], dtype=torch.int64)
    found, rows = index.find(keys, tags)
    for (key, tag), hit, row in zip(queries, found.tolist(), rows.tolist()):
        assert hit == ((key, tag) in entries), (key, tag)
        if hit:
            assert row == entries[(key, tag)], (key, tag)


@FUZZ
@given(
    entries=bucket_entries(),
    changes=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=6),
    misses=st.lists(st.tuples(st.integers(INT64_MIN, INT64_MAX), st.integers(0, 4)), max_size=8),
)
def test_bucket_index_finds_what_a_dict_holds_across_inserts_and_evictions(
    entries: Dict[Tuple[int, int], int], changes: list, misses: list
) -> None:
    """Rebuilt after each change (an entry evicted, or a new (key, tag) inserted with a row
    another entry gave up): every query finds exactly the dict's row, misses find nothing."""
    entries = dict(entries)
    _check_index(_index(entries), entries, misses)
    for evict, seed in changes:
        if evict and entries:
            victim = sorted(entries)[seed % len(entries)]
            row = entries.pop(victim)
            new = (victim[0] ^ (seed | 1), victim[1])
            if new not in entries:  # the evicted entry's row goes to a new id
                entries[new] = row
            misses = misses + [victim]
        else:
            entries[(seed - 500_000, seed % 4)] = -seed - 1
        _check_index(_index(entries), entries, misses)


@st.composite
def tables_and_steps(draw: st.DrawFn) -> tuple:
    count = draw(st.integers(1, 3))
    specs = []
    for _ in range(count):
        buckets = draw(st.integers(1, 3))
        zch = draw(st.integers(buckets, 12))
        specs.append(
            (zch, buckets, draw(st.integers(1, 3)), draw(st.sampled_from(sorted(POLICIES))))
        )
    steps = draw(
        st.lists(
            st.tuples(
                st.booleans(),  # training
                st.lists(st.lists(st.integers(0, 12), max_size=10), min_size=count, max_size=count),
            ),
            min_size=1,
            max_size=8,
        )
    )
    return specs, steps


@FUZZ
@given(scenario=tables_and_steps())
def test_fused_remap_equals_the_reference_and_no_row_has_two_ids(scenario: tuple) -> None:
    """Each step: every table's module remaps its batch as the reference does (training steps
    count ids and evict at the interval; some ids share their salted value with another
    table's id); then the fused remap, over all tables at once,
    gives every id 0..30 of every table (and ids whose salted value equals another
    table's) the reference's row, and the ids holding rows hold distinct rows."""
    specs, steps = scenario
    salts = table_salts(len(specs), torch.device("cpu")).tolist()
    modules, references = [], []
    for zch, buckets, interval, policy in specs:
        make, decay = POLICIES[policy]
        modules.append(
            MCHManagedCollisionModule(zch, "cpu", make(), interval, 2**63 - 1, buckets=buckets)
        )
        references.append(ReferenceZCH(zch, buckets, interval, policy, decay))
    fused = FusedRemap(modules, torch.device("cpu"))

    def id_of(table: int, drawn: int) -> int:
        """Drawn 0..6: that id; 7..12: the id whose salted value is the next table's id
        drawn - 7's (the two share a key in the index; only the table tag separates them)."""
        if drawn <= 6:
            return drawn
        other = (table + 1) % len(specs)
        return (drawn - 7) ^ salts[other] ^ salts[table]

    for training, drawn in steps:
        batches = [[id_of(t, d) for d in ids] for t, ids in enumerate(drawn)]
        for module, reference, ids in zip(modules, references, batches):
            module.train(training)
            jt = JaggedTensor(
                torch.tensor(ids, dtype=torch.int64), lengths=torch.tensor([len(ids)])
            )
            assert module({"f": jt})["f"].values().tolist() == reference.step(ids, training)
            module.evict()
        queries, tables, want = [], [], []
        for t, reference in enumerate(references):
            # ids 0..30, and ids whose salted value is another table's id 0..30's
            ids = list(range(31)) + [
                i ^ salts[o] ^ salts[t] for o in range(len(specs)) for i in range(31) if o != t
            ]
            queries += ids
            tables += [t] * len(ids)
            want += [reference.row_of(i) for i in ids]
        rows = fused.remap(torch.tensor(queries), torch.tensor(tables))
        assert rows.tolist() == want
        for t, reference in enumerate(references):
            held = [i for i in reference.ids if i is not None]
            assert len(set(held)) == len(held), f"table {t}: an id holds two rows"
            got = fused.remap(torch.tensor(held, dtype=torch.int64), torch.full((len(held),), t))
            assert got.tolist() == [reference.ids.index(i) for i in held]
            assert len(set(got.tolist())) == len(held), f"table {t}: a row held by two ids"
