"""Fuzz cases drawn once by hypothesis, the same every run: the fuzz tests draw their cases
here, then run them all in one group of ranks (hypothesis cannot drive spawned ranks)."""

from __future__ import annotations

from typing import Any, Dict, List

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st


def draw_distinct(strategy: st.SearchStrategy[Any], count: int) -> List[Any]:
    """`count` distinct examples of `strategy` (derandomized, nothing stored)."""
    drawn: Dict[str, Any] = {}

    @settings(
        max_examples=count + count // 4,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def collect(case: Any) -> None:
        drawn.setdefault(repr(case), case)

    collect()
    assert len(drawn) >= count, f"hypothesis drew {len(drawn)} distinct cases, wanted {count}"
    return list(drawn.values())[:count]
