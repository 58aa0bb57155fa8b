"""The import codemod: rewrite a Python source's `torchrec` imports to recshard's (libcst, so
comments and formatting survive), and say what could not be mapped.

Three shapes of use are handled:
- `from torchrec.X import a, b as c`: each name goes to the recshard module that provides it
  (one statement per module; names recshard lacks stay in a `from torchrec...` statement);
- `import torchrec` / `import torchrec.X` and the dotted uses rooted at `torchrec`
  (`torchrec.distributed.DistributedModelParallel(...)`): uses become recshard's paths and the
  import names the recshard submodules they need;
- `import torchrec.X as y` / `from torchrec import X as y` (a module): the alias is kept and
  each `y.name` use is checked.
Whatever cannot be mapped is left as it was and reported with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Set

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from recshard.port.mapping import (
    MODULE_MAP,
    Resolved,
    Unmapped,
    resolve_chain,
    resolve_name,
    unmapped_module_reason,
)

ROOT = "torchrec"


@dataclass(frozen=True)
class Issue:
    """One TorchRec use left as it was: 1-based `line` and why."""

    line: int
    name: str
    reason: str


@dataclass
class PortResult:
    """The rewritten source and what could not be mapped."""

    code: str
    issues: List[Issue] = field(default_factory=list)


@dataclass
class _ModuleBinding:
    """A local name bound to a TorchRec module: `local` now means recshard module `target`
    (`new_local` is its name after the rewrite: the alias, or `recshard` for `import torchrec`)."""

    local: str
    torchrec_path: str
    target: str
    new_local: str


def _dotted(node: cst.BaseExpression) -> List[str] | None:
    """`a.b.c` as `["a", "b", "c"]`; None for anything that is not a plain dotted name."""
    if isinstance(node, cst.Name):
        return [node.value]
    if isinstance(node, cst.Attribute):
        head = _dotted(node.value)
        return None if head is None else [*head, node.attr.value]
    return None


def _is_torchrec(path: List[str] | None) -> bool:
    return bool(path) and path[0] == ROOT


def _expr(dotted: str) -> cst.Name | cst.Attribute:
    parts = dotted.split(".")
    node: cst.Name | cst.Attribute = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def _prefix_node(node: cst.BaseExpression, depth: int) -> cst.BaseExpression:
    """The sub-expression of dotted `node` made of its first `depth` parts."""
    length = len(_dotted(node) or [])
    while length > depth and isinstance(node, cst.Attribute):
        node = node.value
        length -= 1
    return node


class _Planner(cst.CSTVisitor):
    """First pass: module bindings, each dotted use's replacement, and the issues."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self) -> None:
        self.bindings: Dict[str, _ModuleBinding] = {}
        self.replacements: Dict[cst.CSTNode, cst.BaseExpression] = {}
        self.needed: Dict[str, Set[str]] = {}  # new_local -> submodules the uses need loaded
        self.issues: List[Issue] = []

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def _report(self, node: cst.CSTNode, name: str, reason: str) -> None:
        self.issues.append(Issue(self._line(node), name, reason))

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            path = _dotted(alias.name)
            if not _is_torchrec(path):
                continue
            full = ".".join(path)
            if alias.asname is None:  # `import torchrec.x` binds `torchrec`
                self.bindings[ROOT] = _ModuleBinding(ROOT, ROOT, MODULE_MAP[ROOT], "recshard")
                if full not in MODULE_MAP:
                    self._report(node, full, unmapped_module_reason(full))
                continue
            local = cst.ensure_type(alias.asname.name, cst.Name).value
            if full not in MODULE_MAP:
                self._report(node, full, unmapped_module_reason(full))
                continue
            self.bindings[local] = _ModuleBinding(local, full, MODULE_MAP[full], local)
        return False  # the imported paths are not uses

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        path = _dotted(node.module) if node.module is not None and not node.relative else None
        if not _is_torchrec(path):
            return False
        module = ".".join(path)
        if isinstance(node.names, cst.ImportStar):
            if module not in MODULE_MAP:
                self._report(node, f"{module}.*", unmapped_module_reason(module))
            return False
        for alias in node.names:
            name = cst.ensure_type(alias.name, cst.Name).value
            try:
                resolve_name(module, name)
            except Unmapped as err:
                self._report(node, f"{module}.{name}", str(err))
            if f"{module}.{name}" in MODULE_MAP:  # a module imported by name
                local = cst.ensure_type(alias.asname.name, cst.Name).value if alias.asname else name
                self.bindings[local] = _ModuleBinding(
                    local, f"{module}.{name}", MODULE_MAP[f"{module}.{name}"], local
                )
        return False

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        parts = _dotted(node)
        if parts is None or parts[0] not in self.bindings:
            return True
        binding = self.bindings[parts[0]]
        torchrec_parts = [*binding.torchrec_path.split("."), *parts[1:]]
        try:
            resolved, consumed = resolve_chain(torchrec_parts)
        except Unmapped as err:
            self._report(node, ".".join(parts), str(err))
            return False
        consumed_local = consumed - len(binding.torchrec_path.split(".")) + 1
        self._plan(node, parts, binding, resolved, max(consumed_local, 1))
        return False

    def _plan(
        self,
        node: cst.Attribute,
        parts: Sequence[str],
        binding: _ModuleBinding,
        resolved: Resolved,
        depth: int,
    ) -> None:
        target = binding.target
        if resolved.dotted != target and not resolved.dotted.startswith(target + "."):
            self._report(
                node,
                ".".join(parts),
                f"{resolved.dotted} is not under {target}; import it from {resolved.module}",
            )
            return
        new = binding.new_local + resolved.dotted[len(target) :]
        if resolved.module != target:
            self.needed.setdefault(binding.new_local, set()).add(resolved.module)
        prefix = _prefix_node(node, depth)
        if _dotted(prefix) != new.split("."):
            self.replacements[prefix] = _expr(new)


