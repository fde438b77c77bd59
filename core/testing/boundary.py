"""The plugin import boundary: a plugin imports only backplane's public API.

`check_plugin_imports(folder, package)` reads every module of a plugin package with `ast` (nothing
is imported from the plugin) and returns one line per import of a private backplane module or of a
name a public module does not export. The bundled plugins are held to it by the test suite; a
third-party plugin can call it from its own tests the same way.

`public_api()` is the other side of the boundary: every public name with its kind, which
tests/test_public_api.py compares with the checked-in snapshot (`api_changes`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import types
from pathlib import Path
from typing import Any

# NOTE: docs/plugins.md ("Packaging") lists these; tests/plugin/test_plugin_docs.py keeps the two equal.
PUBLIC_MODULES = (
    "backplane",
    "backplane.contracts",
    "backplane.attention",
    "backplane.lora",
    "backplane.moe",
    "backplane.ops",
    "backplane.ops.native",
    "backplane.speculative",
    "backplane.layers",
    "backplane.models",
    "backplane.models.llama",
    "backplane.testing",
)


def check_plugin_imports(folder: str | Path, package: str) -> list[str]:
    """Every boundary violation in the `.py` files under `folder`, whose import name is `package`."""
    problems: list[str] = []
    for path in sorted(Path(folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for module, names in _imports(node):
                problem = import_violation(module, names, package)
                if problem:
                    problems.append(f"{path}:{node.lineno}: {problem}")
    return problems


def import_violation(module: str, names: tuple[str, ...], package: str) -> str | None:
    """Why `from module import names` (or `import module` with names=()) breaks the boundary, if it does."""
    if module != "backplane" and not module.startswith("backplane."):
        return None
    if module == package or module.startswith(package + "."):
        return None
    if module.startswith("backplane.plugins"):
        return f"imports another plugin's module {module!r}; plugins depend only on backplane's public API"
    if module not in PUBLIC_MODULES:
        return f"imports private module {module!r}; public modules: {', '.join(PUBLIC_MODULES)}"
    hidden = [name for name in names if not _exported(module, name)]
    if hidden:
        return f"imports {', '.join(hidden)} from {module!r}, which does not export them (see its __all__)"
    return None


def _imports(node: ast.AST):
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, ()
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        yield node.module, tuple(alias.name for alias in node.names)


def _exported(module: str, name: str) -> bool:
    if f"{module}.{name}" in PUBLIC_MODULES:
        return True
    return name in getattr(importlib.import_module(module), "__all__", ())


def public_api(modules: tuple[str, ...] = PUBLIC_MODULES) -> dict[str, str]:
    """`module.name` -> kind (class, function, constant) for every public name: a module's `__all__`
    (lazy names resolved), or, without one, the classes, functions and constants it defines."""
    api = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None)
        if names is None:
            names = [n for n, obj in vars(module).items() if not n.startswith("_") and _defined_in(obj, module_name)]
        api.update({f"{module_name}.{name}": _kind(getattr(module, name)) for name in names})
    return dict(sorted(api.items()))


def api_changes(snapshot: dict[str, str], current: dict[str, str], deprecated: set[str]) -> list[str]:
    """One line per difference: a name gone without a deprecation entry, a name whose kind changed,
    a name new to the snapshot. Names in `deprecated` (backplane.deprecation) may leave the list."""
    problems = [f"{name} ({kind}) disappeared without a deprecation entry; keep it, or alias it with "
                "backplane.deprecation.moved_names" for name, kind in snapshot.items()
                if name not in current and name not in deprecated]
    problems += [f"{name} changed kind: {snapshot[name]} -> {kind}" for name, kind in current.items()
                 if name in snapshot and snapshot[name] != kind]
    problems += [f"{name} ({kind}) is new and not in the snapshot" for name, kind in current.items()
                 if name not in snapshot]
    return problems


def _defined_in(obj: Any, module_name: str) -> bool:
    if isinstance(obj, types.ModuleType):
        return False
    return getattr(obj, "__module__", module_name) == module_name


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return "constant"
