"""torch.fx tracing of models holding recshard modules, under TorchRec's names."""

from recshard.fx.tracer import Tracer, is_fx_tracing, symbolic_trace

__all__ = ["Tracer", "is_fx_tracing", "symbolic_trace"]
