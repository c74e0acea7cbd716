"""Tests that run torch in this process (tests/conftest.py)."""
