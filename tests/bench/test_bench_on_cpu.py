"""`hilore-verl bench` on a small model: every method runs (verl's offload is marked unavailable without a
GPU), exact methods give the exact gradient, lossy ones stay within bounds, the sweep and the report hold."""

import dataclasses
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hilore_verl.bench import BenchConfig, run_bench
from hilore_verl.bench.run import plot, save_json, table

# 1372 packed tokens: activations well above the physical peaks' run-to-run noise (about 15 MB here)
SMALL = BenchConfig(hidden_size=256, num_layers=2, vocab_size=2048, num_groups=2, group_size=8, max_response_len=96,
                    rounds=1)


@pytest.fixture(scope="module")
def report():
    return run_bench(SMALL, methods=("no_gc", "gc", "verl_offload", "hidden_offload", "int8_boundary",
                                     "keep_recompute", "hilore"))


def test_methods_run_and_gradients_hold(report):
    m = report["methods"]
    assert m["verl_offload"]["status"] == "unavailable" and "CUDA" in m["verl_offload"]["error"]
    for name in ("no_gc", "gc", "hidden_offload", "int8_boundary", "keep_recompute", "hilore"):
        assert m[name]["status"] == "ok", m[name]
        assert m[name]["tokens_per_s"] > 0 and m[name]["peak_bytes"] > 0
    for exact in ("gc", "hidden_offload"):  # recompute and host copies are exact
        assert m[exact]["grad_rel_error"] == 0.0, (exact, m[exact])
    # keep / recompute is exact too; it leaves out the zero-advantage half, whose terms are zero, and under
    # bf16 autocast the sums over the remaining rows round differently (bf16's epsilon is 3.9e-3)
    assert m["keep_recompute"]["skipped_token_share"] > 0.3 and m["keep_recompute"]["grad_rel_error"] <= 1e-2
    assert m["int8_boundary"]["grad_cosine"] >= 0.999 and m["hilore"]["grad_cosine"] >= 0.999
    assert m["no_gc"]["peak_bytes"] > m["gc"]["peak_bytes"]  # physical: no GC holds every activation


def test_planners_and_sweep(report):
    m = report["methods"]
    for name in ("keep_recompute", "hilore"):
        assert m[name]["predicted_peak_bytes"] <= m[name]["budget_bytes"]
        assert m[name]["budget_bytes"] == pytest.approx(1.10 * m[name]["gc_peak_predicted_bytes"])
        assert 0 <= m[name]["controller_share"] < 0.2
    for name in ("keep_recompute", "hilore"):
        rows = [r for r in report["sweep"] if r["method"] == name and "candidate" not in r]
        assert [r["budget"] for r in rows] == [1.0, 1.1, 1.25, 1.5, "no_gc"]
        budgets = [r["budget_bytes"] for r in rows[:-1]]  # the ratios of GC's peak; no GC's may lie among them
        assert budgets == sorted(budgets)
        assert all(r["predicted_peak_bytes"] <= r["budget_bytes"] * (1 + 1e-9) for r in rows)
        assert set(rows[-1]["plan_counts"]) == {"keep"}  # no GC's budget: every unit kept
        keeps = [r["plan_counts"].get("keep", 0) for r in sorted(rows, key=lambda r: r["budget_bytes"])]
        assert keeps == sorted(keeps)  # more memory, never fewer kept units


def test_hilores_runner_ups_run_beside_its_choice(report):
    """At each budget of the sweep (but no GC's, where every unit is kept), the plans the cost model ranks
    next to HiLoRe's run in the same paired rounds; each fits the budget and differs from the choice."""
    for budget in (1.0, 1.1, 1.25, 1.5):
        chosen = next(r for r in report["sweep"] if r["method"] == "hilore" and r["budget"] == budget
                      and "candidate" not in r)
        rivals = [r for r in report["sweep"] if r["method"] == "hilore" and r["budget"] == budget and "candidate" in r]
        plans = [tuple(sorted(r["plan"].items())) for r in rivals]
        assert len(set(plans)) == len(plans)
        for r in rivals:
            assert r["predicted_peak_bytes"] <= r["budget_bytes"] * (1 + 1e-9) and r["tokens_per_s"] > 0
            assert r["predicted_step_s"] > 0 and r["measured_step_s"] > 0
        if rivals:
            mean, low, high = chosen["x_fastest_runner_up"]
            assert mean > 0 and chosen["fastest_runner_up"] in [r["candidate"] for r in rivals]
            if chosen["rounds"] >= 2:
                assert low <= mean <= high, chosen
            else:  # one round has no interval
                assert math.isnan(low) and math.isnan(high), chosen
    assert any(r.get("candidate") for r in report["sweep"])


