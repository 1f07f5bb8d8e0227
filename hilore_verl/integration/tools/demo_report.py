"""What `hilore-verl demo` shows of its two arms: the per-step table, the summary with each figure's
spread, the JSON (every figure recomputable from it) and the picture (reward and actor-update time per step).

Means and spreads of the actor update are over steps 2 to the end: step 1 holds HiLoRe's one-time
profiling, its codecs' compilation and the shared prompt's self-check, and verl's first-step warm-up.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


def _spread(values: list[float]) -> dict:
    if not values:
        return {}
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


@dataclass
class DemoResult:
    config: object  # demo.DemoConfig
    arms: dict[str, dict]

    def updates(self, arm: str) -> list[float]:
        """Actor-update seconds of steps 2 to the end (step 1 alone if that is all there is)."""
        steps = self.arms[arm]["steps"]
        return [s["update_s"] for s in steps[1:]] or [steps[0]["update_s"]]

    def mean_update_s(self, arm: str) -> float:
        return statistics.fmean(self.updates(arm))

    def mean_reward(self, arm: str, first: bool) -> float:
        steps = self.arms[arm]["steps"]
        half = steps[: max(1, len(steps) // 2)] if first else steps[len(steps) // 2:]
        return statistics.fmean(s["reward"] for s in half)

    def summary(self) -> dict:
        """Per arm: update-time spread, reward halves, peak RSS, mean shares; HiLoRe against GC where both ran."""
        out = {}
        for arm, data in self.arms.items():
            steps = data["steps"][1:] or data["steps"]
            out[arm] = {"update_s": _spread(self.updates(arm)), "step_s": _spread([s["step_s"] for s in steps]),
                        "reward_first_half": self.mean_reward(arm, True),
                        "reward_second_half": self.mean_reward(arm, False), "peak_rss_gib": data["peak_rss_gib"],
                        "response_length": _spread([s["response_length"] for s in steps if s.get("response_length")])}
            for key in ("skipped_share", "shared_share"):
                values = [s[key] for s in steps if s.get(key) is not None]
                if values:
                    out[arm][key] = statistics.fmean(values)
        if {"hilore", "gc"} <= set(self.arms):
            out["hilore_vs_gc"] = {"update_time": self.mean_update_s("hilore") / self.mean_update_s("gc"),
                                   "peak_rss": self.arms["hilore"]["peak_rss_gib"] / self.arms["gc"]["peak_rss_gib"]}
        return out

    def table(self) -> str:
        names = list(self.arms)
        lines = ["step | " + " | ".join(f"reward {a:>6} | update s {a:>6}" for a in names)
                 + " | skipped (hilore) | computed shared (hilore)"]
        for i in range(min(len(self.arms[a]["steps"]) for a in names)):
            row = [f"{self.arms[a]['steps'][i]['reward']:13.3f} | {self.arms[a]['steps'][i]['update_s']:15.3f}"
                   for a in names]
            h = self.arms["hilore"]["steps"][i] if "hilore" in self.arms else {}
            extra = "".join(f" | {100 * h[k]:15.1f}%" if h.get(k) is not None else " |" for k in ("skipped_share",
                                                                                                 "shared_share"))
            lines.append(f"{i + 1:4d} | " + " | ".join(row) + (extra if h else ""))
        lines.append("")
        summary = self.summary()
        for a in names:
            u = summary[a]["update_s"]
            lines.append(f"{a:>6}: mean reward {summary[a]['reward_first_half']:.3f} (first half) -> "
                         f"{summary[a]['reward_second_half']:.3f} (second half); actor update {u['mean']:.3f} s "
                         f"(sd {u['sd']:.3f}, {u['min']:.3f}-{u['max']:.3f}, steps 2..{len(self.arms[a]['steps'])}); "
                         f"peak RSS {self.arms[a]['peak_rss_gib']:.2f} GiB per rank")
        if "hilore_vs_gc" in summary:
            ratio = summary["hilore_vs_gc"]
            last = self.arms["hilore"]["steps"][-1]
            lines.append(f"HiLoRe / GC actor-update time: {ratio['update_time']:.3f}; peak RSS {ratio['peak_rss']:.3f}x "
                         f"GC's; last plan {last['plan']}" + (f", predicted peak {last['predicted_peak_gib'] * 1024:.0f} "
                         f"MiB of a {last['budget_gib'] * 1024:.0f} MiB budget" if "budget_gib" in last else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "arms": self.arms, "summary": self.summary()}


def plot(result: DemoResult, path: str) -> None:
    """One figure, two panels: mean reward per step and actor-update seconds per step, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward, update) = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm, data in result.arms.items():
        steps = [s["step"] for s in data["steps"]]
        label = {"hilore": "HiLoRe", "gc": "verl GC"}.get(arm, arm)
        reward.plot(steps, [s["reward"] for s in data["steps"]], marker="o", ms=3, label=label)
        update.plot(steps, [s["update_s"] for s in data["steps"]], marker="o", ms=3, label=label)
    reward.set(xlabel="step", ylabel="mean reward", title="reward per step")
    update.set(xlabel="step", ylabel="seconds", title="actor update per step (timing_s/update_actor)")
    update.set_ylim(bottom=0)
    for ax in (reward, update):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"hilore-verl demo: verl main_ppo, recipe {getattr(result.config, 'recipe', '')}, 2 CPU ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
