"""`python -m recshard.port`: TorchRec imports rewritten to recshard's with formatting kept,
unmapped names reported with the reason, `--check`, notebooks, and sample scripts written for
TorchRec that run once ported."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from recshard.port import MODULE_MAP, port_notebook, port_source
from recshard.port.cli import main
from recshard.port.mapping import not_provided_reason, provides

SAMPLES = Path(__file__).parent / "samples"
REPO = Path(__file__).parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_env() -> Dict[str, str]:
    """One rank of a gloo job, as torchrun would set it up."""
    return dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        PYTHONPATH=str(REPO),
    )


def test_every_mapped_module_imports() -> None:
    for torchrec_module, recshard_module in MODULE_MAP.items():
        assert torchrec_module.split(".")[0] == "torchrec"
        importlib.import_module(recshard_module)


def test_provides_only_recshards_own_names() -> None:
    assert provides("recshard.types", "ShardingType")
    assert provides("recshard.datasets.criteo", "DEFAULT_CAT_NAMES")  # a plain constant
    assert provides("recshard.datasets", "random")  # a submodule
    assert not provides("recshard.types", "List")  # imported from typing
    assert not provides("recshard.types", "torch")
    assert not provides("recshard.sparse", "_private")


def test_from_imports_keep_formatting_and_split_by_module() -> None:
    source = (
        "import os  # first\n"
        "from torchrec.models.dlrm import (\n"
        "    DLRM,  # the model\n"
        "    DLRMTrain as Train,\n"
        ")\n"
        "from torchrec.distributed.types import ShardingType\n"
        "from torchrec.distributed import DistributedModelParallel, sharding_plan\n"
        "from torchrec import distributed as trec_dist\n"
        "x = trec_dist.DistributedModelParallel\n"
    )
    expected = (
        "import os  # first\n"
        "from recshard.models.dlrm import (\n"
        "    DLRM,  # the model\n"
        "    DLRMTrain as Train,\n"
        ")\n"
        "from recshard.types import ShardingType\n"
        "from recshard.distributed import DistributedModelParallel, sharding_plan\n"
        "from recshard import distributed as trec_dist\n"
        "x = trec_dist.DistributedModelParallel\n"
    )
    result = port_source(source)
    assert result.code == expected and result.issues == []
    assert port_source(expected).code == expected  # nothing left to do


def test_dotted_uses_follow_the_import() -> None:
    source = (
        "import torchrec\n"
        "import torchrec.sparse.jagged_tensor as jt\n"
        "ebc = torchrec.EmbeddingBagCollection(tables=[], device='meta')\n"
        "kjt = torchrec.sparse.jagged_tensor.KeyedJaggedTensor.from_lengths_sync(\n"
        "    keys=['f'], values=v, lengths=l)\n"
        "dmp = torchrec.distributed.DistributedModelParallel(ebc)\n"
        "jt2 = jt.JaggedTensor\n"
    )
    expected = (
        "import recshard, recshard.distributed, recshard.sparse\n"
        "import recshard.sparse as jt\n"
        "ebc = recshard.EmbeddingBagCollection(tables=[], device='meta')\n"
        "kjt = recshard.sparse.KeyedJaggedTensor.from_lengths_sync(\n"
        "    keys=['f'], values=v, lengths=l)\n"
        "dmp = recshard.distributed.DistributedModelParallel(ebc)\n"
        "jt2 = jt.JaggedTensor\n"
    )
    result = port_source(source)
    assert result.code == expected and result.issues == []


def test_unmapped_names_are_reported_and_left() -> None:
    source = (
        "import torchrec\n"
        "import torchrec.distributed as trec_dist\n"
        "from torchrec.distributed.types import ShardingType, NotAThing\n"
        "from torchrec.modules.itep_modules import GenericITEPModule\n"
        "ne = torchrec.metrics.NE\n"
        "topology = trec_dist.planner.Topology\n"
    )
    result = port_source(source)
    lines = result.code.splitlines()
    assert lines[2:4] == [
        "from recshard.types import ShardingType",
        "from torchrec.distributed.types import NotAThing",
    ]
    assert lines[4] == "from torchrec.modules.itep_modules import GenericITEPModule"
    assert lines[5:] == ["ne = torchrec.metrics.NE", "topology = trec_dist.planner.Topology"]
    found = {(i.line, i.name): i.reason for i in result.issues}
    assert found == {
        (
            3,
            "torchrec.distributed.types.NotAThing",
        ): "recshard.types has no NotAThing (TorchRec's torchrec.distributed.types.NotAThing)",
        (
            4,
            "torchrec.modules.itep_modules.GenericITEPModule",
        ): "not provided: recshard does not have it yet",
        (5, "torchrec.metrics.NE"): (
            "not provided: TorchRec's RecMetrics: use torchmetrics (AUROC, NE)"
        ),
        (
            6,
            "trec_dist.planner.Topology",
        ): (
            "recshard.planner.Topology is not under recshard.distributed; "
            "import it from recshard.planner"
        ),
    }


def test_names_from_torchrecs_defining_modules_map() -> None:
    """TorchRec's tests import from the module that defines a name; where recshard has the
    name, that import maps too (DataType lives in torchrec.types, RowWiseAdagrad in its own)."""
    source = (
        "from torchrec.types import DataType\n"
        "from torchrec.optim.rowwise_adagrad import RowWiseAdagrad\n"
        "from torchrec.optim.fused import FusedOptimizer\n"
        "from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage\n"
        "from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer\n"
        "from torchrec.modules.regroup import KTRegroupAsDict\n"
        "from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor\n"
    )
    expected = (
        "from recshard import DataType\n"
        "from recshard.optim import RowWiseAdagrad\n"
        "from recshard.optim import FusedOptimizer\n"
        "from recshard.optim import WarmupOptimizer, WarmupPolicy, WarmupStage\n"
        "from recshard.optim import GradientClipping, GradientClippingOptimizer\n"
        "from recshard.modules.regroup import KTRegroupAsDict\n"
        "from recshard.sparse.validation import validate_keyed_jagged_tensor\n"
    )
    result = port_source(source)
    assert result.code == expected and result.issues == []


def test_torchrecs_quantized_collections_map_to_the_quantized_classes() -> None:
    """`torchrec.quant(.embedding_modules).EmbeddingBagCollection` is the quantized EBC (the
    tutorial's `quantize_dynamic` mapping); it must not fall through to the float one."""
    source = (
        "from torchrec.quant.embedding_modules import EmbeddingBagCollection as QEBC\n"
        "from torchrec.quant import EmbeddingCollection\n"
    )
    result = port_source(source)
    assert result.issues == []
    namespace: Dict[str, object] = {}
    exec(result.code, namespace)
    from recshard.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection

    assert namespace["QEBC"] is QuantEmbeddingBagCollection
    assert namespace["EmbeddingCollection"] is QuantEmbeddingCollection


def test_split_parenthesized_import_keeps_its_shape() -> None:
    source = (
        "from torchrec.models.dlrm import (\n    DLRM,\n    DLRM_Projection,\n    DLRMTrain,\n)\n"
    )
    result = port_source(source)
    assert result.code == (
        "from recshard.models.dlrm import (\n"
        "    DLRM,\n"
        "    DLRMTrain,\n"
        ")\n"
        "from torchrec.models.dlrm import (\n"
        "    DLRM_Projection,\n"
        ")\n"
    )
    assert [i.name for i in result.issues] == ["torchrec.models.dlrm.DLRM_Projection"]


def test_cli_check_only_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("from torchrec.distributed.types import ShardingType, NotAThing\n")
    assert main(["--check", str(script)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{script}:1: torchrec.distributed.types.NotAThing: recshard.types has no "
        "NotAThing (TorchRec's torchrec.distributed.types.NotAThing)",
        f"would rewrite {script}",
    ]
    assert script.read_text() == "from torchrec.distributed.types import ShardingType, NotAThing\n"
    clean = tmp_path / "clean.py"
    clean.write_text("from torchrec.models.dlrm import DLRM\n")
    assert main([str(clean)]) == 0
    assert clean.read_text() == "from recshard.models.dlrm import DLRM\n"
    assert main(["--check", str(clean)]) == 0


def test_golden_style_script_runs_after_port(tmp_path: Path) -> None:
    script = tmp_path / "train_dlrm.py"
    shutil.copy(SAMPLES / "golden_training_style.py.txt", script)
    ported = subprocess.run(
        [sys.executable, "-m", "recshard.port", str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert ported.returncode == 0, ported.stdout + ported.stderr
    text = script.read_text()
    assert "torchrec" not in text.replace("TorchRec", "")
    assert "# one table per categorical feature, built on meta" in text  # comments kept
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    loss = float(run.stdout.split("final loss")[1])
    assert 0 < loss < 10


def test_notebook_ports_across_cells_and_runs(tmp_path: Path) -> None:
    original = (SAMPLES / "introduction_style.ipynb").read_text()
    text, issues = port_notebook(original)
    assert [(cell, i.line, i.name) for cell, i in issues] == [(1, 1, "pip install torchrec")]
    before, after = json.loads(original), json.loads(text)
    assert before["cells"][0] == after["cells"][0]  # markdown untouched
    sources = ["".join(c["source"]) for c in after["cells"] if c["cell_type"] == "code"]
    assert sources[0] == "".join(before["cells"][1]["source"])  # the shell line stays
    assert "import recshard, recshard.distributed\n" in sources[1]
    assert "recshard.EmbeddingBagCollection(" in sources[2]
    assert sources[4].startswith("%time\nmb = recshard.KeyedJaggedTensor(")
    assert all("torchrec" not in s for s in sources[1:])
    assert port_notebook(text)[0] == text  # already ported: byte for byte
    code = "\n".join(
        line for s in sources for line in s.split("\n") if not line.lstrip().startswith(("!", "%"))
    )
    script = tmp_path / "notebook.py"
    script.write_text(code)
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("torch.Size([3, 16])")


def test_feature_processor_imports_port_and_run() -> None:
    """TorchRec's feature-processor module paths port, and the ported code runs."""
    source = (
        "from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection\n"
        "from torchrec.modules.fp_embedding_modules import (\n"
        "    FeatureProcessedEmbeddingBagCollection,\n"
        ")\n"
        "from torchrec.distributed.fp_embeddingbag import (\n"
        "    FeatureProcessedEmbeddingBagCollectionSharder,\n"
        ")\n"
        "from torchrec.distributed.grouped_position_weighted import GroupedPositionWeightedModule\n"
        "from torchrec.modules.feature_processor import PositionWeightedModule\n"
        "from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor\n"
        "ebc = EmbeddingBagCollection(\n"
        "    [EmbeddingBagConfig(name='t', embedding_dim=4, num_embeddings=10,"
        " feature_names=['f'])],\n"
        "    is_weighted=True,\n"
        ")\n"
        "fp = FeatureProcessedEmbeddingBagCollection("
        "ebc, PositionWeightedModuleCollection({'f': 3}))\n"
        "kjt = KeyedJaggedTensor.from_lengths_sync("
        "['f'], torch.tensor([1, 2, 3]), torch.tensor([3]))\n"
        "out = fp(kjt)['f']\n"
        "sharder = FeatureProcessedEmbeddingBagCollectionSharder()\n"
        "grouped = GroupedPositionWeightedModule({'f': 3})\n"
        "old = PositionWeightedModule({'f': 3})\n"
    )
    result = port_source(source)
    assert result.issues == [] and "torchrec" not in result.code, result.code
    assert "from recshard.distributed.fp_embeddingbag import (" in result.code
    scope: Dict[str, object] = {"torch": __import__("torch")}
    exec(compile(result.code, "<ported>", "exec"), scope)  # noqa: S102 - our own sample
    ebc_out = scope["ebc"](
        scope["kjt"].__class__.from_lengths_sync(
            ["f"],
            scope["torch"].tensor([1, 2, 3]),
            scope["torch"].tensor([3]),
            scope["torch"].ones(3),
        )
    )["f"]
    assert scope["torch"].equal(scope["out"], ebc_out)  # position weights start at 1.0


def test_every_torchrec_module_path_is_mapped_or_excluded_with_a_reason() -> None:
    listed = [
        line
        for line in (Path(__file__).parent / "torchrec_modules.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert "torchrec.distributed.embeddingbag" in listed and len(listed) > 200
    for module in listed:
        if module in MODULE_MAP:
            continue
        reason = not_provided_reason(module)
        assert reason is not None, f"{module}: neither mapped nor excluded with a reason"
        found = port_source(f"from {module} import Anything\n").issues
        assert [i.reason for i in found] == [reason], module


def test_names_torchrec_modules_re_export_are_found() -> None:
    source = (
        "from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward\n"
        "from torchrec.optim import apply_optimizer_in_backward as aob\n"
        "from torchrec.distributed.planner.types import ParameterConstraints, ShardingPlan\n"
        "from torchrec.distributed.embedding_types import ShardingType\n"
        "from torchrec.distributed.planner.enumerators import EmbeddingEnumerator\n"
        "from torchrec.modules.embedding_configs import QuantConfig\n"
        "from torchrec.distributed.shard import shard, shard_modules\n"
    )
    result = port_source(source)
    assert result.issues == []
    assert result.code == (
        "from recshard.optim.apply_optimizer_in_backward import apply_optimizer_in_backward\n"
        "from recshard.optim import apply_optimizer_in_backward as aob\n"
        "from recshard.planner import ParameterConstraints\n"
        "from recshard.types import ShardingPlan\n"
        "from recshard.distributed.embedding_types import ShardingType\n"
        "from recshard.planner import EmbeddingEnumerator\n"
        "from recshard.modules.embedding_configs import QuantConfig\n"
        "from recshard.distributed.shard import shard, shard_modules\n"
    )
    namespace: Dict[str, object] = {}
    exec(result.code, namespace)
    assert callable(namespace["apply_optimizer_in_backward"])
    assert namespace["aob"] is namespace["apply_optimizer_in_backward"]


def test_a_pattern_matching_nothing_is_one_line_and_exit_2(tmp_path: Path) -> None:
    ported = subprocess.run(
        [sys.executable, "-m", "recshard.port", str(tmp_path / "unit" / "*.ipynb")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert ported.returncode == 2
    assert ported.stdout == ""
    assert ported.stderr == f"recshard.port: no file matches {tmp_path / 'unit' / '*.ipynb'}\n"


def test_a_quoted_pattern_is_expanded(tmp_path: Path) -> None:
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("from torchrec.models.dlrm import DLRM\n")
    assert main([str(tmp_path / "*.py")]) == 0
    assert (tmp_path / "b.py").read_text() == "from recshard.models.dlrm import DLRM\n"


def test_report_summarises_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text(
        "from torchrec.distributed.types import ShardingType, NotAThing\n"
    )
    (tmp_path / "plain.py").write_text("import os\n")
    shutil.copy(SAMPLES / "introduction_style.ipynb", tmp_path / "intro.ipynb")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "skip.py").write_text("import torchrec\n")
    assert main(["--report", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    block = out[out.index("recshard.port report") :].splitlines()
    assert block == [
        "recshard.port report",
        f"{tmp_path / 'intro.ipynb'}: rewritten, 1 unmapped",
        "    pip install torchrec: "
        + port_notebook((SAMPLES / "introduction_style.ipynb").read_text())[1][0][1].reason,
        f"{tmp_path / 'plain.py'}: unchanged",
        f"{tmp_path / 'sub' / 'train.py'}: rewritten, 1 unmapped",
        "    torchrec.distributed.types.NotAThing: recshard.types has no NotAThing "
        "(TorchRec's torchrec.distributed.types.NotAThing)",
        "3 files: 2 rewritten, 2 unmapped names",
    ]
    assert (tmp_path / ".hidden" / "skip.py").read_text() == "import torchrec\n"
    assert main(["--report", str(tmp_path / "nothing")]) == 2
