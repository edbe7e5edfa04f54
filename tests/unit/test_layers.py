"""Imports point one way: samplers/, models/ and rewards/ never import the trainer's world, settings/ imports
nothing of the project, and inside train/ every package stands on one floor of LAYERS (CONTRIBUTING.md, Layout):
the ground (errors, the run folder's layout), distribution, the algorithm, the run parts each on its own floor,
the assembly of a run above every part it builds, the trainer (with the run's summary), the commands.

A module imports its own floor or those below it, never one above; no two packages import each other, directly
or around a loop; no command imports another's package, but the preflight the memory planner's (it re-makes the
plan with what it measured); and the modules import each other without a cycle. The configuration's tree stands
above the parts whose groups it composes (each group is a dataclass beside the part that reads it, which never
imports train.parts.config back) and below the parts that read the whole tree."""

import ast
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("train", "torch.distributed", "hydra", "omegaconf", "wandb")
# the floor of each part of train/, lowest first; a part is a sub-package or a top-level module
COMMANDS = ("eval", "probe", "compare", "plan", "preflight")
LAYERS = [
    {"train.ground", "train.parts", "train.loop", "train.tools"},  # the wings' docstrings import nothing
    {"train.distributed"},
    {"train.algorithm"},
    {"train.parts.data"},
    {"train.parts.optim"},
    {"train.parts.checkpoint"},
    {"train.parts.observe"},
    {"train.parts.eval"},
    {"train.parts.config"},
    {"train.parts.scoring"},
    {"train.parts.policy"},
    {"train.run"},
    {"train.loop.trainer", "train.loop.step", "train.loop.faults", "train.loop.epilogue"},
    {"train.cli", "train.__main__", *(f"train.{c}" for c in COMMANDS), *(f"train.tools.{c}" for c in COMMANDS)},
]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("package", ["samplers", "models", "rewards", "settings"])
def test_lower_layers_do_not_import_trainer(package):
    forbidden = (*FORBIDDEN, "samplers", "models", "rewards") if package == "settings" else FORBIDDEN
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    for path in files:
        bad = {m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in forbidden)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def train_import_graph() -> dict[str, set[str]]:
    """train module -> the train modules it imports anywhere (function bodies and TYPE_CHECKING too)."""
    modules = {module_name(path): path for path in (ROOT / "train").rglob("*.py")}
    modules.pop("train")  # the package's docstring: ``from train.x import`` names train.x, not train
    imports = {name: imported_modules(path) for name, path in modules.items()}
    return {
        name: {m for m in modules if m != name and any(i == m or i.startswith(m + ".") for i in imports[name])}
        for name in modules
    }


def layer_of(module: str) -> int:
    """The index in LAYERS of the part that holds ``module`` (the longest matching part)."""
    matches = [
        (len(part), i)
        for i, parts in enumerate(LAYERS)
        for part in parts
        if module == part or module.startswith(part + ".")
    ]
    assert matches, f"{module} belongs to no layer: add its part to LAYERS"
    return max(matches)[1]


