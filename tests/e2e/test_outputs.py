"""Outputs never clobber: every command that writes where the user points (`usp export` in each
format, `usp config cp`, `usp calibrate --out`, `usp report --out`) refuses an existing target
without --force; with --force the old target is replaced only once the new output is whole
(usp.run.files.staged), so a process SIGKILLed at that moment leaves the old content intact. The
export is a directory of its own: nothing lands beside an HF model's config.json. Against a real
trained run, the real CLI, and a real process killed with SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from tests.helpers import REPO, run_usp, usp_cli
from tests.unit.test_outputs import _listing
from usp.config.paths import recipes_dir

TINY = ["data.tokenizer=bytes", "logging.console=plain", "train.sample_tokens=0", "train.log_interval=1",
        "train.eval_interval=0", "checkpoint.enabled=true", "train.steps=2", "train.global_batch=4", "train.seq_len=32",
        "model.dim=32", "model.ffn_dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2"]
PRECIOUS = "the user's own file\n"
CALIBRATION = REPO / "calibration" / "playbook_h100"
RECIPE = (recipes_dir() / "tiny_demo.yaml").read_text()
HF_INDEX = "model.safetensors.index.json"

# The real CLI in its own process, SIGKILLed at the moment the new output is whole and about to be
# swapped into place: the worst moment for the old target.
KILL_AT_SWAP = """
import os, signal, sys
import usp.run.files
from usp.cli import main

def swap_in(tmp, path):
    os.kill(os.getpid(), signal.SIGKILL)

