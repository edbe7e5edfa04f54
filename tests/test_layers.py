"""Imports point one way: samplers/, models/ and rewards/ never import the trainer's world, and the
modules of train/ import each other without a cycle (builders below the trainer and every tool)."""

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


def train_import_graph() -> dict[str, set[str]]:
    """train module -> the train modules it imports anywhere (function bodies and TYPE_CHECKING too)."""
    modules = {f"train.{path.stem}": path for path in (ROOT / "train").glob("*.py")}
    return {
        name: {m for m in modules if m != name and any(i == m or i.startswith(m + ".") for i in imported_modules(path))}
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a path that starts and ends at one node, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_train_imports_form_no_cycle():
    graph = train_import_graph()
    assert {"train.build", "train.trainer", "train.step"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    # the builders serve the trainer and the tools, never the other way round
    assert not graph["train.build"] & {"train.trainer", "train.step", "train.probe", "train.eval", "train.plan"}
    # the planner is a command over the trainer's code: nothing of the trainer depends on it
    assert not [name for name, imports in graph.items() if "train.plan" in imports]


def test_cycle_finder():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_checker_sees_forbidden_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom train.jagg import aggregate\n")
    assert {"torch.distributed", "train.jagg"} <= imported_modules(bad)
