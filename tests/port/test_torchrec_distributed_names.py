"""Every name of TorchRec's documented torchrec.distributed reference (kept as data in
torchrec_distributed_names.txt) is provided by recshard — the codemod maps it and the
rewritten import runs — or deliberately excluded, the codemod saying why."""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import pytest

from recshard.port import port_source

NAMES = Path(__file__).parent / "torchrec_distributed_names.txt"


def _listed() -> List[Tuple[str, str, bool]]:
    rows = []
    for line in NAMES.read_text().splitlines():
        if line and not line.startswith("#"):
            module, name, *flags = line.split()
            rows.append((module, name, flags == ["pending"]))
    return rows


@pytest.mark.parametrize("module,name,pending", _listed(), ids=lambda v: str(v))
def test_each_documented_name_is_provided_or_excluded_with_a_reason(
    module: str, name: str, pending: bool
) -> None:
    result = port_source(f"from {module} import {name}\n")
    if result.issues:  # excluded (or, if pending, not built yet): the codemod says why
        [issue] = result.issues
        assert issue.reason.startswith("not provided: "), (module, name, issue.reason)
        assert len(issue.reason) > len("not provided: ") + 10, issue.reason
        return
    assert "torchrec" not in result.code
    namespace: dict = {}
    exec(result.code, namespace)  # the rewritten import runs
    assert namespace[name] is not None


def test_the_list_holds_what_issue_39_names() -> None:
    listed = {(m, n) for m, n, _ in _listed()}
    assert len(listed) == len(_listed())  # no duplicates
    for must in [
        ("torchrec.distributed.collective_utils", "invoke_on_rank_and_broadcast_result"),
        ("torchrec.distributed.comm", "get_num_groups"),
        ("torchrec.distributed.dist_data", "KJTOneToAll"),
        ("torchrec.distributed.model_parallel", "DataParallelWrapper"),
        ("torchrec.distributed.embedding_types", "BaseEmbeddingSharder"),
        ("torchrec.distributed.comm_ops", "variable_batch_alltoall_pooled"),
    ]:
        assert must in listed, must