usp.run.files._swap_in = swap_in
sys.argv[0] = "usp"
main()
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A real trained run (a checkpoint, metrics) and a small calibration CSV (every 40th layout)."""
    tmp = tmp_path_factory.mktemp("outputs")
    proc = run_usp("train", f"train.runs_dir={tmp}", "train.name=run", *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = (CALIBRATION / "playbook_sweep_calibration.csv").read_text().splitlines()
    csv = tmp / "measured.csv"
    csv.write_text("\n".join([rows[0], *rows[1::40]]) + "\n")
    return {"RUN": str(tmp / "run"), "CSV": str(csv)}


class Case(NamedTuple):
    argv: list[str]  # T: the target directory; RUN, CSV: the inputs
    held: str  # the user's file in T
    writes: Callable[[Path], Path]  # T -> the path the command writes
    looks_new: Callable[[Path], bool]  # is this the command's new output?


def _same_dir(t: Path) -> Path:
    return t


COMMANDS = {
    "export-torch": Case(["export", "RUN", "--out", "T"], "notes.txt", _same_dir,
                         lambda p: _listing(p) == ["config.json", "model.pt"]),
    "export-safetensors": Case(["export", "RUN", "--format", "safetensors", "--out", "T"], "notes.txt", _same_dir,
                               lambda p: _listing(p) == ["config.json", "model.safetensors"]),
    "export-hf": Case(["export", "RUN", "--format", "hf", "--out", "T"], "notes.txt", _same_dir,
                      lambda p: {"config.json", "model.safetensors", HF_INDEX} <= set(_listing(p))),
    # cp into a directory, as `cp` does: the user's own edited copy there is what must survive
    "config-cp": Case(["config", "cp", "tiny_demo", "T"], "tiny_demo.yaml", lambda t: t / "tiny_demo.yaml",
                      lambda p: p.read_text() == RECIPE),
    "calibrate": Case(["calibrate", "CSV", "--cluster", "slurm_h100", "--archs",
                       str(CALIBRATION / "playbook_model_archs.csv"), "--out", "T"], "notes.txt", _same_dir,
                      lambda p: p.is_file() and yaml.safe_load(p.read_text())["name"] == "slurm_h100"),
    "report": Case(["report", "RUN", "--out", "T"], "notes.txt", _same_dir,
                   lambda p: {"report.md", "loss.png"} <= set(_listing(p))),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_existing_target_is_refused_and_survives_a_kill_during_force(tmp_path, inputs, command):
    argv, held, writes, looks_new = COMMANDS[command]
    target = tmp_path / "target"
    target.mkdir()
    (target / held).write_text(PRECIOUS)
    args = [str(target) if a == "T" else inputs.get(a, a) for a in argv]
    output = writes(target)

    def untouched() -> bool:
        return [n for n in _listing(target) if not n.startswith(".")] == [held] and \
            (target / held).read_text() == PRECIOUS

    refused = usp_cli(*args, cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    message = " ".join(refused.stderr.split())
    assert f"={str(output)!r}" in message and "already exists" in message and "--force" in message, message
    assert untouched()

    env = dict(os.environ, COLUMNS="200")
    killed = subprocess.run([sys.executable, "-c", KILL_AT_SWAP, *args, "--force"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert untouched()
    leftover = [output.parent / n for n in _listing(output.parent) if n.startswith(f".{output.name}.tmp-")]
    assert len(leftover) == 1 and looks_new(leftover[0])  # the kill came with the new output whole, unswapped

    forced = usp_cli(*args, "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert looks_new(output) and (output == target / held or not (target / held).exists())
    assert [output.parent / n for n in _listing(output.parent) if n.startswith(".")] == leftover  # no new temp


def test_an_existing_data_file_is_refused_as_out(tmp_path, inputs):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "mine"}\n')
    for fmt in ("hf", "torch"):
        proc = usp_cli("export", inputs["RUN"], "--format", fmt, "--out", str(data), cwd=tmp_path)
        assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
        assert data.read_text() == '{"text": "mine"}\n'


def test_the_torch_export_never_writes_beside_an_hf_model(tmp_path, inputs):
    """--out <hf dir>/usp.pt used to overwrite the HF model's config.json: a weights-file name is
    refused, and a directory there holds the export's own config.json."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    hf = tmp_path / "hf_model"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=64)).save_pretrained(hf)
    before = {n: (hf / n).read_bytes() for n in _listing(hf)}
    proc = usp_cli("export", inputs["RUN"], "--out", str(hf / "usp.pt"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"fix: --out {hf / 'usp'}" in " ".join(proc.stderr.split())
    proc = usp_cli("export", inputs["RUN"], "--out", str(hf / "usp"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {n: (hf / n).read_bytes() for n in _listing(hf) if n != "usp"} == before
    assert _listing(hf / "usp") == ["config.json", "model.pt"]
    assert AutoConfig.from_pretrained(hf).model_type == "llama"


def test_force_never_replaces_the_inputs(tmp_path, inputs):
    """--force replaces only the command's own output: never the run it reads or a path inside it, a
    checkpoint (also one outside the run), an input file (calibrate's archs CSV, read when --archs is
    not given) or the recipe copied; each refused with exit 2, nothing touched."""
    import shutil

    run = Path(inputs["RUN"])
    ckpt = run / "checkpoints" / "step_00000002"
    elsewhere = tmp_path / "elsewhere" / "step_00000002"  # a checkpoint where checkpoint.dir put it
    shutil.copytree(ckpt, elsewhere)
    csv = tmp_path / "measured.csv"
    shutil.copyfile(inputs["CSV"], csv)
    archs = tmp_path / "playbook_model_archs.csv"
    shutil.copyfile(CALIBRATION / "playbook_model_archs.csv", archs)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(RECIPE)
    before = {p: p.read_bytes() for p in [*run.rglob("*"), *elsewhere.iterdir(), archs, recipe] if p.is_file()}
    cases = {
        "is this command's input": [["report", str(run), "--out", str(run)],
                                    ["calibrate", str(csv), "--cluster", "slurm_h100", "--out", str(archs)],
                                    ["config", "cp", str(recipe), str(recipe)]],
        "which this command reads": [["report", str(run), "--out", str(run / "checkpoints")],
                                     ["export", str(run), "--out", str(ckpt)],
                                     ["export", str(run), "--format", "hf", "--out", str(run / "logs")]],
        "holds this command's input": [["report", str(run), "--out", str(run.parent)]],
        "is a checkpoint": [["export", str(run), "--out", str(elsewhere)],
                            ["report", str(run), "--out", str(elsewhere)]],
    }
    for said, commands in cases.items():
        for args in commands:
            proc = usp_cli(*args, "--force", cwd=tmp_path)
            message = " ".join(proc.stderr.split())
            assert proc.returncode == 2 and said in message and "Traceback" not in proc.stderr, (args, message)
    assert {p: p.read_bytes() for p in before} == before
    assert _listing(run / "checkpoints") == ["step_00000002"] and not (run / "report").exists()
