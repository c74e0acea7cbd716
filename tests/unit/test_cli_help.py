"""Every `usp <command> --help` has an Examples section whose lines are real commands with overrides
that compose; shell completion is on (typer's --show-completion / --install-completion) and
completes commands, options and group=option overrides."""
from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from tests.helpers import REPO, USP, usp_cli
from usp.cli import app
from usp.cli_examples import EXAMPLES
from usp.config.compose import compose_config

COMMANDS = [[c.name or c.callback.__name__.replace("_", "-")] for c in app.registered_commands]
COMMANDS += [["config"]] + [["config", c.name or c.callback.__name__] for g in app.registered_groups
                            for c in g.typer_instance.registered_commands]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_help_page_has_examples(tmp_path, command):
    proc = usp_cli(*command, "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "Examples:" in proc.stdout, proc.stdout
    for line in EXAMPLES[command[-1]]:
        assert line in proc.stdout  # not re-wrapped


def test_examples_name_real_commands_and_compose():
    """A typo in an example's key or option would show here (recipes the user makes are skipped)."""
    for lines in EXAMPLES.values():
        for line in lines:
            words = shlex.split(line.split("#")[0].split("&&")[0])
            assert words[0] == "usp" and ([words[1]] in COMMANDS or words[1:3] in COMMANDS), line
            if words[1] in ("plan", "train", "submit", "estimate", "verify", "prepare-data"):
                args = [w for w in words[2:] if "=" in w and not w.startswith("-")]
                conf = next((a.split("=", 1)[1] for a in args if a.startswith("conf=")), None)
                if conf and conf.startswith("my_"):
                    continue
                compose_config(conf, [a for a in args if not a.startswith("conf=")])


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