def test_report_outputs(report, tmp_path):
    text = table(report)
    assert "GC overhead over no GC" in text and "budget sweep" in text and "unavailable" in text
    assert "| hilore | " in text and "predicted step s" in text and "| budget 1.25 | 1 |" in text
    save_json(report, tmp_path / "bench.json")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["summary"]["gc_overhead"] == report["summary"]["gc_overhead"]
    # every row: throughput with its interval and the physical peak; planned rows: prediction and measurement
    for name, row in saved["methods"].items():
        if row["status"] == "ok":
            assert row["tokens_per_s"] > 0 and len(row["tokens_per_s_ci"]) == 2 and row["peak_bytes"] > 0, name
            assert len(row["x_gc"]) == 3 and row["rounds"] == 1 and row["measured_step_s"] > 0, name
    for row in [saved["methods"]["keep_recompute"], saved["methods"]["hilore"], *saved["sweep"]]:
        assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0 and row["predicted_peak_bytes"] > 0, row
    assert "predicted_step_s" not in saved["methods"]["gc"]
    # how quiet the machine was, and how many plans each planned row ran over its steps
    load = saved["machine"]
    assert load["cpus"] >= 1 and 0 < load["own_cpu_share"] and 0 <= load["other_cpu_share"] and len(load["load_avg_1m"]) == 2
    assert "machine: " in text and (load["quiet"] or "WARNING: other processes took" in text)
    for row in [saved["methods"]["keep_recompute"], saved["methods"]["hilore"], *saved["sweep"]]:
        assert row["distinct_plans"] >= 1, row
        # timed after the measured trial chose (or with none to run): its arms are not mixed in the rounds
        assert row["arm"] == "no trial" or row["plan_over_baseline"] > 0, row
    for name in ("keep_recompute", "hilore"):  # the fresh peak process measured the arm the rounds timed
        row = saved["methods"][name]
        assert row["arm"] not in ("plan", "baseline") or row["peak_arm"] == row["arm"], row
    assert saved["stop"]["fixed"] == 1 and saved["ci_reached"] is False  # one round: no interval
    assert [s["label"] for s in saved["rounds"]] == ["methods", "budget 1.0", "budget 1.1", "budget 1.25",
                                                      "budget 1.5", "budget no_gc"]
    assert all(s["stopped_by"] == "fixed" and s["rounds"] == 1 for s in saved["rounds"])
    plot(report, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_the_default_methods_are_the_ones_the_help_names():
    from hilore_verl import cli_args
    from hilore_verl.bench.methods import DEFAULT, METHODS

    import argparse

    bench = cli_args.add_bench(argparse.ArgumentParser().add_subparsers())
    methods = next(a for a in bench._actions if a.dest == "methods")
    assert methods.default is None and ", ".join(DEFAULT) in methods.help and set(DEFAULT) < set(METHODS)


def test_cli_bad_method_is_one_line():
    proc = subprocess.run([str(Path(sys.executable).with_name("hilore-verl")), "bench", "--methods", "gc,zero3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown method 'zero3'; valid: no_gc, gc" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_model_directory_replaces_the_default_shape(tmp_path):
    from hilore_verl.tiny.models import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "llama", "llama", seed=1)
    config = BenchConfig(model=model_dir, vocab_size=512, num_groups=1, group_size=4, max_response_len=32, rounds=1)
    report = run_bench(dataclasses.replace(config, rounds=3), methods=("no_gc", "gc"), sweep=False, peaks=False)
    assert report["methods"]["gc"]["status"] == "ok" and report["methods"]["gc"]["grad_rel_error"] == 0.0
    assert report["config"]["model"] == model_dir
    no_gc = report["methods"]["no_gc"]  # three rounds: the spread of its steps and of its ratio to GC's
    steps = no_gc["step_times_s"]
    assert no_gc["round_cv"] == pytest.approx(statistics.stdev(steps) / statistics.fmean(steps))
    ratios = [s / g for s, g in zip(steps, report["methods"]["gc"]["step_times_s"])]  # paired, round by round
    assert no_gc["round_cv_vs_gc"] == pytest.approx(statistics.stdev(ratios) / statistics.fmean(ratios))
    assert "round_cv_vs_gc" not in report["methods"]["gc"]


def test_a_failing_method_is_marked_and_the_others_still_report(monkeypatch):
    from hilore_verl.bench import methods as M

    real_build = M.build

    def build(name, *args, **kwargs):
        if name == "int8_boundary":
            raise RuntimeError("injected failure")
        return real_build(name, *args, **kwargs)

    monkeypatch.setattr(M, "build", build)
    config = BenchConfig(hidden_size=128, num_layers=1, vocab_size=512, num_groups=1, group_size=4,
                         max_response_len=32, rounds=1)
    report = run_bench(config, methods=("no_gc", "gc", "int8_boundary"), sweep=False, peaks=False)
    assert report["methods"]["int8_boundary"] == {"status": "failed", "error": "RuntimeError: injected failure"}
    assert report["methods"]["gc"]["status"] == "ok" and "gc_overhead" in report["summary"]
    assert "failed: RuntimeError: injected failure" in table(report)


def _no_work(args):
    raise AssertionError("the bench started its work")


@pytest.mark.parametrize("args, message", [
    (["--risk-budget", "-1"], "--risk-budget: expected a finite number >= 0, got '-1'"),
    (["--risk-budget", "nan"], "--risk-budget: expected a finite number >= 0, got 'nan'"),
    (["--risk-budget", "inf"], "--risk-budget: expected a finite number >= 0, got 'inf'"),
    (["--rounds", "0"], "--rounds: expected an integer >= 1, got '0'"),
    (["--target-ci", "0"], "--target-ci: expected a finite number > 0, got '0'"),
    (["--time-cap", "inf"], "--time-cap: expected a finite number > 0, got 'inf'"),
    (["--min-rounds", "0"], "--min-rounds: expected an integer >= 1, got '0'"),
    (["--rounds", "4", "--time-cap", "60"], "--rounds is a fixed count of rounds; drop it or --time-cap"),
    (["--md", "{dir}"], "--md: '{dir}' is a folder"),
    (["--hidden", "2.5"], "--hidden: expected an integer >= 1, got '2.5'"),
    (["--json", "{file}/report.json"], "--json: cannot write"),
    (["--plot", "{file}/plot.png"], "--plot: cannot write"),
    (["--append", "{file}/runs.jsonl"], "--append: cannot write"),
    (["--json", "{dir}"], "--json: '{dir}' is a folder"),
])
def test_cli_bad_options_fail_at_parse_time_in_one_line(args, message, tmp_path, monkeypatch, capsys):
    from hilore_verl import cli

    (tmp_path / "a_file").write_text("")
    fill = {"file": str(tmp_path / "a_file"), "dir": str(tmp_path)}
    monkeypatch.setattr(cli, "_bench", _no_work)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", *(a.format(**fill) for a in args)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.format(**fill) in err and len(err.strip().splitlines()) == 1, err


def test_cli_output_folders_are_created_before_the_run(tmp_path, monkeypatch):
    from hilore_verl import cli

    outputs = [tmp_path / "a" / "b" / "report.json", tmp_path / "c" / "plot.png", tmp_path / "d" / "runs.jsonl",
               tmp_path / "e" / "report.md"]
    seen = []
    monkeypatch.setattr(cli, "_bench", lambda args: seen.append([p.parent.is_dir() for p in outputs]) or 0)
    argv = ["bench", "--json", str(outputs[0]), "--plot", str(outputs[1]), "--append", str(outputs[2]),
            "--md", str(outputs[3])]
    assert cli.main(argv) == 0 and seen == [[True, True, True, True]]


def test_a_budget_no_row_could_run_at_is_refused_at_the_start(monkeypatch, capsys):
    """--budget 0.8 once timed rounds under 1.10x and refused only the fresh-process peak rows: now the
    parser refuses it in one line, and run_bench before any work; 1 and no_gc pass."""
    from hilore_verl import cli
    from hilore_verl.bench.run import run_bench

    seen = []
    monkeypatch.setattr(cli, "_bench", lambda args: seen.append(args.budget) or 0)
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--budget", "0.8"])
    assert stop.value.code == 2 and "expected a ratio >= 1 of GC's peak" in capsys.readouterr().err
    assert cli.main(["bench", "--budget", "1"]) == 0 and cli.main(["bench", "--budget", "no_gc"]) == 0
    assert seen == [1.0, "no_gc"]
    monkeypatch.setattr("hilore_verl.bench.run.make_batch", lambda config: pytest.fail("work began"))
    with pytest.raises(ValueError, match="gc_ratio below 1"):
        run_bench(budget=0.8)


def test_cli_stop_defaults_and_a_fixed_count(monkeypatch):
    from hilore_verl import cli

    seen = []
    monkeypatch.setattr(cli, "_bench", lambda args: seen.append(args) or 0)
    cli.main(["bench"])
    cli.main(["bench", "--rounds", "5"])
    cli.main(["bench", "--target-ci", "0.05", "--min-rounds", "4", "--time-cap", "90", "--sweep-time-cap", "30"])
    stop = [(a.rounds, a.target_ci, a.min_rounds, a.time_cap, a.sweep_time_cap) for a in seen]
    assert stop == [(None, 0.02, 3, 900.0, 300.0), (5, 0.02, 3, 900.0, 300.0), (None, 0.05, 4, 90.0, 30.0)]


def test_rows_that_isolate_the_runtime_cost_are_exact_and_summarized():
    report = run_bench(SMALL, methods=("no_gc", "gc", "runtime_keep", "runtime_recompute"), sweep=False, peaks=False)
    m, s = report["methods"], report["summary"]
    for name in ("runtime_keep", "runtime_recompute"):
        assert m[name]["status"] == "ok" and m[name]["grad_rel_error"] == 0.0, m[name]  # keep / recompute: exact
    for row, base in (("runtime_keep", "no_gc"), ("runtime_recompute", "gc")):
        assert s[f"{row}_vs_{base}"] == pytest.approx(m[row]["step_s"] / m[base]["step_s"])
        paired = [b / r for b, r in zip(m[base]["step_times_s"], m[row]["step_times_s"])]
        assert s[f"{row}_throughput_vs_{base}_ci"][0] == pytest.approx(statistics.fmean(paired))
    # each row runs its baseline's own plan, through the runtime's hooks (never hands-off)
    from hilore_verl.bench import methods as M
    from hilore_verl.bench.actor_update import make_batch

    batch = make_batch(SMALL)
    for name, expected in (("runtime_keep", lambda u: "keep"),
                           ("runtime_recompute", lambda u: "recompute" if u.layer_index is not None else "keep")):
        runtime = M.build(name, SMALL, batch).runtime
        assert not runtime.hands_off
        assert {u.name: str(runtime.plan_of(u.name)) for u in runtime.units} == {
            u.name: expected(u) for u in runtime.units}
        assert "head" in {u.name for u in runtime.units}
    # their peak process counts what the plan holds, though training forwards count nothing
    from hilore_verl.bench.peak import measure

    held = measure("runtime_recompute", json.dumps(SMALL.to_dict()), None)["runtime_held_bytes"]
    assert held is not None and held > 0


def test_the_packed_row_gives_the_padded_layouts_loss_and_gradient():
    import torch

    from hilore_verl.bench.actor_update import build_model, loss_of, make_batch, padding_share

    config = BenchConfig(hidden_size=128, num_layers=2, vocab_size=512, num_groups=2, group_size=4,
                         max_response_len=48, autocast=False)
    results = []
    for pack in (True, False):
        cfg = dataclasses.replace(config, pack=pack)
        batch, model = make_batch(cfg), build_model(cfg)
        loss = loss_of(model, batch, batch["coef"])
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), batch))
    (loss_p, grad_p, packed), (loss_d, grad_d, padded) = results
    assert padding_share(packed) == 0.0 and padding_share(padded) > 0.2
    assert packed["input_ids"].shape == (1, int(padded["attention_mask"].sum()))
    assert torch.allclose(loss_p, loss_d, rtol=1e-5, atol=1e-7)
    assert float(grad_p @ grad_d / (grad_p.norm() * grad_d.norm())) > 0.99999


