"""Torch-free tests run in this process (tests/conftest.py)."""
