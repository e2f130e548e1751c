"""The Python shim's modules use each other through what each offers (docs/conventions.md): no module imports a
sibling's private name (``from .x import _y``) or reads one (``_x._y`` on a sibling module). Private modules
(``fastdp._step``) are imported whole; what they offer has a plain name."""

import ast
import importlib.util
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


# ---- the wrapper's state has one owner ------------------------------------------------------------------------------

WRAPPER = PACKAGE / "data_parallel.py"


def _self(node):
    return isinstance(node, ast.Name) and node.id == "self"


def wrapper_state(path=WRAPPER, cls="DataParallel"):
    """The private attributes DataParallel keeps on itself (``self._x = ...``, ``self.__dict__["_x"] = ...``,
    ``self.__dict__.setdefault("_x", ...)``): its state, which only its own methods may read or write."""
    tree = ast.parse(path.read_text(), str(path))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = set()
    for node in ast.walk(body):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and _self(t.value) and _private(t.attr):
                names.add(t.attr)
            if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "__dict__"
                    and _self(t.value.value) and isinstance(t.slice, ast.Constant)):
                names.add(t.slice.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault"
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "__dict__"
                and _self(node.func.value.value) and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return {n for n in names if isinstance(n, str) and _private(n)}


def _named(node, names):
    return isinstance(node, ast.Constant) and node.value in names


def state_uses(path, names):
    """(line, what) for every read or write of a wrapper state name on anything but ``self``: as an attribute, as
    a ``__dict__`` key, or through getattr/setattr/hasattr/delattr."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in names and not _self(node.value):
            found.append((node.lineno, f".{node.attr}"))
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "__dict__" and not _self(node.value.value) and _named(node.slice, names)):
            found.append((node.lineno, f"__dict__[{node.slice.value!r}]"))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute)
                    and func.value.attr == "__dict__" and not _self(func.value.value) and _named(node.args[0], names)):
                found.append((node.lineno, f"__dict__.{func.attr}({node.args[0].value!r})"))
            elif (isinstance(func, ast.Name) and func.id in ("getattr", "setattr", "hasattr", "delattr")
                  and len(node.args) > 1 and not _self(node.args[0]) and _named(node.args[1], names)):
                found.append((node.lineno, f"{func.id}(..., {node.args[1].value!r})"))
    return found


def test_only_the_wrapper_touches_its_state():
    """The wrapper's private attributes are its own: every other module asks it through named methods or gets what
    it needs as arguments (docs/ARCHITECTURE.md, "Who owns what")."""
    names = wrapper_state()
    assert {"_split", "_replica_set", "_recording", "_last_step", "_oom"} <= names, names
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        uses = state_uses(path, names)
        if uses:
            found[str(path.relative_to(PACKAGE))] = uses
    assert not found, f"the wrapper's state read or written outside its own methods: {found}"


def test_the_state_check_sees_every_form(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("a = wrapper._split\nb = dp.__dict__.get('_oom')\nc = getattr(dp, '_recording', None)\n"
                      "dp.__dict__['_last_step'] = 1\nself._split = 2\nd = self.__dict__.get('_oom')\n")
    assert state_uses(module, {"_split", "_oom", "_recording", "_last_step"}) == [
        (1, "._split"), (2, "__dict__.get('_oom')"), (3, "getattr(..., '_recording')"),
        (4, "__dict__['_last_step']")]


# ---- sizes: every function and file fits a reader's head ------------------------------------------------------------


def _structure():
    """scripts/structure.py, the project's measure of the package's shape (the same numbers a contributor prints)."""
    path = PACKAGE.parent.parent / "scripts" / "structure.py"
    spec = importlib.util.spec_from_file_location("fastdp_structure_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_function_over_the_complexity_limit_outside_the_benchmarks():
    structure = _structure()
    over = [f"{mod}.{name} (line {line}): {score}" for mod, name, line, _, score in
            structure.functions(structure.modules()) if score > structure.COMPLEXITY_LIMIT and ".bench" not in mod]
    assert not over, f"functions over cyclomatic complexity {structure.COMPLEXITY_LIMIT} (split them): {over}"


def test_the_complexity_count_sees_each_branch_kind():
    func = ast.parse("def f(a, b):\n    if a and b or a:\n        pass\n    elif b:\n        pass\n"
                     "    for x in a:\n        y = [i for i in x if i]\n    while b:\n        break\n"
                     "    try:\n        pass\n    except ValueError:\n        pass\n    return a if b else b\n").body[0]
    # 1 + if (1) + and/or (2) + elif (1) + for (1) + comprehension with one if (2) + while (1) + except (1) + ifexp (1)
    assert _structure().complexity(func) == 11


def test_no_file_over_the_line_limit():
    structure = _structure()
    root = PACKAGE.parent.parent
    long = {str(p.relative_to(root)): n for p in structure.source_files() if (n := structure.line_count(p))
            > structure.LINES_LIMIT}
    assert not long, f"files over {structure.LINES_LIMIT} lines (split them by concern): {long}"
