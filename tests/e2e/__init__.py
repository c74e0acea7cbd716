"""Tests that start processes: the usp console script, torchrun, Slurm, pip (tests/conftest.py)."""
