"""TorchRec's sparse API surface: constructors, printed forms, equality, conversions,
variable batch and regrouping, each checked against values worked out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from recshard.modules import EmbeddingBagCollection, EmbeddingBagConfig
from recshard.sparse import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    jt_is_equal,
    kjt_is_equal,
    permute_multi_embedding,
    regroup_kts,
)


def test_from_dense_lengths_keeps_each_rows_prefix() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    weights = values * 10
    jt = JaggedTensor.from_dense_lengths(values, torch.tensor([2, 0, 3]), weights)
    assert jt.values().tolist() == [1.0, 2.0, 7.0, 8.0, 9.0]
    assert jt.weights().tolist() == [10.0, 20.0, 70.0, 80.0, 90.0]
    assert jt.lengths().tolist() == [2, 0, 3]
    assert (
        JaggedTensor.from_dense_lengths(values, torch.tensor([1, 1, 1])).weights_or_none() is None
    )


def test_to_padded_dense_weights_pads_and_cuts() -> None:
    jt = JaggedTensor(
        torch.arange(4), torch.tensor([0.1, 0.2, 0.3, 0.4]), lengths=torch.tensor([1, 3])
    )
    padded = jt.to_padded_dense_weights(desired_length=2, padding_value=-1.0)
    assert torch.allclose(padded, torch.tensor([[0.1, -1.0], [0.2, 0.3]]))
    assert jt.to_padded_dense_weights().shape == (2, 3)
    assert (
        JaggedTensor(torch.arange(1), lengths=torch.tensor([1])).to_padded_dense_weights() is None
    )


def test_lengths_and_offsets_must_be_integers() -> None:
    with pytest.raises(ValueError, match="lengths must be of integer type, got torch.float32"):
        JaggedTensor(torch.arange(2), lengths=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="offsets must be of integer type, got torch.float64"):
        KeyedJaggedTensor(["a"], torch.arange(2), offsets=torch.tensor([0, 2], dtype=torch.float64))


def test_printed_forms_match_torchrec() -> None:
    jt = JaggedTensor(torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([1, 0, 2]))
    assert str(jt) == "JaggedTensor({\n    [[1.0], [], [2.0, 3.0]]\n})\n"
    weighted = JaggedTensor(
        torch.tensor([1, 2]), torch.tensor([0.5, 1.5]), lengths=torch.tensor([2])
    )
    assert (
        str(weighted)
        == 'JaggedTensor({\n    "values": [[1, 2]],\n    "weights": [[0.5, 1.5]]\n})\n'
    )
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2, 0]))
    assert str(kjt) == 'KeyedJaggedTensor({\n    "a": [[1], []],\n    "b": [[2, 3], []]\n})\n'
    assert str(KeyedJaggedTensor.empty()) == "KeyedJaggedTensor()\n"
    kt = KeyedTensor(["x", "y"], [1, 2], torch.tensor([[1.0, 2.0, 3.0]]))
    assert str(kt) == 'KeyedTensor({\n    "x": [[1.0]],\n    "y": [[2.0, 3.0]]\n})\n'
    assert str(KeyedTensor([], [], torch.Tensor())) == "KeyedTensor()\n"


def test_constructor_accepts_what_torchrec_accepts_and_validate_checks() -> None:
    longer = KeyedJaggedTensor(["a"], torch.arange(4), lengths=torch.tensor([1, 2]))
    assert longer["a"].values().tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"lengths sum to 3 \(per key: a=3\) but values has 4"):
        longer.validate()
    empty = KeyedJaggedTensor(["a"], torch.empty(0), offsets=torch.tensor([], dtype=torch.int32))
    assert empty.stride() == 0 and empty.length_per_key() == [0]
    assert KeyedJaggedTensor([], torch.empty(0)).keys() == []
    two_d = KeyedJaggedTensor(["a", "b"], torch.arange(6).view(3, 2), lengths=torch.tensor([2, 1]))
    assert two_d["b"].values().tolist() == [[4, 5]]
    with pytest.raises(ValueError, match="values must be 1-D"):
        two_d.validate()


def test_module_rejects_what_it_cannot_consume_with_the_validate_message() -> None:
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=4, embedding_dim=8, name="t", feature_names=["f"])]
    )
    extra_values = KeyedJaggedTensor(["f"], torch.tensor([0, 1, 2]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"lengths sum to 2 \(per key: f=2\) but values has 3"):
        ebc(extra_values)
    negative = KeyedJaggedTensor(["f"], torch.tensor([0]), lengths=torch.tensor([2, -1]))
    with pytest.raises(ValueError, match="key 'f' has negative length -1 at batch position 1"):
        ebc(negative)


def test_empty_like_keeps_dtypes_device_and_batch() -> None:
    kjt = KeyedJaggedTensor(
        ["a"],
        torch.arange(3, dtype=torch.int32),
        torch.ones(3, dtype=torch.float64),
        lengths=torch.tensor([1, 2], dtype=torch.int64),
    )
    empty = KeyedJaggedTensor.empty_like(kjt)
    assert empty.keys() == [] and empty.stride() == 2
    assert (empty.values().dtype, empty.weights().dtype, empty.lengths().dtype) == (
        torch.int32,
        torch.float64,
        torch.int64,
    )
    jt = JaggedTensor.empty_like(kjt["a"])
    assert jt.values().numel() == 0 and jt.weights().dtype == torch.float64


def test_equality_compares_content_not_identity() -> None:
    by_lengths = JaggedTensor(torch.tensor([1.0, 2.0]), lengths=torch.tensor([2, 0]))
    by_offsets = JaggedTensor(torch.tensor([1.0, 2.0]), offsets=torch.tensor([0, 2, 2]))
    assert jt_is_equal(by_lengths, by_offsets)
    assert not jt_is_equal(
        by_lengths, JaggedTensor(torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1]))
    )
    assert not jt_is_equal(by_lengths, "not a jagged tensor")  # type: ignore[arg-type]
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 0, 2, 0]))
    same = KeyedJaggedTensor(["a", "b"], torch.arange(3), offsets=torch.tensor([0, 1, 1, 3, 3]))
    assert kjt_is_equal(kjt, same)
    assert not kjt_is_equal(
        kjt, KeyedJaggedTensor(["b", "a"], torch.arange(3), lengths=torch.tensor([1, 0, 2, 0]))
    )
    assert not kjt_is_equal(
        kjt, KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([0, 1, 2, 0]))
    )


def test_conversion_modules_round_trip_variable_batch() -> None:
    jt_dict = {
        "a": JaggedTensor(
            torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), lengths=torch.tensor([2, 0])
        ),
        "b": JaggedTensor(
            torch.tensor([3, 4, 5]),
            torch.tensor([3.0, 4.0, 5.0]),
            lengths=torch.tensor([1, 1, 0, 1]),
        ),
    }
    kjt = ComputeJTDictToKJT()(jt_dict)
    assert kjt.variable_stride_per_key() and kjt.stride_per_key() == [2, 4]
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 0, 1]
    back = ComputeKJTToJTDict()(kjt)
    assert list(back) == ["a", "b"]
    assert all(jt_is_equal(back[k], jt_dict[k]) for k in jt_dict)


def test_variable_batch_split_keeps_the_global_stride() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b", "c"],
        torch.arange(6),
        lengths=torch.tensor([1, 1, 2, 1, 0, 1]),
        stride_per_key_per_rank=torch.tensor([[1], [2], [3]]),
    )
    assert kjt.stride() == 3
    first, rest = kjt.split([1, 2])
    assert (first.stride(), rest.stride()) == (3, 3)
    assert first.stride_per_key() == [1] and rest.stride_per_key() == [2, 3]
    assert rest["c"].lengths().tolist() == [1, 0, 1]
    deduplicated = KeyedJaggedTensor(
        ["a"],
        torch.arange(2),
        lengths=torch.tensor([1, 1]),
        stride_per_key_per_rank=[[2]],
        inverse_indices=(["a"], torch.tensor([[0, 1, 1, 0, 1]])),
    )
    assert deduplicated.stride() == 5


@pytest.mark.parametrize("regroup", [regroup_kts, permute_multi_embedding, KeyedTensor.regroup])
def test_regroup_duplicates_skips_and_grads(regroup) -> None:  # noqa: ANN001
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 1, requires_grad=True)
    kts = [KeyedTensor(["x", "y"], [2, 1], a), KeyedTensor(["z"], [1], b)]
    out = regroup(kts, [["z", "x"], ["x"]])
    assert torch.equal(out[0], torch.cat([b, a[:, :2]], dim=1))
    assert torch.equal(out[1], a[:, :2])
    (out[0].sum() + 2 * out[1].sum()).backward()
    assert a.grad.tolist() == [[3.0, 3.0, 0.0]] * 2
    assert b.grad.tolist() == [[1.0]] * 2


def test_pytree_keeps_inverse_indices_and_fixed_batch_has_no_per_rank_strides() -> None:
    inverse = torch.tensor([[0, 1, 0]])
    kjt = KeyedJaggedTensor(
        ["a"],
        torch.arange(3),
        lengths=torch.tensor([1, 2]),
        stride_per_key_per_rank=[[2]],
        inverse_indices=(["a"], inverse),
    )
    leaves, spec = pytree.tree_flatten(kjt)
    back = pytree.tree_unflatten(leaves, spec)
    assert back.inverse_indices()[0] == ["a"] and torch.equal(back.inverse_indices()[1], inverse)
    assert back.stride() == 3 and back.stride_per_key_per_rank() == [[2]]
    fixed = KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2]))
    assert fixed.stride_per_key_per_rank() == [] and not fixed.variable_stride_per_key()


def test_equality_needs_weights_on_both_or_neither() -> None:
    plain = KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([2]))
    weighted = KeyedJaggedTensor(["a"], torch.arange(2), torch.ones(2), lengths=torch.tensor([2]))
    assert not kjt_is_equal(plain, weighted) and not jt_is_equal(plain["a"], weighted["a"])


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_empty_values_and_weights_take_torchs_default_dtype(default: torch.dtype) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        kjt = KeyedJaggedTensor.empty(is_weighted=True)
        jt = JaggedTensor.empty(is_weighted=True)
        assert (kjt.values().dtype, kjt.weights().dtype, kjt.lengths().dtype) == (
            default,
            default,
            torch.int32,
        )
        assert (jt.values().dtype, jt.weights().dtype) == (default, default)
        assert KeyedJaggedTensor.from_jt_dict({}).values().dtype == default
        assert JaggedTensor.from_dense([]).values().dtype == default
    finally:
        torch.set_default_dtype(previous)
    assert KeyedJaggedTensor.empty(values_dtype=torch.int64).values().dtype == torch.int64


def test_unsync_recomputes_the_per_key_sums() -> None:
    # length_per_key given by the caller is trusted until unsync() drops it
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.arange(5), lengths=torch.tensor([1, 2, 0, 2]), length_per_key=[2, 3]
    )
    assert kjt.length_per_key() == [2, 3]
    assert kjt.unsync() is kjt
    assert kjt.length_per_key() == [3, 2] and kjt.offset_per_key() == [0, 3, 5]
    assert kjt["b"].values().tolist() == [3, 4]


@pytest.mark.parametrize(
    "lengths", [torch.empty(2, 0, dtype=torch.int32), torch.empty(0, dtype=torch.int32)]
)
def test_a_batch_of_zero_gives_empty_lengths_and_offsets_per_key(lengths: torch.Tensor) -> None:
    kjt = KeyedJaggedTensor(["a", "b"], torch.empty(0, dtype=torch.int64), lengths=lengths)
    assert kjt.stride() == 0 and kjt.length_per_key() == [0, 0]
    for jt in kjt.to_dict().values():  # TorchRec's form for no rows, as JaggedTensor.empty()
        assert jt.lengths().shape == (0,) and jt.offsets().shape == (0,)
        assert jt.to_dense() == []
    assert kjt["a"].offsets().tolist() == [0]  # TorchRec's __getitem__ differs from its to_dict
    variable = KeyedJaggedTensor(
        ["a", "b"],
        torch.arange(2),
        lengths=torch.tensor([1, 1]),
        stride_per_key_per_rank=[[0], [2]],
    )
    assert variable["a"].offsets().tolist() == [0]  # a zero-batch key of a variable batch
    assert variable["b"].offsets().tolist() == [0, 1, 2]


def test_index_per_key_flatten_lengths_and_an_empty_split() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.arange(4),
        torch.ones(4),
        lengths=torch.tensor([[1, 0], [2, 1]], dtype=torch.int64),
    )
    assert kjt.index_per_key() == {"a": 0, "b": 1}
    flat = kjt.flatten_lengths()
    assert flat.lengths().shape == (4,) and flat.keys() == ["a", "b"]
    assert flat["b"].values().tolist() == [1, 2, 3] and flat.length_per_key() == [1, 3]
    none, both = kjt.split([0, 2])
    assert none.keys() == [] and none.stride() == 2 and none.weights().numel() == 0
    assert (none.lengths().dtype, none.offsets().tolist()) == (torch.int32, [])  # TorchRec's
    assert both.keys() == ["a", "b"] and both["a"].lengths().tolist() == [1, 0]
    # lengths given as [keys, batch]: each key gets its own row, as TorchRec's to_dict
    rows = {key: (jt.lengths().tolist(), jt.values().tolist()) for key, jt in kjt.to_dict().items()}
    assert rows == {"a": ([1, 0], [0]), "b": ([2, 1], [1, 2, 3])}
