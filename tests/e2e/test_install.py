"""A non-editable install (`pip install .`, a wheel, scripts/offline_wheels.py) must carry the
config catalogue: conf/ and recipes/ live at the repository root, not inside the package, and
reach share/usp through pyproject's data-files."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from offline_wheels import copy_source  # noqa: E402


def _usp(site_packages: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """The installed package's CLI, ahead of the checkout's editable install on sys.path."""
    code = "import sys; from usp.cli import app; sys.argv = ['usp', *sys.argv[1:]]; app()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(site_packages), COLUMNS="200", **env), timeout=120)


def test_a_wheel_install_composes_from_its_own_catalogue(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    copy_source(src)  # what scripts/offline_wheels.py builds its usp wheel from
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("usp-*.whl")
    prefix = tmp_path / "prefix"
    subprocess.run([*pip, "install", "--ignore-installed", "--no-deps", "--no-compile", "--prefix", str(prefix),
                    str(wheel)],
                   check=True, capture_output=True, timeout=300)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(prefix)}))
    assert (site_packages / "usp" / "cli" / "commands.py").is_file() and not (site_packages / "conf").exists()

    listing = _usp(site_packages, "config", "list", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert f"config groups ({prefix / 'share' / 'usp' / 'conf'})" in listing.stdout
    assert "tiny_demo" in listing.stdout  # the recipes came along too
    plan = _usp(site_packages, "plan", "--save", "conf=tiny_demo", "parallelism=ddp", "cluster=local_cpu2",
                f"train.runs_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert (tmp_path / "runs" / "tiny_demo" / "plan.yaml").is_file()


def test_a_missing_catalogue_is_named_before_anything_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "usp.cli", "plan"], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, USP_CONF_DIR=str(tmp_path / "nowhere")), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "USP_CONF_DIR=" in proc.stderr and "no config.yaml" in proc.stderr and "Traceback" not in proc.stderr
