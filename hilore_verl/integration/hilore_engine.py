"""verl's FSDP engine with HiLoRe: the runtime on the FSDP2 model and a plan per micro-batch.

Registered in verl's EngineRegistry under the backend `BACKEND` (see actor_config.py for how a
recipe selects it). Overrides as little as possible of `FSDPEngineWithLMHead`:
  - `initialize`: after verl builds and shards the model, attach the runtime (which takes over HF
    gradient checkpointing on the managed layers, and says so);
  - `train_batch`: on the first call, profile the cost table and calibrate the risk model on a
    probe of whole sequences, at most `profile_tokens` tokens (identical on every rank: numbers are
    averaged over the data-parallel group); then, once per mini-batch, hand the controller the predicted exposure of every
    micro-batch, audit every `audit_every` steps, run verl's own train_batch (retrying with every
    unit recomputed after an out-of-memory error) and add `hilore/*` metrics;
  - `forward_step`: before each training micro-batch, apply its plan; after its forward and
    before its backward, record the risk spent from the exact coefficients;
  - `prepare_model_outputs`: the log-prob computation over the vocabulary joins the head unit;
  - `save_checkpoint` / `load_checkpoint`: the controller state rides along with verl's checkpoint
    (`hilore_controller.json`: plain JSON, validated on load; a bad or legacy pickled file re-profiles).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import torch
import torch.distributed as dist

import hilore_verl
from hilore_verl import exposure
from hilore_verl.config import HiLoReConfig
from hilore_verl.integration.actor_config import BACKEND
from hilore_verl.integration.controller_file import read_controller_state, write_controller_state
from hilore_verl.integration.device_memory import available_bytes
from hilore_verl.integration.recovery import (StepFailed, StepSnapshot, StepStart, every_rank_failed, fault_group,
                                              reset_after_failure)
from hilore_verl.planner import Controller, profile
from hilore_verl.planner.costs import measured_values, set_measured_values
from hilore_verl.planner.probe import half_probe, probe_indices, probe_token_bound
from hilore_verl.risk import GradientAudit, RiskModel, calibrate_by_kind
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_torch_device
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.padding import no_padding_2_padding

logger = logging.getLogger("hilore_verl")


def _padded(data, key):
    value = data[key]
    return torch.nested.to_padded_tensor(value, 0.0) if value.is_nested else value


def _sequence_lengths(data) -> list[int]:
    """Tokens per sequence of a micro-batch (nested: its offsets; padded: its attention mask)."""
    ids = data["input_ids"]
    if ids.is_nested:
        return ids.offsets().diff().tolist()
    if "attention_mask" in data:
        return data["attention_mask"].sum(-1).tolist()
    return [ids.shape[-1]] * ids.shape[0]


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "npu", "cpu"])
class HiLoReFSDPEngine(FSDPEngineWithLMHead):
    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config, *,
                 hilore: HiLoReConfig | Mapping[str, Any] | None = None, actor_config=None):
        """`hilore`: the section (default: the one on a HiLoReEngineConfig); `actor_config`: verl's actor
        config for loss coefficients (default: taken from the bound ppo_loss at the first train_batch)."""
        if hilore is None:
            hilore = getattr(engine_config, "hilore", None)
        self.hilore = hilore if isinstance(hilore, HiLoReConfig) else HiLoReConfig.from_dict(hilore)
        if not self.hilore.enable:
            raise ValueError("HiLoReFSDPEngine needs hilore.enable=true; with it off verl's own engine is used")
        if engine_config.strategy == BACKEND:
            engine_config = engine_config.as_fsdp2()  # a copy: verl's FSDP build code expects "fsdp2"
        if engine_config.strategy != "fsdp2":
            raise ValueError(f"hilore needs strategy=fsdp2; got strategy={engine_config.strategy}")
        if getattr(model_config, "enable_activation_offload", False):
            raise ValueError("hilore and verl's enable_activation_offload manage the same activations: "
                             "set actor_rollout_ref.model.enable_activation_offload=false")
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.actor_config = actor_config
        self.runtime = None
        self.controller: Controller | None = None
        self._restored: dict | None = None
        self._step = 0
        self._micro_index = 0
        self._retry_mode: str | None = None  # while retrying after an OOM: "keep_to_recompute" or "recompute"
        self._fault_group = None  # gloo group on which failed ranks agree before a retry
        self._retries = 0  # out-of-memory retries in the current mini-batch
        self._snapshot: StepSnapshot | None = None  # host buffers of the optimizer-step snapshot, reused

    # ------------------------------------------------------------------ set-up
    def initialize(self):
        super().initialize()
        self.runtime = hilore_verl.attach(
            self.module, hilore_verl.RuntimeConfig(min_bytes=self.hilore.min_bytes, seed=self.hilore.seed))
        self._fault_group = fault_group(self.hilore.fault_timeout_s)

    def _static_bytes(self) -> float:
        """Parameter shards, their gradients and two fp32 Adam states per element, on this rank."""
        total = 0.0
        for p in self.module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * (2 * local.element_size() + 8)
        return total

    def _micro_batches(self, data):
        """The local micro-batches of a mini-batch, split exactly as verl's forward_backward_batch splits them."""
        data = data.clone()
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        tokens = data["loss_mask"].sum().to(torch.float32)
        if dist.is_initialized():
            dist.all_reduce(tokens, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=int(tokens.item()), dp_size=self.get_data_parallel_size())
        micro_batches, _ = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(),
                                                 same_micro_num_in_dp=True)
        return micro_batches

    def _run(self, plan, batch, loss_function) -> None:
        """Forward + backward of one micro-batch under `plan` (None: the runtime's current plan);
        grads are left in .grad, no optimizer step."""
        if plan is not None:
            self.runtime.set_plan(plan)
        self.optimizer.zero_grad()
        value, _ = super().forward_step(batch, loss_function, forward_only=False)
        value.backward()

    def _surrogate_gradient(self, plan, batch, c: torch.Tensor) -> torch.Tensor:
        """This rank's gradient shard of sum_t c_t log p_t (the gradient the risk model describes) under
        `plan`; units the plan does not name are recomputed (exact, and the least memory)."""
        def surrogate(model_output, data, dp_group=None):
            log_prob = no_padding_2_padding(model_output["log_probs"], data)
            return (log_prob * c.to(log_prob.dtype)).sum(), {}

        full = {u.name: "recompute" for u in self.runtime.units}
        full.update(plan)
        self._run(full, batch, surrogate)
        return torch.cat([(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).flatten()
                          for p in self.module.parameters()])

    def _make_controller(self, costs, risk) -> Controller:
        audit = (GradientAudit(risk, risk_budget=self.hilore.risk_budget, every=self.hilore.audit_every,
                               tolerance=self.hilore.audit_tolerance)
                 if risk is not None and self.hilore.audit_every > 0 else None)
        free = None
        if self.hilore.budget.mode == "auto":  # measured now, when the actor trains (see device_memory.py)
            free = available_bytes(next(self.module.parameters()).device, self.get_data_parallel_group())
        return Controller(self.runtime, costs, risk, self.hilore.budget, static_bytes=self._static_bytes(),
                          risk_budget=self.hilore.risk_budget, group=self.get_data_parallel_group(),
                          token_bucket=self.hilore.token_bucket, audit=audit,
                          stochastic=self.hilore.stochastic_rounding, free_bytes=free)

    def _build_controller(self, micro_batches, loss_function) -> None:
        if self._restored is not None:  # a resumed run: the saved costs and calibration, no probes
            state, self._restored = self._restored, None
            self.controller = self._make_controller(Controller.costs_from_state(state),
                                                    Controller.risk_from_state(state))
            self.controller.load_state_dict(state)
            logger.warning("hilore-verl: resumed from the checkpoint's costs and calibration (%d units, no probes)",
                           len(self.runtime.units))
            return
        bound = probe_token_bound(self.hilore.profile_tokens, sum(sum(_sequence_lengths(mb)) for mb in micro_batches))
        probe = self._probe(micro_batches[0], bound)  # whole sequences, at most `bound` tokens
        lengths = _sequence_lengths(probe)
        half = half_probe(lengths, list(range(len(lengths))))
        every = torch.tensor([float(half is not None)])  # ranks run the same probe passes (FSDP collectives)
        if dist.is_initialized():
            dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.get_data_parallel_group())
        small = tu.index_select_tensor_dict(probe, half) if half is not None and every.item() else None

        def run(batch):
            return lambda: self._run(None, batch, loss_function)

        element = next(self.module.parameters()).element_size() if self._autocast_dtype == torch.float32 else 2
        costs = profile(self.runtime, run(probe), sum(lengths), element_size=element, formats=self.hilore.formats,
                        offload=self.hilore.offload, group_size=self.hilore.group_size,
                        small=None if small is None else (run(small), sum(_sequence_lengths(small))))
        risk = None
        if self.hilore.risk_budget > 0 and self.actor_config is not None:
            # calibrate on the local micro-batch with the most exposure
            exposures = [self._coefficients(mb) for mb in micro_batches]
            best = max(range(len(micro_batches)), key=lambda i: float(exposures[i].pow(2).sum()))
            batch = self._probe(micro_batches[best], bound, priority=exposures[best].pow(2).sum(-1).tolist())
            c = self._coefficients(batch)  # the most exposed sequences that fit the bound
            risk = calibrate_by_kind(lambda plan: self._surrogate_gradient(plan, batch, c),
                             [u.name for u in self.runtime.units], float(c.pow(2).sum().sqrt()),
                             fmts=self.hilore.formats[:1], group_size=self.hilore.group_size, model=RiskModel())
        self._average_over_ranks(costs, risk)
        self.optimizer.zero_grad()
        self.runtime.set_plan({})
        self.controller = self._make_controller(costs, risk)
        largest = max(sum(_sequence_lengths(mb)) for mb in micro_batches)
        gc_peak = self.controller.predicted_peak({u.name: "recompute" for u in costs.units}, largest)
        logger.warning("hilore-verl: planning under %.3f GiB (full recompute needs %.3f GiB at %d tokens per "
                       "micro-batch) with %d units, profiled on %d tokens", self.controller.memory_budget_at(largest)
                       / 2**30, gc_peak / 2**30, largest, len(costs.units), costs.tokens)

    @staticmethod
    def _probe(micro_batch, bound: int, priority=None):
        """Whole sequences of `micro_batch` up to `bound` tokens (planner/probe.py)."""
        lengths = _sequence_lengths(micro_batch)
        index = probe_indices(lengths, bound, priority)
        return micro_batch if len(index) == len(lengths) else tu.index_select_tensor_dict(micro_batch, index)

    def _average_over_ranks(self, costs, risk) -> None:
        """Every rank must plan from the same numbers: average the measured ones (a fixed-length
        vector on every rank; a sensitivity only where some rank measured it)."""
        if not dist.is_initialized():
            return
        names = [u.name for u in costs.units]
        figures = measured_values(costs)
        values = figures + [float(costs.tokens)]
        if risk is not None:
            for n in names:  # (sum of log sensitivity, how many ranks measured it)
                measured = n in risk.sensitivity
                values += [math.log(risk.sensitivity[n]) if measured else 0.0, float(measured)]
            values += [risk.grad_scale or 0.0, float(bool(risk.grad_scale))]
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.get_data_parallel_group())
        world = self.get_data_parallel_size()
        it = iter(t.tolist())
        set_measured_values(costs, [next(it) / world for _ in figures])
        costs.tokens = int(round(next(it) / world))
        if risk is not None:
            risk.sensitivity.clear()
            for n in names:
                total, count = next(it), next(it)
                if count:
                    risk.sensitivity[n] = math.exp(total / count)
            total, count = next(it), next(it)
            risk.grad_scale = total / count if count else None

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)
        if self.controller is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            write_controller_state(self.controller.state_dict(), local_path)  # every rank holds the same state

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        state = self._read_state(local_path)  # before verl's load, which may delete local_path
        super().load_checkpoint(local_path, hdfs_path, del_local_after_load, **kwargs)
        self._restored, self.controller = state, None  # no state: the first step profiles and calibrates

    def _read_state(self, local_path) -> dict | None:
        units = [u.name for u in self.runtime.units] if self.runtime is not None else None
        group = self.get_data_parallel_group() if dist.is_initialized() else None
        return read_controller_state(local_path, units, group)

    # ------------------------------------------------------------------ per step
    def _coefficients(self, micro_batch, log_prob=None) -> torch.Tensor:
        """Loss coefficients of a micro-batch: predicted (on-policy) without log_prob, exact with it."""
        mask = _padded(micro_batch, "response_mask")
        old = _padded(micro_batch, "old_log_probs")
        optional = {k: _padded(micro_batch, k) for k in ("rollout_is_weights", "ref_log_prob") if k in micro_batch}
        return exposure.loss_coefficients(old if log_prob is None else log_prob, old,
                                          _padded(micro_batch, "advantages"), mask, self.actor_config, **optional)

    def _exposure_l2(self, micro_batch, log_prob=None) -> float:
        """L2 of the micro-batch's exposure: |c_t|, plus the entropy bound when the actor's entropy_coeff
        is not 0 (the entropy bonus acts on the logits, so c leaves it out; a zero-advantage micro-batch
        still moves the policy through it)."""
        if self.actor_config is None:
            return 1.0
        c = self._coefficients(micro_batch, log_prob)
        vocab = self._vocab_size() if getattr(self.actor_config, "entropy_coeff", 0) else None
        return exposure.actor_exposure(c, _padded(micro_batch, "response_mask"), self.actor_config, vocab).l2_of()

    def _vocab_size(self) -> int | None:
        """The model's vocabulary size V (the entropy bound is 2 ln V), from verl's model config."""
        config = getattr(self.model_config, "hf_config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        vocab = getattr(config, "vocab_size", None)
        if vocab is None:  # the module's own config, as the model was built
            vocab = getattr(getattr(self.module, "config", None), "vocab_size", None)
        return vocab

    def train_batch(self, data, loss_function):
        """One mini-batch. A fault anywhere in it (profiling, audit, forward, backward, optimizer step)
        leaves the engine as before the call, or is retried exactly (see _train_with_retries)."""
        step = self._step
        try:
            return self._train_batch(data, loss_function)
        except BaseException:
            self._step = step  # the mini-batch did not happen
            self._recover()
            raise

    def _train_batch(self, data, loss_function):
        if self.actor_config is None:  # the actor worker binds ppo_loss to the actor config
            self.actor_config = getattr(loss_function, "keywords", {}).get("config")
        micro_batches = self._micro_batches(data)
        if self.controller is None:
            self._build_controller(micro_batches, loss_function)
        self._step += 1
        # once per mini-batch: predicted exposure (on-policy point) and tokens of every micro-batch
        self.controller.begin_mini_batch([self._exposure_l2(mb) for mb in micro_batches],
                                         [int(mb["input_ids"].values().numel()) for mb in micro_batches])
        if self.controller.audit_due(self._step) and self.actor_config is not None:
            failed = False
            try:
                self._audit(micro_batches)  # its metrics are in controller.metrics() for this mini-batch only
            except torch.OutOfMemoryError:
                failed = True  # an audit is worth less than the step: skip it, train
            if failed:
                self._recover()
                if not every_rank_failed(self._fault_group):
                    raise StepFailed(f"hilore-verl: out of memory in the gradient audit at step {self._step} on "
                                     "this rank only; training stops here with this rank's state as before the step")
                logger.warning("hilore-verl: out of memory in the gradient audit at step %d; audit skipped",
                               self._step)
        out, retries = self._train_with_retries(data, loss_function)
        if self.is_mp_src_rank_with_outputs():
            metrics = self.controller.metrics()
            metrics["hilore/oom_retries"] = float(retries)
            # as verl's per-micro-batch metrics: a list per key, gathered over ranks and averaged by the trainer
            out["metrics"].update({k: [v] for k, v in metrics.items()})
        return out

    def _train_with_retries(self, data, loss_function):
        """verl's train_batch. Out of device memory in a forward, backward or gradient sync, on every
        rank: put the step back (recovery.py: FSDP2 state, gradients, RNG, the runtime's seeds) and
        retry it; the first retry runs each micro-batch's own plan with kept units recomputed (bitwise
        the update the step would have made), later ones recompute every unit (the exact gradient).
        In the optimizer step: `optimizer_step` restores and retries it. A fault on some ranks only,
        any other exception, or no retry left: the step is put back and the error raised. After a
        retry, later plans are 10% tighter."""
        self._retries = 0
        start = StepStart(self.runtime)
        try:
            while True:
                self._micro_index = 0
                try:
                    return super().train_batch(data, loss_function), self._retries
                except torch.OutOfMemoryError as err:
                    if self._retries >= self.hilore.oom_retries:
                        self._fail(start, f"out of memory at step {self._step} after {self._retries} retries")
                        raise
                    message = str(err).splitlines()[0] if str(err) else "out of memory"
                except BaseException:
                    self._fail(start, None)
                    raise
                # outside the except block: the failed attempt's graph went with its traceback
                self._recover()
                self._agree_or_raise(start, message)
                start.restore()
                self._retries += 1
                self._retry_mode = "keep_to_recompute" if self._retries == 1 else "recompute"
                logger.warning("hilore-verl: %s at step %d; retry %d/%d with %s, planning 10%% tighter from now on",
                               message, self._step, self._retries, self.hilore.oom_retries,
                               "kept units recomputed" if self._retries == 1 else "every unit recomputed")
        finally:
            self._retry_mode = None
            if self._retries:
                self.controller.on_oom()  # tighten future plans (the retry planned as the failed attempt did)

    def _fail(self, start: StepStart, message: str | None) -> None:
        """A loud end to the step: everything as before it, then the caller raises."""
        self._recover()
        start.restore()
        if message is not None:
            logger.error("hilore-verl: %s; parameters, optimizer state and RNG are as before the step", message)

    def _agree_or_raise(self, start: StepStart, what: str) -> None:
        """Retry only when every rank failed here; a rank that failed alone stops the job."""
        if not every_rank_failed(self._fault_group):
            start.restore()
            raise StepFailed(f"hilore-verl: {what} at step {self._step} on this rank only (the other ranks did "
                             f"not fail within hilore.fault_timeout_s={self.hilore.fault_timeout_s} s); a retry "
                             "would pair its collectives with theirs, so training stops here with this rank's "
                             "state as before the step")

    def _recover(self) -> None:
        """Forget a failed forward / backward: runtime ready, FSDP2 state reset, no gradient left."""
        self.runtime.reset()
        reset_after_failure(self.module, self.optimizer)
        get_torch_device().empty_cache()

    def optimizer_step(self):
        """verl's optimizer step (clip + step), undone on any fault from a host snapshot taken before it;
        an out-of-memory error is then retried exactly (same gradients, same state) within oom_retries."""
        snapshot = None
        if self.hilore.step_snapshot:
            if self._snapshot is None:
                self._snapshot = StepSnapshot(self.module, self.optimizer)
            snapshot = self._snapshot.take()
        while True:
            retry = False
            try:
                return super().optimizer_step()
            except torch.OutOfMemoryError:
                if snapshot is None:
                    raise StepFailed("hilore-verl: out of memory inside the optimizer step, which may have updated "
                                     "some parameters already; with hilore.step_snapshot=false it cannot be undone: "
                                     "resume from the last checkpoint") from None
                snapshot.restore()
                if self._retries >= self.hilore.oom_retries:
                    raise
                retry = True
            except BaseException as err:
                if snapshot is None:
                    raise StepFailed(f"hilore-verl: the optimizer step failed ({type(err).__name__}) and may have "
                                     "updated some parameters already; with hilore.step_snapshot=false it cannot "
                                     "be undone: resume from the last checkpoint") from err
                snapshot.restore()
                raise
            if retry:  # outside the except block
                get_torch_device().empty_cache()
                if not every_rank_failed(self._fault_group):
                    raise StepFailed(f"hilore-verl: out of memory in the optimizer step at step {self._step} on this "
                                     "rank only; training stops here with this rank's state as before the step")
                self._retries += 1
                logger.warning("hilore-verl: out of memory in the optimizer step at step %d; state restored, "
                               "retry %d/%d", self._step, self._retries, self.hilore.oom_retries)

    def _audit(self, micro_batches):
        """Exact vs planned gradient of one micro-batch with exposure (2 extra forward + backward passes).

        The surrogate sum_t c_t log p_t measures the c part of the update, so the micro-batch is chosen
        by the L2 of c (all-reduced: the same on every rank, so every rank audits the same index) and
        its prediction uses that exposure, without the entropy bound planning adds. No micro-batch
        with exposure, or a zero exact gradient: None, and nothing is recorded or changed."""
        coefficients = [self._coefficients(mb) for mb in micro_batches]
        squares = torch.tensor([float(c.double().pow(2).sum()) for c in coefficients], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(squares, group=self.get_data_parallel_group())
        exposure_l2 = squares.sqrt().tolist()
        index = self.controller.audit_micro_batch(self._step, exposure_l2)
        if index is None:
            return None
        batch, c = micro_batches[index], coefficients[index]
        plan = self.controller.plan_micro_batch(index)
        approx = self._surrogate_gradient(self.controller.runtime_plan(plan), batch, c)
        exact = self._surrogate_gradient({}, batch, c)
        self.optimizer.zero_grad()
        return self.controller.record_audit(self._step, exact, approx, exposure_l2[index])

    def forward_step(self, micro_batch, loss_function, forward_only):
        if forward_only or self.controller is None:
            return super().forward_step(micro_batch, loss_function, forward_only)
        index, self._micro_index = self._micro_index, self._micro_index + 1
        if self._retry_mode == "recompute":
            self.runtime.set_plan({u.name: "recompute" for u in self.runtime.units})
        else:
            plan = self.controller.plan_micro_batch(index)
            if self._retry_mode == "keep_to_recompute":  # the failed attempt's plan, kept units recomputed
                self.runtime.set_plan(self.controller.runtime_plan(
                    {u: "recompute" if m == "keep" else m for u, m in plan.items()}))
        loss, output = super().forward_step(micro_batch, loss_function, forward_only)
        if self.actor_config is not None and self._retry_mode is None:
            log_prob = no_padding_2_padding(output["model_output"]["log_probs"], micro_batch)
            self.controller.after_forward(index, self._exposure_l2(micro_batch, log_prob.detach()))
        return loss, output

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        parent = super().prepare_model_outputs
        if self.runtime is None or not torch.is_grad_enabled():
            return parent(output, output_args, micro_batch, logits_processor_func)
        return self.runtime.call("head", parent, output, output_args, micro_batch, logits_processor_func)
