"""`python -m usp.cli ...`, the same as the `usp` console script."""
from usp.cli.commands import main

main()
