"""The bench's report from its measurements: the summary figures, a markdown report, the plot, JSON.

Every throughput ratio is printed with its 95% interval over paired rounds (`1.031x [1.012, 1.050]`);
planned rows (the planners and their sweep budgets) print the cost model's predicted step time and
peak next to the measured ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

from hilore_verl.bench import methods as M
from hilore_verl.measure.intervals import paired_ratio_ci

GC_OVERHEAD_RANGE = (0.20, 0.33)  # GC's step time over no GC's on GPU jobs


def _paired(ok: dict, base: str, name: str) -> list[float]:
    """[mean, low, high] of `name`'s throughput over `base`'s, round by round."""
    return list(paired_ratio_ci(ok[base]["step_times_s"], ok[name]["step_times_s"]))


def summarize(report: dict) -> dict:
    """The headline figures and the issue's targets, from measured numbers only (`_ci`: [mean, low, high]
    of the throughput ratio over paired rounds)."""
    ok = {k: v for k, v in report["methods"].items() if v.get("status") == "ok"}
    out: dict = {}
    if "gc" in ok and "no_gc" in ok:
        t_gc, t_no = ok["gc"]["step_s"], ok["no_gc"]["step_s"]
        out["gc_overhead"] = t_gc / t_no - 1
        out["gc_overhead_in_range"] = GC_OVERHEAD_RANGE[0] <= out["gc_overhead"] <= GC_OVERHEAD_RANGE[1]
        out["no_gc_throughput_vs_gc_ci"] = ok["no_gc"].get("x_gc")
        if "peak_bytes" in ok["gc"]:
            out["static_share_of_gc_peak"] = report["static_bytes"] / ok["gc"]["peak_bytes"]
    if "gc" in ok:
        t_gc = ok["gc"]["step_s"]
        if "hilore" in ok:
            t_h = ok["hilore"]["step_s"]
            if "no_gc" in ok:
                t_no = ok["no_gc"]["step_s"]
                out["hilore_recovered_share"] = (t_gc - t_h) / (t_gc - t_no) if t_gc > t_no else None
            out["hilore_throughput_vs_gc"] = t_gc / t_h
            out["hilore_throughput_vs_gc_ci"] = ok["hilore"].get("x_gc")
            if "gc_drop_zero_adv" in ok:
                out["hilore_vs_gc_drop_zero_adv"] = ok["gc_drop_zero_adv"]["step_s"] / t_h
                out["hilore_vs_gc_drop_zero_adv_ci"] = _paired(ok, "gc_drop_zero_adv", "hilore")
            if "peak_bytes" in ok["hilore"] and "peak_bytes" in ok["gc"]:
                out["hilore_peak_vs_gc"] = ok["hilore"]["peak_bytes"] / ok["gc"]["peak_bytes"]
                limit = 1.10 * ok["gc"]["peak_bytes"]
                rivals = [k for k, v in ok.items() if k not in ("hilore", "no_gc", *M.RUNTIME_ONLY)
                          and v.get("peak_bytes", 1e30) <= limit]
                if rivals:
                    best = min(rivals, key=lambda k: ok[k]["step_s"])
                    out["best_other_within_budget"] = best
                    out["hilore_vs_best_other"] = ok[best]["step_s"] / t_h
                    out["hilore_vs_best_other_ci"] = _paired(ok, best, "hilore")
            first = ok["hilore"].get("first_step", {})
            if "seconds" in first:  # profiling + calibration + one update, against a GC step: the faster of the
                # one timed in that process and the rounds' mean (that process's step has run 2.3x the rounds'
                # mean: a slow denominator there would flatter the ratio)
                out["hilore_first_step_vs_gc_step"] = first["seconds"] / min(first["gc_step_s"], t_gc)
                if "peak_bytes" in ok["gc"]:
                    out["hilore_first_step_peak_vs_gc"] = first["peak_bytes"] / ok["gc"]["peak_bytes"]
            out["hilore_grad_cosine"] = ok["hilore"].get("grad_cosine")
            out["hilore_controller_share"] = ok["hilore"].get("controller_share")
        if "runtime_recompute" in ok:  # GC's plan re-run by the runtime against HF's checkpointing of each layer
            out["runtime_recompute_vs_gc"] = ok["runtime_recompute"]["step_s"] / t_gc
            out["runtime_recompute_throughput_vs_gc_ci"] = _paired(ok, "gc", "runtime_recompute")
    if "runtime_keep" in ok and "no_gc" in ok:  # the runtime's own cost: hooks, bookkeeping, nothing to save
        out["runtime_keep_vs_no_gc"] = ok["runtime_keep"]["step_s"] / ok["no_gc"]["step_s"]
        out["runtime_keep_throughput_vs_no_gc_ci"] = _paired(ok, "no_gc", "runtime_keep")
    return out


def ratio(ci) -> str:
    """'1.234x [1.200, 1.268]' from [mean, low, high] (no interval from one round)."""
    if not ci:
        return "-"
    mean, low, high = ci
    return f"{mean:.3f}x" + ("" if math.isnan(low) else f" [{low:.3f}, {high:.3f}]")


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _share(a, b) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.3f}"


def _predicted_rows(report: dict) -> list[tuple[str, dict]]:
    rows = [(name, v) for name, v in report["methods"].items() if "predicted_step_s" in v]
    return rows + [(_sweep_label(r), r) for r in report["sweep"]]


def _sweep_label(row: dict) -> str:
    return f"{row['method']} @ {row['budget']}" + (f" runner-up {row['candidate']}" if "candidate" in row else "")


def _machine_lines(report: dict, rows: dict) -> list[str]:
    """The machine's load during the run (bench/machine.py) and each method's per-round spread."""
    lines = []
    load = report.get("machine")
    if load:
        lines += ["", f"machine: {load['cpus']} cores; other processes {100 * load['other_cpu_share']:.1f}% of its CPU "
                      f"time, this run {100 * load['own_cpu_share']:.1f}%; load average {load['load_avg_1m'][0]:.2f} -> "
                      f"{load['load_avg_1m'][1]:.2f}" + ("" if load["quiet"] else f"; WARNING: {load['warning']}")]
    spread = [f"{name} {100 * v['round_cv']:.1f}%" + (f" ({100 * v['round_cv_vs_gc']:.1f}% of its ratio to GC)"
                                                     if "round_cv_vs_gc" in v else "")
              + (f", {v['distinct_plans']} different plans over its timed steps" if v.get("distinct_plans", 1) > 1 else "")
              + (f", the measured trial's arm: {v['arm']}" + (f" (plans / baseline {v['plan_over_baseline']:.3f})"
                                                                if v.get("plan_over_baseline") else "") if "arm" in v else "")
              for name, v in rows.items() if "round_cv" in v]
    if spread:
        lines += ["", "per-round spread of the step time (sd / mean): " + ", ".join(spread)]
    return lines


def table(report: dict) -> str:
    """The report in markdown."""
    r, s = report["methods"], report["summary"]
    gc = r.get("gc", {})
    lines = ["| method | tokens/s [95%] | x GC's throughput [95%, paired rounds] | peak MiB | x GC's peak | "
             "held MiB | grad cos | rel err | skipped | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in r.items():
        if v.get("status") != "ok":
            lines.append(f"| {name} | | | | | | | | | {v['status']}: {v.get('error', '')} |")
            continue
        low, high = v["tokens_per_s_ci"]
        tput = f"{v['tokens_per_s']:.0f}" + ("" if math.isnan(low) else f" [{low:.0f}, {high:.0f}]")
        peak = (f"{_mib(v['peak_bytes'])} | {_share(v['peak_bytes'], gc.get('peak_bytes'))}" if "peak_bytes" in v
                else f"{v.get('peak_error', '-')[:40]} | -")
        held = _mib(v["runtime_held_bytes"]) if v.get("runtime_held_bytes") else "-"
        skipped = f"{100 * v['skipped_token_share']:.1f}%" if "skipped_token_share" in v else "-"
        # the gradient against no GC's: "-" where no_gc did not run (no reference)
        grad = (f"{v['grad_cosine']:.6f} | {v['grad_rel_error']:.2e}" if "grad_cosine" in v else "- | -")
        lines.append(f"| {name} | {tput} | {ratio(v.get('x_gc'))} | {peak} | {held} | {grad} | {skipped} | ok |")
    lines.append("")
    if "gc_overhead" in s:
        lines.append(f"GC overhead over no GC: {100 * s['gc_overhead']:.1f}% (GPU jobs: 20-33%"
                     + ("" if s["gc_overhead_in_range"] else "; OUT OF RANGE, ratios below are not a GPU job's") + "); "
                     f"padding {100 * report['padding_share']:.0f}% of token positions; "
                     f"vocabulary head {100 * report['head_flop_share']:.1f}% of forward matmul FLOPs; static "
                     f"{report['static_bytes'] / 2**20:.0f} MiB"
                     + (f" = {100 * s['static_share_of_gc_peak']:.0f}% of GC's peak" if "static_share_of_gc_peak" in s else ""))
        lines.append("")
    lines += _summary_lines(s)
    lines += _machine_lines(report, r)
    lines += _rounds_lines(report) + _predicted_lines(report) + _sweep_lines(report)
    return "\n".join(lines)


def _rounds_lines(report: dict) -> list[str]:
    """The paired rounds' sets: rounds, widest interval, spread, how each stopped."""
    lines: list[str] = []
    lines += ["", "paired rounds (every method once per round, the order rotated; stop: "
              + _rule(report["stop"]) + ")", "",
              "| set | rounds | widest 95% half-width | its per-round spread | target reached | stopped by | seconds (cap) "
              "| the target would take |", "|---|---|---|---|---|---|---|---|"]
    for st in report["rounds"]:
        width = "-" if st["half_width"] is None or math.isnan(st["half_width"]) else f"+-{100 * st['half_width']:.2f}%"
        cv = st.get("round_cv")
        spread = "-" if cv is None or math.isnan(cv) else f"{100 * cv:.1f}%"
        cap = "" if st["cap_s"] is None else f" ({st['cap_s']:.0f})"
        needed = (f"{st['rounds_needed']} rounds, ~{st['seconds_needed']:.0f} s" if st.get("rounds_needed")
                  else "-" if st["reached"] or st["cap_s"] is None else "more than is reasonable")
        lines.append(f"| {st['label']} | {st['rounds']} | {width} ({st['widest']}) | {spread} | "
                     f"{'yes' if st['reached'] else 'no'} | {st['stopped_by']} | {st['elapsed_s']:.0f}{cap} | {needed} |")
    return lines


