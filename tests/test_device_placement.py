"""Every tensor the library creates names its device: a static check over `recshard/`.

A factory call without `device=` (`torch.arange(n)`, `torch.tensor(rows)`) makes a CPU tensor;
on CPU every test passes, and on a GPU the first op that meets the data's CUDA tensors fails
("Expected all tensors to be on the same device"). This walks the AST of every module and
fails on such a call: code that means the data's device says so (`device=ids.device`), code
that means the host says that (`device="cpu"`, and moves it where it is used). Whole modules
that run only on the host are listed in HOST_ONLY, each with its reason.
"""

from __future__ import annotations

import ast
import pathlib
from typing import List

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "recshard"

# torch functions that make a tensor from nothing (no tensor argument to take a device from)
FACTORIES = {
    "arange",
    "as_tensor",
    "asarray",
    "empty",
    "empty_strided",
    "eye",
    "full",
    "linspace",
    "logspace",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "range",
    "scalar_tensor",
    "sparse_coo_tensor",
    "tensor",
    "tril_indices",
    "triu_indices",
    "zeros",
}
# legacy constructors: always CPU, no device argument worth having
LEGACY = {"Tensor", "LongTensor", "IntTensor", "FloatTensor", "DoubleTensor", "BoolTensor"}

# modules (paths under recshard/) whose tensors are host-side by design
HOST_ONLY = {
    "calibration/": "measures this host's CPU kernels, memory and storage",
    "datasets/": "datasets yield host batches; the training loop or pipeline moves them",
    "distributed/mc_native.py": "managed collision's C++ path runs on the CPU only",
    "lookup/huge_pages.py": "CPU buffers on transparent huge pages",
    "lookup/key_value.py": "key-value tables run on the CPU only (the kernel refuses others)",
    "lookup/key_value_cache.py": "the key-value tables' row cache (CPU only)",
    "lookup/native_row_cache.py": "the key-value row cache's C++ books (CPU only)",
    "lookup/row_store.py": "rows in files mapped from storage",
}


def _torch_names(tree: ast.Module) -> set[str]:
    """Names bound to the torch module (`import torch`, `import torch as t`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name == "torch"}
    return names


def missing_device(source: str, where: str) -> List[str]:
    """`where:line: torch.f(...)` for each factory call in `source` without `device=` (a call
    that passes `**kwargs` may carry one and is let through), and each legacy constructor."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    imported = {  # `from torch import zeros as z`: z -> zeros
        a.asname or a.name: a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "torch"
        for a in node.names
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            name = func.attr if func.value.id in torch_names else None
        elif isinstance(func, ast.Name):
            name = imported.get(func.id)
        else:
            name = None
        keywords = {k.arg for k in node.keywords}
        if name in LEGACY or (name in FACTORIES and not keywords & {"device", None}):
            found.append((node.lineno, f"{where}:{node.lineno}: {ast.unparse(node)[:90]}"))
    return [text for _, text in sorted(found)]


def _host_only(relative: str) -> bool:
    return any(relative.startswith(prefix) for prefix in HOST_ONLY)


def package_violations(package: pathlib.Path) -> List[str]:
    """Every factory call without a device in `package`, outside HOST_ONLY."""
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if not _host_only(relative):
            found += missing_device(path.read_text(), f"recshard/{relative}")
    return found


def test_every_tensor_the_library_creates_names_its_device() -> None:
    found = package_violations(PACKAGE)
    assert not found, (
        "tensors created without device= (pass the data's device, or device='cpu' for host "
        "metadata moved where it is used):\n" + "\n".join(found)
    )


def test_each_host_only_entry_names_code_that_makes_tensors() -> None:
    """No stale entries: each listed module exists and does create tensors without a device."""
    for prefix in HOST_ONLY:
        paths = [
            p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).as_posix().startswith(prefix)
        ]
        assert paths, f"HOST_ONLY entry '{prefix}' names no module"
        assert any(missing_device(p.read_text(), str(p)) for p in paths), (
            f"HOST_ONLY entry '{prefix}': its modules name every device; remove the entry"
        )


def test_the_check_flags_what_it_should_and_nothing_else() -> None:
    flagged = """
import torch
from torch import zeros as z
a = torch.arange(n)
b = torch.tensor([1, 2], dtype=torch.int64)
c = z(3)
d = torch.LongTensor([1])
e = torch.repeat_interleave(torch.arange(n), lengths)
"""
    passed = """
import torch as t
a = t.arange(n, device=x.device)
b = t.tensor([1, 2], device="cpu")
c = t.zeros_like(x)
d = x.new_zeros(3)
e = t.empty(3, **kwargs)
f = t.repeat_interleave(lengths)
"""
    lines = [line.split(":")[1] for line in missing_device(flagged, "f")]
    assert lines == ["4", "5", "6", "7", "8"], lines
    assert missing_device(passed, "g") == []
