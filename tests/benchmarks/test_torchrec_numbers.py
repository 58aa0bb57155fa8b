"""benchmarks/torchrec_numbers.py without TorchRec: its script ports by the codemod alone (every
torchrec name mapped), and the comparison's pieces put shards together and map TorchRec's
state names as the docs say (the run against TorchRec itself needs its venv: --venv)."""

from __future__ import annotations

import re

import torch

from benchmarks.torchrec_numbers import (
    SCRIPT,
    assemble,
    compare,
    torchrec_optimizer_keys,
    torchrec_quant_rows,
)
from recshard.port.codemod import port_source


def test_the_script_ports_by_the_codemod_alone() -> None:
    result = port_source(SCRIPT.read_text())
    assert result.issues == []
    assert re.search(r"^\s*(from|import)\s+torchrec\b", SCRIPT.read_text(), re.M)
    assert not re.search(r"^\s*(from|import)\s+torchrec\b", result.code, re.M)
    assert not re.search(r"\btorchrec\.", result.code)


def test_assemble_puts_shards_together_and_marks_clashes_and_holes() -> None:
    full = torch.arange(12.0).reshape(4, 3)
    ranks = [
        {"w": ([4, 3], [([0, 0], full[:2])]), "loss": torch.tensor(1.0)},
        {"w": ([4, 3], [([2, 0], full[2:])]), "loss": torch.tensor(2.0)},
    ]
    out = assemble(ranks)
    assert torch.equal(out["w"], full)
    assert torch.equal(out["rank1/loss"], torch.tensor(2.0))
    clash = [{"w": ([2], [([0], torch.tensor([1.0]))])}, {"w": ([2], [([0], torch.tensor([2.0]))])}]
    assert assemble(clash)["w"].isnan().all()  # one value held twice, differently; one held never


def test_torchrec_state_names_map_to_recshards() -> None:
    ours = {
        "o.ebc.embedding_bags.t0.weight.t0.momentum1": torch.zeros(4),
        "o.ebc.embedding_bags.t2.weight.t2.momentum1@col0": torch.zeros(4),
        "o.ebc.embedding_bags.t2.weight.t2.momentum1@col4": torch.zeros(4),
    }
    theirs = {
        "o.ebc.embedding_bags.t0.weight.t0.momentum1": torch.ones(4),
        "o.ebc.embedding_bags.t2.weight.t2.momentum1": torch.arange(8.0),
    }
    theirs = {k.replace("o.", "fused_optimizer.", 1): v for k, v in theirs.items()}
    ours = {k.replace("o.", "fused_optimizer.", 1): v for k, v in ours.items()}
    mapped = torchrec_optimizer_keys(theirs, ours)
    assert set(mapped) == set(ours)
    assert torch.equal(
        mapped["fused_optimizer.ebc.embedding_bags.t2.weight.t2.momentum1@col4"],
        torch.arange(4.0, 8.0),
    )


def test_torchrec_quantized_rows_split_into_codes_scale_and_bias() -> None:
    scale_bias = torch.tensor([[0.5, -1.0]], dtype=torch.float16)
    codes = torch.arange(8, dtype=torch.uint8).reshape(1, 8)
    row = torch.cat([scale_bias.view(torch.uint8), codes, torch.zeros(1, 4, dtype=torch.uint8)], 1)
    ours = {
        "t.weight": codes,
        "t.weight_qscale": scale_bias[:, 0],
        "t.weight_qbias": scale_bias[:, 1],
    }
    mapped = torchrec_quant_rows({"t.weight": row}, ours)
    for key, value in ours.items():
        assert compare(key, mapped[key], value, 0.0, 0.0)["verdict"] == "equal", key
    assert (
        compare("x", torch.ones(2), torch.tensor([1.0, 1.1]), 1e-5, 1e-5)["verdict"] == "different"
    )
