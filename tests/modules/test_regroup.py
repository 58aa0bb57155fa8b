"""KTRegroupAsDict: TorchRec's regroup module, checked against the blocks cut and concatenated
by hand (skipped and repeated keys, gradients, a layout that changes between batches, key dim
0, dtype casts, torch.fx) and against bad arguments."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from recshard.fx import symbolic_trace
from recshard.modules import DataType
from recshard.modules.regroup import KTRegroupAsDict
from recshard.sparse import KeyedTensor

GROUPS = [["s1", "d0"], ["d0", "s2"]]  # d0 twice, d1 and s0 in none
KEYS = ["user", "object"]


def inputs(dims: Dict[str, int], batch: int = 3, seed: int = 0) -> List[KeyedTensor]:
    """A dense KT (d0, d1) and a sparse one (s0, s1, s2) with the given widths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for keys in (["d0", "d1"], ["s0", "s1", "s2"]):
        lengths = [dims[k] for k in keys]
        values = torch.randn(batch, sum(lengths), generator=g, requires_grad=True)
        out.append(KeyedTensor(keys, lengths, values))
    return out


def by_hand(kts: List[KeyedTensor], groups: List[List[str]], dim: int = 1) -> List[torch.Tensor]:
    blocks = {}
    for kt in kts:
        start = 0
        for key, length in zip(kt.keys(), kt.length_per_key()):
            blocks[key] = kt.values().narrow(dim, start, length)
            start += length
    return [torch.cat([blocks[k] for k in group], dim=dim) for group in groups]


def test_regroups_skips_and_repeats_keys_with_gradients() -> None:
    kts = inputs({"d0": 2, "d1": 3, "s0": 1, "s1": 4, "s2": 2})
    out = KTRegroupAsDict(GROUPS, KEYS)(kts)
    want = by_hand(kts, GROUPS)
    assert list(out) == KEYS
    for key, expected in zip(KEYS, want):
        assert torch.equal(out[key], expected), key
    (out["user"].sum(1) * out["object"].sum(1)).sum().backward()
    got = [kt.values().grad.clone() for kt in kts]
    for kt in kts:
        kt.values().grad = None
    (want[0].sum(1) * want[1].sum(1)).sum().backward()
    for mine, reference in zip(got, [kt.values().grad for kt in kts]):
        assert torch.allclose(mine, reference)
    assert got[0][:, 2:].abs().sum() == 0  # d1 is in no group: no gradient


def test_layout_change_between_batches_still_regroups() -> None:
    regroup = KTRegroupAsDict(GROUPS, KEYS)
    for dims in (
        {"d0": 2, "d1": 3, "s0": 1, "s1": 4, "s2": 2},
        {"d0": 5, "d1": 1, "s0": 2, "s1": 1, "s2": 3},
    ):
        kts = inputs(dims, batch=4)
        for key, expected in zip(KEYS, by_hand(kts, GROUPS)):
            assert torch.equal(regroup(kts)[key], expected)
    regroup.clear_cache()


def test_key_dim_zero() -> None:
    kts = [
        KeyedTensor(["d0", "d1"], [2, 1], torch.arange(6.0).view(3, 2), key_dim=0),
        KeyedTensor(["s0", "s1", "s2"], [1, 1, 2], torch.arange(8.0).view(4, 2), key_dim=0),
    ]
    out = KTRegroupAsDict(GROUPS, KEYS)(kts)
    for key, expected in zip(KEYS, by_hand(kts, GROUPS, dim=0)):
        assert torch.equal(out[key], expected)


@pytest.mark.parametrize(
    "data_type,dtype", [(DataType.FP16, torch.float16), (DataType.BF16, torch.bfloat16)]
)
def test_emb_dtype_casts(data_type: DataType, dtype: torch.dtype) -> None:
    kts = inputs({"d0": 2, "d1": 3, "s0": 1, "s1": 4, "s2": 2})
    plain = KTRegroupAsDict(GROUPS, KEYS)(kts)
    cast = KTRegroupAsDict(GROUPS, KEYS, emb_dtype=data_type)(kts)
    for key in KEYS:
        assert cast[key].dtype == dtype and torch.equal(cast[key], plain[key].to(dtype))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.regroup = KTRegroupAsDict(GROUPS, KEYS)

    def forward(self, dense: KeyedTensor, sparse: KeyedTensor) -> torch.Tensor:
        out = self.regroup([dense, sparse])
        return out["user"].sum(1) * out["object"].sum(1)


def test_fx_trace_gives_the_eager_result() -> None:
    kts = inputs({"d0": 2, "d1": 3, "s0": 1, "s1": 4, "s2": 2})
    model = _Model()
    traced = symbolic_trace(model)
    assert torch.equal(traced(*kts), model(*kts))


def test_bad_arguments_and_inputs_are_named() -> None:
    kts = inputs({"d0": 2, "d1": 3, "s0": 1, "s1": 4, "s2": 2})
    with pytest.raises(ValueError, match=r"2 groups but 1 keys \(\['user'\]\)"):
        KTRegroupAsDict(GROUPS, ["user"])
    with pytest.raises(ValueError, match=r"output keys \['user'\] appear more than once"):
        KTRegroupAsDict(GROUPS, ["user", "user"])
    with pytest.raises(ValueError, match="emb_dtype DataType.INT4"):
        KTRegroupAsDict(GROUPS, KEYS, emb_dtype=DataType.INT4)
    regroup = KTRegroupAsDict(GROUPS, KEYS)
    with pytest.raises(ValueError, match="no KeyedTensors"):
        regroup([])
    flat = KeyedTensor(["s0", "s1", "s2"], [1, 1, 2], torch.zeros(4, 3), key_dim=0)
    with pytest.raises(
        ValueError, match=r"KeyedTensor 1 \(keys \['s0', 's1', 's2'\]\) has key dim 0"
    ):
        regroup([kts[0], flat])
    with pytest.raises(KeyError, match=r"\['s1', 's2'\]"):
        regroup([kts[0]])
    with pytest.raises(ValueError, match="'d0' appears in more than one KeyedTensor"):
        regroup([kts[0], kts[0]])
