#!/usr/bin/env python
"""Is every torch-free `usp` command's output the same at a base revision and in this working tree?

    python scripts/compare_outputs.py BASE_REV [--jobs 2] [--only TEXT] [--list]

The base revision is checked out in a temporary git worktree. Each case (one or a few usp command
lines) runs twice in the same fresh scratch directory, once with the base tree's `usp` package and
once with this tree's (`python -c "from usp.cli import main; main()"` with PYTHONPATH set to the
tree, so both use this interpreter and its packages). Compared, byte for byte: the exit code,
stdout and stderr of every command, and every file the case left in its scratch directory
(plan.yaml, job.sbatch, sweep.json, copied recipes, token files...). Normalised, and nothing else:
the tree's own path becomes `<tree>` (a recipe or conf path printed in a message), this interpreter's
path `<python>` (job.sbatch names it; it lies inside the working tree), and the clock: the times
sweep.json and a dataset's meta.json record, the search's "searched in N s" and a disk's free space
become `<time>`.
The base tree is checked out beside this one under a name of the same length, so that a path in a
table pads and wraps the same on both sides.

The cases: every command's --help; `usp config list`; `config show` of every group option and
recipe; for conf/config.yaml and every recipe in recipes/: plan, plan --cfg job, plan --force,
plan --search, plan --save then status and logs of the saved run, estimate (--devices and --hours),
train --cfg job, train --dry-run, submit --dry-run (as is and on cluster=local_slurm),
sweep --dry-run, config cp then plan of the copy; `usp plan` with every group option; calibrate on
the committed measurements; prepare-data and plan on a small corpus of own files; and the config
mistakes of tests/test_config.py and tests/test_messages.py (each error message's wording).
Exit status 0 when everything is identical, 1 otherwise (a unified diff of each difference)."""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RUNNER = "import sys; from usp.cli import main; sys.argv[0] = 'usp'; main()"
CORPUS = "\n".join(f"the king and queen {i} of love and my heart that is {i % 7}" for i in range(3000)) + "\n"
SCRATCH_FILES = {  # written into every case's scratch directory before it runs
    "corpus.txt": CORPUS,
    "mine.yaml": "defaults:\n  - config\n  - _self_\ntrain:\n  steps: 7\n  name: mine\n",
    "mine_yml.yml": "defaults:\n  - config\n  - _self_\ntrain:\n  steps: 7\n  name: mine_yml\n",
    "broken.yaml": "defaults:\n  - config\n  - _self_\ntrain:\n  steps: [1, 2\n  name: x\n",
    "nodefaults.yaml": "train:\n  steps: 7\n",
    "shadow/config.yaml": "defaults:\n  - config\n  - _self_\n",
    "a_file": "not a directory\n",
}
COMMANDS = ["plan", "calibrate", "estimate", "train", "submit", "cancel", "logs", "status", "export", "verify",
            "prepare-data", "sweep", "report"]
CONFIG_COMMANDS = ["list", "show", "cp"]
ERRORS = [  # config mistakes: each must keep its message (tests/test_config.py, tests/test_messages.py)
    ["trian.steps=3"], ["parallelism.tpp=4"], ["+parallelism.tpp=4"], ["+train.stepz=3"],
    ["train.steps=abc"], ["optimizer.lr=fast"], ["train.compile=maybe"], ["cluster.nodes=1.5"],
    ["model=tinyy"], ["cluster=local_cpu3"], ["parallelism=dpp"], ["conf=tiny_ddp", "cluster=nowhere"],
    ["conf=tiny_dpp"], ["conf=missing/tiny_dpp.yaml"], ["conf=shadow/config.yaml"], ["parallelism.tp=1,2"],
    ["train.steps"], ["~train.steps"], ["cluster.env.X=1"], ["+cluster.env.NCCL_DEBUG=INFO", "--cfg", "job"],
    ["+cluster.env.A=1", "+cluster.env.B=x", "~cluster.env.A", "--cfg", "job"], ["+model=tiny"],
    ["train.steps=3", "train.steps=4", "--cfg", "job"], ["train.name='a b'", "--cfg", "job"],
    ["data.paths=[a.txt,b.txt]", "data=files", "--cfg", "job"], ["train.steps=${train.seq_len}", "--cfg", "job"],
    ["conf=broken.yaml"], ["conf=nodefaults.yaml"], ["conf=mine.yaml"], ["conf=mine_yml.yml", "--cfg", "job"],
    ["conf=./mine_yml", "--cfg", "job"], ["hydra.job.name=x"], ["train.steps=1e3"], ["optimizer.lr=3"],
    ["train.runs_dir=a_file/sub", "--save"], ["parallelism.tp=3"], ["model.dim=130", "--force"],
]
# What differs between any two runs of the same code: the wall-clock times a file records (sweep.json's
# created/updated, a dataset's meta.json created and *_seconds), how long the layout search took.
CLOCK = re.compile(r'("(?:created|updated|submitted_at|[a-z_]*seconds)": )(?:[0-9.e+]+|"[0-9T:+-]+")'
                   r'|(searched in )[0-9.]+(?= s)'
                   r'|(has )[0-9.]+ [KMGT]?i?B \([0-9,]+ bytes\) free')  # a shared disk's free space moves too