def _predicted_lines(report: dict) -> list[str]:
    """The planned rows: the cost model's predicted step and peak against the measured."""
    lines: list[str] = []
    predicted = _predicted_rows(report)
    if predicted:
        lines += ["", "planned rows: the cost model's prediction for the plan run against the measurement (step: mean "
                  "of the timed rounds; predicted: the probes' model times the scale measured on the row's earlier "
                  "steps, planner/step_time.py; probes alone: the model without it, no optimizer step; measured "
                  "peak: the bytes tensors held at most, as the model counts them (the CPU: the allocator's events "
                  "over a step in the peak process; CUDA: its peak allocated), not the resident size; sweep peaks "
                  "are not measured)", "",
                  "| row | predicted step s | measured step s | predicted / measured | probes alone / measured | "
                  "predicted peak MiB | measured peak MiB | predicted / measured |", "|---|---|---|---|---|---|---|---|"]
        for label, v in predicted:
            measured = v.get("tensor_peak_bytes", v.get("peak_bytes"))
            lines.append(f"| {label} | {v['predicted_step_s']:.4f} | {v['measured_step_s']:.4f} | "
                         f"{_share(v['predicted_step_s'], v['measured_step_s'])} | "
                         f"{_share(v.get('modelled_step_s'), v['measured_step_s'])} | {_mib(v['predicted_peak_bytes'])} | "
                         f"{_mib(measured)} | {_share(v['predicted_peak_bytes'], measured)} |")
    return lines


