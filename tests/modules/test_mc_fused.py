"""FusedRemap (recshard.modules.mc_fused): the one index over several modules maps every id as
each module's own index does, salted-id collisions between tables included."""

from __future__ import annotations

import torch

from recshard.modules.mc_fused import FusedRemap, table_salts
from recshard.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
from recshard.sparse import JaggedTensor


def _filled(zch: int, buckets: int, ids: torch.Tensor) -> MCHManagedCollisionModule:
    module = MCHManagedCollisionModule(zch, "cpu", LFU_EvictionPolicy(), 1, 2**62, buckets=buckets)
    module({"f": JaggedTensor(ids, lengths=torch.tensor([ids.numel()]))})
    module.evict()
    return module


def test_fused_remap_matches_each_module() -> None:
    gen = torch.Generator().manual_seed(3)
    salt = table_salts(3, torch.device("cpu")).tolist()
    first = torch.randint(0, 2**40, (3000,), generator=gen)
    # table 1 holds ids whose salted ids equal table 0's: only the table tag tells them apart
    clash = first[:500] ^ salt[0] ^ salt[1]
    modules = [
        _filled(2000, 1, first),
        _filled(1500, 3, torch.cat([clash, torch.randint(0, 2**40, (1000,), generator=gen)])),
        _filled(7, 2, torch.arange(20)),  # tiny: most queries miss
    ]
    assert bool(torch.isin(clash, modules[1]._mch_raw_ids).any())
    fused = FusedRemap(modules, torch.device("cpu"))
    queries = [
        torch.cat([first[:2500], torch.randint(0, 2**40, (500,), generator=gen)]),
        torch.cat([clash, first[:300]]),
        torch.arange(40),
    ]
    tables = torch.cat([torch.full((q.numel(),), t) for t, q in enumerate(queries)])
    before = [m.metrics(reset=True) for m in modules]
    rows = fused.remap(torch.cat(queries), tables)
    found = [m.metrics(reset=True) for m in modules]
    want = [m.remap_ids(q) - m.row_range()[0] for m, q in zip(modules, queries)]
    assert torch.equal(rows, torch.cat(want))
    again = [m.metrics(reset=True) for m in modules]
    assert [(f["lookups"], f["hits"]) for f in found] == [
        (a["lookups"], a["hits"]) for a in again
    ], before
