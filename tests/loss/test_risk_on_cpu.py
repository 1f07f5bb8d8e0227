"""The risk model: calibrated on the tiny model, it predicts held-out gradient errors within 2x;
the audit catches a bad codec within one period and tightens the budget."""

import math

import pytest
import torch

import hilore_verl
import hilore_verl.runtime.saving as runtime_module
from hilore_verl.loss import exposure
from hilore_verl.integration.actor import loss as actor_loss
from hilore_verl.integration.tools.verl_engine import actor_config
from hilore_verl.loss.risk import GradientAudit, RiskModel, calibrate, codec_error
from hilore_verl.tiny.models import build_tiny_model
from hilore_verl.tiny.workload import GRPOWorkload, make_grpo_batch
from hilore_verl.tiny.workload import response_log_probs
from tests.harness.models import surrogate_gradient

WORKLOAD = GRPOWorkload(num_groups=2, group_size=4, max_prompt_len=16, max_response_len=48, zero_advantage_share=0.5)
FMTS = ("int8", "fp8", "int4")


def _micro_batch(model, seed):
    batch = make_grpo_batch(WORKLOAD, seed=seed)
    with torch.no_grad():
        log_prob = response_log_probs(model, batch)
    noise = torch.randn(log_prob.shape, generator=torch.Generator().manual_seed(seed)) * 0.1
    batch["old_log_probs"] = (log_prob + noise) * batch["response_mask"]
    c = actor_loss.loss_coefficients(log_prob, batch["old_log_probs"], batch["advantages"], batch["response_mask"],
                                   actor_config())
    return batch, c, exposure.summarize(c, batch["response_mask"]).l2_of()


@pytest.fixture(scope="module")
def calibrated():
    model = build_tiny_model("qwen2", seed=0).train()
    rt = hilore_verl.attach(model)
    units = [u.name for u in rt.units]
    risk = RiskModel()
    for seed in (0, 1, 2):
        batch, c, e2 = _micro_batch(model, seed)
        calibrate(lambda plan: surrogate_gradient(model, rt, batch, c, plan), units, e2, FMTS, model=risk)
    return model, rt, units, risk


def test_codec_errors_are_measured_and_ordered():
    errs = [codec_error(f) for f in FMTS]
    assert errs == sorted(errs) and 0.004 < errs[0] < 0.008 and 0.08 < errs[2] < 0.15
    assert codec_error("int8", 32) < codec_error("int8", 128)


def test_predictions_within_the_stated_bound_on_held_out_micro_batches(calibrated):
    """docs/design.md: measured / predicted in [0.6, 1.4] on held-out micro-batches (measured 0.65-1.30)."""
    model, rt, units, risk = calibrated
    figures = []
    for seed in (10, 11, 12, 13):
        batch, c, e2 = _micro_batch(model, seed)
        exact = surrogate_gradient(model, rt, batch, c, {})
        plans = [{u: f for u in units} for f in FMTS]  # every unit compressed
        plans += [{"layers.1.mlp.act": "int4"}, {"head": "int8", "layers.0.attn.core": "fp8"}]
        for plan in plans:
            measured = float((surrogate_gradient(model, rt, batch, c, plan) - exact).norm())
            predicted = risk.predict(plan, e2)
            figures.append((seed, sorted(set(plan.values())), len(plan), measured / predicted))
    print("\nheld-out measured / predicted:", [f"{s}:{fm}x{n}={r:.2f}" for s, fm, n, r in figures])
    assert all(0.6 <= r <= 1.4 for *_, r in figures), figures


def test_zero_exposure_means_zero_risk(calibrated):
    _, _, units, risk = calibrated
    assert risk.predict({u: "int4" for u in units}, 0.0) == 0.0
    assert risk.predict({u: "keep" for u in units}, 1.0) == risk.predict({u: "recompute" for u in units}, 1.0) == 0
    assert risk.predict({"head": "int8"}, 1.0) > 0