def _sweep_lines(report: dict) -> list[str]:
    """The budget sweep's rows, runner-ups included."""
    lines: list[str] = []
    if report["sweep"]:
        lines += ["", "budget sweep (each budget its own paired rounds with GC; predicted peak from the runtime's cost "
                  "table; time measured)", "",
                  "| method | budget | budget MiB | tokens/s [95%] | x GC's throughput [95%] | rounds | plan | "
                  "x fastest runner-up [95%] |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in report["sweep"]:
            low, high = row["tokens_per_s_ci"]
            tput = f"{row['tokens_per_s']:.0f}" + ("" if math.isnan(low) else f" [{low:.0f}, {high:.0f}]")
            rival = (f"{ratio(row['x_fastest_runner_up'])} (runner-up {row['fastest_runner_up']})"
                     if "x_fastest_runner_up" in row else "-")
            label = row["method"] + (f" runner-up {row['candidate']}" if "candidate" in row else "")
            lines.append(f"| {label} | {row['budget']} | {_mib(row['budget_bytes'])} | {tput} | "
                         f"{ratio(row.get('x_gc'))} | {row['rounds']} | {row['plan_counts']} | {rival} |")
    return lines


def _rule(stop: dict) -> str:
    if stop["fixed"] is not None:
        return f"{stop['fixed']} rounds per set, fixed"
    return (f"every interval within +-{100 * stop['target']:g}% of its ratio, at least {stop['min_rounds']} rounds, "
            f"{stop['time_cap_s']:g} s of rounds for the methods' set"
            + (f", {stop['sweep_time_cap_s']:g} s and what the methods' set left shared by the sweep's budgets"
               if "sweep_time_cap_s" in stop else ""))


def _summary_lines(s: dict) -> list[str]:
    lines = []
    if s.get("hilore_throughput_vs_gc_ci"):
        lines.append(f"HiLoRe throughput over GC's, paired rounds: {ratio(s['hilore_throughput_vs_gc_ci'])}")
    if s.get("hilore_vs_gc_drop_zero_adv_ci"):
        lines.append(f"HiLoRe throughput over gc_drop_zero_adv's, paired rounds: {ratio(s['hilore_vs_gc_drop_zero_adv_ci'])}")
    if s.get("hilore_recovered_share") is not None:
        lines.append(f"HiLoRe recovers {100 * s['hilore_recovered_share']:.0f}% of GC's recompute overhead "
                     "(medians; target >= 60%)")
    if "runtime_keep_vs_no_gc" in s:
        lines.append(f"Runtime, every unit kept: throughput {ratio(s['runtime_keep_throughput_vs_no_gc_ci'])} no GC's")
    if "runtime_recompute_vs_gc" in s:
        lines.append(f"Runtime, GC's plan (every layer's units recomputed): throughput {ratio(s['runtime_recompute_throughput_vs_gc_ci'])} GC's")
    if "hilore_peak_vs_gc" in s:
        lines.append(f"HiLoRe peak: {s['hilore_peak_vs_gc']:.3f}x GC's (target <= 1.10)")
    if "hilore_first_step_peak_vs_gc" in s:
        lines.append(f"HiLoRe's first step (profiling, calibration, one update; fresh processes: its time with the "
                     f"kernels' caches on, as in training, its peak as the peak rows measure): "
                     f"{s['hilore_first_step_vs_gc_step']:.2f}x a GC step's time (the faster of the rounds' and "
                     f"one timed beside it; target <= 3), "
                     f"{s['hilore_first_step_peak_vs_gc']:.3f}x GC's peak (target <= 1.10)")
    if "hilore_vs_best_other" in s:
        lines.append(f"HiLoRe vs the fastest other method within 1.10x GC's peak ({s['best_other_within_budget']}): "
                     f"{ratio(s['hilore_vs_best_other_ci'])} (target >= 1.05)")
    if s.get("hilore_controller_share") is not None:
        cosine = s.get("hilore_grad_cosine")
        lines.append(f"HiLoRe session (planning, metrics, measured peak; host): {100 * s['hilore_controller_share']:.2f}% of update time "
                     f"(target <= 2%)" + ("" if cosine is None else f"; gradient cosine {cosine:.6f} (target >= 0.999)"))
    return lines


def plot(report: dict, path: str) -> None:
    """Throughput (95% interval as error bars) against peak memory; each point labelled with its throughput
    over GC's and its interval, planned points also with the predicted step time and peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, v in report["methods"].items():
        if v.get("status") == "ok" and "peak_bytes" in v:
            x, y = v["peak_bytes"] / 2**20, v["tokens_per_s"]
            low, high = v["tokens_per_s_ci"]
            err = None if math.isnan(low) else [[y - low], [high - y]]
            ax.errorbar(x, y, yerr=err, fmt="o", capsize=3, label=f"{name} {ratio(v.get('x_gc'))}")
            note = ratio(v.get("x_gc"))
            if "predicted_step_s" in v:
                note += (f"\npredicted {v['predicted_step_s']:.3f} s / measured {v['measured_step_s']:.3f} s,"
                         f"\npredicted peak {_mib(v['predicted_peak_bytes'])} MiB")
            ax.annotate(note, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=6)
    for method in M.PLANNERS:
        rows = [r for r in report["sweep"] if r["method"] == method and "candidate" not in r]
        if rows:
            xs, ys = [r["predicted_peak_bytes"] / 2**20 for r in rows], [r["tokens_per_s"] for r in rows]
            ax.plot(xs, ys, "--", marker="x", label=f"{method} budget sweep (predicted peak)")
            for x, y, r in zip(xs, ys, rows):
                ax.annotate(f"{r['budget']}: {ratio(r.get('x_gc'))}", (x, y), textcoords="offset points",
                            xytext=(5, -10), fontsize=6)
    ax.set_xlabel("peak memory of the step, MiB")
    ax.set_ylabel("tokens / s (95% interval over paired rounds)")
    ax.set_title(f"actor update throughput against peak memory ({report['device']}); x GC's throughput [95%]",
                 fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o))


def save_markdown(report: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write(table(report) + "\n")


def append_record(report: dict, path: str, command: str) -> None:
    """One JSON line per run: when, what command, the summary and the per-method figures (no plans)."""
    methods = {k: {f: v for f, v in m.items() if f != "plan"} for k, m in report["methods"].items()}
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command,
              "device": report["device"], "threads": report["threads"], "versions": report["versions"],
              "config": report["config"], "summary": report["summary"], "methods": methods, "sweep": report["sweep"],
              "rounds": report["rounds"], "ci_reached": report["ci_reached"], "ci_half_width": report["ci_half_width"]}
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


__all__ = ["append_record", "plot", "ratio", "save_json", "save_markdown", "summarize", "table"]
