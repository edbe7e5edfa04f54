"""Imports point one way: samplers/, models/ and rewards/ never import the trainer's world."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("train", "torch.distributed", "hydra", "omegaconf", "wandb")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("package", ["samplers", "models", "rewards"])
def test_lower_layers_do_not_import_trainer(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    for path in files:
        bad = {m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_checker_sees_forbidden_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom train.jagg import aggregate\n")
    assert {"torch.distributed", "train.jagg"} <= imported_modules(bad)
