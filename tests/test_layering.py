"""The package's arrows run one way (cli -> decode / train -> model -> attention; data
and checkpoint below them, importing no model code; decoding never imports training),
and the command line starts without torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.environment import python_path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "transduce"

# Module prefix -> what it may not import, anywhere in the file (lazy imports included).
FORBIDDEN = {
    "transduce.errors": ["transduce."],
    "transduce.config": ["transduce.attention", "transduce.model", "transduce.data",
                         "transduce.checkpoint", "transduce.decode", "transduce.train",
                         "transduce.cli", "transduce.export"],
    "transduce.atomic": ["transduce.attention", "transduce.model", "transduce.data",
                         "transduce.decode", "transduce.train", "transduce.cli"],
    "transduce.data": ["transduce.attention", "transduce.model", "transduce.checkpoint",
                       "transduce.decode", "transduce.train", "transduce.cli", "transduce.export"],
    "transduce.checkpoint": ["transduce.attention", "transduce.model", "transduce.decode",
                             "transduce.train", "transduce.cli", "transduce.export"],
    "transduce.onnx_format": ["transduce.attention", "transduce.model", "transduce.data",
                              "transduce.checkpoint", "transduce.decode", "transduce.train",
                              "transduce.cli", "transduce.export"],
    "transduce.attention": ["transduce.model", "transduce.data", "transduce.checkpoint",
                            "transduce.decode", "transduce.train", "transduce.cli",
                            "transduce.export"],
    "transduce.model": ["transduce.decode", "transduce.train", "transduce.cli",
                        "transduce.export"],
    "transduce.decode": ["transduce.train", "transduce.cli", "transduce.export"],
    "transduce.train": ["transduce.cli", "transduce.export"],
    "transduce.export": ["transduce.train", "transduce.cli", "transduce.decode"],
    "transduce.importers": ["transduce.train", "transduce.cli", "transduce.decode",
                            "transduce.export"],
}


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("name,path", list(modules()), ids=lambda x: str(x))
def test_imports_go_one_way(name, path):
    rules = [banned for prefix, banned in FORBIDDEN.items()
             if name == prefix or name.startswith(prefix + ".")]
    wrong = sorted(module for module in imported(path) for banned in rules for forbidden in banned
                   if module == forbidden.rstrip(".") or module.startswith(forbidden))
    assert not wrong, f"{name} imports {wrong}"


@pytest.mark.parametrize("argv", [["--help"], ["translate", "--help"], ["train", "--help"]])
def test_the_command_line_starts_without_torch(argv):
    code = ("import sys\nfrom transduce.cli import main\ntry:\n    main(%r)\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)" % argv)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": python_path()}, timeout=60)
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout + result.stderr


def test_import_transduce_is_cheap_and_its_names_load_on_use():
    code = ("import sys, transduce\nprint('torch' in sys.modules)\n"
            "print(transduce.load.__module__, transduce.Transformer.__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": python_path()}, timeout=120)
    assert result.stdout.split() == ["False", "transduce.decode.load", "Transformer"], \
        result.stderr


def test_training_without_sharding_does_not_import_fsdp():
    """torch.distributed's FSDP and checkpoint modules take a second to import: only a
    sharded run (train/sharding.py's functions) loads them."""
    code = ("import sys\nimport transduce.train.loop, transduce.train.state\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.fsdp', "
            "'torch.distributed.checkpoint', 'torch.distributed.tensor'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": python_path()}, timeout=120)
    assert result.stdout.strip().splitlines()[-1:] == ["[]"], result.stdout + result.stderr


def test_every_native_kernel_source_ships_with_the_package():
    """The C++ kernels are compiled where they run, from the installed package: each
    package holding one lists *.cpp in pyproject.toml's package data."""
    import tomllib

    project = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())
    package_data = project["tool"]["setuptools"]["package-data"]
    for source in PACKAGE.rglob("*.cpp"):
        package = ".".join(source.parent.relative_to(PACKAGE.parent).parts)
        assert "*.cpp" in package_data.get(package, []), f"{source.name} of {package}"
