"""Shell completion is on: typer's --show-completion from the real `usp` console script, completing
commands, options and group=option overrides (the help pages: tests/unit/test_cli_help.py)."""
from __future__ import annotations

import os
import subprocess

from tests.helpers import REPO, USP


def _complete(words: str) -> list[str]:
    env = dict(os.environ, _USP_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=str(len(words.split()) - 1
                                                                                         + words.endswith(" ")))
    proc = subprocess.run([USP], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_shell_completion_is_on():
    # typer detects the shell from the parent process (in CI that is make's sh): ask from bash, as a user does
    script = subprocess.run(["bash", "-c", f"{USP} --show-completion; exit $?"],  # not exec: bash stays the parent
                            capture_output=True, text=True, cwd=REPO)
    assert script.returncode == 0 and "complete -o default -F _usp_completion usp" in script.stdout, script.stderr
    assert _complete("usp pre") == ["prepare-data"]
    assert _complete("usp config ") == ["list", "show", "cp"]
    assert _complete("usp plan --st") == ["--strict"]
    assert "model=llama3_1_8b" in _complete("usp plan model=ll") and "conf=tiny_demo" in _complete("usp train conf=t")
