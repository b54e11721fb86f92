"""The package's import graph, read from the source with `ast` (nothing is imported): no circle between modules,
and the floors of README's Layout hold, each part importing only from the floors below it.

Every import counts, at the top of a module or inside a function (a lazy import that runs back up a floor is
still a circle waiting to happen, and the style guide asks for the shared piece one floor down instead). An
import names the module it loads: `from a.b import c` is an edge to `a.b.c` when that is a module, else to
`a.b`. Loading `a.b.c` also runs the packages above it, `a` and `a.b` (their `__init__`), so it is an edge to
each of them too, unless the importer is inside that package (which is then loaded already): a package whose
`__init__` gathers its modules' names is in a circle with any module it gathers that imports one of them."""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxrl_llm", "kernels")

# The ground floor: small modules every floor may use, which import nothing of the package themselves.
GROUND = ("jaxrl_llm.errors", "jaxrl_llm.distributed", "jaxrl_llm.sharding", "jaxrl_llm.compile_watch",
          "jaxrl_llm.xla_flags", "jaxrl_llm.ray_cluster")
# The entry points (the CLI, the launcher, export, the benchmarks and the report): the top floor, which nothing
# of the library imports.
ENTRY = ("jaxrl_llm.train", "jaxrl_llm.launch", "jaxrl_llm.export", "jaxrl_llm.configurables", "jaxrl_llm.bench",
         "jaxrl_llm.report")
LIBRARY = ("jaxrl_llm.models", "jaxrl_llm.algorithms", "jaxrl_llm.rollout", "jaxrl_llm.rewards", "jaxrl_llm.agent",
           "jaxrl_llm.data", "jaxrl_llm.trainer", "jaxrl_llm.checkpoint", "jaxrl_llm.weights_io")
T = "jaxrl_llm.trainer."
# (importers, what they must not import, what of that they may import after all, importers the rule leaves out), by
# module-name prefix: README's Layout in rules. First the package's floors, then the trainer's wings
# (trainer/__init__.py).
RULES = [
    (GROUND, ("jaxrl_llm.",), GROUND, ()),
    (("kernels",), ("jaxrl_llm",), (), ()),
    (("jaxrl_llm.models", "jaxrl_llm.algorithms"),
     ("jaxrl_llm.trainer", "jaxrl_llm.rollout", "jaxrl_llm.agent", "jaxrl_llm.rewards", "jaxrl_llm.data"), (), ()),
    (("jaxrl_llm.rewards",), ("jaxrl_llm.trainer", "jaxrl_llm.rollout", "jaxrl_llm.agent", "jaxrl_llm.data"), (), ()),
    (("jaxrl_llm.rollout",), ("jaxrl_llm.trainer", "jaxrl_llm.agent", "jaxrl_llm.rewards", "jaxrl_llm.data"), (), ()),
    (("jaxrl_llm.agent",), ("jaxrl_llm.trainer", "jaxrl_llm.data"), (), ()),
    (("jaxrl_llm.data",), ("jaxrl_llm.trainer", "jaxrl_llm.rollout"), (), ()),
    (LIBRARY, ENTRY, (), ()),
    # The config is the trainer's ground floor: it imports no other room of the trainer.
    ((T + "config",), ("jaxrl_llm.trainer",), (T + "config",), ()),
    # The programs and their memory know the worker only as what it hands them.
    ((T + "memory",), (T + "roles", T + "rollouters", T + "processes", T + "loop"), (), ()),
    # The roles and the rollouters sit below the loop; the roles know no rollouter.
    ((T + "roles",), (T + "rollouters", T + "loop", T + "processes.process", T + "processes.ray_driver"), (), ()),
    ((T + "rollouters",), (T + "loop", T + "processes.process", T + "processes.ray_driver"), (), ()),
    # The channel and the device split are the processes' ground floor.
    ((T + "processes.channel", T + "processes.placement"), ("jaxrl_llm.trainer",), (T + "config",), ()),
    # Only a process's life (and the entry points above the library) builds the loop.
    (("jaxrl_llm.trainer",), (T + "loop",), (), (T + "processes.process",)),
]


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p if p.endswith(".") else p + ".") for p in prefixes)