@pytest.mark.parametrize("hidden", [16, 200, 288, 448, 1024])
def test_any_hidden_size_gives_a_model_whose_heads_divide(hidden):
    # hidden 448 had 7 query heads over 2 KV heads and 1024 16 over 5: SDPA refused both
    from hilore_verl.bench.actor_update import build_model, loss_of, make_batch

    config = BenchConfig(hidden_size=hidden, num_layers=1, vocab_size=256, num_groups=1, group_size=2,
                         max_response_len=8, max_prompt_len=4, per_sequence_attention=True)
    heads, kv = config.num_heads, config.num_kv_heads
    assert hidden % heads == 0 and heads % kv == 0 and config.intermediate_size >= 64
    assert hidden // heads >= min(hidden, 64) and kv == max(k for k in range(1, max(1, heads // 3) + 1) if heads % k == 0)
    batch = make_batch(config)
    loss_of(build_model(config), batch, batch["coef"]).backward()


def test_a_workload_unlike_a_gpu_job_is_refused_naming_the_flag():
    from hilore_verl.bench.run import WorkloadRefused

    with pytest.raises(WorkloadRefused, match=r"% of the padded batch's token positions are padding .* drop --no-pack"):
        run_bench(dataclasses.replace(SMALL, pack=False), methods=("gc",), sweep=False, peaks=False)
    heavy = BenchConfig(hidden_size=256, num_layers=2, vocab_size=16384, num_groups=1, group_size=2,
                        max_response_len=16, rounds=1)  # a small batch on a large vocabulary: static dominates
    with pytest.raises(WorkloadRefused, match=r"static memory .* of GC's peak .*\(--groups, --group-size"):
        run_bench(heavy, methods=("no_gc", "gc"), sweep=False, peaks=True)