def test_audit_catches_an_injected_bad_codec_and_tightens(calibrated, monkeypatch):
    model, rt, units, risk = calibrated
    risk = RiskModel()  # a copy: the fixture's model stays clean
    risk.load_state_dict(calibrated[3].state_dict())
    audit = GradientAudit(risk, ceiling=0.05, every=2)
    budget = 0.05
    plan = {u: "int8" for u in units if u.startswith("layers.")}
    real = runtime_module.quantize

    def two_bit(t, fmt, group_size, **kwargs):  # a broken codec: int8 codes coarsened to 5 levels
        q = real(t, fmt, group_size, **kwargs)
        q.codes = (torch.round(q.codes.float() / 64) * 64).clamp(-127, 127).to(q.codes.dtype)
        return q

    results = []
    for step in range(1, 7):
        if step == 3:
            monkeypatch.setattr(runtime_module, "quantize", two_bit)
        batch, c, e2 = _micro_batch(model, 20 + step)
        if audit.due(step):
            exact = surrogate_gradient(model, rt, batch, c, {})
            approx = surrogate_gradient(model, rt, batch, c, plan)
            results.append(audit.run(step, exact, approx, plan, e2, budget))
            budget = results[-1].risk_budget
    before, after = results[0], results[1]  # audits at steps 2 and 4: one period after the injection
    assert not before.anomaly and before.risk_budget == pytest.approx(0.05)
    assert after.anomaly and after.ratio > 2 and after.risk_budget == pytest.approx(0.025)
    assert results[2].ratio < after.ratio  # sensitivities re-scaled: predictions caught up
    metrics = after.metrics()
    assert metrics["hilore/audit/anomaly"] == 1.0 and math.isclose(metrics["hilore/risk_budget"], 0.025)


def test_uncalibrated_model_says_so():
    with pytest.raises(ValueError, match="not calibrated"):
        RiskModel().predict({"head": "int8"}, 1.0)
    with pytest.raises(ValueError, match="need every >= 1"):
        GradientAudit(RiskModel(), every=0)


def test_an_audit_of_a_zero_exact_gradient_records_nothing():
    """A micro-batch without exposure has a zero exact gradient (and a zero approximate one): there is
    no cosine or relative error to report, and the audit must not relax the budget or move sensitivities."""
    risk = RiskModel(sensitivity={"head": 1.0, "layers.0.mlp.act": 2.0}, grad_scale=1.0)
    audit = GradientAudit(risk, ceiling=0.05, every=1)
    before = dict(risk.sensitivity)
    zeros = torch.zeros(50)
    # 0.02: tightened by an earlier anomaly, which a clean audit would relax
    assert audit.run(1, zeros, zeros, {"head": "int8", "layers.0.mlp.act": "int4"}, 0.0, 0.02) is None
    assert audit.history == [] and risk.sensitivity == before
    # the same over ranks: the reduced sums decide (here every shard is zero)
    assert audit.run(2, zeros, zeros, {"head": "int8"}, 1.0, 0.02, reduce=lambda t: t.mul_(2)) is None
    # a non-zero exact gradient is audited as before, and the clean audit relaxes the budget by 10%
    exact = torch.ones(50)
    result = audit.run(3, exact, exact + 1e-4, {"head": "int8"}, 1.0, 0.02)
    assert result is not None and result.cosine == pytest.approx(1.0) and len(audit.history) == 1
    assert result.risk_budget == pytest.approx(0.022)
    assert audit.run(4, exact, exact + 1e-4, {"head": "int8"}, 1.0, 0.049).risk_budget == 0.05  # not past the ceiling


def test_a_non_finite_approximate_gradient_is_an_anomaly():
    risk = RiskModel(sensitivity={"head": 1.0}, grad_scale=1.0)
    audit = GradientAudit(risk, ceiling=0.05, every=1)
    approx = torch.ones(10)
    approx[3] = float("nan")
    result = audit.run(1, torch.ones(10), approx, {"head": "int8"}, 1.0, 0.05)
    assert result.anomaly and result.rel_error == math.inf and result.risk_budget == pytest.approx(0.025)
    assert math.isfinite(risk.sensitivity["head"])  # not re-scaled by an infinite ratio


