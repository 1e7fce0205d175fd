"""Proves the import layering: `python -m kvrecover.tools.layering [PACKAGE_DIR]`.

The import arrows point one way: entrypoints -> llm -> engine -> worker ->
ops/models, with kv_transfer beside the worker. Read from the source with `ast`
(nothing is imported), the rules are:

- `kvrecover/kv_transfer` and `kvrecover/ops` import nothing from
  `kvrecover.engine` or `kvrecover.worker`, except inside `if TYPE_CHECKING:`
  (type hints only);
- `kvrecover/models` imports nothing from `kvrecover.worker` or
  `kvrecover.engine`, not even for type hints.

Prints one line per violation and exits 1 if there is any, else exits 0.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    """Modules under `package` must not import any of `forbidden`."""

    package: str  # e.g. "kvrecover.ops"
    forbidden: tuple[str, ...]
    type_checking_allowed: bool


RULES = (
    Rule("kvrecover.kv_transfer", ("kvrecover.engine", "kvrecover.worker"), True),
    Rule("kvrecover.ops", ("kvrecover.engine", "kvrecover.worker"), True),
    Rule("kvrecover.models", ("kvrecover.engine", "kvrecover.worker"), False),
)


@dataclass(frozen=True)
class Violation:
    """One import that breaks a rule."""

    path: Path
    line: int
    module: str  # the importing module
    imported: str  # what it imports
    rule: Rule

    def __str__(self) -> str:
        where = "outside TYPE_CHECKING" if self.rule.type_checking_allowed else "at all"
        return (f"{self.path}:{self.line}: {self.module} imports {self.imported} "
                f"({self.rule.package} must not import {' or '.join(self.rule.forbidden)} {where})")


def find_violations(package_dir: Path) -> list[Violation]:
    """Every rule violation in the package rooted at `package_dir` (a `kvrecover` folder)."""
    package_dir = Path(package_dir)
    violations = []
    for path in sorted(package_dir.rglob("*.py")):
        module = _module_name(package_dir, path)
        rules = [r for r in RULES if _within(module, r.package)]
        if not rules:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for line, imported, type_checking in _imports(tree, module, is_package):
            for rule in rules:
                if type_checking and rule.type_checking_allowed:
                    continue
                if any(_within(imported, target) for target in rule.forbidden):
                    violations.append(Violation(path, line, module, imported, rule))
    return violations


def _module_name(package_dir: Path, path: Path) -> str:
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[int, str, bool]]:
    """(line, imported module, whether under `if TYPE_CHECKING:`) for every import."""
    for node, type_checking in _walk(tree, False):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, type_checking
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            for alias in node.names:
                # `from kvrecover import engine` imports the module kvrecover.engine.
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name, type_checking


def _walk(node: ast.AST, type_checking: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        yield child, type_checking
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for statement in child.body:
                yield statement, True
                yield from _walk(statement, True)
            for statement in child.orelse:
                yield statement, type_checking
                yield from _walk(statement, type_checking)
        else:
            yield from _walk(child, type_checking)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) `from ... import` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def main(argv: list[str] | None = None) -> int:
    """Check the package folder given (default: the installed `kvrecover`); 1 on violations."""
    argv = sys.argv[1:] if argv is None else argv
    package_dir = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    violations = find_violations(package_dir)
    for violation in violations:
        print(violation)
    if violations:
        print(f"{len(violations)} layering violation(s)")
        return 1
    print(f"layering ok: {package_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
