"""The code's shape: imports point down the layers ARCHITECTURE.md lists, no import cycles
inside jaxllm, dependencies declared as imported, and resolving a config never builds or loads
the C++ kernels."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "jaxllm")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _imports(path: str, modules: dict[str, str], name: str) -> set[str]:
    """jaxllm modules `name` imports, at module level or inside functions (a deferred import
    still makes a cycle between the two modules' meanings)."""
    tree = ast.parse(open(path).read())
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".") if is_package else name.split(".")[:-1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        found |= {t for t in targets if t in modules and t != name}
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(path, modules, name) for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in graph[node]:
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _layers() -> dict[str, int]:
    """{package or top-level module of jaxllm: its layer, 0 at the bottom} from ARCHITECTURE.md."""
    text = open(os.path.join(ROOT, "ARCHITECTURE.md")).read()
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    rows = [line for line in block.splitlines() if line.strip()]
    return {name.strip(): len(rows) - 1 - i for i, line in enumerate(rows) for name in line.split(",")}


def test_imports_point_down():
    modules = _modules()
    layers = _layers()

    def unit(module: str) -> str:
        return module.split(".")[1] if "." in module else "__init__"

    assert {unit(m) for m in modules} == set(layers), "ARCHITECTURE.md's layers must name every package"
    upward = sorted(
        f"{name} ({unit(name)}) imports {dep} ({unit(dep)})"
        for name, path in modules.items()
        for dep in _imports(path, modules, name)
        if layers[unit(dep)] > layers[unit(name)]
    )
    assert not upward, "imports that point up the layers of ARCHITECTURE.md:\n" + "\n".join(upward)


def test_resolving_a_config_loads_no_kernels():
    code = (
        "import sys; from jaxllm.config import EngineArgs; from jaxllm.engine_config import resolve_config; "
        "from jaxllm.models.decoder import ModelConfig; "
        "cfg = ModelConfig('LlamaForCausalLM', 100, 64, 128, 2, 4, 2, 16, 1e-5, 1e4, 512); "
        "resolve_config(EngineArgs(), cfg, 'tiny'); "
        "print(sorted(m for m in sys.modules if m.startswith('jaxllm.kernels')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def _third_party_imports(*tops: str) -> set[str]:
    """Top-level names of the modules imported under `tops` that are neither the standard
    library nor the repository's own (jaxllm, the tests package, and the benchmarks' sibling modules)."""
    local = {"jaxllm", "tests"}
    files = []
    for top in tops:
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            files += [os.path.join(dirpath, f) for f in names if f.endswith(".py")]
            local |= {f[:-3] for f in names if f.endswith(".py")}
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.add(node.module.split(".")[0])
    return found - local - set(sys.stdlib_module_names)


def _declared() -> tuple[set[str], set[str], set[str]]:
    """(the project's dependencies, its dev extra, its other extras) from pyproject.toml, as
    import names."""
    import re
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    import_name = {"pyyaml": "yaml", "absl-py": "absl"}
    import_name.update({n: "opentelemetry" for n in ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")})

    def names(requirements):
        bare = (re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower() for r in requirements)
        return {import_name.get(n, n.replace("-", "_")) for n in bare}

    extras = project["optional-dependencies"]
    optional = set().union(*(names(reqs) for name, reqs in extras.items() if name != "dev"))
    return names(project["dependencies"]), names(extras["dev"]), optional


def test_dependencies_are_what_the_code_imports():
    # jaxllm declares exactly what it imports (an optional feature's imports in its extra); the
    # tests and benchmarks import only what is declared, or the peers a benchmark measures when
    # they are installed apart.
    main, dev, optional = _declared()
    # What a library jaxllm imports needs but does not declare (pyproject.toml says which).
    undeclared_by_imports = {"absl"}
    assert _third_party_imports("jaxllm") | undeclared_by_imports == main | optional
    optional_peers = {"vllm", "llama_cpp", "xgrammar", "qwix"}
    assert _third_party_imports("tests", "benchmarks", "examples") - main - dev - optional_peers == set()
