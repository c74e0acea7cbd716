"""The plan as a page: `usp plan --json` / `--html` and `usp ui` (docs/ui.md)."""
