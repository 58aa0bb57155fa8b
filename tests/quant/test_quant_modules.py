"""Quantized EBC / EC: fbgemm's layout, outputs within the per-row quantization bound of the
float modules, the expected size reduction, conversion of a model, and clear errors."""

from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch
from torch import nn

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from recshard.modules.embedding_configs import DataType
from recshard.quant import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    dequantize_rows,
    max_row_error,
    quantize_embeddings,
    quantize_rows,
)

DTYPES = [torch.qint8, torch.quint4x2, torch.quint2x4, torch.float16]


def bag_tables() -> List[EmbeddingBagConfig]:
    """Shared features, MEAN, mixed dims (all multiples of 4: every dtype can hold them)."""
    return [
        EmbeddingBagConfig(
            num_embeddings=40, embedding_dim=8, name="t0", feature_names=["f0", "f1"]
        ),
        EmbeddingBagConfig(
            num_embeddings=7,
            embedding_dim=4,
            name="t1",
            feature_names=["f2"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(num_embeddings=25, embedding_dim=12, name="t2", feature_names=["f3"]),
        EmbeddingBagConfig(
            num_embeddings=9,
            embedding_dim=16,
            name="t3",
            feature_names=["f4"],
            weight_init_min=-3.0,
            weight_init_max=5.0,
        ),  # wide, offset rows
    ]


def make_kjt(
    rows: Dict[str, int],
    batch: int,
    seed: int,
    weighted: bool = False,
    id_dtype: torch.dtype = torch.int64,
) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = list(reversed(list(rows)))  # input key order differs from the module's
    lengths = torch.randint(0, 5, (len(keys), batch), generator=g)
    values = torch.cat(
        [
            torch.randint(0, rows[k], (int(lengths[i].sum()),), generator=g)
            for i, k in enumerate(keys)
        ]
    ).to(id_dtype)
    weights = torch.rand(values.numel(), generator=g) * 2 - 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths.reshape(-1), weights)


def feature_rows(configs) -> Dict[str, int]:
    return {f: c.num_embeddings for c in configs for f in c.feature_names}


def pooled_bound(qebc: QuantEmbeddingBagCollection, kjt: KeyedJaggedTensor) -> torch.Tensor:
    """`[B, sum dims]`: per bag, sum over its ids of |weight| * that row's max error
    (divided by the bag length for MEAN): the most quantization can move a pooled value."""
    columns = []
    errors = {
        name: max_row_error(v, sb, c.data_type, c.embedding_dim)
        for c in qebc.embedding_bag_configs()
        for name, (v, sb) in [(c.name, qebc.quantized_weights()[c.name])]
    }
    for config in qebc.embedding_bag_configs():
        for feature in config.feature_names:
            jt = kjt[feature]
            weights = jt.weights_or_none()
            per_id = errors[config.name][jt.values().long()]
            if weights is not None:
                per_id = per_id * weights.abs()
            bags = torch.repeat_interleave(torch.arange(jt.lengths().numel()), jt.lengths().long())
            bound = torch.zeros(jt.lengths().numel()).index_add_(0, bags, per_id)
            if config.pooling == PoolingType.MEAN:
                bound = bound / jt.lengths().clamp(min=1)
            columns.append(bound.unsqueeze(1).expand(-1, config.embedding_dim))
    return torch.cat(columns, dim=1)


def dequantized_ebc(qebc: QuantEmbeddingBagCollection, weighted: bool) -> EmbeddingBagCollection:
    """A float EBC holding exactly the values the quantized kernel reads."""
    configs = [copy.copy(c) for c in qebc.embedding_bag_configs()]
    for c in configs:
        c.data_type = DataType.FP32
    ebc = EmbeddingBagCollection(configs, is_weighted=weighted)
    with torch.no_grad():
        for c in qebc.embedding_bag_configs():
            values, scale_bias = qebc.quantized_weights()[c.name]
            ebc.embedding_bags[c.name].weight.copy_(
                dequantize_rows(values, scale_bias, c.data_type, c.embedding_dim)
            )
    return ebc


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_rows_match_fbgemm_quantize_op_bit_for_bit(bits: int) -> None:
    fbgemm = pytest.importorskip("fbgemm_gpu")  # noqa: F841
    torch.manual_seed(bits)
    weight = torch.randn(300, 16) * torch.rand(300, 1) * 4 + torch.randn(300, 1)
    weight[0] = 0.25  # constant row: scale 1, every code 0
    ref = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight, bits)
    data_type = {8: DataType.INT8, 4: DataType.INT4, 2: DataType.INT2}[bits]
    values, scale_bias = quantize_rows(weight, data_type)
    assert torch.equal(values, ref[:, :-4])
    assert torch.equal(scale_bias.view(torch.uint8), ref[:, -4:])


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quant_ebc_within_quantization_error(dtype: torch.dtype, weighted: bool) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(bag_tables(), is_weighted=weighted)
    qebc = QuantEmbeddingBagCollection.from_float(ebc, dtype)
    kjt = make_kjt(feature_rows(bag_tables()), batch=64, seed=1, weighted=weighted)
    want, got = ebc(kjt), qebc(kjt)
    assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
    assert got.values().dtype == torch.float32
    # the kernel reads exactly the stored rows ...
    exact = dequantized_ebc(qebc, weighted)(kjt).values()
    torch.testing.assert_close(got.values(), exact, rtol=1e-5, atol=1e-5)
    # ... and those are within half a quantization step (per row) of the float rows
    error = (got.values() - want.values()).abs()
    bound = pooled_bound(qebc, kjt)
    assert bool((error <= bound + 1e-6).all()), f"worst excess {(error - bound).max():.3g}"
    # the bound is the right size, not a loose one: the error reaches a fair part of it
    assert error.max() > 0.2 * bound.max(), (error.max(), bound.max())


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint4x2, torch.float16])
def test_quant_ec_within_quantization_error(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    configs = [
        EmbeddingConfig(num_embeddings=30, embedding_dim=8, name="e0", feature_names=["a", "b"]),
        EmbeddingConfig(num_embeddings=12, embedding_dim=4, name="e1", feature_names=["c"]),
        EmbeddingConfig(num_embeddings=5, embedding_dim=8, name="e2", feature_names=["d"]),
    ]
    ec = EmbeddingCollection(configs, need_indices=True)
    qec = QuantEmbeddingCollection.from_float(ec, dtype)
    assert len(qec.lookups) == 2  # one fbgemm sequence kernel per dim
    kjt = make_kjt(feature_rows(configs), batch=16, seed=2)
    want, got = ec(kjt), qec(kjt)
    assert list(got) == list(want) == ["a", "b", "c", "d"]
    for config in qec.embedding_configs():
        values, scale_bias = qec.quantized_weights()[config.name]
        row_error = max_row_error(values, scale_bias, config.data_type, config.embedding_dim)
        for feature in config.feature_names:
            ids = kjt[feature].values().long()
            assert torch.equal(got[feature].lengths(), want[feature].lengths())
            assert torch.equal(got[feature].weights(), kjt[feature].values())
            error = (got[feature].values() - want[feature].values()).abs()
            assert bool((error <= row_error[ids].unsqueeze(1) + 1e-7).all()), feature


@pytest.mark.parametrize(
    "dtype,bytes_per_row",
    [
        (torch.float32, 256),
        (torch.float16, 128),
        (torch.qint8, 64 + 4),
        (torch.quint4x2, 32 + 4),
        (torch.quint2x4, 16 + 4),
    ],
)
def test_model_size_shrinks_by_the_expected_factor(dtype: torch.dtype, bytes_per_row: int) -> None:
    configs = [
        EmbeddingBagConfig(
            num_embeddings=2000, embedding_dim=64, name=f"t{i}", feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]
    ebc = EmbeddingBagCollection(configs)
    qebc = QuantEmbeddingBagCollection.from_float(ebc, dtype)
    float_bytes = sum(t.numel() * t.element_size() for t in ebc.state_dict().values())
    saved_bytes = sum(t.numel() * t.element_size() for t in qebc.state_dict().values())
    assert saved_bytes == 3 * 2000 * bytes_per_row
    # fbgemm's buffer adds at most 128 bytes of alignment per table on CPU
    assert 0 <= qebc.storage_bytes() - saved_bytes <= 3 * 128
    factor = float_bytes / qebc.storage_bytes()
    assert factor == pytest.approx(256 / bytes_per_row, rel=3e-3)


def test_quantize_embeddings_converts_a_model() -> None:
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(bag_tables())
            self.tower = nn.Sequential(nn.Linear(4, 4))
            self.alias = self.ebc  # the same module at two paths stays one module

    model = Model()
    kjt = make_kjt(feature_rows(bag_tables()), batch=8, seed=3)
    want = model.ebc(kjt).values()
    copy_model = quantize_embeddings(
        model, torch.quint4x2, inplace=False, per_table_weight_dtype={"t3": torch.qint8}
    )
    assert type(model.ebc) is EmbeddingBagCollection  # not in place: the original is untouched
    assert (
        isinstance(copy_model.ebc, QuantEmbeddingBagCollection)
        and copy_model.alias is copy_model.ebc
    )
    types = {c.name: c.data_type for c in copy_model.ebc.embedding_bag_configs()}
    assert types == {
        "t0": DataType.INT4,
        "t1": DataType.INT4,
        "t2": DataType.INT4,
        "t3": DataType.INT8,
    }
    assert quantize_embeddings(model, torch.qint8) is model and isinstance(
        model.ebc, QuantEmbeddingBagCollection
    )
    assert (model.ebc(kjt).values() - want).abs().max() < 0.05
    bare = quantize_embeddings(EmbeddingBagCollection(bag_tables()), torch.float16)
    assert isinstance(bare, QuantEmbeddingBagCollection)


def test_state_dict_round_trip_and_fresh_modules() -> None:
    torch.manual_seed(0)
    qebc = QuantEmbeddingBagCollection.from_float(
        EmbeddingBagCollection(bag_tables()), torch.quint4x2
    )
    state = qebc.state_dict()
    assert sorted(state) == sorted(
        f"embedding_bags.t{i}.{k}"
        for i in range(4)
        for k in ("weight", "weight_qscale", "weight_qbias")
    )
    assert state["embedding_bags.t0.weight"].dtype == torch.uint8
    assert tuple(state["embedding_bags.t0.weight"].shape) == (40, 4)
    configs = [copy.copy(c) for c in qebc.embedding_bag_configs()]
    torch.manual_seed(1)
    fresh = QuantEmbeddingBagCollection(configs)  # starts from the configs' init, quantized
    kjt = make_kjt(feature_rows(bag_tables()), batch=8, seed=4)
    assert not torch.equal(fresh(kjt).values(), qebc(kjt).values())
    fresh.load_state_dict(state)
    assert torch.equal(fresh(kjt).values(), qebc(kjt).values())


def test_inputs_are_checked_like_the_float_module() -> None:
    qebc = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(bag_tables()), torch.qint8)
    rows = feature_rows(bag_tables())
    int32 = make_kjt(rows, batch=4, seed=5, id_dtype=torch.int32)
    int64 = make_kjt(rows, batch=4, seed=5)
    assert torch.equal(qebc(int32).values(), qebc(int64).values())
    empty = make_kjt(rows, batch=0, seed=5)
    assert tuple(qebc(empty).values().shape) == (0, 8 + 8 + 4 + 12 + 16)
    bad = KeyedJaggedTensor.from_lengths_sync(
        list(rows), torch.tensor([0, 1, 7, 3, 4]), torch.tensor([1, 1, 1, 1, 1])
    )
    with pytest.raises(ValueError, match="f2"):  # table t1 has 7 rows
        qebc(bad)


def test_bad_dtype_or_dim_names_the_table_and_changes_nothing() -> None:
    configs = bag_tables() + [
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=6, name="odd", feature_names=["g"])
    ]
    model = nn.Sequential(EmbeddingBagCollection(configs))
    with pytest.raises(ValueError, match=r"table 't0'.*bfloat16"):
        quantize_embeddings(model, torch.bfloat16)
    with pytest.raises(ValueError, match=r"table 'odd'.*embedding_dim 6.*INT2.*multiple of 4"):
        quantize_embeddings(model, torch.quint2x4)
    assert type(model[0]) is EmbeddingBagCollection  # checked before anything changed
    quantize_embeddings(model, torch.quint4x2)  # 6 is even: INT4 holds it
    with pytest.raises(ValueError, match=r"table 'x'.*embedding_dim 3.*INT4"):
        QuantEmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=4, embedding_dim=3, name="x", data_type=DataType.INT4
                )
            ]
        )
    with pytest.raises(ValueError, match=r"table 'x'.*BF16"):
        QuantEmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=4, embedding_dim=4, name="x", data_type=DataType.BF16
                )
            ]
        )
    big = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=2,
                embedding_dim=4,
                name="big",
                weight_init_min=7e4,
                weight_init_max=8e4,
            )
        ]
    )
    with pytest.raises(ValueError, match=r"table 'big'.*fp16's range"):
        quantize_embeddings(big, torch.float16)


