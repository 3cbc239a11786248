"""The package's import graph (docs/design.md, section 3): no module imports itself back through
others, and the routing never imports the data-parallel layer, which plugs into it at one seam
(``maskedbranch/_unit.py``, ``DATA_PARALLEL``). Read from the source files, so the installed
build and the source tree agree."""
import ast
import os

import maskedbranch

PACKAGE = os.path.dirname(maskedbranch.__file__)
DATA_PARALLEL = {"maskedbranch._decide", "maskedbranch._reducer", "maskedbranch._layout", "maskedbranch.unused_grads"}
# Above both layers: the package's face, and the doctor (it simulates a DDP job's wrapper).
ABOVE = ("maskedbranch", "maskedbranch.doctor")


def _modules():
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(name, path, known):
    """The package's modules that ``name`` imports (any import statement, at any depth)."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            found.update(subs)
            if not all(m in known for m in subs):  # names defined in ``base`` itself
                found.add(base)
    return {m for m in found if m in known and m != name}


def _graph():
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_no_import_circle():
    graph = _graph()
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_the_routing_never_imports_the_data_parallel_layer():
    graph = _graph()
    assert DATA_PARALLEL <= set(graph), "the data-parallel layer's modules moved: update this test"
    wrong = {n: sorted(ms & DATA_PARALLEL) for n, ms in graph.items()
             if n not in DATA_PARALLEL and not n.startswith(ABOVE[1]) and n != ABOVE[0] and ms & DATA_PARALLEL}
    assert not wrong, f"the routing imports the data-parallel layer: {wrong}"


def test_integrations_import_no_data_parallel_internals():
    graph = _graph()
    for n, ms in graph.items():
        if n.startswith("maskedbranch.integrations"):
            assert not ms & DATA_PARALLEL, (n, ms & DATA_PARALLEL)
