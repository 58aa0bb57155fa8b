"""`parallelize_module(module, pg, plan)`: tensor parallelism applied by submodule name.

As in PyTorch's tensor-parallel API, a plan maps module FQNs (atoms may use `*` wildcards:
"layers.*.w1") to styles; here the styles swap in recshard's own layers and primitives:

    ColwiseParallel   nn.Linear -> ColumnParallelLinear, nn.Embedding -> ParallelEmbedding
    RowwiseParallel   nn.Linear -> RowParallelLinear,    nn.Embedding -> VocabParallelEmbedding
    SequenceParallel  any module with replicated parameters (LayerNorm, RMSNorm, Dropout...)
                      runs on this rank's slice of the sequence

Layouts are plain values: `Replicate()` or `Shard(dim)` (torch.distributed.tensor placements
are accepted too). Shard(-1) means split over features; Shard(d) for another d means split
over the sequence (sequence parallelism: all-gather in, reduce-scatter out).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from torch import nn

from recshard.parallel.dropout import ParallelDropout
from recshard.parallel.embedding import ParallelEmbedding, VocabParallelEmbedding
from recshard.parallel.linear import ColumnParallelLinear, RowParallelLinear
from recshard.parallel.mappings import all_reduce
from recshard.parallel.utils import ProcessGroup, group_size, shard_spec_of


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""


@dataclass(frozen=True)
class Shard:
    """Every rank holds an equal slice along `dim` (-1: features; other: sequence)."""

    dim: int


Layout = Replicate | Shard


def _layout(value: Any, default: Layout, owner: str) -> Layout:
    """Normalize a layout: ours, a torch.distributed.tensor placement, or a 1-tuple of one."""
    if value is None:
        return default
    if isinstance(value, (Replicate, Shard)):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 1:
        return _layout(value[0], default, owner)
    if callable(getattr(value, "is_replicate", None)) and value.is_replicate():
        return Replicate()
    if callable(getattr(value, "is_shard", None)) and value.is_shard():
        return Shard(int(value.dim))
    raise ValueError(f"{owner}: unsupported layout {value!r}; use Replicate() or Shard(dim)")


def _sequence_dim(layout: Layout, owner: str, what: str) -> int | None:
    """None for Replicate, the dim for Shard(d) with d != -1; Shard(-1) is refused."""
    if isinstance(layout, Replicate):
        return None
    if layout.dim == -1:
        raise ValueError(f"{owner}: {what} Shard(-1) is not supported here")
    return layout.dim


class ParallelStyle:
    """How one submodule is parallelized. `build` returns the module to put in its place and
    must not modify the given module (all checks happen before anything is swapped)."""

    def build(self, module: nn.Module, pg: ProcessGroup | None) -> nn.Module:
        raise NotImplementedError


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Split output features. Input: Replicate() (default) or Shard(seq_dim); output:
    Shard(-1) (default, no gather) or Replicate() (gathered)."""

    input_layouts: Any = None
    output_layouts: Any = None

    def build(self, module: nn.Module, pg: ProcessGroup | None) -> nn.Module:
        owner = type(self).__name__
        inp = _layout(self.input_layouts, Replicate(), owner)
        out = _layout(self.output_layouts, Shard(-1), owner)
        if out not in (Shard(-1), Replicate()):
            raise ValueError(f"{owner}: output_layouts must be Shard(-1) or Replicate(), got {out}")
        gather = out == Replicate()
        if type(module) is nn.Linear:
            seq = _sequence_dim(inp, owner, "input_layouts")
            return ColumnParallelLinear.from_linear(
                module, pg, gather_output=gather, sequence_dim=seq
            )
        if type(module) is nn.Embedding:
            if inp != Replicate():
                raise ValueError(f"{owner}: embedding ids must be Replicate(), got {inp}")
            return ParallelEmbedding.from_embedding(module, pg, gather_output=gather)
        raise ValueError(
            f"{owner} applies to nn.Linear or nn.Embedding, not {type(module).__name__}"
        )


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Split input features (Linear) or rows (Embedding). Input: Shard(-1) (Linear default)
    or Replicate() (scattered here; Embedding default); output: Replicate() (default,
    all-reduced) or Shard(seq_dim) (reduce-scattered over the sequence)."""

    input_layouts: Any = None
    output_layouts: Any = None

    def build(self, module: nn.Module, pg: ProcessGroup | None) -> nn.Module:
        owner = type(self).__name__
        seq = _sequence_dim(
            _layout(self.output_layouts, Replicate(), owner), owner, "output_layouts"
        )
        if type(module) is nn.Linear:
            inp = _layout(self.input_layouts, Shard(-1), owner)
            if inp not in (Shard(-1), Replicate()):
                raise ValueError(
                    f"{owner}: Linear input must be Shard(-1) or Replicate(), got {inp}"
                )
            return RowParallelLinear.from_linear(
                module, pg, input_is_parallel=inp == Shard(-1), sequence_dim=seq
            )
        if type(module) is nn.Embedding:
            inp = _layout(self.input_layouts, Replicate(), owner)
            if inp != Replicate():
                raise ValueError(f"{owner}: embedding ids must be Replicate(), got {inp}")
            return VocabParallelEmbedding.from_embedding(module, pg, sequence_dim=seq)
        raise ValueError(
            f"{owner} applies to nn.Linear or nn.Embedding, not {type(module).__name__}"
        )


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Run a module with replicated parameters on this rank's slice of the sequence
    (input and output sharded on `sequence_dim`, no communication forward). Parameter
    gradients are all-reduced (each rank saw part of the sequence); nn.Dropout inside
    becomes a per-rank `ParallelDropout`. Applied in place."""

    sequence_dim: int = 1

    def build(self, module: nn.Module, pg: ProcessGroup | None) -> nn.Module:
        owner = type(self).__name__
        if getattr(module, "_recshard_sequence_parallel", False):
            raise ValueError(f"{owner}: module is already sequence-parallel")
        sharded = [name for name, p in module.named_parameters() if shard_spec_of(p) is not None]
        if sharded:
            raise ValueError(f"{owner}: parameters must be replicated, {sharded} are sharded")
        return module  # the in-place part runs in `finish`, after every check passed

    def finish(self, module: nn.Module, pg: ProcessGroup | None) -> nn.Module:
        if group_size(pg) > 1:
            for param in module.parameters():
                if param.requires_grad:
                    param.register_hook(lambda grad, pg=pg: all_reduce(grad, pg))
        dropouts = {
            id(m): ParallelDropout(m.p, input_is_parallel=True, pg=pg, inplace=m.inplace)
            for m in module.modules()
            if type(m) is nn.Dropout
        }
        module = _swap(module, dropouts)
        module._recshard_sequence_parallel = True  # type: ignore[assignment]
        return module


