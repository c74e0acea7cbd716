"""The one rule for a name that becomes a directory (train.name, `usp sweep --name`): a single path
component that can't escape the directory it is put in, and that a shell or an #SBATCH line takes
as it is. No torch, no usp imports besides usp.errors: every layer may use it."""
from __future__ import annotations

import re

from usp.errors import UspError

# A letter or digit first (no "..", no hidden ".x", no "-x" read as an option), then letters, digits,
# '.', '_', '-': no '/', no space, no control character.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
NAME_MAX = 255  # a file name's limit on Linux (NAME_MAX)
NAME_RULE = "one directory name: a letter or digit, then letters, digits, '.', '_', '-' (no '/', spaces or '..')"


def name_problem(name: object) -> str | None:
    """None when `name` is a valid directory name, else why not."""
    if not isinstance(name, str) or not name:
        return f"empty; it must be {NAME_RULE}"
    if not NAME_PATTERN.fullmatch(name):
        return f"it becomes a directory, so it must be {NAME_RULE}"
    if len(name) > NAME_MAX:
        return f"{len(name)} characters; a directory name has at most {NAME_MAX}"
    return None


def check_dir_name(name: object, *, key: str, fix: str, error: type[UspError] = UspError) -> str:
    """`name` if it is a valid directory name, else `error` naming the key, the value and the fix."""
    problem = name_problem(name)
    if problem is not None:
        raise error(problem, key=key, value=name, fix=fix)
    return str(name)
