"""`usp export --out` to a place that can't take a file is one clean error, before the checkpoint is
looked for (the other messages: tests/unit/test_messages.py)."""
from __future__ import annotations

from tests.helpers import usp_cli
from tests.unit.test_messages import _flat, _unwritable


def test_export_out_to_an_unwritable_place_before_loading(tmp_path):
    """Checked before the checkpoint is even looked for (a long load would be wasted)."""
    for directory, says in _unwritable(tmp_path):
        proc = usp_cli("export", str(tmp_path / "no_such_run"), "--out", f"{directory}/model", cwd=tmp_path)
        out = _flat(proc.stderr)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert says in out and "--out=" in out, out