def test_hilores_first_step_fits_where_gc_fits_and_takes_at_most_three_gc_steps(tmp_path):
    """The first step (profiling, calibration on a token-bounded probe, one update) of `BenchConfig()`'s
    workload, in a fresh process: its physical peak <= 1.10x GC's (GC's measured in another fresh
    process, both over a base that holds the codec's compiled code) and its time <= 3x a GC step
    timed in the same process. That workload attends over the whole packed row (a GC step about twice
    the per-sequence one) with half the groups at zero advantage; on the command line's per-sequence
    workload the first step takes 5.1-5.5x a GC step (docs/benchmarks/bench_cpu.md), over the 3x aimed at."""
    from hilore_verl.bench.run import _peak
    from hilore_verl.bench.actor_update import BenchConfig

    config = BenchConfig()
    first = _peak("hilore", config, None, str(tmp_path), first_step=True)
    gc = _peak("gc", config, None, str(tmp_path))
    assert "peak_error" not in first and "peak_error" not in gc, (first, gc)
    assert first["peak_bytes"] <= 1.10 * gc["peak_bytes"], (first, gc)
    assert first["seconds"] <= 3 * first["gc_step_s"], first


def test_zero_advantage_skip_and_the_dropping_baseline():
    """KL off: HiLoRe and the dropping baseline leave out the zero-advantage groups, exactly (the left-out
    sequences have no loss term). KL on: HiLoRe trains every sequence (each has a KL term), while dropping
    zero-advantage sequences, as verl's open pull requests do, changes the gradient."""
    tiny = BenchConfig(hidden_size=128, num_layers=2, vocab_size=512, num_groups=4, group_size=4,
                       max_response_len=32, rounds=1, zero_advantage_share=0.5)
    off = run_bench(tiny, methods=("no_gc", "gc", "gc_drop_zero_adv", "hilore"), sweep=False, peaks=False)["methods"]
    on = run_bench(dataclasses.replace(tiny, kl_coef=0.1), methods=("no_gc", "gc_drop_zero_adv", "hilore"),
                   sweep=False, peaks=False)["methods"]
    for name in ("gc_drop_zero_adv", "hilore"):
        assert 0.3 < off[name]["skipped_token_share"] < 0.7, off[name]
        assert off[name]["grad_rel_error"] <= 1e-2, off[name]  # bf16 autocast: the same sums over fewer rows
    assert on["hilore"]["skipped_token_share"] == 0.0 and on["hilore"]["grad_cosine"] >= 0.999
    assert on["gc_drop_zero_adv"]["skipped_token_share"] > 0.3
    assert on["gc_drop_zero_adv"]["grad_rel_error"] > 10 * off["gc_drop_zero_adv"]["grad_rel_error"]