def _matches(fqn: str, key: str) -> bool:
    names, atoms = fqn.split(".") if fqn else [], key.split(".") if key else []
    return len(names) == len(atoms) and all(fnmatch.fnmatchcase(n, a) for n, a in zip(names, atoms))


def _swap(root: nn.Module, replacements: Dict[int, nn.Module]) -> nn.Module:
    """Put `replacements[id(old)]` wherever `old` is a child; returns the (maybe new) root."""
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in replacements:
                setattr(parent, name, replacements[id(child)])
    return replacements.get(id(root), root)


def parallelize_module(
    module: nn.Module,
    pg: ProcessGroup | None = None,
    plan: ParallelStyle | Dict[str, ParallelStyle] | None = None,
) -> nn.Module:
    """Apply `plan` ({fqn pattern: style}, or one style for `module` itself) over `pg`.

    Submodules are replaced by recshard's parallel layers cut from their current weights, so
    a model keeps its outputs. Every key must match a submodule and no target may contain
    another; all checks run before anything changes. Returns the parallelized module.
    """
    if plan is None:
        raise ValueError("parallelize_module: a plan is required")
    if isinstance(plan, ParallelStyle):
        plan = {"": plan}
    modules = list(module.named_modules())
    targets: List[Tuple[str, nn.Module, ParallelStyle]] = []
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ValueError(f"parallelize_module: plan[{key!r}] is not a ParallelStyle: {style!r}")
        hits = [(fqn, m) for fqn, m in modules if _matches(fqn, key)]
        if not hits:
            raise ValueError(f"parallelize_module: plan key {key!r} matches no submodule")
        targets.extend((fqn, m, style) for fqn, m in hits)
    names = [fqn for fqn, _, _ in targets]
    for fqn in names:
        inner = [
            other for other in names if other != fqn and (not fqn or other.startswith(fqn + "."))
        ]
        if names.count(fqn) > 1 or inner:
            clash = fqn if names.count(fqn) > 1 else inner[0]
            raise ValueError(f"parallelize_module: plan targets overlap at {clash!r} ({fqn!r})")

    replacements: Dict[int, nn.Module] = {}
    for fqn, sub, style in targets:
        try:
            replacements[id(sub)] = style.build(sub, pg)
        except ValueError as err:
            raise ValueError(f"parallelize_module: {fqn or '<root>'!r}: {err}") from err
    for _, sub, style in targets:
        if isinstance(style, SequenceParallel):
            replacements[id(sub)] = style.finish(sub, pg)
    return _swap(module, replacements)
