"""One kernel call per group of tables in the unsharded EBC / EC: the per-table Parameters
are views of one flat storage per group, and everything a user does to them (optimizers,
load_state_dict, to(), .data, copies, meta + reset_parameters) still gives the outputs and
gradients of per-table torch lookups on the current weights."""

from __future__ import annotations

import copy
import io
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from recshard import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from recshard.modules.embedding_modules import EC_MAX_GROUP_BYTES
from recshard.optim import apply_optimizer_in_backward

# two SUM tables of different dims, one MEAN table between them (columns come back in config
# order), a table read by two features, a feature read by two tables
TABLES = [
    EmbeddingBagConfig(num_embeddings=9, embedding_dim=3, name="a", feature_names=["x", "y"]),
    EmbeddingBagConfig(
        num_embeddings=5,
        embedding_dim=2,
        name="b",
        feature_names=["w", "x"],
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="c", feature_names=["v"]),
]
OUTPUTS = {"x@a": ("x", "a"), "y": ("y", "a"), "w": ("w", "b"), "x@b": ("x", "b"), "v": ("v", "c")}
SEQ_TABLES = [
    EmbeddingConfig(
        num_embeddings=c.num_embeddings, embedding_dim=4, name=c.name, feature_names=c.feature_names
    )
    for c in TABLES
]


def batch(
    seed: int, weighted: bool = False, ids_dtype: torch.dtype = torch.int64
) -> KeyedJaggedTensor:
    """Batch 5, keys out of config order, ids < 5 (valid in every table)."""
    keys, g = ["v", "x", "w", "y"], torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * 5,), generator=g)
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=g).to(ids_dtype)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)


def reference_pooled(ebc: EmbeddingBagCollection, features: KeyedJaggedTensor) -> torch.Tensor:
    """Per feature, `F.embedding_bag` on the table's current weight (what TorchRec runs)."""
    configs = {c.name: c for c in ebc.embedding_bag_configs()}
    jts = features.to_dict()
    pieces = []
    for feature, table in OUTPUTS.values():
        jt, config = jts[feature], configs[table]
        sums = F.embedding_bag(
            jt.values(),
            ebc.embedding_bags[table].weight,
            jt.offsets()[:-1],
            mode="sum",
            per_sample_weights=jt.weights_or_none(),
        )
        if config.pooling == PoolingType.MEAN:
            sums = sums / jt.lengths().clamp(min=1).unsqueeze(1)
        pieces.append(sums)
    return torch.cat(pieces, dim=1)


def kernel_calls(fn) -> Dict[str, int]:  # noqa: ANN001
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {
        e.key: e.count
        for e in prof.key_averages()
        if e.key.startswith(("fbgemm::", "aten::embedding"))
    }


def check_against_reference(ebc: EmbeddingBagCollection, features: KeyedJaggedTensor) -> None:
    """Forward and table gradients equal per-feature lookups on the current weights."""
    ebc.zero_grad(set_to_none=True)
    out = ebc(features)
    assert out.keys() == list(OUTPUTS)
    expected = reference_pooled(ebc, features)
    torch.testing.assert_close(out.values(), expected)
    grad = torch.randn_like(expected)
    out.values().backward(grad)
    got = {name: bag.weight.grad.clone() for name, bag in ebc.embedding_bags.items()}
    ebc.zero_grad(set_to_none=True)
    reference_pooled(ebc, features).backward(grad)
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(got[name], bag.weight.grad)


def test_tables_of_a_group_share_one_storage_and_one_kernel_call() -> None:
    ebc = EmbeddingBagCollection(TABLES)
    storage = {n: b.weight.untyped_storage().data_ptr() for n, b in ebc.embedding_bags.items()}
    assert storage["a"] == storage["c"] != storage["b"]  # SUM tables together, MEAN apart
    assert list(ebc.state_dict()) == [f"embedding_bags.{t}.weight" for t in "abc"]
    features = batch(0)
    calls = kernel_calls(lambda: ebc(features).values().sum().backward())
    assert calls.get("fbgemm::split_embedding_codegen_forward_cpu") == 2  # one per group
    assert calls.get("fbgemm::split_embedding_backward_codegen_dense_cpu") == 2
    assert "aten::embedding_bag" not in calls
    grads = {n: b.weight.grad.untyped_storage().data_ptr() for n, b in ebc.embedding_bags.items()}
    assert grads["a"] == grads["c"] != grads["b"]  # views of the group's one flat gradient
    ec = EmbeddingCollection(SEQ_TABLES)
    calls = kernel_calls(lambda: sum(jt.values().sum() for jt in ec(features).values()).backward())
    assert calls.get("aten::embedding") == 1
    assert calls.get("fbgemm::split_embedding_backward_codegen_dense_cpu") == 1


