"""The C layers include one way (docs/ARCHITECTURE.md): the public header includes nothing of ours, no folder of
csrc/ includes a folder that includes it back, loaders include only base/, and the binding sees the public header
and its own headers only: what it needs of the library below it is a public, documented function of fastdp.h."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"


def _folder(path):
    rel = path.relative_to(CSRC)
    return "backend" if rel.parts[0] == "backend" else (rel.parts[0] if len(rel.parts) > 1 else "public")


def _edges():
    """{(from folder, to folder, file, included)} for every #include "..." of ours."""
    edges = set()
    for path in sorted(CSRC.rglob("*.[ch]")):
        for inc in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M):
            target = (path.parent / inc) if (path.parent / inc).exists() else CSRC / inc
            assert target.exists(), f"{path.relative_to(ROOT)} includes {inc}, which does not exist"
            edges.add((_folder(path), _folder(target.resolve()), str(path.relative_to(CSRC)), inc))
    return edges


def _graph(edges):
    graph = {}
    for a, b, _, _ in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
    return graph


def _cycle(graph):
    state = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if not state.get(nxt):
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            found = visit(node, [])
            if found:
                return found
    return None


def test_no_folder_includes_one_that_includes_it_back():
    assert _cycle(_graph(_edges())) is None, _cycle(_graph(_edges()))


def test_each_layer_includes_only_what_is_below_it():
    allowed = {"public": set(), "base": {"public"}, "dl": {"base", "public"}, "core": {"base", "public"},
               "backend": {"core", "dl", "base", "public"}, "python": {"public"}}
    bad = [(f, inc) for a, b, f, inc in _edges() if a != b and b not in allowed[a]]
    assert not bad, bad


def test_the_binding_includes_only_the_public_header_and_its_own():
    """Of the library's headers, csrc/python/*.c|h include fastdp.h and csrc/python's own headers, nothing else: no
    loader, no core or base internals, however the include spells them ("..." or <...>, through csrc/ or not)."""
    public, binding = (CSRC / "fastdp.h").resolve(), (CSRC / "python").resolve()
    bad = []
    for path in sorted(binding.glob("*.[ch]")):
        for quote, inc in re.findall(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', path.read_text(), re.M):
            near = path.parent / inc
            target = near if quote == '"' and near.exists() else CSRC / inc
            if not target.exists():
                continue  # a system header (Python.h, the C library)
            target = target.resolve()
            if target != public and target.parent != binding:
                bad.append((str(path.relative_to(CSRC)), inc))
    assert not bad, f"the binding includes library headers other than fastdp.h: {bad}"


def test_the_check_sees_a_cycle():
    # The cycle finder itself: a loader that includes the core, and the core a loader.
    edges = {("dl", "core", "dl/x.h", "core/backend.h"), ("core", "dl", "core/info.c", "dl/x.h")}
    assert _cycle(_graph(edges)) is not None
    assert _cycle(_graph({("core", "dl", "core/info.c", "dl/x.h")})) is None
