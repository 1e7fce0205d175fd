"""Proves the import layering: `python -m kvrecover.tools.layering [PACKAGE_DIR]`.

The house, top to bottom (each part may import only the parts below it):

    entrypoints (and cli, scenario) -> llm -> engine -> worker -> models -> ops
                                                 kv_transfer (beside the worker)
    the shared vocabulary below them all: config, options, sampling, outputs,
    kv_layout, step_messages, tokenizer, model sources, structured (grammars)

Read from the source with `ast` (nothing is imported), every import counts, type
hints under `if TYPE_CHECKING:` and imports inside functions included. The rules:

- no import runs back up the house (`HOUSE` ranks every part of the package; a part
  it does not rank is itself a violation, so a new module gets placed);
- the worker and kv_transfer stand side by side: the worker may use connectors,
  kv_transfer imports nothing from the worker;
- entrypoints reach the engine only through `llm` and the names the engine package
  declares public (its `__all__`), never `worker`, `models` or `ops`;
- inside entrypoints, the server and the proxy stand side by side and share only
  `entrypoints.openai`, which imports neither; only the CLI imports them
  (`ENTRYPOINT_ROLES`);
- no circles: neither between modules nor between the parts of the house.

Prints one line per violation or circle and exits 1 if there is any, else exits 0.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Part of the package (its first two name components) -> its floor; higher imports lower.
HOUSE: dict[str, int] = {
    "kvrecover.entrypoints": 6, "kvrecover.cli": 6, "kvrecover.__main__": 6,
    "kvrecover.scenario": 6, "kvrecover.tools": 6,
    "kvrecover": 5, "kvrecover.llm": 5,  # the package's front door re-exports LLM
    "kvrecover.engine": 4,
    "kvrecover.worker": 3, "kvrecover.kv_transfer": 3, "kvrecover.distributed": 3,
    "kvrecover.models": 2,
    "kvrecover.ops": 1,
    **{f"kvrecover.{name}": 0 for name in (
        "config", "options", "device_defaults", "sampling", "outputs", "kv_layout",
        "step_messages", "tokenizer", "model_source", "default_model", "cache_dir",
        "structured")},
}
# (importer, imported) pairs on one floor that must not meet.
SIDEWAYS_FORBIDDEN = (("kvrecover.kv_transfer", "kvrecover.worker"),
                      ("kvrecover.distributed", "kvrecover.worker"),
                      ("kvrecover.distributed", "kvrecover.kv_transfer"),
                      ("kvrecover.kv_transfer", "kvrecover.distributed"))
# What entrypoints may not import, except the engine package's declared public names.
ENTRYPOINTS = "kvrecover.entrypoints"
ENTRYPOINTS_FORBIDDEN = ("kvrecover.engine", "kvrecover.worker", "kvrecover.models",
                         "kvrecover.ops")
PUBLIC_API_PACKAGE = "kvrecover.engine"
# The roles inside entrypoints, floor by floor: the CLI starts the server and the proxy,
# which stand side by side over what they share (OpenAI's formats, the HTTP plumbing).
ENTRYPOINT_ROLES: dict[str, int] = {
    "kvrecover.entrypoints.cli": 2,
    "kvrecover.entrypoints.server": 1, "kvrecover.entrypoints.proxy": 1,
    "kvrecover.entrypoints.openai": 0,
}


@dataclass(frozen=True)
class Violation:
    """One import that breaks a rule."""

    path: Path
    line: int
    module: str  # the importing module
    imported: str  # what it imports
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.imported} ({self.reason})"


@dataclass(frozen=True)
class Circle:
    """Modules (or parts of the house) that import each other, in import order."""

    members: tuple[str, ...]

    def __str__(self) -> str:
        return "circle: " + " -> ".join((*self.members, self.members[0]))


@dataclass
class _Package:
    """Every module of the package with its imports: (line, imported name)."""

    root: Path
    imports: dict[str, list[tuple[int, str]]]
    paths: dict[str, Path]

    def module_of(self, name: str) -> str | None:
        """The package module that `name` (a module or a name inside one) lives in."""
        while name:
            if name in self.imports:
                return name
            name = name.rpartition(".")[0]
        return None


def find_violations(package_dir: Path) -> list[Violation]:
    """Every rule violation in the package rooted at `package_dir` (a `kvrecover` folder)."""
    package = _read_package(Path(package_dir))
    public = _public_names(package, PUBLIC_API_PACKAGE)
    violations = []
    for module, imports in package.imports.items():
        part = _part(module)
        for line, imported in imports:
            target = package.module_of(imported)
            if target is None:
                continue  # outside the package
            reason = _broken_rule(module, part, imported, _part(target), public)
            if reason:
                violations.append(Violation(package.paths[module], line, module, imported, reason))
    return violations


def find_circles(package_dir: Path) -> list[Circle]:
    """Import circles between modules, then between the parts of the house."""
    package = _read_package(Path(package_dir))
    modules: dict[str, set[str]] = {module: set() for module in package.imports}
    parts: dict[str, set[str]] = {}
    for module, imports in package.imports.items():
        parts.setdefault(_part(module), set())
        for _, imported in imports:
            target = package.module_of(imported)
            if target is None or target == module:
                continue
            modules[module].add(target)
            if _part(target) != _part(module):
                parts[_part(module)].add(_part(target))
    return _circles(modules) + _circles(parts)


def _broken_rule(module: str, part: str, imported: str, target_part: str,
                 public: set[str]) -> str | None:
    if part not in HOUSE:
        return f"{part} has no floor in the house: place it in layering.HOUSE"
    if target_part not in HOUSE:
        return f"{target_part} has no floor in the house: place it in layering.HOUSE"
    if part == target_part:
        return _broken_role_rule(module, imported)
    if HOUSE[target_part] > HOUSE[part]:
        return f"runs back up the house: {part} is below {target_part}"
    if (part, target_part) in SIDEWAYS_FORBIDDEN:
        return f"{part} stands beside {target_part} and must not import it"
    if _within(module, ENTRYPOINTS) and any(_within(imported, f) for f in ENTRYPOINTS_FORBIDDEN):
        name = imported.removeprefix(PUBLIC_API_PACKAGE + ".")
        if _within(imported, PUBLIC_API_PACKAGE) and name in public:
            return None
        return (f"entrypoints use kvrecover.llm and the public names of {PUBLIC_API_PACKAGE} "
                f"({', '.join(sorted(public)) or 'none declared'}), no internals")
    return None


def _broken_role_rule(module: str, imported: str) -> str | None:
    role, target = _role(module), _role(imported)
    if role is None or target is None or role == target:
        return None
    if ENTRYPOINT_ROLES[target] > ENTRYPOINT_ROLES[role]:
        return f"runs back up the entrypoints: {role} is below {target}"
    if ENTRYPOINT_ROLES[target] == ENTRYPOINT_ROLES[role]:
        return f"{role} stands beside {target}; share code through kvrecover.entrypoints.openai"
    return None


def _role(module: str) -> str | None:
    return next((role for role in ENTRYPOINT_ROLES if _within(module, role)), None)


def _read_package(package_dir: Path) -> _Package:
    imports, paths = {}, {}
    for path in sorted(package_dir.rglob("*.py")):
        module = _module_name(package_dir, path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imports[module] = list(_imports(tree, module, path.name == "__init__.py"))
        paths[module] = path
    return _Package(package_dir, imports, paths)


def _public_names(package: _Package, name: str) -> set[str]:
    """The names in `__all__` of package `name`'s `__init__.py` (literal lists only)."""
    path = package.paths.get(name)
    if path is None:
        return set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in targets
            ):
                return set(ast.literal_eval(node.value))
    return set()


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _module_name(package_dir: Path, path: Path) -> str:
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, imported module or name) for every import, wherever it stands."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            for alias in node.names:
                # `from kvrecover import engine` imports the module kvrecover.engine.
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) `from ... import` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _circles(graph: dict[str, set[str]]) -> list[Circle]:
    """One circle per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(Circle(_cycle_through(graph, set(component))))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> tuple[str, ...]:
    """A shortest cycle inside `component` from its first member (breadth first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph.get(node, set()) & component):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return tuple(reversed(path))
                if successor not in parents:
                    parents[successor] = node
                    following.append(successor)
        frontier = following
    return tuple(sorted(component))  # unreachable for a strongly connected component


def main(argv: list[str] | None = None) -> int:
    """Check the package folder given (default: the installed `kvrecover`); 1 on violations."""
    argv = sys.argv[1:] if argv is None else argv
    package_dir = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    violations = find_violations(package_dir)
    circles = find_circles(package_dir)
    for problem in (*violations, *circles):
        print(problem)
    if violations or circles:
        print(f"{len(violations)} layering violation(s), {len(circles)} circle(s)")
        return 1
    print(f"layering ok: {package_dir} (0 violations, 0 circles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
