"""Imports point one way: samplers/, models/ and rewards/ never import the trainer's world, settings/ imports
nothing of the project, and inside train/ the packages stand on each other in the partial order of STANDS_ON
(CONTRIBUTING.md, Layout), within the wings of WINGS: the ground (errors, the disk's one line, the run folder's
layout), distributed/ and the algorithm, the run's parts (train/parts/), the assembly of a run (train/run/)
above every part it builds, the loop (train/loop/), what the commands share (train/cli/), the commands
(train/tools/, each with its entry train/<command>.py) and ``python -m train``.

A package imports only the packages below it in the order, so no two import each other, directly or around a
loop (an import the order does not allow is a back arrow, or an edge to add); the order holds no edge the code
does not need, and its edges point down the wings; no command imports another's package, but the preflight the
memory planner's (it re-makes the plan with what it measured); and the modules import each other without a
cycle. The configuration's tree stands above the parts whose groups it composes (each group is a dataclass
beside the part that reads it, which never imports train.parts.config back) and below the parts that read the
whole tree (the policy, the scoring stage)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("train", "torch.distributed", "hydra", "omegaconf", "wandb")
COMMANDS = ("eval", "probe", "compare", "plan", "preflight")
# the wings of train/, lowest first: a package's edges in STANDS_ON stay in its wing or point to a lower one
WINGS = [
    {"train.ground"},
    {"train.distributed", "train.algorithm"},
    {"train.parts"},
    {"train.run"},
    {"train.loop"},
    {"train.cli"},
    {"train.tools"},
    {"train.__main__"},
]
# what each package of train/ stands on: it may import these and whatever they stand on, nothing else (the
# transitive reduction of the packages' import graph: each edge is needed and implied by no other)
STANDS_ON: dict[str, set[str]] = {
    "train.ground": set(),
    "train.algorithm": set(),
    "train.distributed": {"train.ground"},
    "train.parts.optim": set(),
    "train.parts.data": {"train.distributed"},
    "train.parts.observe": {"train.distributed"},
    "train.parts.checkpoint": {"train.distributed", "train.parts.optim"},
    "train.parts.eval": {"train.parts.data", "train.parts.observe", "train.parts.optim"},
    "train.parts.scoring": {"train.algorithm", "train.distributed"},
    "train.parts.config": {"train.parts.checkpoint", "train.parts.eval", "train.parts.scoring"},
    "train.parts.policy": {"train.parts.config"},
    "train.run": {"train.parts.policy"},
    "train.loop": {"train.run"},
    "train.cli": {"train.run"},
    "train.tools.eval": {"train.cli"},
    "train.tools.compare": {"train.cli"},
    "train.tools.probe": {"train.cli", "train.loop"},
    "train.tools.plan": {"train.cli", "train.loop"},
    "train.tools.preflight": {"train.tools.plan"},
    "train.__main__": {"train.cli", "train.loop"},
}


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
    # the package's and the wings' docstrings: ``from train.parts.x import`` names train.parts.x, not train.parts
    for docstring_only in ("train", "train.parts", "train.tools"):
        assert not imported_modules(modules.pop(docstring_only)), f"{docstring_only}/__init__.py imports"
    imports = {name: imported_modules(path) for name, path in modules.items()}
    return {
        name: {m for m in modules if m != name and any(i == m or i.startswith(m + ".") for i in imports[name])}
        for name in modules
    }


def part_of(module: str) -> str:
    """The package that holds ``module``: train.x, train.parts.x or train.tools.x; a command's entry
    train.<command> (train/<command>.py) is its command's."""
    names = module.split(".")
    if len(names) == 2 and names[1] in COMMANDS:
        return f"train.tools.{names[1]}"
    return ".".join(names[:3] if names[1] in ("parts", "tools") and len(names) > 2 else names[:2])


def wing_of(package: str) -> int:
    """The index in WINGS of ``package`` (train.parts.x stands in the wing train.parts)."""
    (index,) = [i for i, wing in enumerate(WINGS) for w in wing if package == w or package.startswith(w + ".")]
    return index


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
    """The packages' graph: package -> the other packages its modules import."""
    parts: dict[str, set[str]] = {part_of(a): set() for a in graph}
    for a, imports in graph.items():
        parts[part_of(a)] |= {part_of(b) for b in imports} - {part_of(a)}
    return parts


def below(order: dict[str, set[str]], package: str, without: tuple[str, str] | None = None) -> set[str]:
    """Every package ``package`` stands on in ``order``, directly or through others (leaving out the edge
    ``without``)."""
    reached: set[str] = set()
    todo = [b for b in order.get(package, ()) if (package, b) != without]
    while todo:
        if (b := todo.pop()) not in reached:
            reached.add(b)
            todo += order.get(b, ())
    return reached


