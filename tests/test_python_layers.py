"""The Python shim's modules use each other through what each offers (docs/conventions.md): no module imports a
sibling's private name (``from .x import _y``) or reads one (``_x._y`` on a sibling module). Private modules
(``fastdp._step``) are imported whole; what they offer has a plain name."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "fastdp"
EXTENSION = "_C"  # the binding: its underscored names are the binding's own business (checked in C)


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _uses(path):
    """(line, what) for every private name of a sibling that ``path`` imports or reads."""
    tree = ast.parse(path.read_text(), str(path))
    siblings = {}  # local name -> sibling module, for `from . import x [as y]`
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            for alias in node.names:
                if node.module is None:
                    if alias.name != EXTENSION:
                        siblings[alias.asname or alias.name] = alias.name
                elif _private(alias.name):
                    found.append((node.lineno, f"from {'.' * node.level}{node.module} import {alias.name}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in siblings
                and _private(node.attr)):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def test_no_module_uses_a_siblings_private_names():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        uses = _uses(path)
        if uses:
            found[str(path.relative_to(PACKAGE))] = uses
    assert not found, f"private names used across modules (offer them under a plain name): {found}"


def test_the_check_sees_both_forms(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from . import _split\nfrom .data_parallel import _resolve\nx = _split._leaf_sizes\n")
    assert _uses(module) == [(2, "from .data_parallel import _resolve"), (3, "_split._leaf_sizes")]
