"""One HiLoRe training session: what happens around each mini-batch of the actor update.

Free of verl and of torch.distributed: the framework side (integration/actor/engine.py for verl)
supplies the protocols of host.py, `Passes` (forward + backward passes on its model, a micro-batch's
loss coefficients, how to forget a failed pass) and `Collectives` (the data-parallel reductions).

Order of one mini-batch (`Session.train`):

  first call      profile the cost table and calibrate the risk model on a probe, averaged over
                  ranks (calibration.py; or both from a checkpoint), build the controller
  every call      step += 1; the controller gets every micro-batch's exposure and tokens,
                  reduced over ranks; an audit every `audit_every` steps; the framework's
                  step under out-of-memory retries; the mini-batch's measured peak (max over
                  ranks; peak_memory.py) to the controller, which plans tighter or looser after
                  it (not for the first mini-batch nor a retried one); the `hilore/*` metrics
  per micro-batch `before_forward` applies the plan (the one place a plan reaches the runtime,
                  retries included), `after_forward` hands on the exact exposure
                  (a device tensor, or a function computing one: nothing waits for the device
                  between a forward and its backward); the controller reads them all at once
                  with the mini-batch's metrics

A fault anywhere leaves the session as before the call (the step counter too), or is retried
exactly: see `_train_with_retries` and `optimizer_step`.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Sequence

import torch

from hilore_verl.training import calibration
from hilore_verl.training.config import HiLoReConfig
from hilore_verl.loss.exposure import read_floats
from hilore_verl.training.host import Collectives, Passes, SingleProcess
from hilore_verl.measure.peak_memory import PeakMeter
from hilore_verl.planner import Controller
from hilore_verl.planner.state import costs_of, risk_of
from hilore_verl.training.snapshots import StepFailed, StepSnapshot, StepStart
from hilore_verl.loss.risk import GradientAudit
from hilore_verl.runtime import KEEP, RECOMPUTE, Runtime
from hilore_verl.measure.timing import DeviceClock

logger = logging.getLogger("hilore_verl")


class Session:
    def __init__(self, config: HiLoReConfig, runtime: Runtime, passes: Passes, collectives: Collectives | None = None,
                 peak_meter: PeakMeter | None = None):
        """`peak_meter`: measures each mini-batch's peak memory (default: the device's, made at the first
        mini-batch, when the model is on its device)."""
        self.config = config
        self.peak_meter = peak_meter
        self.runtime = runtime
        self.passes = passes
        self.collectives = collectives or SingleProcess()
        self.controller: Controller | None = None
        self.step = 0
        self.retries = 0  # out-of-memory retries in the current mini-batch
        self.retry_mode: str | None = None  # while retrying: "keep_to_recompute" or "recompute"
        self._restored: dict | None = None
        self._micro_index = 0
        self._in_optimizer_step = False  # the current attempt's fault was inside the optimizer step
        self._timed: tuple | None = None  # the last mini-batch's (start mark, end mark), read at the next
        self._measured_now = False  # build_controller probed (rather than restored) at this call
        self._calibration_floor = 0  # the ranks' probe tokens the next calibration needs (probes measured nothing)
        self._stepped = None  # this mini-batch's optimizer step, done: its snapshot (False: none was taken)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict | None:
        """The controller's state (None before the first mini-batch): identical on every rank."""
        return self.controller.state_dict() if self.controller is not None else None

    def restore(self, state: dict | None) -> None:
        """After a checkpoint load: the next mini-batch plans from `state` without probing
        (None: it profiles and calibrates again)."""
        self._restored, self.controller = state, None

    # ------------------------------------------------------------------ the controller
    def _make_controller(self, costs, risk) -> Controller:
        c = self.config
        audit = (GradientAudit(risk, ceiling=c.risk_budget, every=c.audit_every, tolerance=c.audit_tolerance)
                 if risk is not None and c.audit_every > 0 else None)
        free = self.passes.free_bytes() if c.budget.mode == "auto" else None  # measured when the actor trains
        return Controller(self.runtime, costs, risk, c.budget, static_bytes=self.passes.static_bytes(),
                          gradient_bytes=self.passes.gradient_bytes(),
                          risk_budget=c.risk_budget, token_bucket=c.token_bucket, audit=audit,
                          stochastic=c.stochastic_rounding, free_bytes=free, measure_baseline=c.measure_baseline)

    def build_controller(self, micro_batches: list) -> None:
        """What the first mini-batch does before training (`train` calls it): profile the cost table and
        calibrate the risk model on `micro_batches` (this rank's), average them over ranks, build the
        controller; after `restore(state)`, the saved state instead (no probes)."""
        self._measured_now = self._restored is None  # the probes ran on these micro-batches
        if self._restored is not None:  # a resumed run: the saved costs and calibration, no probes
            state, self._restored = self._restored, None
            self.controller = self._make_controller(costs_of(state), risk_of(state))
            self.controller.load_state_dict(state)
            logger.warning("hilore-verl: resumed from the checkpoint's costs and calibration (%d units, no probes)",
                           len(self.runtime.units))
            return
        costs, risk, tokens = calibration.measure(self.config, self.runtime, self.passes, self.collectives,
                                                  micro_batches)
        self.controller = self._make_controller(costs, risk)
        if risk is not None:
            self._calibrated_on(tokens, late=False)
        largest = max(sum(self.passes.lengths(mb)) for mb in micro_batches)  # GC's peak as without shared prompts
        gc_peak = self.controller.predicted_peak(self.controller.gc_plan(), largest)
        logger.warning("hilore-verl: planning under %.3f GiB (gradient checkpointing needs %.3f GiB at %d tokens per "
                       "micro-batch) with %d units, profiled on %d tokens", self.controller.memory_budget_at(largest)
                       / 2**30, gc_peak / 2**30, largest, len(costs.units), costs.tokens)

    # ------------------------------------------------------------------ one mini-batch
    def train(self, micro_batches: list, step: Callable[[], Any], row_tokens: Sequence[int]) -> tuple[Any, dict]:
        """One mini-batch: `step()` runs the framework's own forward, backward and optimizer step
        over `micro_batches` (this rank's, as the framework splits them; `row_tokens`: the tokens of
        each one's packed row, padding included), calling `before_forward`
        and `after_forward` around each training forward. Returns step()'s result and the
        mini-batch's metrics. On any fault the session is as before the call, and so are the parameters
        and optimizer state where the fault came after the optimizer step (from its snapshot). A fault
        while another rank has stopped training (this rank's collectives aborted) raises StepFailed."""
        start_step = self.step
        self._stepped = None
        try:
            return self._train(micro_batches, step, row_tokens)
        except BaseException as err:
            self.step = start_step  # the mini-batch did not happen
            self._timed = None
            if self.controller is not None:
                self.controller.discard_unread()
            self._recover()
            undone = self._undo_step()
            peer = self.collectives.stopped_by_peer() if isinstance(err, Exception) else None
            if peer is not None and not isinstance(err, StepFailed):
                raise StepFailed(f"hilore-verl: training stopped at step {start_step + 1} by {peer}; this rank's "
                                 f"step ended with {type(err).__name__} and {undone} (ranks may differ by a "
                                 "step: resume from the last checkpoint)") from err
            raise
        finally:
            self._stepped = None

    def _undo_step(self) -> str:
        """Put back an optimizer step this mini-batch completed before a later fault (its snapshot)."""
        if self._stepped is None:
            return "its state is as before the step"
        snapshot, self._stepped = self._stepped, None
        if snapshot is False:
            return ("its optimizer step was applied (hilore.step_snapshot=false: it cannot be undone)")
        snapshot.restore()
        return "its parameters and optimizer state are as before the step (undone from the snapshot)"

    def _train(self, micro_batches, step, row_tokens):
        first = self.controller is None
        if first:
            self.build_controller(micro_batches)
        self.step += 1
        if self._uncalibrated() and not (first and self._measured_now):
            self._optional("calibrating the risk model", lambda: self._calibrate(micro_batches))
        self._begin(micro_batches, row_tokens)
        self._meter().start()
        if self.controller.audit_due(self.step) and self.passes.has_coefficients:
            # its metrics are in controller.metrics() for this mini-batch only
            self._optional("the gradient audit", lambda: calibration.audit(
                self.runtime, self.passes, self.collectives, self.controller, self.step, micro_batches))
        clock = self._device_clock
        start = clock.mark()
        out = self._train_with_retries(step)
        # timed for the measured choice of arm (planner/arms.py): not the first (profiling), nor a retried one
        self._timed = None if first or self.retries else (start, clock.mark())
        peak = self._measured_peak()
        if not first and not self.retries:  # the first ran the probes; a retry's includes the failed attempt
            self.controller.end_mini_batch(peak, self._meter().noise_bytes)
        metrics = self.controller.metrics()
        metrics["hilore/oom_retries"] = float(self.retries)
        return out, metrics

    def _optional(self, what: str, work: Callable[[], Any]) -> None:
        """Extra passes worth less than the step (the audit, a late calibration): out of memory on every
        rank skips them (said once, tried again on their next turn); on this rank only, StepFailed."""
        failed = False
        try:
            work()
        except torch.OutOfMemoryError:
            failed = True  # outside the except block: the failed passes' graph went with the traceback
        if failed:
            self._recover()
            why = self.collectives.agree_on_failure()
            if why is not None:
                raise StepFailed(f"hilore-verl: out of memory in {what} at step {self.step}: {why}; training "
                                 "stops here with this rank's state as before the step")
            logger.warning("hilore-verl: out of memory in %s at step %d; skipped", what, self.step)

    def _uncalibrated(self) -> bool:
        """A risk model waits for its calibration (no loss term in the mini-batches it was measured on)."""
        risk = self.controller.risk
        return risk is not None and not risk.calibrated and self.passes.has_coefficients

    def _calibrate(self, micro_batches) -> None:
        """The risk model, calibrated on this mini-batch where some rank's micro-batches have a loss term
        and the ranks' probes may hold more than the last probes that measured nothing (every rank decides
        alike); the controller plans lossy units from the next plan on."""
        tokens = calibration.calibrate_risk(self.config, self.runtime, self.passes, self.collectives,
                                            micro_batches, self.controller.risk, at_least=self._calibration_floor)
        if tokens:
            self._calibrated_on(tokens)

    def _calibrated_on(self, tokens: int, late: bool = True) -> None:
        """What a calibration's figure (`calibration.calibrate_risk`) means for the plans, said in one line;
        probes that measured nothing set the next try's floor at twice their tokens."""
        risk = self.controller.risk
        if risk.calibrated and late:
            self.controller.calibrated()
            logger.warning("hilore-verl: risk model calibrated at step %d (%d units measured): plans may compress "
                           "from now on", self.step, len(risk.sensitivity))
        elif not risk.calibrated and tokens:
            self._calibration_floor = 2 * tokens
            logger.warning("hilore-verl: the risk model's probes (%d tokens over the ranks) measured no gradient "
                           "deviation (no saved tensor of theirs reached the runtime's min_bytes, or none the loss "
                           "reaches): plans are exact (keep / recompute) until a mini-batch whose probes may hold "
                           "%d tokens calibrates it", tokens, self._calibration_floor)
        elif not risk.calibrated and not late:
            logger.warning("hilore-verl: no loss term in the first mini-batch on any rank (every coefficient is "
                           "zero): the risk model is not calibrated, so plans are exact (keep / recompute) until "
                           "a mini-batch with a loss term calibrates it")

    def _begin(self, micro_batches, row_tokens) -> None:
        """Every micro-batch's predicted exposure (on-policy point) and tokens (those its layers compute
        and those of its packed row, `row_tokens`), reduced over ranks (sum of squares, max) so that
        micro-batch i gets the same plan on every rank."""
        n = len(micro_batches)
        if len({row[0] for row in self.collectives.gather([float(n)])}) != 1:
            raise ValueError("data-parallel ranks disagree on the number of micro-batches; "
                             "verl splits them with same_micro_num_in_dp=True")
        exposures = read_floats([self.passes.exposure_l2(mb) for mb in micro_batches])  # one read
        last, self._timed = self._timed, None  # the last mini-batch's (start, end), if timed
        seconds = -1.0 if last is None else self._device_clock.seconds(last[0], last[1])
        layers = [self.passes.layer_tokens(mb) for mb in micro_batches]
        heads = [self.passes.head_rows(mb) for mb in micro_batches]  # None: every token (-1 over the wire)
        rows = self.collectives.gather([e ** 2 for e in exposures] + [float(t) for t in row_tokens]
                                       + [float(t) for t in layers] + [-1.0 if h is None else float(h) for h in heads]
                                       + [seconds])
        squares = [sum(col) for col in zip(*(row[:n] for row in rows))]
        counts = [max(col) for col in zip(*(row[n:2 * n] for row in rows))]
        computed = [max(col) for col in zip(*(row[2 * n:3 * n] for row in rows))]
        head = [max(col) for col in zip(*(row[3 * n:4 * n] for row in rows))]
        whole = [row[4 * n] for row in rows]  # the slowest rank's, where every rank timed the last one
        self.controller.begin_mini_batch([math.sqrt(s) for s in squares], [int(t) for t in computed],
                                         row_tokens=[int(t) for t in counts],
                                         head_rows=[None if h < 0 else int(h) for h in head],
                                         seconds=max(whole) if min(whole) > 0 else None)

    def _meter(self) -> PeakMeter:
        if self.peak_meter is None:
            self.peak_meter = PeakMeter()
            if not self.peak_meter.available:
                logger.warning("hilore-verl: plans follow the memory model alone, without the measured-peak "
                               "feedback: %s", self.peak_meter.why_not)
        return self.peak_meter

    def _measured_peak(self) -> float | None:
        """This mini-batch's peak, the maximum over ranks (None where some rank could not measure it)."""
        local = self._meter().read(self.controller.static_bytes)
        peaks = [row[0] for row in self.collectives.gather([-1.0 if local is None else local])]
        return None if min(peaks) < 0 else max(peaks)

    @functools.cached_property
    def _device_clock(self) -> DeviceClock:  # made at the first mini-batch, when the model is on its device
        return DeviceClock(next(self.runtime.model.parameters()).device)

    def _train_with_retries(self, step):
        """The framework's step. Out of device memory on every rank: put the step back (the framework's
        pass state and gradients, RNG, the runtime's seeds; after a fault in the optimizer step also the
        parameters and optimizer state, from the snapshot: `optimizer_step`) and run the mini-batch
        again. A fault in a forward, backward or gradient sync: the first retry runs each micro-batch's
        own plan with kept units recomputed (bitwise the update the step would have made), later ones
        recompute every unit (the exact gradient). A fault in the optimizer step: the retry runs the
        plans of the attempt that failed, kept units recomputed, so its gradients (and grad norm) are
        bitwise the failed attempt's. Any other exception, or no retry left: the step is put back and the
        error raised. Ranks agree before either (`Collectives.agree_on_failure`): a retry, or the error
        raised, only where every rank failed at the same point; otherwise every rank stops with StepFailed
        (the ranks that did not fail when their collectives are aborted), never a hang. After a retry,
        later plans are 10% tighter."""
        self.retries = 0
        start = StepStart(self.runtime)
        self.collectives.watch()
        try:
            while True:
                self._micro_index = 0
                self._in_optimizer_step = False
                try:
                    return step()
                except torch.OutOfMemoryError as err:
                    where = " in the optimizer step" if self._in_optimizer_step else ""
                    if self.retries >= self.config.oom_retries:
                        self._fail(start, f"out of memory{where} at step {self.step} after {self.retries} retries")
                        self._raise_agreed(err)
                    message = (str(err).splitlines()[0] if str(err) else "out of memory") + where
                except Exception as err:
                    self._fail(start, None)
                    self._raise_agreed(err)
                except BaseException:  # an interrupt: no agreement, the process ends
                    self._fail(start, None)
                    raise
                # outside the except block: the failed attempt's graph went with its traceback
                in_step = self._in_optimizer_step
                self._recover()
                self._agree_or_raise(start, message)
                start.restore()
                self.retries += 1
                if in_step:  # the gradients were not at fault: the same plans, so the same gradients
                    self.retry_mode = self.retry_mode or "keep_to_recompute"
                else:
                    self.retry_mode = "keep_to_recompute" if self.retry_mode is None else "recompute"
                logger.warning("hilore-verl: %s at step %d; %sretry %d/%d with %s, planning 10%% tighter from now on",
                               message, self.step, "parameters and optimizer state restored; " if in_step else "",
                               self.retries, self.config.oom_retries,
                               "kept units recomputed" if self.retry_mode == "keep_to_recompute"
                               else "every unit recomputed")
        finally:
            self.retry_mode = None
            if self.retries:
                self.controller.on_oom()  # tighten future plans (the retry planned as the failed attempt did)

    def _fail(self, start: StepStart, message: str | None) -> None:
        """A loud end to the step: everything as before it, then the caller raises."""
        self._recover()
        start.restore()
        if message is not None:
            logger.error("hilore-verl: %s; parameters, optimizer state and RNG are as before the step", message)

    def _raise_agreed(self, err: Exception):
        """Raise `err` (the step is put back) where every rank failed at the same point, so that a caller may
        go on with every rank's collectives paired. Where another rank stopped training (this rank's
        collectives were aborted), or the ranks did not fail alike, StepFailed: every rank stops."""
        why = self.collectives.agree_on_failure()
        if why is not None:
            raise StepFailed(f"hilore-verl: {type(err).__name__} at step {self.step}: {why}; training stops here "
                             f"with this rank's state as before the step ({err})") from err
        raise err

    def _agree_or_raise(self, start: StepStart, what: str) -> None:
        """Retry only when every rank failed and their collectives are paired (Collectives.agree_on_failure);
        otherwise every rank stops: this one here, the others when their collectives are aborted."""
        why = self.collectives.agree_on_failure()
        if why is not None:
            start.restore()
            raise StepFailed(f"hilore-verl: {what} at step {self.step}, not retried: {why}; a retry would pair "
                             "its collectives with the other ranks' unrelated ones, so training stops here with "
                             "this rank's state as before the step")

    def _recover(self) -> None:
        """Forget a failed forward / backward: runtime ready, the framework's pass state reset."""
        self.runtime.reset()
        self.passes.recover()

    # ------------------------------------------------------------------ per micro-batch
    def before_forward(self) -> int:
        """Before a training micro-batch's forward: apply its plan; returns its index."""
        index, self._micro_index = self._micro_index, self._micro_index + 1
        if self.retry_mode == "recompute":
            self.runtime.set_plan({u.name: RECOMPUTE for u in self.runtime.units})
            return index
        # the first micro-batch after zero_grad allocates its gradients as its backward goes
        gradients = index > 0 or any(p.grad is not None for p in self.runtime.model.parameters())
        plan = self.controller.plan_micro_batch(index, gradients)
        if self.retry_mode == "keep_to_recompute":  # the failed attempt's plan, kept units recomputed
            self.runtime.set_plan(self.controller.runtime_plan(
                {u: RECOMPUTE if p == KEEP else p for u, p in plan.items()}))
        else:  # measure=False: a plan the runtime need not hook (every unit kept, or HF's checkpointing) runs plain
            self.runtime.set_plan(self.controller.runtime_plan(plan), measure=False)
        return index

    def records_risk(self) -> bool:
        """Whether `after_forward` wants the exact exposure (coefficients known, not a retry)."""
        return self.passes.has_coefficients and self.retry_mode is None

    def after_forward(self, index: int, exposure_l2_exact) -> None:
        """After its forward, before its backward: the exact exposure, for the risk spent. A float, a
        0-d tensor or a function computing one (`Controller.after_forward`): a tensor is not read here,
        and a function not called, so that nothing waits for the device before the backward."""
        self.controller.after_forward(index, exposure_l2_exact)

    # ------------------------------------------------------------------ the optimizer step
    def optimizer_step(self, step: Callable[[], Any], snapshot: StepSnapshot | None):
        """The framework's optimizer step (clip + step). A fault inside it may have updated some
        parameters and moments already: they are put back from `snapshot` (taken when the mini-batch
        started: parameters and optimizer state change only in this step) and the error raised on.
        `_train_with_retries` then retries an out-of-memory error on every rank by running the
        mini-batch again, whose gradients are bitwise the failed attempt's; the gradients themselves are
        never copied. Without a snapshot the fault cannot be undone: StepFailed."""
        try:
            out = step()
            self._stepped = snapshot if snapshot is not None else False  # undone if the mini-batch fails later
            return out
        except torch.OutOfMemoryError:
            if snapshot is None:
                raise StepFailed("hilore-verl: out of memory inside the optimizer step, which may have updated "
                                 "some parameters already; with hilore.step_snapshot=false it cannot be undone: "
                                 "resume from the last checkpoint") from None
            snapshot.restore()
            self._in_optimizer_step = True
            raise
        except BaseException as err:
            if snapshot is None:
                raise StepFailed(f"hilore-verl: the optimizer step failed ({type(err).__name__}) and may have "
                                 "updated some parameters already; with hilore.step_snapshot=false it cannot "
                                 "be undone: resume from the last checkpoint") from err
            snapshot.restore()
            self._in_optimizer_step = True
            raise


__all__ = ["Collectives", "Passes", "Session", "SingleProcess"]