def test_paired_intervals_and_a_budget_at_no_gcs_peak():
    """Every row carries a paired interval of its throughput over GC's; a planner under `budget="no_gc"`
    plans every unit kept (the predicted peak of keeping everything) and runs the plain model."""
    tiny = BenchConfig(hidden_size=128, num_layers=2, vocab_size=512, num_groups=4, group_size=4,
                       max_response_len=32, rounds=3, zero_advantage_share=0.0)
    report = run_bench(tiny, methods=("gc", "hilore"), sweep=False, peaks=False, budget="no_gc")
    m, s = report["methods"], report["summary"]
    assert report["budget"] == "no_gc"
    for name in ("gc", "hilore"):
        mean, low, high = m[name]["x_gc"]
        assert low <= mean <= high and len(m[name]["step_times_s"]) == 3
        lo, hi = m[name]["tokens_per_s_ci"]
        assert lo <= hi
    assert m["gc"]["x_gc"] == [1.0, 1.0, 1.0]
    assert set(m["hilore"]["plan"].values()) == {"keep"}, m["hilore"]["plan"]
    assert m["hilore"]["budget_bytes"] >= m["hilore"]["predicted_peak_bytes"] > m["hilore"]["gc_peak_predicted_bytes"]
    assert s["hilore_throughput_vs_gc_ci"] == m["hilore"]["x_gc"]
    assert "HiLoRe throughput over GC's, paired rounds" in table(report)