class _Rewriter(cst.CSTTransformer):
    """Second pass: apply the planned uses and rewrite the import statements."""

    def __init__(self, plan: _Planner) -> None:
        super().__init__()
        self.plan = plan
        self._extra_done: Set[str] = set()

    def leave_Attribute(
        self, original: cst.Attribute, updated: cst.Attribute
    ) -> cst.BaseExpression:
        return self.plan.replacements.get(original, updated)

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        return self.plan.replacements.get(original, updated)

    def leave_Import(self, original: cst.Import, updated: cst.Import) -> cst.Import:
        names: List[cst.ImportAlias] = []
        for alias in updated.names:
            path = _dotted(alias.name)
            full = ".".join(path) if path else ""
            if not _is_torchrec(path) or full not in MODULE_MAP:
                names.append(alias)
                continue
            new_local = (
                "recshard"
                if alias.asname is None
                else cst.ensure_type(alias.asname.name, cst.Name).value
            )
            names.append(alias.with_changes(name=_expr(MODULE_MAP[full])))
            if new_local not in self._extra_done:
                self._extra_done.add(new_local)
                for module in sorted(self.plan.needed.get(new_local, ())):
                    if module != MODULE_MAP[full]:
                        names.append(cst.ImportAlias(name=_expr(module)))
        # the last alias carries no comma (the ones before get libcst's default ", ")
        names[-1] = names[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(names=names)

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.FlattenSentinel[cst.SimpleStatementLine]:
        if len(updated.body) != 1 or not isinstance(updated.body[0], cst.ImportFrom):
            return updated
        statements = self._split_from_import(updated.body[0])
        if statements is None:
            return updated
        lines = [updated.with_changes(body=[statements[0]])]
        lines += [cst.SimpleStatementLine(body=[s]) for s in statements[1:]]
        return lines[0] if len(lines) == 1 else cst.FlattenSentinel(lines)

    def _split_from_import(self, node: cst.ImportFrom) -> List[cst.ImportFrom] | None:
        """The statements replacing `from torchrec.X import ...`, grouped by recshard module;
        None when the statement is not TorchRec's."""
        path = _dotted(node.module) if node.module is not None and not node.relative else None
        if not _is_torchrec(path):
            return None
        module = ".".join(path)
        if isinstance(node.names, cst.ImportStar):
            return (
                [node.with_changes(module=_expr(MODULE_MAP[module]))]
                if module in MODULE_MAP
                else None
            )
        groups: Dict[str, List[cst.ImportAlias]] = {}
        for alias in node.names:
            name = cst.ensure_type(alias.name, cst.Name).value
            try:
                resolved = resolve_name(module, name)
                key = resolved.module
                alias = alias.with_changes(name=cst.Name(resolved.name or name))
                if resolved.name != name and alias.asname is None:
                    alias = alias.with_changes(asname=cst.AsName(name=cst.Name(name)))
            except Unmapped:
                key = module  # left as it was (reported by the planner)
            groups.setdefault(key, []).append(alias)
        if list(groups) == [module]:
            return None
        # each group ends as the statement did: a parenthesized one keeps its trailing comma
        # (and the line break before ")"), a bare one must end without a comma
        ending = node.names[-1].comma if node.rpar is not None else cst.MaybeSentinel.DEFAULT
        return [
            node.with_changes(
                module=_expr(target), names=[*aliases[:-1], aliases[-1].with_changes(comma=ending)]
            )
            for target, aliases in groups.items()
        ]


def port_source(code: str) -> PortResult:
    """Rewrite the TorchRec imports (and dotted uses) of Python source `code`."""
    wrapper = MetadataWrapper(cst.parse_module(code))
    planner = _Planner()
    wrapper.visit(planner)
    new_module = wrapper.module.visit(_Rewriter(planner))
    issues = sorted(set(planner.issues), key=lambda i: (i.line, i.name))
    return PortResult(new_module.code, issues)