def back_arrows(packages: dict[str, set[str]], order: dict[str, set[str]]) -> list[str]:
    """The imports between packages that ``order`` does not allow."""
    return sorted(f"{a} -> {b}" for a, imports in packages.items() for b in imports if b not in below(order, a))


def unneeded_edges(packages: dict[str, set[str]], order: dict[str, set[str]]) -> list[str]:
    """The edges of ``order`` that no import needs, or that its other edges imply."""
    return sorted(
        f"{a} -> {b}"
        for a, bs in order.items()
        for b in bs
        if b not in below(packages, a) or b in below(order, a, without=(a, b))
    )


def test_train_packages_import_down_their_order():
    graph = train_import_graph()
    assert {"train.run.build", "train.loop.trainer", "train.loop.step", "train.algorithm.jagg"} <= set(graph)
    packages = package_graph(graph)
    assert sorted(packages) == sorted(STANDS_ON), "a package was added or renamed: give it its place in STANDS_ON"
    assert find_cycle(STANDS_ON) is None, " -> ".join(find_cycle(STANDS_ON) or [])
    assert back_arrows(packages, STANDS_ON) == []
    assert unneeded_edges(packages, STANDS_ON) == []
    assert sorted(f"{a} -> {b}" for a, bs in STANDS_ON.items() for b in bs if wing_of(b) > wing_of(a)) == []
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    # the commands are rooms of their own: none imports another's package (the trainer's `python -m
    # train` and the shared train.cli aside), and only the preflight imports the memory planner
    commands = tuple(f"train.tools.{c}" for c in COMMANDS)
    crossing = sorted(
        f"{a} -> {b}" for a, imports in graph.items() for b in imports
        if part_of(b) in commands and part_of(a) != part_of(b)
        and not (part_of(a) == "train.tools.preflight" and part_of(b) == "train.tools.plan")
    )  # fmt: skip
    assert crossing == []


def test_order_rule_sees_back_arrows_cycles_and_unneeded_edges():
    order = {"train.ground": set(), "train.parts.data": {"train.ground"}, "train.run": {"train.parts.data"}}
    # an import down the order, directly or across a floor, is allowed; one up it, or sideways, is not
    assert back_arrows({"train.run": {"train.ground", "train.parts.data"}}, order) == []
    assert back_arrows({"train.ground": {"train.run"}}, order) == ["train.ground -> train.run"]
    assert back_arrows({"train.parts.data": {"train.parts.optim"}}, order) == ["train.parts.data -> train.parts.optim"]
    # an edge no import needs, and one the others imply
    packages = {"train.run": {"train.parts.data"}, "train.parts.data": {"train.ground"}, "train.ground": set()}
    assert unneeded_edges(packages, order) == []
    assert unneeded_edges({**packages, "train.run": set()}, order) == ["train.run -> train.parts.data"]
    implied = {**order, "train.run": {"train.parts.data", "train.ground"}}
    assert unneeded_edges(packages, implied) == ["train.run -> train.ground"]
    # two packages that import each other through different modules: no module cycle, a package cycle
    graph = {"train.run.a": {"train.parts.policy.b"}, "train.parts.policy.c": {"train.run.d"}}
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["train.parts.policy", "train.run", "train.parts.policy"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    # the packages of the wings, and a command's entry with its command
    modules = ("train.parts.eval.protocol", "train.tools.plan.fake", "train.plan", "train.loop.step")
    assert [part_of(m) for m in modules] == ["train.parts.eval", "train.tools.plan", "train.tools.plan", "train.loop"]
    assert wing_of("train.parts.eval") == 2 and wing_of("train.tools.plan") > wing_of("train.loop")


def test_checker_sees_forbidden_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom train.algorithm.jagg import aggregate\n")
    assert {"torch.distributed", "train.algorithm.jagg"} <= imported_modules(bad)


def test_no_core_module_mentions_the_planner():
    """The planner is a tool in its own room: no seam, comment or import for it outside train/tools/plan/ and its
    entry train/plan.py (and the preflight, the command above it that re-makes its plan)."""
    rooms = {("train", "tools", "plan"), ("train", "tools", "preflight"), ("train", "plan.py")}
    core = [p for pkg in ("train", "models", "samplers", "rewards") for p in (ROOT / pkg).rglob("*.py")]
    mentions = [
        str(p.relative_to(ROOT))
        for p in core
        if not any(p.relative_to(ROOT).parts[: len(room)] == room for room in rooms)
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