def module_files(root: pathlib.Path, packages=PACKAGES) -> dict[str, tuple[pathlib.Path, bool]]:
    """{module name: (its file, whether it is a package's __init__)} of every module under `packages`."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph(root: pathlib.Path, packages=PACKAGES) -> dict[str, set[str]]:
    """{module: the modules of `packages` it imports}, from every import statement of its source."""
    mods = module_files(root, packages)

    def resolve(name: str) -> str | None:  # the longest prefix of `name` that is one of our modules
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, (path, is_pkg) in mods.items():
        here = mod if is_pkg else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` floors above this module's
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else resolve(base))
        for t in list(targets):  # the packages a module's loading runs first
            while t and "." in t:
                t = t.rpartition(".")[0]
                if t in mods and not mod.startswith(t + "."):
                    targets.add(t)
        graph[mod] = {t for t in targets if t and t != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def layering_violations(graph: dict[str, set[str]], rules=RULES) -> list[str]:
    out = []
    for importer, imported in sorted(graph.items()):
        for sources, forbidden, allowed, left_out in rules:
            if not _under(importer, sources) or _under(importer, left_out):
                continue
            for t in sorted(imported):
                if _under(t, forbidden) and not _under(t, allowed):
                    out.append(f"{importer} imports {t}")
    return sorted(set(out))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO)


def test_no_module_imports_one_that_imports_it_back(graph):
    assert len(graph) > 150  # the whole package was read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_each_floor_imports_only_from_the_floors_below(graph):
    assert layering_violations(graph) == []


def test_the_checks_find_a_planted_circle_and_a_planted_import_up_a_floor(tmp_path):
    """The checks themselves, on a package planted with one lazy circle and one import up a floor."""
    pkg = tmp_path / "jaxrl_llm"
    for d in ("", "rewards", "trainer"):
        (pkg / d).mkdir(exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "rewards" / "manager.py").write_text("def f():\n    from jaxrl_llm.trainer.roles import g\n")
    (pkg / "trainer" / "roles.py").write_text("from . import loop\ng = 1\n")
    (pkg / "trainer" / "loop.py").write_text("import jaxrl_llm.rewards.manager\n\n\ndef h():\n"
                                             "    from .roles import g\n")
    planted = import_graph(tmp_path, ("jaxrl_llm",))
    assert planted["jaxrl_llm.rewards.manager"] == {"jaxrl_llm.trainer", "jaxrl_llm.trainer.roles"}  # (and the package)
    assert planted["jaxrl_llm.trainer.roles"] == {"jaxrl_llm.trainer.loop"}
    assert find_cycle(planted) == ["jaxrl_llm.rewards.manager", "jaxrl_llm.trainer.roles", "jaxrl_llm.trainer.loop",
                                   "jaxrl_llm.rewards.manager"]
    assert layering_violations(planted) == ["jaxrl_llm.rewards.manager imports jaxrl_llm.trainer",
                                            "jaxrl_llm.rewards.manager imports jaxrl_llm.trainer.roles",
                                            "jaxrl_llm.trainer.roles imports jaxrl_llm.trainer.loop"]


def test_a_package_that_gathers_its_modules_names_is_in_a_circle_with_a_module_that_imports_one(tmp_path):
    """`from jaxrl_llm.config.check import x` runs `jaxrl_llm/config/__init__.py` first: when that imports a module
    that imports the importer back, Python meets a half-loaded module (what a run met in `trainer/config/`)."""
    pkg = tmp_path / "jaxrl_llm"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("from jaxrl_llm.config.run import Run\n")
    (pkg / "config" / "check.py").write_text("x = 1\n")
    (pkg / "config" / "run.py").write_text("from jaxrl_llm.config.check import x\nfrom jaxrl_llm.replay import S\n")
    (pkg / "replay.py").write_text("from jaxrl_llm.config.check import x\nS = 1\n")
    planted = import_graph(tmp_path, ("jaxrl_llm",))
    assert planted["jaxrl_llm.config.run"] == {"jaxrl_llm.config.check", "jaxrl_llm.replay"}  # its own package: loaded
    assert find_cycle(planted) == ["jaxrl_llm.config", "jaxrl_llm.config.run", "jaxrl_llm.replay", "jaxrl_llm.config"]


def test_no_module_is_over_500_lines():
    """Issue 42's bound: a module a reader can hold (the paged engine sits at it), so a growing one is split into
    a wing of its own rather than creeping past it."""
    long = {str(path.relative_to(REPO)): n for path, _ in module_files(REPO).values()
            if (n := len(path.read_text().splitlines())) > 500}
    assert len(module_files(REPO)) > 150 and long == {}, long