def part_of(module: str) -> str:
    """train.x, or train.<wing>.x for a package of the wings train/parts/ and train/tools/."""
    names = module.split(".")
    return ".".join(names[:3] if names[1:2] in (["parts"], ["tools"], ["loop"]) else names[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a path that starts and ends at one node, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
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


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The parts' graph: part -> the other parts its modules import."""
    parts: dict[str, set[str]] = {part_of(a): set() for a in graph}
    for a, imports in graph.items():
        parts[part_of(a)] |= {part_of(b) for b in imports} - {part_of(a)}
    return parts


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, imports in graph.items() for b in imports if layer_of(b) > layer_of(a))


def test_train_layers_import_downwards_only():
    graph = train_import_graph()
    assert {"train.run.build", "train.loop.trainer", "train.loop.step", "train.algorithm.jagg"} <= set(graph)
    assert upward_imports(graph) == []
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    assert find_cycle(package_graph(graph)) is None, " -> ".join(find_cycle(package_graph(graph)) or [])
    # the commands are rooms of their own: none imports another's package (the trainer's `python -m
    # train` and the shared train.cli aside), and only the preflight imports the memory planner
    commands = tuple(f"train.tools.{c}" for c in COMMANDS)
    crossing = sorted(
        f"{a} -> {b}" for a, imports in graph.items() for b in imports
        if part_of(b) in commands and part_of(a) != part_of(b)
        and not (part_of(a) == "train.tools.preflight" and part_of(b) == "train.tools.plan")
        and a != "train." + part_of(b).split(".")[-1]  # train/<command>.py: its python -m entry
    )  # fmt: skip
    assert crossing == []


def test_layer_rule_sees_an_upward_import():
    graph = {"train.algorithm.update": {"train.parts.config.schema"}, "train.parts.config.schema": set()}
    assert upward_imports(graph) == ["train.algorithm.update -> train.parts.config.schema"]
    # every run part on its own floor: a part that imports one above it fails, wherever the two sit
    parts = [
        next(iter(floor)) for floor in LAYERS[LAYERS.index({"train.parts.data"}) : LAYERS.index({"train.run"}) + 1]
    ]
    for low, high in pairwise(parts):
        assert upward_imports({f"{low}.a": {f"{high}.b"}, f"{high}.b": set()}) == [f"{low}.a -> {high}.b"]
    # two packages that import each other through different modules: no module cycle, a package cycle
    graph = {"train.run.a": {"train.parts.policy.b"}, "train.parts.policy.c": {"train.run.d"}}
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["train.parts.policy", "train.run", "train.parts.policy"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_checker_sees_forbidden_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom train.algorithm.jagg import aggregate\n")
    assert {"torch.distributed", "train.algorithm.jagg"} <= imported_modules(bad)


def test_no_core_module_mentions_the_planner():
    """The planner is a tool in its own room: no seam, comment or import for it outside train/tools/plan/ (and the
    preflight, the command above it that re-makes its plan)."""
    core = [p for pkg in ("train", "models", "samplers", "rewards") for p in (ROOT / pkg).rglob("*.py")]
    mentions = [
        str(p.relative_to(ROOT))
        for p in core
        if not {"plan", "preflight", "plan.py"} & set(p.relative_to(ROOT).parts[1:3])
        and ("train.tools.plan" in p.read_text() or "train.plan" in p.read_text())
    ]
    assert mentions == []


def test_the_algorithm_is_pure_tensor_code():
    """train/algorithm/ imports nothing of train/ outside itself and nothing of torch.distributed: it runs
    no collective. Its metrics carry their reductions and the trainer's step reduces them over ranks; a
    measurement over ranks (the probe, the auto router) takes the caller's reductions."""
    files = sorted((ROOT / "train" / "algorithm").rglob("*.py"))
    assert files
    for path in files:
        bad = {
            m
            for m in imported_modules(path)
            if (m.startswith("train.") and not m.startswith("train.algorithm"))
            or m.startswith(("torch.distributed", "hydra", "omegaconf", "wandb"))
        }
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


# the modules that build a run's parts at start-up
BUILDERS = {
    "train.run.build",
    "train.parts.policy.builder",
    "train.parts.policy.predict",
    "train.parts.optim.optimizer",
    "train.parts.eval.evaluator",
}


def test_a_step_uses_parts_built_at_start_up():
    """Build once, use many: the step reads the run's parts and imports no builder, nor does any module it imports
    (the update's predictors, router and settings are built before it runs, not per segment or micro-batch)."""
    graph = train_import_graph()
    assert BUILDERS <= set(graph), "a builder module was renamed: update BUILDERS"
    reached, todo = set(), ["train.loop.step"]
    while todo:
        new = graph[todo.pop()] - reached
        reached |= new
        todo += new
    assert sorted(BUILDERS & reached) == []
