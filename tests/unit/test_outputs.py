"""usp.run.files.staged, which every command writing where the user points goes through: a failed write
keeps the old target, and without renameat2 (another OS or filesystem) two renames do the swap (the
commands themselves, killed mid-swap: tests/e2e/test_outputs.py)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from usp.run import files as rundir
from usp.run.files import staged


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_staged_keeps_the_old_target_on_failure_and_without_renameat2(tmp_path, monkeypatch):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged(target) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("half")
        raise RuntimeError("the write failed")
    assert _listing(tmp_path) == ["out"] and _listing(target) == ["old.txt"]

    def no_renameat2(a, b):
        raise OSError(errno.ENOSYS, "renameat2 is not available")

    monkeypatch.setattr(rundir, "_exchange", no_renameat2)  # another OS or filesystem: two renames
    with staged(target) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
    assert _listing(tmp_path) == ["out"] and _listing(target) == ["new.txt"]
    with staged(target) as tmp:  # a file replaces a directory
        tmp.write_text("a file now")
    assert _listing(tmp_path) == ["out"] and target.read_text() == "a file now"


# -- what --force never replaces (usp.run.writable.check_new_output) -----------------------------
def _run_dir(root: Path) -> Path:
    """A run directory with one checkpoint, as usp writes them."""
    run = root / "runs" / "r"
    step = run / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    (run / "plan.yaml").write_text("version: 1\n")
    (step / "manifest.json").write_text('{"step": 10, "files": {}}')
    (step / ".metadata").write_bytes(b"x")
    return run


@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/step_00000010", "metrics.jsonl", "logs/new"])
def test_force_never_writes_inside_a_run_the_command_reads(tmp_path, where):
    from usp.errors import UspError
    from usp.run.writable import check_new_output

    run = _run_dir(tmp_path)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UspError, match="which this command reads"):
        check_new_output(run / where, force=True, key="--out", inputs=[run], own=run / "report")
    assert check_new_output(run / "report", force=True, key="--out", inputs=[run], own=run / "report")


def test_force_never_replaces_an_input_file_or_a_checkpoint_or_a_run(tmp_path, monkeypatch):
    from usp.errors import UspError
    from usp.run.writable import check_new_output

    monkeypatch.chdir(tmp_path)
    archs = tmp_path / "playbook_model_archs.csv"
    archs.write_text("model\n")
    with pytest.raises(UspError, match="is this command's input"):
        check_new_output("playbook_model_archs.csv", force=True, key="--out", inputs=["runs.csv", archs])
    run = _run_dir(tmp_path / "elsewhere")
    with pytest.raises(UspError, match="is a checkpoint"):  # not an input of the command, still a checkpoint
        check_new_output(run / "checkpoints" / "step_00000010", force=True, key="--out")
    with pytest.raises(UspError, match="inside the checkpoint"):
        check_new_output(run / "checkpoints" / "step_00000010" / "x", force=True, key="--out")
    with pytest.raises(UspError, match="holds a run directory"):
        check_new_output(run.parent, force=True, key="--out")
    with pytest.raises(UspError, match="holds a checkpoint"):
        check_new_output(run / "checkpoints", force=True, key="--out")
    assert archs.read_text() == "model\n" and (run / "plan.yaml").is_file()


# -- checkpoint checksums (usp.run.checksums) ----------------------------------------------------
def test_a_file_with_other_bytes_of_the_same_size_is_found(tmp_path):
    from usp.run import checksums

    ckpt = tmp_path / "step_00000003"
    ckpt.mkdir()
    names = {"__0_0.distcp": os.urandom(3 << 20), "__1_0.distcp": os.urandom(1000), ".metadata": b"m" * 10}
    for name, data in names.items():
        (ckpt / name).write_bytes(data)
    sums = checksums.digests(ckpt, names)
    sizes = {n: len(d) for n, d in names.items()}
    (ckpt / "manifest.json").write_text(__import__("json").dumps(checksums.manifest(3, sizes, sums)))
    assert checksums.verify_checkpoint(ckpt) == ("verified", [])
    with open(ckpt / "__1_0.distcp", "r+b") as f:  # same size, one byte other
        f.seek(500)
        byte = f.read(1)
        f.seek(500)
        f.write(bytes([byte[0] ^ 1]))
    state, problems = checksums.verify_checkpoint(ckpt)
    assert state == "damaged" and problems == ["__1_0.distcp does not match its checksum (other bytes than were saved)"]
    (ckpt / "manifest.json").write_text(__import__("json").dumps({"step": 3, "files": sizes}))  # an earlier usp's
    assert checksums.verify_checkpoint(ckpt) == ("unverified", [])


def test_each_file_is_checked_by_the_rank_that_wrote_it():
    from usp.run.checksums import owner

    assert [owner(n, 4) for n in ("__0_0.distcp", "__3_1.distcp", "rng_rank2.pt", ".metadata", "plan.yaml")] == \
        [0, 3, 2, 0, 0]
    assert owner("__5_0.distcp", 2) == 1  # saved by 6 ranks, checked by 2


def test_retention_never_deletes_the_newest_verified_checkpoint(tmp_path):
    """keep_last=2 over steps 1-4 where 3 and 4 were saved without checksums (an earlier usp): step 2,
    the newest with checksums, stays; step 1 goes."""
    import json

    from usp.run import checksums
    from usp.run.files import list_checkpoints

    for step in (1, 2, 3, 4):
        ckpt = tmp_path / f"step_{step:08d}"
        ckpt.mkdir()
        (ckpt / "x").write_bytes(b"x")
        sums = checksums.digests(ckpt, ["x"]) if step <= 2 else {}
        body = checksums.manifest(step, {"x": 1}, sums) if sums else {"step": step, "files": {"x": 1}}
        (ckpt / "manifest.json").write_text(json.dumps(body))
    found = list_checkpoints(tmp_path)
    assert [p.name for p in checksums.retired(found, 2)] == ["step_00000001"]
    assert [p.name for p in checksums.retired(found, 3)] == ["step_00000001"]
    assert checksums.retired(found, 0) == [] and checksums.retired(found, 4) == []
