"""usp's command line: the Typer app (usp.cli.commands) and the examples of its --help pages
(usp.cli.examples). pyproject's console script is `usp = "usp.cli:app"`."""
from usp.cli.commands import app, main

__all__ = ["app", "main"]
