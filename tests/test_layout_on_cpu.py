"""The package layout as the docs state it: which packages may import what."""

import ast
import pathlib
import subprocess
import sys

import hilore_verl

ROOT = pathlib.Path(hilore_verl.__file__).parent
BLOCKED = ("verl", "ray", "hydra", "omegaconf")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_packages_import_without_verl_ray_hydra_or_omegaconf():
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            f"        if name.split('.')[0] in {BLOCKED!r}:\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import hilore_verl.runtime, hilore_verl.planner, hilore_verl.kernels, hilore_verl.training.session\n"
            "import hilore_verl.model.unit_maps, hilore_verl.loss.skip, hilore_verl.measure.timing\n"
            "import hilore_verl.tiny.task, hilore_verl.validation.versions, hilore_verl.shared_prompt\n"
            f"assert not [m for m in sys.modules if m.split('.')[0] in {BLOCKED!r}]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_only_integration_imports_verl():
    outside = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if "integration" not in p.relative_to(ROOT).parts
               and any(m == "verl" or m.startswith("verl.") for m in _imports(p))]
    assert outside == []


def test_cpu_host_imports_no_other_hilore_package():
    found = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.startswith("hilore_verl")
                                              and not m.startswith("hilore_verl.integration.cpu_host"))
             for p in (ROOT / "integration" / "cpu_host").glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


# What each package may import of hilore_verl (docs/design.md's map). The top-level modules (cli, doctor,
# plugin, ...) are the tools on top and may import any package.
MAY_IMPORT = {
    "validation": set(), "measure": set(), "model": set(), "tiny": set(), "kernels": set(), "presets": set(),
    "shared_prompt": set(),
    "runtime": {"kernels", "model", "validation"},
    "loss": {"kernels", "model", "runtime"},
    "planner": {"kernels", "loss", "measure", "model", "runtime", "validation"},
    "training": {"kernels", "loss", "measure", "planner", "runtime", "validation"},
    "integration": {"kernels", "loss", "measure", "model", "planner", "runtime", "shared_prompt", "tiny",
                    "training", "validation"},
    "bench": {"integration", "kernels", "loss", "measure", "planner", "presets", "runtime", "shared_prompt", "tiny",
              "training"},
    "gpucheck": {"bench", "kernels", "measure", "planner", "runtime", "shared_prompt", "tiny", "training"},
}


def _package_imports() -> dict[str, set[str]]:
    """Per package (or top-level module), the other hilore_verl packages and modules its files import."""
    found: dict[str, set[str]] = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT).parts
        source = parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")
        names = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hilore_verl" and node.level == 0:
                names.update(a.name for a in node.names)  # from hilore_verl import X: X's home
        names.update(m.split(".")[1] for m in _imports(p) if m.startswith("hilore_verl."))
        top = {"Mode", "Plan", "UnitPlan", "RuntimeConfig", "attach", "__version__"}  # re-exported by __init__
        found.setdefault(source, set()).update(("runtime" if n in top - {"__version__"} else n) for n in names
                                               if n != source and n != "__version__")
    return found


def test_every_package_imports_only_what_the_map_allows():
    found = _package_imports()
    assert set(MAY_IMPORT) <= set(found) | {"presets"}
    packages = {d.name for d in ROOT.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
    assert packages == set(MAY_IMPORT), "a package the map does not state"
    extra = {k: sorted(v - MAY_IMPORT[k]) for k, v in found.items() if k in MAY_IMPORT and v - MAY_IMPORT[k]}
    assert extra == {}


def test_packages_import_one_another_without_a_circle():
    found = _package_imports()
    graph = {k: {d for d in v if d in found} for k, v in found.items()}
    done: set[str] = set()
    while len(done) < len(graph):
        ready = [k for k in graph if k not in done and graph[k] <= done]
        assert ready, f"a circle among {sorted(set(graph) - done)}"
        done.update(ready)


def test_core_never_imports_integration():
    """runtime, planner, kernels, the session and the top-level modules import nothing from integration/ (no
    upward import); bench, gpucheck, the CLI and the plugin are the tools on top and may."""
    on_top = {"bench", "gpucheck", "integration", "cli.py", "doctor.py", "plugin.py", "__main__.py"}
    upward = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
              if p.relative_to(ROOT).parts[0] not in on_top
              and any(m.startswith("hilore_verl.integration") for m in _imports(p))]
    assert upward == []