@dataclass
class Case:
    name: str
    commands: list[list[str]]
    results: dict[str, str] = field(default_factory=dict)  # side -> the case's whole record


def _names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def cases(tree: Path) -> list[Case]:
    """Every case, from this tree's catalogue (a group option or recipe only one side has shows up as
    a difference)."""
    out = [Case("help", [["--help"]] + [[c, "--help"] for c in COMMANDS] + [["config", "--help"]]
                + [["config", c, "--help"] for c in CONFIG_COMMANDS]),
           Case("config-list", [["config", "list"]])]
    groups = sorted(p.name for p in (tree / "conf").iterdir() if p.is_dir())
    for group in groups:
        for option in _names(tree / "conf" / group):
            out.append(Case(f"show {group}={option}", [["config", "show", f"{group}={option}"]]))
            out.append(Case(f"plan {group}={option}", [["plan", f"{group}={option}"]]))
    for recipe in [None, *_names(tree / "recipes")]:
        out += _recipe_cases(recipe)
    out.append(Case("calibrate", [["calibrate", "calibration/playbook_h100/playbook_sweep_calibration.csv",
                                   "--cluster", "h100_playbook", "--profile", "nanotron", "--holdout", "4"]]))
    out.append(Case("own files", [["plan", "data=files", "data.paths=[corpus.txt]"],
                                  ["prepare-data", "data=text_files", "data.paths=[corpus.txt]", "data.vocab_size=300",
                                   "data.val_fraction=0.3"],
                                  ["plan", "data=text_files", "data.paths=[corpus.txt]", "data.vocab_size=300",
                                   "data.val_fraction=0.3"]]))
    out += [Case("error " + " ".join(argv), [["plan", *argv]]) for argv in ERRORS]
    return out


def _recipe_cases(recipe: str | None) -> list[Case]:
    conf = [f"conf={recipe}"] if recipe else []
    label = recipe or "conf/config.yaml"
    runs = ["train.runs_dir=runs", "train.name=saved"]
    return [Case(f"{label}: {name}", commands) for name, commands in [
        ("plan", [["plan", *conf]]),
        ("plan --cfg job", [["plan", *conf, "--cfg", "job"]]),
        ("plan --force --strict", [["plan", *conf, "--force", "--strict"]]),
        ("plan --search", [["plan", *conf, "--search", "--top", "3"]]),
        ("plan --save, status, logs", [["plan", *conf, *runs, "--save"], ["status", "runs/saved"],
                                       ["logs", "runs/saved"]]),
        ("estimate --devices", [["estimate", *conf, "train.tokens=1e12", "--devices", "64"]]),
        ("estimate --hours", [["estimate", *conf, "train.tokens=15e12", "--hours", "720", "--mfu", "0.4"]]),
        ("train --cfg job", [["train", *conf, "--cfg", "job"]]),
        ("train --dry-run", [["train", *conf, *runs, "--dry-run"]]),
        ("submit --dry-run", [["submit", *conf, *runs, "--dry-run"]]),
        ("submit --dry-run local_slurm", [["submit", *conf, "cluster=local_slurm", *runs, "--dry-run"]]),
        ("sweep --dry-run", [["sweep", *conf, "train.micro_batch=1,2", "train.runs_dir=runs", "--name", "sw",
                              "--dry-run"]]),
        *([("config show, cp, plan the copy", [["config", "show", recipe], ["config", "cp", recipe, "copy.yaml"],
                                                ["plan", "conf=copy.yaml"]])] if recipe else []),
    ]]


def _normalise(text: str, tree: Path) -> str:
    text = text.replace(sys.executable, "<python>").replace(str(tree), "<tree>")
    return CLOCK.sub(lambda m: next(g for g in m.groups() if g) + "<time>", text)


