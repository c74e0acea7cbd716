"""Every `usp <command> --help` has an Examples section whose lines are real commands with overrides
that compose (shell completion: tests/e2e/test_cli_help.py)."""
from __future__ import annotations

import shlex

import pytest

from tests.helpers import usp_cli
from usp.cli import app
from usp.cli.examples import EXAMPLES
from usp.config.compose import compose_config

COMMANDS = [[c.name or c.callback.__name__.replace("_", "-")] for c in app.registered_commands]
COMMANDS += [[g.name] for g in app.registered_groups]
COMMANDS += [[g.name, c.name or c.callback.__name__] for g in app.registered_groups
             for c in g.typer_instance.registered_commands]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_help_page_has_examples(tmp_path, command):
    proc = usp_cli(*command, "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "Examples:" in proc.stdout, proc.stdout
    for line in EXAMPLES[" ".join(command)]:
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
