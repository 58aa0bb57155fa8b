"""Local lookups: fused fbgemm TBE, its pure-torch twin, and a dense kernel, grouped."""

from recshard.lookup.grouped import GroupedLookup
from recshard.lookup.tables import LocalTable

__all__ = ["GroupedLookup", "LocalTable"]
