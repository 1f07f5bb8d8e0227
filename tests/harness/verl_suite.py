"""verl's own CPU tests (its `*_on_cpu.py` files), run in this project's environment.

verl's wheel carries no tests; the source distribution of the same release on PyPI does.
`python -m tests.harness.verl_suite fetch DIR` (run by `make install`) downloads the sdist of the
installed verl and keeps its `tests/` in DIR (nothing of it is part of this repository);
tests/integration/test_verl_suite_on_cpu.py runs them with the plugin loaded.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

# pytest settings for the suite's own directory, so that this repository's pyproject.toml is not used
PYTEST_INI = """[pytest]
addopts = -p no:cacheprovider
asyncio_default_fixture_loop_scope = function
timeout = 600
"""


def installed_verl() -> tuple[str, Path]:
    """The installed verl's version and package directory."""
    spec = importlib.util.find_spec("verl")
    return metadata.version("verl"), Path(spec.origin).parent


def fetch(dest: Path) -> Path:
    """verl's tests/ for the installed release in `dest` (skipped when already there)."""
    version, _ = installed_verl()
    stamp = dest / "VERSION"
    if stamp.exists() and stamp.read_text().strip() == version and (dest / "tests").is_dir():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"verl=={version}", "-d", tmp], check=True)
        (archive,) = Path(tmp).glob("verl-*.tar.gz")
        prefix = f"verl-{version}/tests/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            if not any(m.name.endswith("_on_cpu.py") for m in members):
                raise RuntimeError(f"the verl {version} sdist holds no *_on_cpu.py tests")
            dest.mkdir(parents=True, exist_ok=True)
            for m in members:
                m.name = m.name[len(f"verl-{version}/"):]
            tar.extractall(dest, members=members, filter="data")
    (dest / "pytest.ini").write_text(PYTEST_INI)
    stamp.write_text(version + "\n")
    return dest


def prepare(dest: Path) -> list[str]:
    """Link `dest/verl` to the installed package (some tests read verl's files by their path in
    the source tree) and return the CPU test files, relative to `dest`."""
    _, package = installed_verl()
    link = dest / "verl"
    if link.is_symlink() or link.exists():
        if link.resolve() != package.resolve():
            link.unlink()
    if not link.exists():
        os.symlink(package, link)
    return sorted(str(p.relative_to(dest)) for p in (dest / "tests").rglob("*_on_cpu.py"))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "fetch":
        sys.exit("usage: python -m tests.harness.verl_suite fetch DIR")
    print(f"verl's CPU tests in {fetch(Path(sys.argv[2]))}")