EC_TABLES = [
    EmbeddingConfig(num_embeddings=30, embedding_dim=8, name="e0", feature_names=["a", "b"]),
    EmbeddingConfig(num_embeddings=12, embedding_dim=4, name="e1", feature_names=["c"]),
    EmbeddingConfig(num_embeddings=5, embedding_dim=8, name="e2", feature_names=["d"]),
]


def _one_id_each(keys: List[str], bad_key: str, bad_id: int) -> KeyedJaggedTensor:
    """Batch 1, one id per key (id 1), the id of `bad_key` replaced by `bad_id`."""
    values = torch.tensor([bad_id if k == bad_key else 1 for k in keys])
    return KeyedJaggedTensor.from_lengths_sync(
        keys, values, torch.ones(len(keys), dtype=torch.int64)
    )


@pytest.mark.parametrize("bad_id", [5, 29, 30, -1, -7])
def test_forward_refuses_an_id_outside_its_table_naming_feature_and_id(bad_id: int) -> None:
    """fbgemm's inference kernel checks no id: forward does (one bounds check over every
    key), and the error names the table, the feature and the id. Table e2 (5 rows) shares
    a kernel with e0 (30 rows): ids 5..29 are rows of the kernel but not of e2."""
    qec = QuantEmbeddingCollection.from_float(EmbeddingCollection(EC_TABLES), torch.qint8)
    message = rf"table 'e2', feature 'd': id {bad_id} is outside \[0, 5\)"
    with pytest.raises(ValueError, match=message):
        qec(_one_id_each(["d", "c", "b", "a"], "d", bad_id))
    bags = [
        EmbeddingBagConfig(
            num_embeddings=c.num_embeddings,
            embedding_dim=c.embedding_dim,
            name=c.name,
            feature_names=c.feature_names,
        )
        for c in EC_TABLES
    ]
    qebc = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(bags), torch.quint4x2)
    with pytest.raises(ValueError, match=message):
        qebc(_one_id_each(["a", "b", "c", "d"], "d", bad_id))