def test_risk_follows_the_plans_codec_settings():
    """Stochastic rounding has a larger RMS error than rounding to nearest; a smaller group a smaller
    one; offload changes nothing. The planner's option names are accepted."""
    from hilore_verl.runtime.plan import Mode, UnitPlan

    assert codec_error("int8", 64, stochastic=True) > 1.2 * codec_error("int8", 64)
    risk = RiskModel(sensitivity={"head": 1.0}, grad_scale=1.0)
    rtn = risk.predict({"head": UnitPlan(Mode.COMPRESS, fmt="int8")}, 1.0)
    sr = risk.predict({"head": UnitPlan(Mode.COMPRESS, fmt="int8", stochastic=True)}, 1.0)
    g32 = risk.predict({"head": UnitPlan(Mode.COMPRESS, fmt="int8", group_size=32)}, 1.0)
    assert sr > rtn > g32 > 0
    assert risk.predict({"head": "int8+offload"}, 1.0) == risk.predict({"head": "int8"}, 1.0) == rtn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_sums_equal_float64_sums_over_chunks_and_missing_gradients(monkeypatch, dtype):
    """Chunks of 7 elements over tensors of 1, 7, 8 and 23 elements, a gradient only one pass has (the
    other counts as zero) and one neither has: the float64 sums of the whole, concatenated."""
    from hilore_verl.loss import risk as risk_module

    monkeypatch.setattr(risk_module, "SUM_CHUNK", 7)
    g = torch.Generator().manual_seed(1)
    shapes = [(1,), (7,), (2, 4), (23,), (5,), (3,)]
    exact = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    approx = [e + 0.1 * torch.randn(e.shape, generator=g).to(dtype) for e in exact]
    exact[4], approx[5] = None, None  # only the approximate pass has the fifth, only the exact the sixth
    exact.append(None)
    approx.append(None)
    sums = risk_module.gradient_sums(exact, approx)
    pairs = [(x, y) for x, y in zip(exact, approx) if x is not None or y is not None]
    e = torch.cat([(x if x is not None else torch.zeros_like(y)).double().reshape(-1) for x, y in pairs])
    a = torch.cat([(y if y is not None else torch.zeros_like(x)).double().reshape(-1) for x, y in pairs])
    ref = torch.stack([(a - e).pow(2).sum(), e.pow(2).sum(), a.pow(2).sum(), e.dot(a)])
    torch.testing.assert_close(sums, ref, rtol=1e-12, atol=0)
    assert risk_module.gradient_sums([None], [None]).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="different layouts"):
        risk_module.gradient_sums([torch.ones(3)], [torch.ones(4)])


def test_the_audits_sums_read_gradients_in_place_in_bounded_memory():
    """The audit's and calibration's sums over two gradients of 2 x 128 MiB (fp32, as verl's sharded
    gradients) add at most three float64 chunks (3 x SUM_CHUNK x 8 bytes = 24 MiB) to the resident peak of
    a fresh process, not float64 copies of the gradients (1 GiB here, what they were), and equal the
    float64 sums of the whole."""
    import subprocess
    import sys

    from hilore_verl.loss.risk import SUM_CHUNK

    script = (
        "import torch\n"
        "from hilore_verl.measure.peak_memory import PeakMeter\n"
        "from hilore_verl.loss.risk import gradient_sums\n"
        "g = torch.Generator().manual_seed(0)\n"
        "exact = [torch.randn(24 * 2**20, generator=g), torch.randn(8 * 2**20 + 5, generator=g), None]\n"
        "approx = [e + 1e-3 * torch.randn(e.shape, generator=g) for e in exact[:2]] + [None]\n"
        "meter = PeakMeter(cuda=False)\n"
        "assert meter.available, meter.why_not\n"
        "meter.start()\n"
        "sums = gradient_sums(exact, approx)\n"
        "added = meter.read(static_bytes=0.0)\n"
        "e, a = torch.cat(exact[:2]).double(), torch.cat(approx[:2]).double()\n"
        "ref = torch.stack([(a - e).pow(2).sum(), e.pow(2).sum(), a.pow(2).sum(), e.dot(a)])\n"
        "print(added, bool(torch.allclose(sums, ref, rtol=1e-12)))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    added, equal = out.stdout.split()
    bound = 3 * SUM_CHUNK * 8 + 8 * 2**20  # the chunks, and 8 MiB for pages the interpreter touches
    assert float(added) <= bound, f"{float(added) / 2**20:.1f} MiB over the sums' bound {bound / 2**20:.1f} MiB"
    assert equal == "True"
