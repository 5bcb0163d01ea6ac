"""The import graph of the package (read with ``ast``, nothing imported): no circle between modules and
no arrow that runs back up the layers of docs/DESIGN.md section 5.

Every ``import`` counts, also one inside a function (a lazy import is still an arrow).  An import of a
package counts as an arrow to its ``__init__``; the parent packages a module sits in are not arrows.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The rooms, lowest first: a module may import its own room and the rooms below it, never one above.
# A room is a module and everything below it; "=kvpop" is the module kvpop itself (its __init__, the
# public names, all re-exported from kvpop.core; it imports kvpop.baselines.attention_scores, which registers
# the TOVA and H2O cache policies).
LAYERS = [
    ("kvpop_kernels", "kvpop.progress", "kvpop.policies"),  # Triton kernels and their references; the progress
                                                            # report; the evaluation's policy names
    ("kvpop.models",),                  # one adapter per model family
    ("kvpop.core",),                    # KVpop itself, the patch lifecycle, the layer files
    ("kvpop.baselines",),               # methods KVpop is measured against (DMS, TOVA, H2O), built on the core
    ("=kvpop",),                        # the public names (the core's), the baselines' cache policies registered
    ("kvpop.training",),                # the loop and its method interface (KVpop, DMS); reading training data
    ("kvpop.answers",),                 # kvpop eval --problems: generated answers per policy and budget
    ("kvpop.evaluation",),              # the measurement engine of kvpop eval, --auto, the demo and the studies
                                        # (the task it measures on is given to it)
    ("kvpop.demo",),                    # the synthetic tasks, retrofits, pre-training, the demo's grid and run
    ("kvpop.cli", "kvpop.vllm"),        # the commands; the vLLM plugin (a leaf beside them)
    ("kvpop.__main__",),                # python -m kvpop
    ("studies",),                       # research instruments (the evidence ledger), beside the package: nothing
                                        # in kvpop or kvpop_kernels imports them
]
# Arrows allowed against the layering (each would be a deprecated alias kept for one release): none.
ALLOWED_UP: set[tuple[str, str]] = set()
# Third-party packages a room must not import.
FORBIDDEN = {"kvpop_kernels": ("transformers", "kvpop")}


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("kvpop", "kvpop_kernels", "studies"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if {"data", "results"} & set(path.relative_to(ROOT).parts):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the package ``name`` imports (resolved; ``from pkg import mod`` -> ``pkg.mod``) and
    the third-party top-level names it imports (prefixed ``ext:``)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[: len(here) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [(base, a.name) for a in node.names]
        else:
            continue
        for mod, attr in targets:
            if mod.split(".")[0] not in ("kvpop", "kvpop_kernels"):
                out.add("ext:" + mod.split(".")[0])
                continue
            full = f"{mod}.{attr}" if attr else None
            if full in known:
                out.add(full)
            else:
                while mod not in known and "." in mod:
                    mod = mod.rsplit(".", 1)[0]
                out.add(mod)
    return out


def _layer(mod: str) -> int:
    best, level = -1, None
    for i, rooms in enumerate(LAYERS):
        for room in rooms:
            hit = mod == room[1:] if room.startswith("=") else (mod == room or mod.startswith(room + "."))
            if hit and len(room) > best:
                best, level = len(room), i
    assert level is not None, f"{mod} is in no layer of LAYERS: add its room"
    return level


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_no_arrow_runs_back_up_the_layers():
    graph = _graph()
    bad = []
    for a, targets in graph.items():
        for b in sorted(targets):
            if b.startswith("ext:"):
                top = a.split(".")[0]
                if b[4:] in FORBIDDEN.get(top, ()):
                    bad.append(f"{a} -> {b[4:]} (forbidden for {top})")
                continue
            if b.split(".")[0] in FORBIDDEN.get(a.split(".")[0], ()):
                bad.append(f"{a} -> {b} (forbidden for {a.split('.')[0]})")
            elif _layer(b) > _layer(a) and (a, b) not in ALLOWED_UP:
                bad.append(f"{a} -> {b}")
    assert not bad, "imports that run back up the layering (tests/test_imports.py LAYERS):\n" + "\n".join(bad)


def test_no_import_circle():
    graph = {a: {b for b in bs if not b.startswith("ext:") and b != a} for a, bs in _graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_graph_is_read():
    """The walk sees the package (a guard against a test that passes on an empty graph)."""
    graph = _graph()
    assert {"kvpop.core.patching", "kvpop.baselines.dms.patching", "kvpop.training.train",
            "kvpop_kernels.decode"} <= set(graph)
    assert "kvpop.core.lifecycle" in graph["kvpop.baselines.dms.patching"]
    assert "kvpop.demo.retrofit" in graph["kvpop.demo.run"] and "kvpop.demo.run" in graph["kvpop.cli.demo"]
    assert "ext:transformers" in graph["kvpop.core.cache"]
