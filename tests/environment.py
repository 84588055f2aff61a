"""The environment of the subprocesses tests start: the repository's src first on the
module path, then the caller's own PYTHONPATH, so that packages a machine supplies that
way (rather than installed) stay importable in the child."""

import os
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def python_path() -> str:
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(SRC), inherited]) if inherited else str(SRC)


def subprocess_env(**overrides: str) -> dict[str, str]:
    """This process's environment with the module path above and `overrides`."""
    return {**os.environ, "PYTHONPATH": python_path(), **overrides}
