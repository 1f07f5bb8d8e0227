"""Run Python code in a fresh interpreter of this environment (for import-time behaviour)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_python(code: str, env: dict[str, str] | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout_s)
