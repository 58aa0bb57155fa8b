"""A training step's history record of every CPU MCH module of a collection in one C++ call
(`csrc/mc_record.cpp`): each module's iteration counter goes up by one and the ids it received
this step, read straight from the received KJTs' values, are appended to its history with that
iteration, as each module's `MCHManagedCollisionModule.record` of them would (the same arrays,
entries, order and growth).

Per module, Python only checks the state and makes room before the call (`reserve_record`:
rarely a growth) and advances the history after it (`recorded`); the C++ side checks every
address's room before its first write, so a refused call changes nothing.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Sequence, Tuple

import torch

from recshard.distributed import mc_library
from recshard.distributed.mc_layout import counted_key_tables
from recshard.modules.mc_modules import MCHManagedCollisionModule
from recshard.sparse import KeyedJaggedTensor

# per received layout (the keys of each KJT): the module of each key, -1 for a key seen before
_Layout = Tuple[torch.Tensor, List[int]]


class NativeFusedRecord:
    """`record` of several CPU MCH modules at once (`record`), for a collection whose ids
    arrive as KJTs keyed by feature; `table_of_feature` names each feature's module (its
    position in `modules`)."""

    def __init__(
        self, modules: Sequence[MCHManagedCollisionModule], table_of_feature: Dict[str, int]
    ) -> None:
        self._modules = list(modules)
        self._table_of_feature = dict(table_of_feature)
        self._layouts: Dict[Tuple[Tuple[str, ...], ...], _Layout] = {}
        # the tensors `_addresses` last checked, their addresses, and their arguments
        self._tensors: List[torch.Tensor | None] = []
        self._pointers: List[int] = []
        self._arguments: Tuple[torch.Tensor, List[int]] = (torch.empty(0, device="cpu"), [])

    def _layout(self, keys: Tuple[Tuple[str, ...], ...]) -> _Layout:
        """The module of each key of the received KJTs (in order), -1 for a key seen in an
        earlier one (a column-split table's feature: counted once); cached per layout."""
        layout = self._layouts.get(keys)
        if layout is None:
            tables = counted_key_tables(keys, self._table_of_feature)
            layout = (torch.tensor(tables, dtype=torch.int64, device="cpu"), tables)
            self._layouts[keys] = layout
        return layout

    def _addresses(
        self, arrays: List[Tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]
    ) -> List[int]:
        """`history_arguments` of every module's (history arrays, iteration counter), checked
        again only when one of these tensors or its address changed (a growth, a load,
        a move: rarely). The tensors are held here, so no new one can take an address in use."""
        tensors = [t for trio in arrays for t in trio]
        pointers = [0 if t is None else t.data_ptr() for t in tensors]
        if pointers != self._pointers or not all(map(operator.is_, tensors, self._tensors)):
            self._arguments = history_arguments(arrays)
            self._tensors, self._pointers = tensors, pointers
        return self._arguments[1]

    def record(self, received: List[KeyedJaggedTensor]) -> List[MCHManagedCollisionModule]:
        """Every module's iteration counted, each key's ids `[N]` (its first KJT's) appended to
        its module's history; returns the modules whose iteration evicts, in order."""
        segment_tables, tables_list = self._layout(tuple(tuple(kjt.keys()) for kjt in received))
        lengths_list = [n for kjt in received for n in kjt.length_per_key()]
        if len(received) == 1:
            ids = received[0].values()
        else:
            ids = torch.cat([kjt.values() for kjt in received] or [torch.empty(0, device="cpu")])
        ids = ids.to(torch.int64).contiguous()  # kept alive through the call
        counts = [0] * len(self._modules)
        for table, length in zip(tables_list, lengths_list):
            if table >= 0:
                counts[table] += length
        arrays = [m.reserve_record(count) for m, count in zip(self._modules, counts)]
        arguments = self._addresses(arrays)
        used = [m.history_length() for m in self._modules]
        recorded = record_histories(
            ids,
            segment_tables,
            torch.tensor(lengths_list, dtype=torch.int64, device="cpu"),
            torch.tensor(used, dtype=torch.int64, device="cpu"),
            arguments,
        )
        tables = len(self._modules)
        return [
            module
            for module, iteration, count in zip(self._modules, recorded, recorded[tables:])
            if module.recorded(count, iteration)
        ]


def history_arguments(
    arrays: Sequence[Tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
) -> Tuple[torch.Tensor, List[int]]:
    """`record_histories`' per-module arguments from each module's (history ids `[C]`, its
    iterations `[C]` or None, its iteration counter `[1]`), checked: the `[4, T]` tensor (keep
    it, and these tensors, alive while it is used) and the address of each argument's array."""
    columns = []
    for history_ids, history_seen, iteration in arrays:
        capacity = history_ids.numel()
        columns.append(
            (
                mc_library.vector("history ids", history_ids),
                0 if history_seen is None else mc_library.vector("history", history_seen, capacity),
                capacity,
                mc_library.vector("iteration counter", iteration, 1),
            )
        )
    return mc_library.argument_arrays(columns, 4, torch.int64)


def record_histories(
    ids: torch.Tensor,
    segment_tables: torch.Tensor,
    segment_lengths: torch.Tensor,
    used: torch.Tensor,
    arguments: List[int],
) -> List[int]:
    """One step of T modules in one C++ call (`rs_mc_record`): each module's counter advanced
    and the ids `[N]` (in segments as `NativeFusedRemap.remap` takes them, table -1: skipped)
    appended to its history of `used[t]` entries (`arguments`: `history_arguments`' addresses).
    Returns the new iterations `[T]`, then how many ids each module took `[T]`. The C++ side
    checks every module's room before its first write: a refusal changes nothing."""
    tables = used.numel()
    recorded = torch.empty(2 * tables, dtype=torch.int64, device="cpu")
    ids_at, seen_at, capacity_at, iteration_at = arguments
    code = mc_library.library().rs_mc_record(
        *mc_library.segment_arguments(ids, segment_tables, segment_lengths),
        tables,
        ids_at,
        seen_at,
        mc_library.vector("history lengths", used),
        capacity_at,
        iteration_at,
        recorded.data_ptr(),
    )
    mc_library.check(code, "history record")
    return recorded.tolist()
