"""The plugin import boundary: a plugin imports only backplane's public API.

`check_plugin_imports(folder, package)` reads every module of a plugin package with `ast` (nothing
is imported from the plugin) and returns one line per import of a private backplane module or of a
name a public module does not export. The bundled plugins are held to it by the test suite; a
third-party plugin can call it from its own tests the same way.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

# NOTE: docs/plugins.md ("Packaging") lists these; tests/plugin/test_plugin_docs.py keeps the two equal.
PUBLIC_MODULES = (
    "backplane",
    "backplane.attention",
    "backplane.lora",
    "backplane.ops",
    "backplane.ops.native",
    "backplane.speculative",
    "backplane.layers",
    "backplane.models",
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
