"""verl's FSDP engine with HiLoRe: the runtime on the FSDP2 model and a plan per micro-batch.

Registered in verl's EngineRegistry under the backend `BACKEND` (see actor_config.py for how a
recipe selects it). Overrides as little as possible of `FSDPEngineWithLMHead`:
  - `initialize`: after verl builds and shards the model, attach the runtime (which takes over HF
    gradient checkpointing on the managed layers, and says so);
  - `train_batch`: on the first call, profile the cost table and calibrate the risk model on one
    probe micro-batch (identical on every rank: numbers are averaged over the data-parallel
    group); then, once per mini-batch, hand the controller the predicted exposure of every
    micro-batch, audit every `audit_every` steps, run verl's own train_batch (retrying with every
    unit recomputed after an out-of-memory error) and add `hilore/*` metrics;
  - `forward_step`: before each training micro-batch, apply its plan; after its forward and
    before its backward, record the risk spent from the exact coefficients;
  - `prepare_model_outputs`: the log-prob computation over the vocabulary joins the head unit;
  - `save_checkpoint` / `load_checkpoint`: the controller state rides along with verl's checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

import hilore_verl
from hilore_verl import exposure
from hilore_verl.config import HiLoReConfig
from hilore_verl.integration.actor_config import BACKEND
from hilore_verl.planner import Controller, profile
from hilore_verl.risk import GradientAudit, RiskModel, calibrate
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
        self._fallback: dict | None = None  # the all-recompute plan while retrying after an OOM

    # ------------------------------------------------------------------ set-up
    def initialize(self):
        super().initialize()
        self.runtime = hilore_verl.attach(
            self.module, hilore_verl.RuntimeConfig(min_bytes=self.hilore.min_bytes, seed=self.hilore.seed))

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
        return Controller(self.runtime, costs, risk, self.hilore.budget, static_bytes=self._static_bytes(),
                          risk_budget=self.hilore.risk_budget, group=self.get_data_parallel_group(),
                          token_bucket=self.hilore.token_bucket, audit=audit)

    def _build_controller(self, micro_batches, loss_function) -> None:
        if self._restored is not None:  # a resumed run: the saved costs and calibration, no probes
            state, self._restored = self._restored, None
            self.controller = self._make_controller(Controller.costs_from_state(state),
                                                    Controller.risk_from_state(state))
            self.controller.load_state_dict(state)
            return
        probe = micro_batches[0]
        tokens = int(probe["input_ids"].values().numel())

        def run(plan=None):
            self._run(plan, probe, loss_function)

        element = next(self.module.parameters()).element_size() if self._autocast_dtype == torch.float32 else 2
        costs = profile(self.runtime, run, tokens, element_size=element, formats=self.hilore.formats,
                        offload=self.hilore.offload, group_size=self.hilore.group_size)
        risk = None
        if self.hilore.risk_budget > 0 and self.actor_config is not None:
            # calibrate on the local micro-batch with the most exposure
            exposures = [self._coefficients(mb) for mb in micro_batches]
            best = max(range(len(micro_batches)), key=lambda i: float(exposures[i].pow(2).sum()))
            batch, c = micro_batches[best], exposures[best]
            risk = calibrate(lambda plan: self._surrogate_gradient(plan, batch, c),
                             [u.name for u in self.runtime.units], float(c.pow(2).sum().sqrt()),
                             fmts=self.hilore.formats[:1], group_size=self.hilore.group_size, model=RiskModel())
        self._average_over_ranks(costs, risk)
        self.optimizer.zero_grad()
        self.runtime.set_plan({})
        self.controller = self._make_controller(costs, risk)
        logger.warning("hilore-verl: planning under %.3f GiB (full recompute needs %.3f GiB) with %d units",
                       self.controller.memory_budget / 2**30, self.controller.gc_peak / 2**30, len(costs.units))

    def _average_over_ranks(self, costs, risk) -> None:
        """Every rank must plan from the same numbers: average the measured ones (a fixed-length
        vector on every rank; a sensitivity only where some rank measured it)."""
        if not dist.is_initialized():
            return
        names = [u.name for u in costs.units]
        values = [x for u in costs.units for x in (u.saved_bytes, u.held_bytes, u.forward_s, u.compressible)]
        values += [costs.unmanaged_bytes, costs.codec_bytes_per_s, costs.host_bytes_per_s, float(costs.tokens)]
        if risk is not None:
            for n in names:  # (sum of log sensitivity, how many ranks measured it)
                measured = n in risk.sensitivity
                values += [math.log(risk.sensitivity[n]) if measured else 0.0, float(measured)]
            values += [risk.grad_scale or 0.0, float(bool(risk.grad_scale))]
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.get_data_parallel_group())
        world = self.get_data_parallel_size()
        it = iter(t.tolist())
        for u in costs.units:
            u.saved_bytes, u.held_bytes, u.forward_s, u.compressible = (next(it) / world for _ in range(4))
        costs.unmanaged_bytes, costs.codec_bytes_per_s, costs.host_bytes_per_s = (next(it) / world for _ in range(3))
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
    STATE_FILE = "hilore_controller.pt"

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)
        if self.controller is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            os.makedirs(local_path, exist_ok=True)  # every rank holds the same state: rank 0 writes it
            torch.save(self.controller.state_dict(), os.path.join(local_path, self.STATE_FILE))

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        path = os.path.join(local_path, self.STATE_FILE)
        state = torch.load(path, weights_only=False) if os.path.exists(path) else None
        super().load_checkpoint(local_path, hdfs_path, del_local_after_load, **kwargs)
        if state is not None:
            self._restored, self.controller = state, None
        else:
            logger.warning("hilore-verl: %s has no controller state; the first step profiles and calibrates again",
                           local_path)

    # ------------------------------------------------------------------ per step
    def _coefficients(self, micro_batch, log_prob=None) -> torch.Tensor:
        """Loss coefficients of a micro-batch: predicted (on-policy) without log_prob, exact with it."""
        mask = _padded(micro_batch, "response_mask")
        old = _padded(micro_batch, "old_log_probs")
        optional = {k: _padded(micro_batch, k) for k in ("rollout_is_weights", "ref_log_prob") if k in micro_batch}
        return exposure.loss_coefficients(old if log_prob is None else log_prob, old,
                                          _padded(micro_batch, "advantages"), mask, self.actor_config, **optional)

    def _exposure_l2(self, micro_batch, log_prob=None) -> float:
        if self.actor_config is None:
            return 1.0
        return float(self._coefficients(micro_batch, log_prob).pow(2).sum().sqrt())

    def train_batch(self, data, loss_function):
        if self.actor_config is None:  # the actor worker binds ppo_loss to the actor config
            self.actor_config = getattr(loss_function, "keywords", {}).get("config")
        micro_batches = self._micro_batches(data)
        if self.controller is None:
            self._build_controller(micro_batches, loss_function)
        self._step += 1
        # once per mini-batch: predicted exposure (on-policy point) and tokens of every micro-batch
        self.controller.begin_mini_batch([self._exposure_l2(mb) for mb in micro_batches],
                                         [int(mb["input_ids"].values().numel()) for mb in micro_batches])
        audit = None
        if self.controller.audit_due(self._step) and self.actor_config is not None:
            audit = self._audit(micro_batches[0])
        out, retries = self._train_with_retries(data, loss_function)
        if self.is_mp_src_rank_with_outputs():
            metrics = self.controller.metrics()
            metrics["hilore/oom_retries"] = float(retries)
            if audit is not None:
                metrics.update(audit.metrics())
            # as verl's per-micro-batch metrics: a list per key, gathered over ranks and averaged by the trainer
            out["metrics"].update({k: [v] for k, v in metrics.items()})
        return out

    def _train_with_retries(self, data, loss_function):
        """verl's train_batch; out of device memory: retry with every unit recomputed, plan tighter after.
        (All ranks run the same plan, so they run out of memory at the same micro-batch or none does.)"""
        retries = 0
        try:
            while True:
                self._micro_index = 0
                try:
                    return super().train_batch(data, loss_function), retries
                except torch.OutOfMemoryError:
                    if retries >= self.hilore.oom_retries:
                        raise
                    retries += 1
                    self.optimizer.zero_grad(set_to_none=True)
                    get_torch_device().empty_cache()
                    self._fallback = self.controller.on_oom()
                    logger.warning("hilore-verl: out of memory at step %d; retry %d/%d with every unit recomputed, "
                                   "planning 10%% tighter from now on", self._step, retries, self.hilore.oom_retries)
        finally:
            self._fallback = None

    def _audit(self, micro_batch):
        """Exact vs planned gradient of one micro-batch (2 extra forward + backward passes)."""
        c = self._coefficients(micro_batch)
        plan = self.controller.plan_micro_batch(0)
        approx = self._surrogate_gradient(self.controller.runtime_plan(plan), micro_batch, c)
        exact = self._surrogate_gradient({}, micro_batch, c)
        self.optimizer.zero_grad()
        return self.controller.record_audit(self._step, exact, approx, self.controller.exposure_l2(0))

    def forward_step(self, micro_batch, loss_function, forward_only):
        if forward_only or self.controller is None:
            return super().forward_step(micro_batch, loss_function, forward_only)
        index, self._micro_index = self._micro_index, self._micro_index + 1
        if self._fallback is None:
            self.controller.plan_micro_batch(index)
        loss, output = super().forward_step(micro_batch, loss_function, forward_only)
        if self.actor_config is not None and self._fallback is None:
            log_prob = no_padding_2_padding(output["model_output"]["log_probs"], micro_batch)
            self.controller.after_forward(index, self._exposure_l2(micro_batch, log_prob.detach()))
        return loss, output

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        parent = super().prepare_model_outputs
        if self.runtime is None or not torch.is_grad_enabled():
            return parent(output, output_args, micro_batch, logits_processor_func)
        return self.runtime.call("head", parent, output, output_args, micro_batch, logits_processor_func)