def test_cli_attention_per_sequence_by_default_and_dense_on_request(monkeypatch, capsys):
    """The bench's packed rows compute attention per sequence (what a GPU's varlen kernel computes) unless
    --dense-attention asks for SDPA over the whole row; padded rows have no packed row; the shared-prompt rows
    need the per-sequence attention and refuse --dense-attention before any work."""
    from hilore_verl import cli

    seen = []
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")  # no re-exec
    monkeypatch.setattr("hilore_verl.bench.run.run_bench", lambda config, *a, **k: seen.append(config) or pytest.fail("ran"))
    for argv, per_sequence in ((["bench"], True), (["bench", "--dense-attention"], False),
                               (["bench", "--no-pack"], False), (["bench", "--shared-prompt"], True)):
        with pytest.raises(pytest.fail.Exception):
            cli.main(argv)
        assert seen.pop().per_sequence_attention is per_sequence, argv
    assert cli.main(["bench", "--shared-prompt", "--dense-attention"]) == 2
    assert "computes attention per sequence; drop --dense-attention" in capsys.readouterr().err
    assert not seen


def test_a_planner_moved_to_another_budget_hands_that_budget_to_its_peak_process():
    """`--budget` moves a planner's controller after it is built (at 1.10); the state a fresh peak process
    starts from carries the controller's budget, so the peak row plans what the timed rows ran (it carried
    the build's 1.10 and measured a plan with fewer kept units)."""
    from hilore_verl.bench import methods as M
    from hilore_verl.bench import run as R
    from hilore_verl.bench.actor_update import make_batch

    config = dataclasses.replace(SMALL, per_sequence_attention=True)
    batch = make_batch(config)
    method = M.build("keep_recompute", config, batch)
    method.session.controller = R._controller_at(method, batch, 1.5)
    method.step(batch)
    state = method.state()
    assert state["budget"] == ("gc_ratio", 1.5)
    fresh = M.build_from_state("keep_recompute", config, batch, state)
    assert fresh.controller.budget == method.controller.budget
    assert fresh.controller.memory_budget == pytest.approx(method.controller.memory_budget)
    fresh.step(batch)
    assert fresh.controller.history[-1].plan == method.controller.history[-1].plan


def test_a_peak_process_whose_mark_does_not_follow_its_pages_gives_an_error_not_a_low_peak(monkeypatch):
    from hilore_verl.bench import peak
    from hilore_verl.measure.peak_memory import PeakMeter

    monkeypatch.setattr(PeakMeter, "check_host_peak", classmethod(lambda cls: "the mark rose by 0.0 MiB"))
    monkeypatch.setattr(peak, "_status_kib", lambda key: pytest.fail(f"{key} read"))
    with pytest.raises(RuntimeError, match="no physical peak in this process: the mark rose by 0.0 MiB"):
        peak._peak_steps(None, None, cuda=False)
    with pytest.raises(RuntimeError, match="no physical peak in this process"):
        peak._first_step("hilore", None, None, cuda=False)