def test_nonfinite_weights_are_left_to_validate_input() -> None:
    """Forward runs the checks that keep the kernel in its memory; a NaN per-id weight (a
    pass over every weight) is `validate_input`'s, as in the float collections."""
    qebc = QuantEmbeddingBagCollection.from_float(
        EmbeddingBagCollection(bag_tables(), is_weighted=True), torch.qint8
    )
    kjt = make_kjt(feature_rows(bag_tables()), batch=6, seed=7, weighted=True)
    weights = kjt.weights().clone()
    weights[0] = float("nan")
    nan = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), weights)
    assert torch.isnan(qebc(nan).values()).any()
    with pytest.raises(
        ValueError, match=r"weight nan at position 0 of the feature's values is not finite"
    ):
        qebc.validate_input(nan)
    qebc.validate_input(kjt)
    qec = QuantEmbeddingCollection.from_float(EmbeddingCollection(EC_TABLES), torch.qint8)
    with pytest.raises(ValueError, match=r"table 'e2', feature 'd': id 5 is outside \[0, 5\)"):
        qec.validate_input(_one_id_each(["a", "b", "c", "d"], "d", 5))


@pytest.mark.parametrize(
    "lengths,offsets,message",
    [
        (None, [2, 3, 5], "offsets must start at 0, got 2"),
        ([1, 2], [0, 4, 3], "offsets decrease at entry 2"),
    ],
)
def test_bag_offsets_outside_the_values_are_refused(lengths, offsets, message) -> None:  # noqa: ANN001
    """fbgemm's kernels read ids at the bag offsets unchecked: offsets given by the caller
    that leave `values` are refused before the lookup, float and quantized."""
    kjt = KeyedJaggedTensor(
        ["f0"],
        torch.tensor([1, 2, 3]),
        offsets=torch.tensor(offsets),
        lengths=None if lengths is None else torch.tensor(lengths),
    )
    float_ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=40, embedding_dim=8, name="t0", feature_names=["f0"])]
    )
    for module in (float_ebc, QuantEmbeddingBagCollection.from_float(float_ebc, torch.qint8)):
        with pytest.raises(ValueError, match=message):
            module(kjt)


def test_quant_ebc_refuses_a_variable_batch_per_feature() -> None:
    """The inference kernel pools one batch: a 1-user / 3-item batch would come back as 2 rows
    (TorchRec's quantized EBC returns them silently); refused, naming the batch sizes."""
    tables = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=8, name=f"t_{f}", feature_names=[f])
        for f in ("user", "item")
    ]
    qebc = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(tables))
    kjt = KeyedJaggedTensor(
        ["user", "item"],
        torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([1, 1, 1, 1]),
        stride_per_key_per_rank=[[1], [3]],
        inverse_indices=(["user", "item"], torch.tensor([[0, 0, 0], [0, 1, 2]])),
    )
    with pytest.raises(ValueError, match=r"different batch sizes \{'user': 1, 'item': 3\}"):
        qebc(kjt)
