"""Sparse types that torch.fx can build symbolically, as TorchRec's can.

A model that builds a KeyedJaggedTensor (or JaggedTensor, KeyedTensor) from tensors in its
`forward` must trace: constructed from `torch.fx.Proxy` arguments during symbolic tracing,
the object becomes one `call_function` node that calls the class when the graph runs. This is
`torch.fx.ProxyableClassMeta`'s rule, checked with `is_fx_symbolic_tracing` so that eager
construction does not trigger torch's `is_fx_tracing` deprecation warning.
"""

from __future__ import annotations

from typing import Any, List

from torch.fx import Proxy
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.fx.node import map_aggregate


class TraceableConstruction(type):
    """Metaclass: construction from proxies is recorded in the trace, not run."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if is_fx_symbolic_tracing():
            proxies: List[Proxy] = []
            map_aggregate(
                (args, kwargs), lambda a: proxies.append(a) if isinstance(a, Proxy) else None
            )
            if proxies:
                return proxies[0].tracer.create_proxy("call_function", cls, args, kwargs)
        return super().__call__(*args, **kwargs)
