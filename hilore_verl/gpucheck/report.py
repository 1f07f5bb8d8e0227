"""gpu_check.md from the check's report: the command, a table of stages, then each stage's checks and figures."""

from __future__ import annotations

import json

GIB = 2**30


def _methods_table(methods: dict) -> list[str]:
    lines = ["| row | workload | status | step s | first step s | peak GiB (over base) | reserved GiB (over base) | "
             "predicted peak GiB | plan |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for name, r in methods.items():
        if r.get("status") != "ok":
            lines.append(f"| {name} | {r.get('workload', '')} | {r.get('status')}: {r.get('error', '')[:80]} | | | | | | |")
            continue
        peak = r.get("peak_allocated_bytes", r.get("peak_rss_bytes", 0)) - r.get("base_bytes", 0)
        reserved = r.get("peak_reserved_bytes")
        reserved = None if reserved is None else reserved - (r.get("base_reserved_bytes") or 0)
        predicted = r.get("predicted_peak_bytes")
        plan = ", ".join(f"{k} {v}" for k, v in r.get("plan_counts", {}).items())
        lines.append(f"| {name} | {r.get('workload', '')} | ok | {r['step_s']:.3f} | {r['first_step_s']:.2f} | "
                     f"{peak / GIB:.3f} | {'' if reserved is None else f'{reserved / GIB:.3f}'} | "
                     f"{'' if predicted is None else f'{predicted / GIB:.3f}'} | {plan} |")
    return lines


def _figure(key: str, value) -> list[str]:
    if key.endswith(": methods") and isinstance(value, dict):
        return [f"**{key[: -len(': methods')]}** (workload plain: every token a loss term; skip: half the groups at "
                "zero advantage, attention per sequence; peak: CUDA max_memory_allocated, or the CPU's resident "
                "high-water mark)", "", *_methods_table(value), ""]
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        cols = list(dict.fromkeys(c for v in value.values() for c in v))
        return [f"**{key}**", "", "| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols),
                *(f"| {name} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |" for name, row in value.items()),
                ""]
    if isinstance(value, list) and value and isinstance(value[0], dict):
        cols = list(value[0])
        return [f"**{key}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
                *("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |" for row in value), ""]
    text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
    return [f"- {key}: `{text}`" if len(text) < 160 else f"- {key}:\n\n```\n{json.dumps(value, indent=1)}\n```", ""]


def markdown(report: dict) -> str:
    lines = ["# hilore-verl gpu-check", ""]
    for run in report.get("runs", []):
        lines += [f"Run {run['run']}: `{run['command'] or 'hilore-verl gpu-check'}` at commit "
                  f"`{run.get('commit') or 'unknown'}`, {run['date']}"
                  + (f", {run['seconds']:.0f} s" if "seconds" in run else ", running"), ""]
    verdict = {True: "every stage passed", False: "some stage did not pass", None: "running"}[report.get("passed")]
    lines += [f"Device `{report['device']}`{' (tiny sizes)' if report.get('tiny') else ''}; {verdict}.", "",
              "| stage | run | status | seconds | limit s | checks passed |", "|---|---:|---|---:|---:|---:|"]
    for s in report["stages"]:
        passed = sum(c["ok"] for c in s["checks"])
        lines.append(f"| {s['name']} | {s.get('run', '')} | {s['status']} | {s['seconds']:.0f} | {s['limit_s']:.0f} | "
                     f"{passed}/{len(s['checks'])} |")
    lines.append("")
    for s in report["stages"]:
        lines += [f"## {s['name']}: {s['status']}", ""]
        lines += [f"- [{'x' if c['ok'] else ' '}] {c['name']}" + (f": {c['detail']}" if c["detail"] else "")
                  for c in s["checks"]]
        lines.append("")
        if s.get("error") and s["status"] != "passed":
            lines += ["```", s["error"], "```", ""]
        for key, value in s["figures"].items():
            lines += _figure(key, value)
    return "\n".join(lines).rstrip() + "\n"
