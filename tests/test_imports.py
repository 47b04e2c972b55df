"""The house the imports draw: the host at the bottom, no circle inside the host, and
no module (plugin, test or benchmark) reaching into another distribution's private
modules. Read from the source (every ``import``, also those inside functions), and
checked by importing every module of every distribution."""

from __future__ import annotations

import ast
import importlib
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def distributions() -> dict[str, pathlib.Path]:
    """Distribution name -> its folder (the host's and every pyproject.toml beside it)."""
    out = {}
    for pyproject in [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml")),
                      *sorted(ROOT.glob("examples/*/pyproject.toml"))]:
        out[tomllib.loads(pyproject.read_text())["project"]["name"]] = pyproject.parent
    return out


def packages() -> dict[str, str]:
    """Top-level package -> the distribution that ships it."""
    out = {}
    for dist, folder in distributions().items():
        for init in folder.glob("*/__init__.py"):
            if init.parent.name not in ("tests",):
                out[init.parent.name] = dist
    return out


def owner(path: pathlib.Path) -> str:
    """The distribution a source file belongs to ("benchmarks" for benchmarks/)."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "benchmarks":
        return "benchmarks"
    folders = distributions()
    best = max((f for f in folders.values() if f == ROOT or f in path.parents), key=lambda f: len(f.parts))
    return next(d for d, f in folders.items() if f == best)


def sources() -> list[pathlib.Path]:
    skip = {".venv", ".git", "build", "runs"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts))


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: pathlib.Path, *, typing_only: bool = True) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path``, ``from a import b`` as ``a.b``
    (``typing_only=False``: without those under ``if TYPE_CHECKING:``, which never run)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    if not typing_only:
        for node in ast.walk(tree):
            if _type_checking(node):
                node.body = []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def private_part(module: str) -> str | None:
    """The first private component of a dotted module path past its package, if any."""
    for part in module.split(".")[1:]:
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return part
    return None


def test_the_distributions_are_found() -> None:
    pkgs = packages()
    for pkg in ("skyrl_host", "skyrl_models", "skyrl_weightsync", "skyrl_launchers", "skyrl_engines"):
        assert pkg in pkgs, sorted(pkgs)
    assert owner(ROOT / "plugins" / "weightsync" / "tests" / "test_delta.py") == "skyrl-weightsync"
    assert owner(ROOT / "tests" / "test_imports.py") == "skyrl-host"
    assert owner(ROOT / "benchmarks" / "weight_sync.py") == "benchmarks"
    # The check below finds what it is meant to find.
    assert private_part("skyrl_weightsync._delta.codec") == "_delta"
    assert private_part("skyrl_weightsync.delta.DeltaSender") is None
    assert private_part("skyrl_models.__version__") is None


def test_no_module_imports_another_distributions_private_modules() -> None:
    pkgs = packages()
    bad = []
    for path in sources():
        mine = owner(path)
        for line, module in imports(path):
            theirs = pkgs.get(module.split(".")[0])
            if theirs is not None and theirs != mine and private_part(module):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} (private to {theirs})")
    assert not bad, "cross-distribution imports of private modules:\n" + "\n".join(bad)


def module_graph(packages_: list[str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (at any depth of the file; not under
    ``if TYPE_CHECKING:``), for the modules of ``packages_`` (default: every package of
    every distribution, tests excluded)."""
    pkgs = packages()
    folders = distributions()
    modules: dict[str, pathlib.Path] = {}
    for pkg in packages_ or sorted(pkgs):
        folder = folders[pkgs[pkg]] / pkg
        for p in folder.rglob("*.py"):
            if "tests" in p.relative_to(folder).parts:
                continue
            modules[".".join(p.relative_to(folder.parent).with_suffix("").parts).removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for _line, module in imports(path, typing_only=False):
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module != name and "." in module:  # a package's own __init__ is the package, not a module
                deps.add(module)
        graph[name] = deps
    return graph


def host_graph() -> dict[str, set[str]]:
    """skyrl_host module -> the skyrl_host modules it imports."""
    return module_graph(["skyrl_host"])


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Each import circle of ``graph``, as ``a -> b -> a``."""
    state: dict[str, int] = {}
    found = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                found.append(" -> ".join(trail[trail.index(dep):] + [dep]) if dep in trail else f"{node} -> {dep}")
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_host_imports_no_plugin() -> None:
    pkgs = packages()
    bad = []
    for path in (ROOT / "skyrl_host").rglob("*.py"):
        for line, module in imports(path):
            if pkgs.get(module.split(".")[0], "skyrl-host") != "skyrl-host":
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert not bad, "the host imports plugin distributions:\n" + "\n".join(bad)


def test_no_import_circle_anywhere() -> None:
    """No circle in the host or in any plugin distribution: a plugin's light face (the
    module its entry point names) and its implementation share what both need through a
    third module, never by importing each other."""
    graph = module_graph()
    found = circles(graph)
    print("import circles:", len(found))
    assert not found, "import circles:\n" + "\n".join(found)
    # The bottom of the house: the contracts and the kind table import only each other.
    host = host_graph()
    for low in ("skyrl_host.interfaces", "skyrl_host.errors", "skyrl_host.options"):
        assert host[low] == set(), (low, host[low])
    assert host["skyrl_host.kinds"] == {"skyrl_host.interfaces"}


def test_the_circle_check_finds_a_circle() -> None:
    assert circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}) == ["a.x -> a.y -> a.z -> a.x"]


def all_modules() -> list[str]:
    out = []
    for pkg, dist in sorted(packages().items()):
        folder = distributions()[dist] / pkg
        for path in sorted(folder.rglob("*.py")):
            out.append(".".join(path.relative_to(folder.parent).with_suffix("").parts).removesuffix(".__init__"))
    return out


@pytest.mark.parametrize("module", all_modules())
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)
