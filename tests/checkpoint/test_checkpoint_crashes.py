"""Checkpoints survive crashes and damage.

A save killed before its commit point (while DCP writes, just before `LATEST` is replaced, or
racing a real write of a large model) leaves the previous checkpoint loadable with the previous
values; truncated, missing and mismatched checkpoints raise an
error naming the directory, the file or table and both sizes, before the model is touched.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Dict

import pytest
import torch
from dmp_cases import TinyDLRM, batch_for, make_optimizer, table_wise_dmp
from multiprocess import RankError, run_ranks

from recshard import EmbeddingBagCollection, EmbeddingBagConfig, checkpoint

PG_TIMEOUT_S = 20.0


def _ebc(rows: int = 64, dim: int = 8, seed: int = 0) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                num_embeddings=rows, embedding_dim=dim, name="t0", feature_names=["f0"]
            ),
            EmbeddingBagConfig(num_embeddings=32, embedding_dim=4, name="t1", feature_names=["f1"]),
        ]
    )


def _weights(model: EmbeddingBagCollection) -> Dict[str, torch.Tensor]:
    return {name: bag.weight.detach().clone() for name, bag in model.embedding_bags.items()}


def _second_save_killed(rank: int, ws: int, path: str, kill_at: str, rows: int, dim: int) -> str:
    """A second save (its own process, world size 1) that SIGKILLs itself at `kill_at`:
    write  - inside DCP's file writer, after the first item's bytes reached the shard file
    commit - just before LATEST is replaced (every shard file and manifest.json written)
    race   - a watcher thread kills the process as soon as the new ckpt-* directory appears,
             wherever the save is then (no hooks in the save itself)
    Returns "saved" only if the save finished before the kill (race)."""
    import threading

    import torch.distributed.checkpoint.filesystem as fs

    def die(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    model = _ebc(rows, dim, seed=1)
    if kill_at == "commit":
        os.replace = die  # this process only: save's commit point
    elif kill_at == "write":
        real_write = fs._write_item

        def write_then_die(transforms, stream, *args, **kwargs):  # noqa: ANN001, ANN202
            result = real_write(transforms, stream, *args, **kwargs)
            stream.flush()
            die()
            return result

        fs._write_item = write_then_die
    else:
        before = set(glob.glob(f"{path}/ckpt-*"))

        def watch() -> None:
            while not set(glob.glob(f"{path}/ckpt-*")) - before:
                time.sleep(0.001)
            die()

        threading.Thread(target=watch, daemon=True).start()
    checkpoint.save(path, model, extra={"save": 2})
    return "saved"


def _assert_previous_checkpoint_loads(
    path: str, first_dir: str, first: Dict[str, torch.Tensor], rows: int, dim: int
) -> None:
    assert str(checkpoint.latest_checkpoint(path)) == first_dir
    restored = _ebc(rows, dim, seed=5)
    assert checkpoint.load(path, restored) == {"save": 1}
    for name, weight in _weights(restored).items():
        torch.testing.assert_close(weight, first[name], rtol=0, atol=0, msg=name)


def _killed(path: str, kill_at: str, rows: int, dim: int) -> bool:
    """Run the second save; True if it was killed, False if it finished first."""
    try:
        run_ranks(1, _second_save_killed, path, kill_at, rows, dim, timeout=120)
    except RankError as e:
        assert f"exited with code {-signal.SIGKILL}" in str(e), str(e)
        return True
    return False


@pytest.mark.parametrize("kill_at", ["write", "commit"])
def test_save_killed_before_commit_keeps_previous_checkpoint(kill_at: str) -> None:
    with tempfile.TemporaryDirectory() as path:
        model = _ebc()
        first_dir = checkpoint.save(path, model, extra={"save": 1})
        first = _weights(model)
        assert _killed(path, kill_at, 64, 8)
        partial = [d for d in glob.glob(f"{path}/ckpt-*") if d != first_dir]
        assert len(partial) == 1, partial  # the killed save's directory is there, uncommitted
        has_metadata = os.path.exists(os.path.join(partial[0], "manifest.json"))
        assert has_metadata == (kill_at == "commit")
        _assert_previous_checkpoint_loads(path, first_dir, first, 64, 8)
        # The next save that completes removes the half-written directory.
        third = checkpoint.save(path, model, extra={"save": 3})
        assert sorted(glob.glob(f"{path}/ckpt-*")) == sorted([first_dir, third])
        assert checkpoint.load(path, _ebc(seed=4)) == {"save": 3}


def test_save_killed_while_writing_a_large_model_keeps_previous_checkpoint() -> None:
    """No hooks in the save: ~64 MB of tables, killed once the new directory appears."""
    rows, dim = 250_000, 64
    with tempfile.TemporaryDirectory() as path:
        model = _ebc(rows, dim)
        first_dir = checkpoint.save(path, model, extra={"save": 1})
        first = _weights(model)
        del model
        for _attempt in range(3):  # retried only if the save won the race
            if _killed(path, "race", rows, dim):
                break
            for d in glob.glob(f"{path}/ckpt-*"):
                if d != first_dir:
                    shutil.rmtree(d)
            Path(path, "LATEST").write_text(os.path.basename(first_dir))
        else:
            pytest.fail("the second save finished before it could be killed, 3 times")
        _assert_previous_checkpoint_loads(path, first_dir, first, rows, dim)


def _only_shard_file(directory: str) -> str:
    files = glob.glob(f"{directory}/*.distcp")
    assert len(files) == 1, files
    return files[0]


def _load_error(path: str, model: EmbeddingBagCollection) -> str:
    before = _weights(model)
    with pytest.raises((ValueError, RuntimeError)) as info:
        checkpoint.load(path, model)
    for name, weight in _weights(model).items():  # checked before anything was copied in
        assert torch.equal(weight, before[name]), f"{name} was partly loaded"
    return str(info.value)


@pytest.mark.parametrize("damage", ["truncated", "removed", "no_metadata", "bad_metadata"])
def test_damaged_checkpoint_names_the_file(damage: str) -> None:
    with tempfile.TemporaryDirectory() as path:
        directory = checkpoint.save(path, _ebc(), extra={"save": 1})
        shard = _only_shard_file(directory)
        name = os.path.basename(shard)
        if damage == "truncated":
            size = os.path.getsize(shard)
            os.truncate(shard, size // 2)
        elif damage == "removed":
            os.remove(shard)
        elif damage == "no_metadata":
            os.remove(os.path.join(directory, "manifest.json"))
        else:
            metadata = os.path.join(directory, "manifest.json")
            os.truncate(metadata, os.path.getsize(metadata) // 2)
        text = _load_error(path, _ebc(seed=3))
        assert os.path.basename(directory) in text, text
        if damage == "truncated":
            assert f"shard file {name} is truncated: {size // 2} bytes, the manifest says" in text
            assert "table 't0'" in text and "table 't1'" in text, text
        elif damage == "removed":
            assert f"shard file {name} is missing" in text and "table 't0'" in text, text
        elif damage == "no_metadata":
            assert "incomplete or truncated (no manifest.json)" in text, text
        else:
            assert "manifest.json: not a recshard checkpoint manifest" in text, text


def test_corrupted_shard_bytes_raise_naming_the_checkpoint() -> None:
    """Same length, garbage inside: the checksum catches it before anything is loaded."""
    with tempfile.TemporaryDirectory() as path:
        directory = checkpoint.save(path, _ebc(), extra={"save": 1})
        shard = _only_shard_file(directory)
        size = os.path.getsize(shard)
        with open(shard, "r+b") as f:
            f.write(os.urandom(size))
        text = _load_error(path, _ebc(seed=3))
        assert (
            f"checkpoint {directory}: shard file {os.path.basename(shard)} does not match "
            f"its checksum" in text
        ), text


@pytest.mark.parametrize("rows, dim, missing", [(80, 8, None), (64, 16, None), (64, 8, "t2")])
def test_mismatched_checkpoint_names_the_table_and_both_shapes(
    rows: int, dim: int, missing: str | None
) -> None:
    with tempfile.TemporaryDirectory() as path:
        directory = checkpoint.save(path, _ebc(), extra={"save": 1})
        model = _ebc(rows, dim, seed=3)
        if missing:  # a table the checkpoint does not have
            torch.manual_seed(3)
            model = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(
                        num_embeddings=64, embedding_dim=8, name="t0", feature_names=["f0"]
                    ),
                    EmbeddingBagConfig(
                        num_embeddings=9, embedding_dim=4, name=missing, feature_names=["f2"]
                    ),
                ]
            )
        text = _load_error(path, model)
        assert directory in text, text
        if missing:
            assert f"no table '{missing}'" in text, text
        else:
            assert (
                f"table 't0' ('embedding_bags.t0.weight') (model) has shape (64, 8) in the "
                f"checkpoint but ({rows}, {dim}) in the model"
            ) in text, text


def test_checkpoint_table_the_model_lacks_is_reported_unless_not_strict() -> None:
    with tempfile.TemporaryDirectory() as path:
        saved = _ebc()
        directory = checkpoint.save(path, saved, extra={"save": 1})
        torch.manual_seed(3)
        smaller = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    num_embeddings=64, embedding_dim=8, name="t0", feature_names=["f0"]
                )
            ]
        )
        text = _load_error(path, smaller)
        assert directory in text and "1 saved key(s) the model does not have" in text, text
        assert "table 't1' ('embedding_bags.t1.weight')" in text and "strict=False" in text, text
        assert checkpoint.load(path, smaller, strict=False) == {"save": 1}
        torch.testing.assert_close(
            smaller.embedding_bags["t0"].weight, saved.embedding_bags["t0"].weight
        )


def _save_then_load_sharded(rank: int, ws: int, path: str) -> str:
    """ws 2 save; then a model whose table 'ta' has other dims loads it: every rank raises the
    shape error before any collective of the load, so nothing hangs."""
    model = table_wise_dmp(ws)
    checkpoint.save(path, model, make_optimizer(model, fused=True, adagrad=False))
    wider = TinyDLRM()
    wider.ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=12, embedding_dim=4, name="ta", feature_names=["a"]),
            *TinyDLRM("meta").ebc.embedding_bag_configs()[1:],
        ]
    )
    try:
        checkpoint.load(path, wider)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_mismatched_checkpoint_raises_on_every_rank() -> None:
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(2, _save_then_load_sharded, path, timeout=120, pg_timeout_s=20)
    for text in results:
        assert (
            "table 'ta' ('ebc.embedding_bags.ta.weight') (model) has shape (10, 4) in the "
            "checkpoint but (12, 4) in the model" in text
        ), text


def _save_twice_rank_1_dies(rank: int, ws: int, path: str) -> None:
    """Save, train a step, save again; rank 1 dies inside the second save's shard writing."""
    import torch.distributed.checkpoint.filesystem as fs

    model = table_wise_dmp(ws)
    optimizer = make_optimizer(model, fused=True, adagrad=False)
    checkpoint.save(path, model, optimizer, extra={"save": 1})
    dense, kjt, labels = batch_for(0, rank, ws)
    model(dense, kjt, labels).backward()
    optimizer.step()
    if rank == 1:
        fs._write_item = lambda *args, **kwargs: os._exit(1)
    start = time.monotonic()
    try:
        checkpoint.save(path, model, optimizer, extra={"save": 2})
    except Exception as e:
        raise RuntimeError(
            f"rank {rank} raised after {time.monotonic() - start:.1f}s: {type(e).__name__}: {e}"
        ) from e


def test_rank_dying_during_a_sharded_save_leaves_the_previous_checkpoint() -> None:
    """ws 2: rank 1 dies while writing; rank 0 raises (naming the save step, not hanging) and
    the first checkpoint still loads, with the values from before the training step."""
    with tempfile.TemporaryDirectory() as path:
        with pytest.raises(RankError) as info:
            run_ranks(2, _save_twice_rank_1_dies, path, timeout=120, pg_timeout_s=PG_TIMEOUT_S)
        text = info.value.rank_text(0)
        assert re.search(
            r"rank 0 raised after [\d.]+s: RuntimeError: saving checkpoint "
            r"\S+/ckpt-\w+: writing shards \(torch.distributed.checkpoint\) failed; "
            r"the previous checkpoint is still the latest",
            text,
        ), text
        assert "process-group timeout ran out" not in text, text
        torch.manual_seed(0)
        initial = TinyDLRM()  # what both ranks held at the first save
        torch.manual_seed(1)
        restored = TinyDLRM()
        assert checkpoint.load(path, restored) == {"save": 1}
        for key, value in initial.state_dict().items():
            torch.testing.assert_close(restored.state_dict()[key], value, rtol=0, atol=0, msg=key)