def _snapshot(cwd: Path, tree: Path) -> str:
    """Every file the case left (a listing, then each text file's content; a binary file by size)."""
    parts = []
    for path in sorted(p for p in cwd.rglob("*") if p.is_file()):
        rel = path.relative_to(cwd).as_posix()
        if rel in SCRATCH_FILES:
            continue
        data = path.read_bytes()
        try:
            parts.append(f"--- file {rel}\n{_normalise(data.decode('utf-8'), tree)}")
        except UnicodeDecodeError:
            import hashlib

            parts.append(f"--- file {rel} (binary, {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()})")
    return "\n".join(parts)


def run_case(case: Case, trees: dict[str, Path], scratch: Path) -> Case:
    """Both sides, one after the other, in the same scratch directory (its path is in the output)."""
    for side, tree in trees.items():
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        for rel, text in SCRATCH_FILES.items():
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            (scratch / rel).write_text(text)
            os.utime(scratch / rel, (1e9, 1e9))  # a dataset's cache key holds its files' mtimes
        (scratch / "calibration").symlink_to(tree / "calibration")
        env = {k: v for k, v in os.environ.items() if not k.startswith("USP_")}
        env.update(PYTHONPATH=str(tree), USP_CACHE_DIR=str(scratch / "cache"), COLUMNS="120", LINES="50",
                   PYTHONHASHSEED="0", TZ="UTC", NO_COLOR="1", TERM="dumb")
        record = []
        for argv in case.commands:
            proc = subprocess.run([sys.executable, "-c", RUNNER, *argv], cwd=scratch, env=env, capture_output=True,
                                  text=True, timeout=600)
            record.append(f"$ usp {' '.join(argv)}\n[exit {proc.returncode}]\n--- stdout\n"
                          f"{_normalise(proc.stdout, tree)}--- stderr\n{_normalise(proc.stderr, tree)}")
        (scratch / "calibration").unlink()
        record.append(_snapshot(scratch, tree))
        case.results[side] = "\n".join(record)
    shutil.rmtree(scratch, ignore_errors=True)
    return case


def check_trees(trees: dict[str, Path]) -> None:
    """Each side imports its own usp (an editable install must not win over PYTHONPATH)."""
    for side, tree in trees.items():
        where = subprocess.run([sys.executable, "-c", "import usp; print(usp.__file__)"], cwd=tempfile.gettempdir(),
                               env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                               check=True).stdout.strip()
        if not Path(where).resolve().is_relative_to(tree):
            raise SystemExit(f"{side}: usp imported from {where}, not from {tree}")


def _sibling_of_equal_length(tree: Path) -> Path:
    """A free path beside `tree` whose name is as long as its name (e.g. rooms -> .cmp0)."""
    width = len(tree.name)
    for i in range(10 ** max(width - 1, 1)):
        candidate = tree.parent / f".{i}".ljust(width, "_")[:width]
        if len(candidate.name) == width and not candidate.exists():
            return candidate
    raise SystemExit(f"no free name of {width} characters beside {tree}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="git revision to compare against (e.g. main)")
    p.add_argument("--jobs", type=int, default=2, help="cases run at once")
    p.add_argument("--only", help="only the cases whose name contains this text")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args()
    todo = [c for c in cases(HERE) if not args.only or args.only in c.name]
    if args.list:
        print("\n".join(f"{c.name}: " + " ; ".join(" ".join(a) for a in c.commands) for c in todo))
        return
    with tempfile.TemporaryDirectory(prefix="usp-compare-") as tmp:
        base = _sibling_of_equal_length(HERE)
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", "--quiet", str(base), args.base],
                       check=True)
        try:
            trees = {"base": base.resolve(), "here": HERE}
            check_trees(trees)
            with ThreadPoolExecutor(args.jobs) as pool:
                done = list(pool.map(lambda ic: run_case(ic[1], trees, Path(tmp) / "work" / str(ic[0])),
                                     enumerate(todo)))
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(base)], check=False)
    differ = [c for c in done if c.results["base"] != c.results["here"]]
    for case in differ:
        print(f"=== {case.name}: differs")
        sys.stdout.writelines(difflib.unified_diff(case.results["base"].splitlines(True),
                                                   case.results["here"].splitlines(True), "base", "here"))
    commands = sum(len(c.commands) for c in done)
    print(f"{len(done)} cases ({commands} usp commands per side) against {args.base}: "
          f"{len(done) - len(differ)} identical, {len(differ)} differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
