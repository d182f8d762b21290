"""Imports point down: training's sub-packages in their order, and no import cycle between modules."""
import ast
from pathlib import Path

import transformer

PACKAGE = Path(transformer.__file__).parent
# transformer/training/, bottom to top: a sub-package imports only its own and those before it.
TRAINING = ("components", "reporting", "speed", "distributed", "loop", "tools", "launcher")


def imports(path: Path, top_level_only: bool):
    """The transformer.* modules a file imports (all of them, or only at module level, not inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformer"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield full if (PACKAGE.parent / (full.replace(".", "/") + ".py")).exists() else node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("transformer"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def training_layer(module: str):
    parts = module.split(".")
    if parts[:2] != ["transformer", "training"] or len(parts) < 3:
        return None
    return TRAINING.index(parts[2]) if parts[2] in TRAINING else None


def test_training_sub_packages_import_only_downwards():
    upward = []
    for name, path in MODULES.items():
        layer = training_layer(name)
        if layer is None:
            continue
        for target in imports(path, top_level_only=False):
            other = training_layer(target)
            if other is not None and other > layer:
                upward.append(f"{name} -> {target}")
    assert not upward, upward


def test_no_import_cycle_between_modules():
    graph = {name: {t for t in imports(path, top_level_only=True) if t in MODULES and t != name}
             for name, path in MODULES.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles
