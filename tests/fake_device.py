"""A second device on a CPU-only machine, for running the CUDA tests' bodies (`tests/cuda`)
where no GPU is: `fakegpu`, torch's PrivateUse1 backend written in Python.

A `fakegpu` tensor wraps a CPU tensor (its payload). Every op on one unwraps, runs on the
CPU, and wraps the results, after refusing what CUDA refuses: a CPU tensor with any elements
meeting a device tensor in one op ("Expected all tensors to be on the same device"), except a
device tensor indexed by CPU indices, which CUDA allows. So a tensor the library made on the
CPU without meaning to fails here as it fails on a GPU (the GPU run's errors at a3d2450 all
show up), while the branches that test `device.type == "cuda"` stay on their CPU side and
fbgemm has no kernel for the device (as on a GPU machine without fbgemm-gpu).

Registering the backend is process-wide and for good, and it keeps a torch-function mode
entered: call `activate()` only in a process of its own (a `run_ranks` worker, a subprocess).
`RECSHARD_FAKE_CUDA=1` makes `tests/cuda` run on it (`cuda_or_fake`, `backend`).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Dict, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

ENV = "RECSHARD_FAKE_CUDA"
NAME = "fakegpu"  # the device type, once `activate()` registered it
# ops that take a device tensor with CPU indices (what CUDA allows); a CPU tensor indexed by
# device indices is still refused
_CPU_INDICES_OK = {
    "aten.index.Tensor",
    "aten.index_put_.default",
    "aten.index_put.default",
    "aten._index_put_impl_.default",
}
_active = False


def requested() -> bool:
    return os.environ.get(ENV) == "1"


def cuda_or_fake() -> torch.device:
    """The device `tests/cuda` runs on: the fake one when requested, else GPU 0."""
    if requested():
        return device()
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def backend() -> str:
    return "gloo" if requested() else "nccl"


class FakeDeviceTensor(torch.Tensor):
    """A `fakegpu` tensor: metadata of its own, data in `payload` (a CPU tensor)."""

    payload: torch.Tensor

    @staticmethod
    def __new__(cls, payload: torch.Tensor) -> FakeDeviceTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            payload.size(),
            strides=payload.stride(),
            storage_offset=payload.storage_offset(),
            dtype=payload.dtype,
            device=torch.device(NAME, 0),
            requires_grad=payload.requires_grad,
        )

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload = payload

    def __repr__(self) -> str:  # noqa: D105
        return f"FakeDeviceTensor({self.payload!r})"

    def __deepcopy__(self, memo: Dict[int, Any]) -> FakeDeviceTensor:
        new = FakeDeviceTensor(copy.deepcopy(self.payload.detach(), memo))
        if self.requires_grad:
            new.requires_grad_(True)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        return new

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.payload.untyped_storage()

    def data_ptr(self) -> int:
        return self.payload.data_ptr()

    def tolist(self) -> Any:
        return self.payload.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        return _run(func, args, kwargs or {})


def _run(func, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:  # noqa: ANN001
    """`func` on the payloads, refusing what CUDA refuses; results wrapped when the op ran on
    the device."""
    on_device, on_cpu = [], []

    def unwrap(t: Any) -> Any:
        if isinstance(t, FakeDeviceTensor):
            on_device.append(t)
            return t.payload
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0:
            on_cpu.append(t)
        return t

    cpu_args, cpu_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    name = str(func)
    moves = name.startswith("aten._to_copy") or name.startswith("aten.copy_")
    if on_device and on_cpu and not moves:
        indexed_on_device = args and isinstance(args[0], FakeDeviceTensor)
        if not (name in _CPU_INDICES_OK and indexed_on_device):
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but got a cpu tensor in {name}"
            )
    to_device = bool(on_device)
    target = cpu_kwargs.get("device")
    if isinstance(target, torch.device):
        to_device = target.type == NAME
        cpu_kwargs["device"] = torch.device("cpu")
    out = func(*cpu_args, **cpu_kwargs)
    if name.startswith("aten.copy_") and isinstance(args[0], FakeDeviceTensor):
        return args[0]
    if name.startswith("aten._local_scalar_dense"):
        return out

    def wrap(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and to_device and not isinstance(t, FakeDeviceTensor):
            return FakeDeviceTensor(t)
        return t

    return tree_map(wrap, out)


class _FactoriesOnHost(TorchFunctionMode):
    """A factory asked for the fake device (`torch.tensor(data, device=...)`, `torch.zeros`)
    makes its tensor on the CPU and moves it: the Python backend cannot take the C++ paths of
    these constructors (out= variants would resize the payload, not the wrapper)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if (
            device is not None
            and not isinstance(device, int)
            and torch.device(device).type == NAME
            and not any(isinstance(a, FakeDeviceTensor) for a in args)
        ):
            grad = kwargs.pop("requires_grad", False)
            out = func(*args, **dict(kwargs, device="cpu"))
            if not isinstance(out, torch.Tensor):
                return out
            out = out.to(torch.device(NAME, 0))
            return out.requires_grad_() if grad else out
        return func(*args, **kwargs)


def _arange(*args: Any, **kwargs: Any) -> FakeDeviceTensor:
    """`arange` on the device (also in autograd's device thread, outside the mode)."""
    return FakeDeviceTensor(torch.arange(*args, **dict(kwargs, device=torch.device("cpu"))))


def device() -> torch.device:
    """`fakegpu:0`, registered in this process first if it is not yet."""
    activate()
    return torch.device(NAME, 0)


def activate() -> None:
    """Register `fakegpu` in this process (once)."""
    global _active
    if _active:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=NAME)
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(lambda op, *a, **k: _run(op, a, k), "PrivateUse1", with_keyset=False)
    aten = torch.library.Library("aten", "IMPL")
    for overload in ("arange", "arange.start", "arange.start_step"):
        aten.impl(overload, _arange, "PrivateUse1")
    _FactoriesOnHost().__enter__()
    activate.libraries = (fallback, aten)  # kept alive: dropping a Library unregisters it
    _active = True