def test_ec_groups_stop_at_the_byte_cap() -> None:
    """Past `EC_MAX_GROUP_BYTES` of weights a new group starts (big per-step buffers cost
    page faults): 3 tables of 6 MiB with a 16 MiB cap make groups of 2 and 1."""
    rows = (6 << 20) // (4 * 64)
    ec = EmbeddingCollection(
        [
            EmbeddingConfig(
                num_embeddings=rows, embedding_dim=64, name=f"t{i}", feature_names=[f"f{i}"]
            )
            for i in range(3)
        ]
    )
    assert EC_MAX_GROUP_BYTES == 16 << 20
    storage = [e.weight.untyped_storage().data_ptr() for e in ec.embeddings.values()]
    assert storage[0] == storage[1] != storage[2]


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_grouped_lookup_matches_per_table_lookups(weighted: bool, ids_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    check_against_reference(
        EmbeddingBagCollection(TABLES, is_weighted=weighted), batch(1, weighted, ids_dtype)
    )


def test_per_id_weight_gradients() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=True)
    features = batch(2, weighted=True)
    weights = features.weights().clone().requires_grad_()
    grouped = KeyedJaggedTensor.from_lengths_sync(
        features.keys(), features.values(), features.lengths(), weights=weights
    )
    grad = torch.randn(5, sum(c.embedding_dim * len(c.feature_names) for c in TABLES))
    (ebc(grouped).values() * grad).sum().backward()
    expected_weights = features.weights().clone().requires_grad_()
    reference = KeyedJaggedTensor.from_lengths_sync(
        features.keys(), features.values(), features.lengths(), weights=expected_weights
    )
    (reference_pooled(ebc, reference) * grad).sum().backward()
    torch.testing.assert_close(weights.grad, expected_weights.grad)


