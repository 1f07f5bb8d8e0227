"""The package's rank launcher (hilore_verl.integration.tools.launch), as the tests use it."""

from hilore_verl.integration.tools.launch import RankFailed, free_port, run_on_ranks

__all__ = ["RankFailed", "free_port", "run_on_ranks"]
