"""README.md's commands run as written, so the README can't rot.

The examples are the command lines of README's ```sh blocks. They run in README order in one
fresh directory, as a reader would type them: `usp report runs/tiny_grid` reads the sweep an
earlier line ran. Run alone (`-k export`), an example first runs the earlier lines of its block
that train. How each line is checked:

- as written, exit code 0: every `usp` command that needs neither a GPU nor Slurm;
- needs Slurm (`usp submit`, or `usp train` / `usp sweep` on a cluster group with
  `launcher: slurm`): with `--dry-run` added, which plans and writes the batch script without
  sbatch; the script must be valid bash;
- needs a GPU (`usp train` / `usp verify` / `usp sweep` on a local cluster whose device isn't
  the CPU): `usp plan` with the same overrides, which checks the whole plan without one;
- `make demo`: the Makefile's demo command with fewer steps (the full demo takes a minute);
- `make test`, `make test-fast`, `make lint`: skipped, with the reason: they are this suite and
  CI's lint step.

A line with another program fails: teach this file how to check it."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, run_usp, usp_cli

README = REPO / "README.md"
TRAINS = {"train", "sweep", "verify"}  # they start training (and may launch torchrun)
SKIPPED_MAKE = {
    "test": "`make test` is this whole suite: it can't run inside itself",
    "test-fast": "`make test-fast` is a subset of this suite",
    "lint": "`make lint` is CI's own step (.ci/run), not a test",
}
DEMO_STEPS = "train.steps=10"


def shell_blocks(text: str) -> list[list[str]]:
    """The command lines of every ```sh block (comments dropped, `\\` continuations joined)."""
    blocks = re.findall(r"^```sh\n(.*?)^```", text, flags=re.M | re.S)
    return [[line for line in block.replace("\\\n", " ").splitlines() if shlex.split(line, comments=True)]
            for block in blocks]


def examples() -> list[tuple[int, int, list[str]]]:
    """(block, line, argv) of every README example, in README order."""
    return [(b, i, shlex.split(line, comments=True))
            for b, block in enumerate(shell_blocks(README.read_text())) for i, line in enumerate(block)]


def marks(argv: list[str]) -> set[str]:
    if argv[0] == "usp" and argv[1] in TRAINS:
        return {"slow", "distributed"}
    return {"slow"} if argv[:2] == ["make", "demo"] else set()


def needs_runs(argv: list[str]) -> bool:
    return any(arg.startswith("runs/") for arg in argv)


EXAMPLES = examples()
PARAMS = []
for block, line, argv in EXAMPLES:
    earlier = [a for b, i, a in EXAMPLES if b == block and i < line and a[0] == "usp" and a[1] in TRAINS]
    names = marks(argv).union(*(marks(a) for a in earlier)) if needs_runs(argv) else marks(argv)
    PARAMS.append(pytest.param(block, line, argv, id=shlex.join(argv)[:60],
                               marks=[getattr(pytest.mark, name) for name in sorted(names)]))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


DONE: dict[tuple[int, int], subprocess.CompletedProcess] = {}


def overrides(argv: list[str]) -> list[str]:
    """The `key=value` / `~key` words (options and their values dropped), a sweep's first value."""
    words = [w for w in argv[2:] if not w.startswith("-") and ("=" in w or w.startswith("~"))]
    return [re.sub(r"^([^=]+=)([^'\"\[{][^,]*),.*$", r"\1\2", w) for w in words]


def cluster_of(argv: list[str], cwd: Path) -> dict:
    """The composed config's cluster group, as `usp train --cfg job` prints it."""
    r = usp_cli("train", *overrides(argv), "--cfg", "job", cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    return yaml.safe_load(r.stdout)["cluster"]


def how_to_check(argv: list[str], cwd: Path) -> list[str]:
    """The usp argv that checks this README line (see the module docstring)."""
    if argv[0] == "make":
        target = argv[1]
        if target in SKIPPED_MAKE:
            pytest.skip(SKIPPED_MAKE[target])
        assert target == "demo", f"README runs `make {target}`: add it to {__file__}"
        recipe = re.search(r"^demo:.*\n\t\$\(VENV\)/bin/(usp .*)$", (REPO / "Makefile").read_text(), flags=re.M)
        assert recipe, "the Makefile's demo target is no longer one `usp` command: update this test"
        return [*shlex.split(recipe.group(1))[1:], DEMO_STEPS]
    assert argv[0] == "usp", f"README runs {argv[0]!r}: teach {__file__} how to check it"
    sub = argv[1]
    if sub == "submit":
        return [*argv[1:], "--dry-run"] if "--dry-run" not in argv else argv[1:]
    if sub in TRAINS:
        cluster = cluster_of(argv, cwd)
        if cluster["launcher"] == "slurm" and sub != "verify":
            return [*argv[1:], "--dry-run"] if "--dry-run" not in argv else argv[1:]
        if cluster["device"] != "cpu":
            return ["plan", *overrides(argv)]
    return argv[1:]


def run_example(block: int, line: int, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    if (block, line) not in DONE:
        if needs_runs(argv):  # the earlier lines of the block that train make the runs it reads
            for b, i, a in EXAMPLES:
                if b == block and i < line and a[0] == "usp" and a[1] in TRAINS:
                    run_example(b, i, a, cwd)
        DONE[(block, line)] = run_usp(*how_to_check(argv, cwd), cwd=cwd, timeout=600)
    return DONE[(block, line)]


@pytest.mark.parametrize("block,line,argv", PARAMS)
def test_readme_example_runs(block, line, argv, workdir, request):
    checked = how_to_check(argv, workdir)
    if marks(argv) or needs_runs(argv):
        request.getfixturevalue("shakespeare")  # the corpus, tokenized once per session
    r = run_example(block, line, argv, workdir)
    ran = f"`{shlex.join(argv)}` (run as `usp {shlex.join(checked)}`)"
    assert r.returncode == 0, f"{ran}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    if "--dry-run" in checked and "--dry-run" not in argv:  # a Slurm line: the script it would submit
        script = re.search(r"wrote (\S+/job\.sbatch)", r.stdout)
        assert script, r.stdout[-2000:]
        assert subprocess.run(["bash", "-n", script.group(1)]).returncode == 0


@pytest.mark.parametrize("line,checked", [
    ("usp plan conf=llama3_1_70b", ["plan", "conf=llama3_1_70b"]),
    ("usp submit conf=llama3_1_8b", ["submit", "conf=llama3_1_8b", "--dry-run"]),
    ("usp train conf=llama3_1_8b train.steps=5", ["train", "conf=llama3_1_8b", "train.steps=5", "--dry-run"]),
    ("usp sweep conf=llama3_1_8b train.micro_batch=1,2 --name s",
     ["sweep", "conf=llama3_1_8b", "train.micro_batch=1,2", "--name", "s", "--dry-run"]),
    ("usp train cluster=local_gpu parallelism.tp=2", ["plan", "cluster=local_gpu", "parallelism.tp=2"]),
    ("usp train conf=tiny_ddp train.micro_batch=4,8", ["train", "conf=tiny_ddp", "train.micro_batch=4,8"]),
])
def test_how_a_line_is_checked(line, checked, tmp_path):
    """The rules above, on lines the README may gain: Slurm lines get --dry-run, local GPU lines a plan."""
    assert how_to_check(shlex.split(line), tmp_path) == checked


def test_readme_has_the_examples_it_promises():
    """Six to eight `usp` commands with an example each, and the two `make` commands, are found:
    an extraction that finds nothing would make the test above pass vacuously."""
    argvs = [argv for _, _, argv in EXAMPLES]
    commands = {argv[1] for argv in argvs if argv[0] == "usp"}
    assert 6 <= len(commands) <= 8, commands
    assert ["make", "demo"] in argvs and ["make", "test"] in argvs


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 150, f"README.md has {lines} lines (at most 150: move details to docs/)"


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_links_resolve(page):
    """Every relative link of README, CHANGELOG and docs/ names a file that exists, and an anchor that one of
    its headings makes (docs moved out of README must stay reachable from it)."""
    for target in re.findall(r"\]\((?!https?:)([^)\s]+)\)", page.read_text()):
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        assert file.exists(), f"{page.name} links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
            assert anchor in {github_anchor(h) for h in headings}, f"{page.name} links to {target}: no such heading"