def test_moved_or_replaced_tables_are_regrouped() -> None:
    """Every way a table can leave its flat storage: outputs and gradients follow the
    current weights, and Parameter identity is kept where the user kept it."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    features = batch(3)
    weight_a = ebc.embedding_bags["a"].weight
    weight_a.data = torch.randn(9, 3)  # off the storage
    check_against_reference(ebc, features)
    assert ebc.embedding_bags["a"].weight is weight_a
    state = {k: torch.randn_like(v) for k, v in ebc.state_dict().items()}
    ebc.load_state_dict(state, assign=True)  # new Parameters
    check_against_reference(ebc, features)
    torch.testing.assert_close(ebc.embedding_bags["b"].weight, state["embedding_bags.b.weight"])
    ebc.load_state_dict({k: v + 1 for k, v in state.items()})  # in place
    torch.testing.assert_close(ebc.embedding_bags["c"].weight, state["embedding_bags.c.weight"] + 1)
    check_against_reference(ebc, features)
    twin = copy.deepcopy(ebc)
    check_against_reference(twin, features)
    torch.testing.assert_close(twin(features).values(), ebc(features).values())
    double = copy.deepcopy(ebc).to(torch.float64)  # off fbgemm's float32 kernels: per-table path
    out = double(
        KeyedJaggedTensor.from_lengths_sync(features.keys(), features.values(), features.lengths())
    )
    assert out.values().dtype == torch.float64
    torch.testing.assert_close(out.values().float(), ebc(features).values())


def _set_(ebc: EmbeddingBagCollection) -> None:
    with torch.no_grad():
        ebc.embedding_bags["c"].weight.set_(torch.randn(7, 4))


def _swap_tensors(ebc: EmbeddingBagCollection) -> None:
    torch.utils.swap_tensors(ebc.embedding_bags["a"].weight, torch.nn.Parameter(torch.randn(9, 3)))


def _new_table_module(ebc: EmbeddingBagCollection) -> None:
    ebc.embedding_bags["c"] = torch.nn.EmbeddingBag(7, 4, mode="sum", include_last_offset=True)


def _child_load_assign(ebc: EmbeddingBagCollection) -> None:
    ebc.embedding_bags["a"].load_state_dict({"weight": torch.randn(9, 3)}, assign=True)


def _pickled(ebc: EmbeddingBagCollection) -> EmbeddingBagCollection:
    buffer = io.BytesIO()
    torch.save(ebc, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize(
    "change", [_set_, _swap_tensors, _new_table_module, _child_load_assign, None]
)
def test_changes_the_collection_does_not_see_are_found_on_the_next_call(change) -> None:  # noqa: ANN001
    """Storage changes no hook of the collection sees (`set_`, `swap_tensors`, a replaced
    table module, a table module's own assign load, a pickle round trip) after a first call
    bound the groups: the next call reads the current weights."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    features = batch(12)
    check_against_reference(ebc, features)
    if change is None:
        ebc = _pickled(ebc)
    else:
        change(ebc)
    check_against_reference(ebc, features)
    storage = {
        b.weight.untyped_storage().data_ptr() for n, b in ebc.embedding_bags.items() if n != "b"
    }
    assert len(storage) == 1  # regrouped


def test_frozen_table_gets_no_gradient() -> None:
    ebc = EmbeddingBagCollection(TABLES)
    ebc.embedding_bags["c"].weight.requires_grad_(False)
    ebc(batch(4)).values().sum().backward()
    assert ebc.embedding_bags["c"].weight.grad is None
    assert ebc.embedding_bags["a"].weight.grad is not None


def _reference_modules(ebc: EmbeddingBagCollection) -> Dict[str, torch.nn.Parameter]:
    return {n: torch.nn.Parameter(b.weight.detach().clone()) for n, b in ebc.embedding_bags.items()}


def _reference_loss(
    params: Dict[str, torch.nn.Parameter], features: KeyedJaggedTensor
) -> torch.Tensor:
    jts = features.to_dict()
    configs = {c.name: c for c in TABLES}
    loss = torch.zeros(())
    for feature, table in OUTPUTS.values():
        jt = jts[feature]
        sums = F.embedding_bag(jt.values(), params[table], jt.offsets()[:-1], mode="sum")
        if configs[table].pooling == PoolingType.MEAN:
            sums = sums / jt.lengths().clamp(min=1).unsqueeze(1)
        loss = loss + (sums**2).sum()
    return loss


@pytest.mark.parametrize("optimizer", ["adam", "sgd_in_backward", "adagrad_in_backward"])
def test_optimizers_step_every_table_as_per_table_lookups(optimizer: str) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    params = _reference_modules(ebc)
    if optimizer == "adam":
        steppers = [
            torch.optim.Adam(ebc.parameters(), lr=0.1),
            torch.optim.Adam(params.values(), lr=0.1),
        ]
    else:
        cls = torch.optim.SGD if optimizer.startswith("sgd") else torch.optim.Adagrad
        apply_optimizer_in_backward(cls, ebc.parameters(), {"lr": 0.1})
        apply_optimizer_in_backward(cls, params.values(), {"lr": 0.1})
        steppers = []
    for step in range(3):
        features = batch(10 + step)
        (ebc(features).values() ** 2).sum().backward()
        _reference_loss(params, features).backward()
        for s in steppers:
            s.step()
            s.zero_grad()
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(bag.weight, params[name], rtol=1e-5, atol=1e-6)
    storage = {
        b.weight.untyped_storage().data_ptr() for n, b in ebc.embedding_bags.items() if n != "b"
    }
    assert len(storage) == 1  # in-place steps keep the group's storage


def test_meta_then_reset_parameters_groups_the_materialized_tables() -> None:
    ebc = EmbeddingBagCollection(TABLES, device="meta")
    assert ebc(batch(5).to(torch.device("meta"))).values().shape == (5, 3 + 3 + 2 + 2 + 4)
    ebc.reset_parameters()
    assert (
        ebc.embedding_bags["a"].weight.untyped_storage().data_ptr()
        == ebc.embedding_bags["c"].weight.untyped_storage().data_ptr()
    )
    check_against_reference(ebc, batch(6))


def _bad(features: KeyedJaggedTensor, key: str, bad_id: int) -> KeyedJaggedTensor:
    """`features` with the first id of `key` replaced by `bad_id`."""
    values = features.values().clone()
    at = features.offset_per_key()[features.keys().index(key)]
    values[at] = bad_id
    return KeyedJaggedTensor.from_lengths_sync(features.keys(), values, features.lengths())


@pytest.mark.parametrize("bad_id", [7, 9, 21, -1])
def test_an_id_past_its_table_never_reads_the_next_table(bad_id: int) -> None:
    """Table c (7 rows) follows table a (9 rows) in one flat storage: ids 7..8 would be rows of
    the storage but are outside c; the kernel refuses them and the error names c and v."""
    features = _bad(batch(7), "v", bad_id)
    message = rf"table 'c', feature 'v': id {bad_id} is outside \[0, 7\)"
    with pytest.raises(ValueError, match=message):
        EmbeddingBagCollection(TABLES)(features)
    with pytest.raises(ValueError, match=message):
        EmbeddingCollection(SEQ_TABLES)(features)


def test_validate_input_runs_the_checks_forward_leaves_out() -> None:
    ebc = EmbeddingBagCollection(TABLES, is_weighted=True)
    features = batch(8, weighted=True)
    weights = features.weights().clone()
    weights[3] = float("nan")
    nan = KeyedJaggedTensor.from_lengths_sync(
        features.keys(), features.values(), features.lengths(), weights=weights
    )
    assert torch.isnan(ebc(nan).values()).any()  # forward: no pass over the weights
    with pytest.raises(
        ValueError, match=r"weight nan at position \d+ of the feature's values is not finite"
    ):
        ebc.validate_input(nan)
    with pytest.raises(ValueError, match=r"table 'c', feature 'v': id 8 is outside \[0, 7\)"):
        ebc.validate_input(_bad(features, "v", 8))
    ebc.validate_input(features)


def check_ec_rows_and_grads(ec: EmbeddingCollection, features: KeyedJaggedTensor) -> None:
    """Each output's rows are its table's rows at the feature's ids, in OUTPUTS' order, and a
    weighted sum's gradient lands on those rows of the right table."""
    out = ec(features)
    assert list(out) == list(OUTPUTS)
    jts = features.to_dict()
    grads: Dict[str, torch.Tensor] = {
        n: torch.zeros_like(e.weight) for n, e in ec.embeddings.items()
    }
    losses: List[torch.Tensor] = []
    for name, (feature, table) in OUTPUTS.items():
        ids = jts[feature].values()
        assert torch.equal(out[name].values(), ec.embeddings[table].weight[ids])
        scale = torch.randn_like(out[name].values())
        losses.append((out[name].values() * scale).sum())
        grads[table].index_add_(0, ids, scale)
    torch.stack(losses).sum().backward()
    for name, emb in ec.embeddings.items():
        torch.testing.assert_close(emb.weight.grad, grads[name])


def test_ec_grouped_lookup_matches_per_table_rows() -> None:
    torch.manual_seed(0)
    ec = EmbeddingCollection(SEQ_TABLES, need_indices=True)
    features = batch(9)
    check_ec_rows_and_grads(ec, features)


ONE_DIM_TABLES = [
    EmbeddingBagConfig(
        num_embeddings=c.num_embeddings,
        embedding_dim=4,
        name=c.name,
        feature_names=c.feature_names,
        pooling=c.pooling,
    )
    for c in TABLES
]


def test_torch_path_is_one_call_per_group_of_one_dim() -> None:
    """Off fbgemm's float32 CPU kernels (float64 here; CUDA, fp16 and bf16 take the same
    path) a group whose tables share a dim is one torch call over its flat storage, with the
    outputs and gradients of per-table lookups; an id past its table still names it."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(ONE_DIM_TABLES).to(torch.float64)
    features = batch(13)
    calls = kernel_calls(lambda: ebc(features))
    assert (
        calls.get("aten::embedding_bag") == 2
        and "fbgemm::split_embedding_codegen_forward_cpu" not in calls
    )
    check_against_reference(ebc, features)
    ec = EmbeddingCollection(SEQ_TABLES).to(torch.float64)
    assert kernel_calls(lambda: ec(features)).get("aten::embedding") == 1
    check_ec_rows_and_grads(ec, features)
    message = r"table 'c', feature 'v': id 8 is outside \[0, 7\)"
    for module in (ebc, ec):
        with pytest.raises(ValueError, match=message):
            module(_bad(features, "v", 8))
