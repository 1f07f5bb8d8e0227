"""Supported verl / torch ranges and the start-up check. Reads installed metadata only: never imports verl."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Keep in step with pyproject.toml (tests/validation/test_versions_on_cpu.py checks that they agree).
SUPPORTED: dict[str, str] = {
    "verl": ">=0.9.1,<0.10",
    "torch": ">=2.10,<2.14",
}


class UnsupportedVersionError(RuntimeError):
    """A dependency is missing or outside the range hilore-verl supports."""


@dataclass(frozen=True)
class VersionProblem:
    package: str
    found: str | None  # None: not installed
    supported: str

    def __str__(self) -> str:
        found = "not installed" if self.found is None else f"{self.found} is installed"
        return f"{self.package}: {found}; hilore-verl supports {self.package}{self.supported}"


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> Version:
    # "2.13.0+cpu" and "2.11.0a0+git..." compare by their release number: local builds count.
    return Version(Version(version).base_version)


def version_problems(found: dict[str, str | None] | None = None) -> list[VersionProblem]:
    """Problems with the installed (or the given) versions; empty when all are supported."""
    problems = []
    for package, spec in SUPPORTED.items():
        version = found[package] if found is not None else installed_version(package)
        if version is None or _release(version) not in SpecifierSet(spec):
            problems.append(VersionProblem(package, version, spec))
    return problems


def require_supported_versions(found: dict[str, str | None] | None = None) -> None:
    """Raise UnsupportedVersionError naming every unsupported package and the supported range."""
    problems = version_problems(found)
    if problems:
        lines = "\n  ".join(str(p) for p in problems)
        raise UnsupportedVersionError(
            f"hilore-verl cannot run with these versions:\n  {lines}\n"
            "Install versions in these ranges; the README's install section shows the commands."
        )
