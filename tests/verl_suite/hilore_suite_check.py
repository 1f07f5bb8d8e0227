"""A pytest plugin for the run of verl's own tests (`-p hilore_suite_check`): at the end it writes
which verl was imported and whether hilore-verl's verl plugin loaded, to $HILORE_SUITE_REPORT."""

import json
import os
import sys


def pytest_sessionfinish(session, exitstatus):
    import verl

    plugin = sys.modules.get("hilore_verl.plugin")
    status = getattr(plugin, "STATUS", None)
    report = {"verl_file": os.path.realpath(verl.__file__), "loaded": bool(status and status.loaded),
              "registered": list(status.registered) if status else [], "error": status.error if status else None}
    with open(os.environ["HILORE_SUITE_REPORT"], "w") as f:
        json.dump(report, f)
