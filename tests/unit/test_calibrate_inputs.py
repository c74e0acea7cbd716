"""`usp calibrate` can't mislead (issue 31, item 6): a malformed input is one clear error naming the file,
the line and the column; too few runs for the constants it fits are refused (or, below three per
constant, a loud warning); the cluster group it writes is used by the command it prints, and
`cluster=<path.yaml>` works wherever a cluster group does. Pure Python, real files, the real CLI."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.errors import ConfigError, UspError
from usp.perf.calibration.calibrate import params_for
from usp.perf.calibration.measured_runs import SWEEP_CSV, read_sweep_csv

ROWS = SWEEP_CSV.read_text().splitlines()
HEADER, OK_ROWS = ROWS[0], [r for r in ROWS[1:] if ",ok," in r]


@pytest.fixture
def folder(tmp_path) -> Path:
    """A folder for the runs CSVs, with the playbook's model shapes beside them."""
    (tmp_path / "playbook_model_archs.csv").write_text((SWEEP_CSV.parent / "playbook_model_archs.csv").read_text())
    return tmp_path


MALFORMED = [  # (the file's bytes, what the error says)
    (b"model,nodes\n1.34B,1\n", "its header lacks the column(s) dp, tp, pp, gas, mbs, zero (it has: model, nodes)"),
    ((HEADER + ",dp_kind\n" + OK_ROWS[0] + ",fsdp3\n").encode(), "runs.csv:2: column dp_kind is 'fsdp3', not one of"),
    ((HEADER + "\n" + OK_ROWS[0].replace("1.34B,1,", "1.34B,one,", 1) + "\n").encode(),
     "runs.csv:2: column nodes is 'one', not an integer >= 1"),
    ((HEADER + "\n" + OK_ROWS[0] + "\n" + ",".join(OK_ROWS[1].split(",")[:11] + ["abc"] + OK_ROWS[1].split(",")[12:])
      + "\n").encode(), "runs.csv:3: column mfu_pct is 'abc', not a number in [0, 100]"),
    ((HEADER + "\n1.34B,1,8\n").encode(), "runs.csv:2: 3 values, but the header names 14 columns"),
    ((HEADER + '\n"1.34B,1\n').encode(), "runs.csv:2: 1 values"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "is a binary file (a NUL byte at offset 7), not a CSV"),
    ("model,café\n".encode("latin-1"), "is not UTF-8 text (byte offset 9)"),
    (b"", "its header lacks the column(s) model, nodes"),
    ((HEADER + "\n").encode(), "has a header but no rows"),
    ((HEADER + "\n" + OK_ROWS[0].replace("1.34B", "9.99B", 1) + "\n").encode(), "model '9.99B' is not in"),
]


@pytest.mark.parametrize("content,says", MALFORMED)
def test_a_malformed_runs_csv_is_one_clear_error(folder, content, says):
    runs = folder / "runs.csv"
    runs.write_bytes(content)
    with pytest.raises(UspError) as err:
        read_sweep_csv(runs)
    assert says in str(err.value) and err.value.key == "RUNS" and err.value.fix, str(err.value)
    proc = usp_cli("calibrate", str(runs), "--cluster", "slurm_h100", cwd=folder, columns=400)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and says in " ".join(proc.stderr.split()), \
        proc.stderr


def test_a_malformed_archs_csv_names_it(folder):
    (folder / "runs.csv").write_text(HEADER + "\n" + OK_ROWS[0] + "\n")
    archs = folder / "playbook_model_archs.csv"
    archs.write_text(archs.read_text().replace(",true,", ",yes,", 1))
    with pytest.raises(UspError) as err:
        read_sweep_csv(folder / "runs.csv")
    assert err.value.key == "--archs" and "column tie_word_embeddings is 'yes', not true or false" in str(err.value)


def _constants(runs_csv: Path, fit: str = "network,stack") -> int:
    """How many constants `usp calibrate --fit <fit>` moves for these runs (the stack's pipeline ones only
    when a run is pipelined)."""
    return len(params_for(tuple(fit.split(",")), "slurm_h100", "usp", read_sweep_csv(runs_csv)))


def test_fewer_layouts_than_constants_are_refused_and_nothing_is_written(folder):
    runs, out = folder / "runs.csv", folder / "mine.yaml"
    runs.write_text(HEADER + "\n" + OK_ROWS[0] + "\n")
    k = _constants(runs)
    assert k == 8  # the cluster's 2 latencies + the stack's 6 (no pipeline: not its 4 pipeline constants)
    proc = usp_cli("calibrate", str(runs), "--cluster", "slurm_h100", "--out", str(out), cwd=folder, columns=400)
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in said and not out.exists(), said
    assert f"1 measured run(s), 1 distinct (model, nodes, layout): too few to fit the time model's {k} " \
           "constants" in said and f"fix: measure at least {k} different layouts" in said, said
    assert not list(folder.glob("mine*.yaml"))  # neither the cluster group nor the profile file
    proc = usp_cli("calibrate", str(runs), "--cluster", "slurm_h100", "--fit", "network", cwd=folder, columns=400)
    assert proc.returncode == 2 and "too few to fit the time model's 2 constants" in " ".join(proc.stderr.split())
    runs.write_text(HEADER + "\n" + "\n".join([OK_ROWS[0]] * 40) + "\n")  # the same layout 40 times: still 1
    proc = usp_cli("calibrate", str(runs), "--cluster", "slurm_h100", cwd=folder, columns=400)
    assert proc.returncode == 2 and "40 measured run(s), 1 distinct" in " ".join(proc.stderr.split())


