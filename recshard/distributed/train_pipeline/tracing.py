"""Find the sharded modules a train pipeline can feed ahead of time, and where their inputs come
from.

The model is traced symbolically with `torch.fx`. Sharded modules are leaves, and so is every
module that holds no sharded module (the dense arch, a DDP-wrapped part, the loss): the trace
never looks inside them. A sharded module can be pipelined when each of its inputs is a chain of
attribute / item reads on the batch (`batch.sparse_features`, `batch["idlist"]`,
`batch.features.get("user")`) or a constant: the pipeline then pulls that input straight out of
a batch and starts its input dist before the model runs on it. An input computed inside the
model (ids remapped, two KJTs merged) can only exist once the forward runs, so that module keeps
its ordinary, synchronous forward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple

from torch import fx, nn

from recshard.types import ShardedModule

Step = Tuple[str, Any]  # ("attr", name) | ("item", key) | ("get", key)


@dataclass(frozen=True)
class ArgInfo:
    """How to pull one input of a sharded module out of the batch.

    `steps` are applied in order to the batch (`[("attr", "sparse_features")]` means
    `batch.sparse_features`); an `ArgInfo` with `is_constant` stands for `constant` itself.
    """

    steps: Tuple[Step, ...] = ()
    constant: Any = None
    is_constant: bool = False

    def fetch(self, batch: Any) -> Any:
        if self.is_constant:
            return self.constant
        value = batch
        for kind, key in self.steps:
            if kind == "attr":
                value = getattr(value, key)
            elif kind == "item":
                value = value[key]
            else:
                value = value.get(key)
        return value

    def __str__(self) -> str:
        if self.is_constant:
            return repr(self.constant)
        text = "batch"
        for kind, key in self.steps:
            text += (
                f".{key}"
                if kind == "attr"
                else f"[{key!r}]"
                if kind == "item"
                else f".get({key!r})"
            )
        return text


@dataclass
class PipelinedModuleSpec:
    """A sharded module the pipeline feeds: its path in the model and where its inputs come from."""

    name: str
    module: ShardedModule
    args: List[ArgInfo]
    kwargs: Dict[str, ArgInfo] = field(default_factory=dict)

    def inputs(self, batch: Any) -> Tuple[List[Any], Dict[str, Any]]:
        return [a.fetch(batch) for a in self.args], {
            k: a.fetch(batch) for k, a in self.kwargs.items()
        }


@dataclass
class TraceResult:
    """Sharded modules that can be pipelined (in call order), and those that cannot, with why."""

    pipelined: List[PipelinedModuleSpec]
    unpipelined: Dict[str, str]


class _NotPipelineable(Exception):
    pass


class _Tracer(fx.Tracer):
    """Treats sharded modules and modules without any sharded module inside as leaves."""

    def __init__(self, leaf_modules: Set[int]) -> None:
        super().__init__()
        self._leaf_modules = leaf_modules
        self.proxy_buffer_attributes = False

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._leaf_modules


def sharded_modules(model: nn.Module) -> Dict[str, ShardedModule]:
    """Every sharded module of `model` by path (the outermost one where they nest)."""
    found: Dict[str, ShardedModule] = {}

    def visit(module: nn.Module, path: str) -> None:
        if isinstance(module, ShardedModule):
            found.setdefault(path, module)
            return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return found


def _leaf_modules(model: nn.Module) -> Set[int]:
    """ids of sharded modules and of modules that hold no sharded module."""
    leaves: Set[int] = set()

    def visit(module: nn.Module) -> bool:  # True when the subtree holds a sharded module
        if isinstance(module, ShardedModule):
            leaves.add(id(module))
            return True
        holds = False
        for child in module.children():
            holds |= visit(child)
        if not holds:
            leaves.add(id(module))
        return holds

    visit(model)
    return leaves


def _has_node(value: Any) -> bool:
    found = []
    fx.node.map_arg(value, lambda n: found.append(n))
    return bool(found)


def _arg_info(value: Any, batch_node: fx.Node) -> ArgInfo:
    """Walk one argument of a sharded module call back to the batch placeholder."""
    if not isinstance(value, fx.Node):
        if _has_node(value):
            raise _NotPipelineable(f"an argument packs traced values in a {type(value).__name__}")
        return ArgInfo(constant=value, is_constant=True)
    steps: List[Step] = []
    node = value
    while node is not batch_node:
        args = node.args
        if (
            node.op == "call_function"
            and node.target is getattr
            and len(args) == 2
            and isinstance(args[1], str)
            and not node.kwargs
        ):
            steps.append(("attr", args[1]))
        elif (
            node.op == "call_function"
            and node.target is operator.getitem
            and len(args) == 2
            and not _has_node(args[1])
        ):
            steps.append(("item", args[1]))
        elif (
            node.op == "call_method"
            and node.target == "get"
            and len(args) == 2
            and not node.kwargs
            and not _has_node(args[1])
        ):
            steps.append(("get", args[1]))
        else:
            raise _NotPipelineable(
                f"its input is computed inside the model (fx node {node.format_node()}); "
                "only attribute / item reads on the batch can be pipelined"
            )
        if not isinstance(args[0], fx.Node):
            raise _NotPipelineable(f"fx node {node.format_node()} does not read from the batch")
        node = args[0]
    return ArgInfo(tuple(reversed(steps)))


def trace_sharded_inputs(model: nn.Module) -> TraceResult:
    """Trace `model` (unwrapped, no DMP/DDP) and say how to feed each sharded module.

    Raises `RuntimeError` when the model cannot be traced at all (then nothing is pipelined).
    """
    modules = sharded_modules(model)
    if not modules:
        return TraceResult([], {})
    tracer = _Tracer(_leaf_modules(model))
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds; the message says which
        raise RuntimeError(f"torch.fx could not trace {type(model).__name__}.forward: {e}") from e
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    calls: Dict[str, List[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(model.get_submodule(node.target), ShardedModule):
            calls.setdefault(node.target, []).append(node)
    unpipelined: Dict[str, str] = {}
    pipelined: List[PipelinedModuleSpec] = []
    for name in modules:
        if name not in calls:
            unpipelined[name] = "the traced forward never calls it"
    for name, nodes in calls.items():
        module = model.get_submodule(name)
        try:
            if len(nodes) > 1:
                raise _NotPipelineable(f"forward calls it {len(nodes)} times")
            if not placeholders:
                raise _NotPipelineable("the model's forward takes no batch")
            node = nodes[0]
            args = [_arg_info(a, placeholders[0]) for a in node.args]
            kwargs = {k: _arg_info(v, placeholders[0]) for k, v in node.kwargs.items()}
            if all(a.is_constant for a in [*args, *kwargs.values()]):
                raise _NotPipelineable("none of its inputs comes from the batch")
        except _NotPipelineable as e:
            unpipelined[name] = str(e)
            continue
        pipelined.append(PipelinedModuleSpec(name, module, args, kwargs))
    return TraceResult(pipelined, unpipelined)
