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
            "import hilore_verl.runtime, hilore_verl.planner, hilore_verl.kernels, hilore_verl.session\n"
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


def test_core_never_imports_integration():
    """runtime, planner, kernels, the session and the top-level modules import nothing from integration/ (no
    upward import); bench, gpucheck, the CLI and the plugin are the tools on top and may."""
    on_top = {"bench", "gpucheck", "integration", "cli.py", "doctor.py", "plugin.py", "__main__.py"}
    upward = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
              if p.relative_to(ROOT).parts[0] not in on_top
              and any(m.startswith("hilore_verl.integration") for m in _imports(p))]
    assert upward == []