@pytest.mark.parametrize("out", ["fitted/mine.yaml", "mine"])
def test_few_runs_warn_and_the_printed_command_runs(folder, out):
    """30 layouts for 14 constants: fitted, with a warning; the advice is a command (the cluster group and the
    profile file the fit wrote), run here as printed."""
    runs = folder / "runs.csv"
    runs.write_text(HEADER + "\n" + "\n".join(OK_ROWS[::34][:30]) + "\n")
    (folder / "fitted").mkdir()
    k = _constants(runs)
    assert k == 14 and 30 < 3 * k  # network 2 + stack 6 + pipeline 4 + its TP wait 2: below 3 layouts per constant
    proc = usp_cli("calibrate", str(runs), "--cluster", "slurm_h100", "--out", out, cwd=folder, columns=400)
    assert proc.returncode == 0, proc.stderr
    assert f"warning: only 30 measured run(s), 30 distinct (model, nodes, layout) for {k} fitted constants" \
           in " ".join(proc.stderr.split()) and "--holdout" in proc.stderr
    advice = next(line for line in proc.stdout.splitlines() if "use it: " in line)
    command = shlex.split(advice.split("use it: ", 1)[1].split(" (or ")[0])
    assert command[:2] == ["usp", "plan"] and command[2] in (f"cluster={out}", f"cluster=./{out}")
    stack = str(Path(out).with_suffix(".usp.yaml"))  # the stack's constants: a profile file beside the group
    assert command[3] == f"planner.profile={stack}" and (folder / stack).is_file()
    assert f"stack constants written to {stack}" in proc.stdout
    plan = usp_cli(*command[1:], cwd=folder, columns=200)
    assert plan.returncode == 0, plan.stderr
    said = " ".join(plan.stdout.split())
    assert "calibrated on 30 runs (runs.csv, profile usp)" in said and "runs.csv, profile usp: 30 runs" in said
    assert f"cluster={(folder / out).resolve()}" in "".join(plan.stdout.split())


def test_a_cluster_file_works_wherever_a_cluster_group_does(tmp_path):
    mine = tmp_path / "groups" / "two_cpus.yaml"
    mine.parent.mkdir()
    mine.write_text("name: two_cpus\nprocs_per_node: 2\ndevice_memory_gb: 12\n")
    cfg, choices = compose_config(None, [f"cluster={mine}"])
    assert cfg.cluster.procs_per_node == 2 and cfg.cluster.device_memory_gb == 12 and choices["cluster"] == str(mine)
    assert cfg.cluster.launcher == "local" and cfg.cluster.peak_tflops_fp32 == 0.15  # the schema fills the rest
    for command in (["plan"], ["estimate", "train.tokens=1e6"], ["train", "--cfg", "job"],
                    ["sweep", "--dry-run", "train.micro_batch=4,8"]):
        proc = usp_cli(*command, "cluster=groups/two_cpus.yaml", cwd=tmp_path, columns=200)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (command, proc.stderr)
    assert "procs_per_node: 2" in usp_cli("train", "--cfg", "job", "cluster=groups/two_cpus.yaml", cwd=tmp_path).stdout


@pytest.mark.parametrize("override,says", [
    ("cluster=cal/nowhere.yaml", "cluster='cal/nowhere.yaml': no such cluster file"),  # was "config group 'cal'"
    ("cluster=nowhere.yaml", "cluster='nowhere.yaml': no such cluster file"),
    ("model=tinyy", "model='tinyy': no option 'tinyy' in config group 'model'"),
])
def test_a_missing_group_file_or_option_names_the_group(override, says):
    with pytest.raises(ConfigError) as err:
        compose_config(None, [override])
    assert says in str(err.value) and "'cal'" not in str(err.value) and "available: ;" not in str(err.value)
    assert err.value.fix and "a100_80gb" in err.value.fix or "tiny" in err.value.fix


def test_a_recipe_defaults_entry_with_a_path_names_the_group(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("defaults:\n  - config\n  - override cluster: cal/mine\n  - _self_\n")
    with pytest.raises(ConfigError) as err:
        compose_config(str(recipe), [])
    assert err.value.key == "cluster" and err.value.value == "cal/mine", str(err.value)
    assert "config group 'cluster'" in str(err.value) and "cluster=path/to/my_cluster.yaml" in err.value.fix
