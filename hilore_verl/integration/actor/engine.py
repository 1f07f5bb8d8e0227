"""verl's FSDP engine with HiLoRe: the runtime on the FSDP2 model and a plan per micro-batch.

Registered in verl's EngineRegistry under the backend `BACKEND` (see config.py for how a
recipe selects it). Overrides as little as possible of `FSDPEngineWithLMHead`:
  - `initialize`: Inductor's compile workers limited to the rank's share of the node's CPUs
    (compile_workers.py); after verl builds and shards the model, attach the runtime (which takes over HF
    gradient checkpointing on the managed layers, and says so);
  - `train_batch`: split the mini-batch as verl does and hand it to the session (session.py: probing
    and calibration on the first call, the plan per micro-batch, the audit, out-of-memory retries),
    which runs verl's own train_batch; add its `hilore/*` metrics;
  - `forward_step`: the session applies each training micro-batch's plan before its forward and, after
    it, gets the exact exposure as a deferred computation: nothing in it reads device data (the
    controller computes and reads every micro-batch's with the mini-batch's metrics);
  - `optimizer_step`: verl's, under a host snapshot of parameters and optimizer state taken when the
    mini-batch started (queued on a side stream, overlapped with the passes) that undoes a fault inside it;
  - `prepare_model_outputs`: the log-prob computation over the vocabulary joins the head unit;
  - `save_checkpoint` / `load_checkpoint`: the controller state rides along with verl's checkpoint
    (`hilore_controller.json`: plain JSON, validated on load; a bad file re-profiles).

`VerlPasses` (passes.py) is what the session asks of verl (forward + backward passes); batch.py
reads verl's batch (tokens, loss coefficients, exposure: `LossTerms`); `collectives.py` holds the
data-parallel reductions. This file decides nothing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist

import hilore_verl
from hilore_verl.loss import skip
from hilore_verl.training.config import HiLoReConfig
from hilore_verl.integration.actor.collectives import collectives_for
from hilore_verl.integration.actor.compile_workers import limit_compile_workers
from hilore_verl.integration.actor.controller_file import read_controller_state, write_controller_state
from hilore_verl.integration.actor.device_memory import compute_device
from hilore_verl.integration.actor.batch import LossTerms, chunks, vocab_size, zero_exposure
from hilore_verl.integration.actor.passes import VerlPasses
from hilore_verl.integration.actor.loss import batch_skip_refusal, skip_refusal
from hilore_verl.integration.actor.shared_check import self_check
from hilore_verl.integration.actor.shared_prompt import SharedPrompt, unsupported_model
from hilore_verl.training.snapshots import StepSnapshot
from hilore_verl.training.session import Session
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.utils.seqlen_balancing import rearrange_micro_batches
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

logger = logging.getLogger("hilore_verl")


def check_codec_device(config: HiLoReConfig, device: torch.device) -> bool:
    """At start-up, not at the first compressed tensor: can Triton launch its codecs on `device`? When it
    cannot, `kernels.triton_status` logs one line naming what is missing (C compiler, Python.h, libcuda)
    and the torch reference codec runs on the device instead. True when nothing is in the way."""
    if device.type != "cuda" or config.risk_budget <= 0:  # no Triton there, or nothing will be compressed
        return True
    from hilore_verl.kernels import triton_status

    return triton_status(device)[0]


BACKEND = "hilore_fsdp2"
"""verl's EngineRegistry backend key of HiLoReFSDPEngine (verl's own FSDP2 engine is under "fsdp2"). A recipe
selects it through HiLoReActorConfig (config.py), whose engine config carries this key."""


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
        self.loss_terms = LossTerms(lambda: vocab_size(self.model_config, self.module), actor_config)
        self.runtime = None
        self.session: Session | None = None
        self._snapshot: StepSnapshot | None = None  # host buffers of the optimizer-step snapshot, reused
        self._taken: StepSnapshot | None = None  # the snapshot of the mini-batch in train_batch now
        self._refusals: set[str] = set()  # why zero-exposure sequences were not skipped, each said once
        self._shared: SharedPrompt | None = None  # hilore.shared_prompt: each group's prompt once

    @property
    def actor_config(self):
        """verl's actor config, for the loss coefficients (integration/actor/batch.py)."""
        return self.loss_terms.actor_config

    @actor_config.setter
    def actor_config(self, config) -> None:
        self.loss_terms.actor_config = config

    @property
    def controller(self):
        return self.session.controller if self.session is not None else None

    def initialize(self):
        limit_compile_workers()  # before anything compiles: one node's ranks share its CPUs
        super().initialize()
        self.runtime = hilore_verl.attach(self.module, self.hilore.runtime_config())
        self.session = Session(self.hilore, self.runtime, VerlPasses(self),
                               collectives_for(self.get_data_parallel_group(), self.hilore.fault_timeout_s))
        check_codec_device(self.hilore, compute_device())
        if self.hilore.shared_prompt:
            why = unsupported_model(self.module)
            if why is None:
                self._shared = SharedPrompt.install(self.module, self.ulysses_sequence_parallel_size)
            else:
                logger.warning("hilore-verl: shared_prompt is off for this model: %s", why)

    # ------------------------------------------------------------------ the model's inputs and outputs
    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if self._shared is not None:
            model_inputs, output_args = self._shared.rewrite(micro_batch, model_inputs, output_args)
        return model_inputs, output_args

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)
        state = self.session.state_dict() if self.session is not None else None
        if state is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            write_controller_state(state, local_path)  # every rank holds the same state

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        if self.session is None:
            raise RuntimeError("hilore-verl: load_checkpoint before initialize")
        state = self._read_state(local_path)  # before verl's load, which may delete local_path
        super().load_checkpoint(local_path, hdfs_path, del_local_after_load, **kwargs)
        self.session.restore(state)  # no state: the first step profiles and calibrates

    def _read_state(self, local_path) -> dict | None:
        """The controller state saved with the checkpoint at `local_path`, checked against this model's
        units (controller_file.py); None when there is none or it is refused (said once, in the log)."""
        group = self.get_data_parallel_group() if dist.is_initialized() else None
        return read_controller_state(local_path, [u.name for u in self.runtime.units], group)

    # ------------------------------------------------------------------ per step
    def train_batch(self, data, loss_function):
        """One mini-batch through the session (session.py); a fault leaves the engine as before the
        call, or is retried exactly."""
        bound = getattr(loss_function, "keywords", {}).get("config")  # the actor worker binds ppo_loss to it
        self.actor_config = bound if bound is not None else self.actor_config
        self.session.passes.loss_function = loss_function
        self._taken = self._take_snapshot()  # before the first forward: overlapped with the passes
        if self._shared is not None:
            self._shared.take_metrics()  # this mini-batch's only (not the log-prob passes' before it)
        try:
            self.loss_terms.check(data)
            micro_batches, indices, layout = self._split(data, loss_function)
            out, metrics = self.session.train(micro_batches,
                                              lambda: self._train_step(data, micro_batches, indices, loss_function),
                                              [int(mb["input_ids"].values().numel()) for mb in micro_batches])
        finally:
            self._taken = None
            if self._shared is not None:
                self._shared.forget_split()
        if self.is_mp_src_rank_with_outputs():
            # as verl's per-micro-batch metrics: a list per key, gathered over ranks and averaged by the trainer
            metrics.update(layout.metrics() if layout is not None else {})
            if self._shared is not None:
                metrics.update(self._shared.take_metrics())
            elif self.hilore.shared_prompt:  # configured, but this model cannot be served
                metrics["hilore/shared_prompt_on"] = 0.0
            out["metrics"].update({k: [v] for k, v in metrics.items()})
        return out

    # ------------------------------------------------------------------ micro-batches
    def _split(self, data, loss_function):
        """verl's loss normalisation over the whole mini-batch and its micro-batches (forward_backward_batch's
        split), with the sequences that have no loss term left out (skip.py) where that is exact.
        Returns (micro-batches, verl's reorder indices or None, the skip's Layout or None)."""
        tu.maybe_fix_3d_position_ids(data)  # what BaseEngine.train_batch does first
        group = self.get_data_parallel_group()
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        tokens = data["loss_mask"].sum().to(get_device_id())  # over every sequence, as stock verl counts them
        dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item(), dp_size=self.get_data_parallel_size())
        layout = None
        if self._skips(data, loss_function):
            forming, at_least = skip.Forming(*zero_exposure(data), self.session.collectives), 1
            while at_least is not None:  # this rank's split of its kept sequences, agreed over ranks
                at_least = forming.offer(self._split_kept(data, forming.kept, at_least) if forming.kept else [])
            layout = forming.layout
            if layout.micro_batches is not None:
                return [tu.index_select_tensor_dict(data, i) for i in layout.micro_batches], None, layout
        if self._shared is not None:  # each group's sequences in one micro-batch where verl's bounds allow
            parts = self._shared.agreed_split(data, self.session.collectives)
            if parts is not None:
                return [tu.index_select_tensor_dict(data, p) for p in parts], parts, layout
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        return micro_batches, indices, layout

    def _skips(self, data, loss_function) -> bool:
        """Whether this mini-batch's zero-exposure sequences may be left out; a refusal is said once."""
        if not self.hilore.skip_zero_exposure:
            return False
        reason = skip_refusal(self.actor_config, loss_function) or batch_skip_refusal(self.actor_config, data)
        if reason is not None and reason not in self._refusals:
            self._refusals.add(reason)
            logger.warning("hilore-verl: hilore.skip_zero_exposure is on, but every sequence is trained: %s", reason)
        return reason is None

    def _split_kept(self, data, kept: list[int], at_least: int) -> list[list[int]]:
        """verl's split of the sequences `kept` on this rank alone, into at least `at_least` micro-batches
        (groups together, with the shared-prompt layout)."""
        parts = self._shared.split(data, kept, at_least) if self._shared is not None else None
        if parts is not None:
            return parts
        if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            return chunks(kept, int(data["micro_batch_size_per_gpu"]), at_least)
        sub = tu.index_select_tensor_dict(data, kept)
        sp = tu.get_non_tensor_data(data=data, key="sp_size", default=1)
        _, parts = rearrange_micro_batches(sub, max_token_len=data["max_token_len_per_gpu"] * sp, dp_group=None,
                                           same_micro_num_in_dp=False, min_num_micro_batch=at_least)
        return [[kept[j] for j in part] for part in parts]

    def _train_step(self, data, micro_batches, indices, loss_function):
        """verl's train_batch (BaseEngine.train_batch around FSDPEngine.forward_backward_batch's loop) over
        the micro-batches `_split` formed: zero grads, forward + backward each under verl's gradient-sync
        context, the optimizer step."""
        self.optimizer_zero_grad()
        keep_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        scaler = getattr(self, "scaler", None)
        outputs = []
        for i, micro_batch in enumerate(micro_batches):
            with (self._gradient_sync_context(is_last_micro_batch=i == len(micro_batches) - 1),
                  torch.profiler.record_function(f"micro_batch{i}")):
                loss, meta = self.forward_step(micro_batch, loss_function=loss_function, forward_only=False)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                if not keep_output:
                    meta.pop("model_output", None)
            outputs.append(meta)
        out = postprocess_batch_func(output_lst=outputs, indices=indices, data=data)
        grad_norm = self.optimizer_step()
        if self.is_mp_src_rank_with_outputs():
            out["metrics"]["grad_norm"] = grad_norm
        return out

    def _take_snapshot(self) -> StepSnapshot | None:
        if not self.hilore.step_snapshot:
            return None
        if self._snapshot is None:
            self._snapshot = StepSnapshot(self.module, self.optimizer)
        return self._snapshot.take()

    def optimizer_step(self):
        """verl's optimizer step (clip + step), undone on any fault from the snapshot of the mini-batch
        (taken now when called outside train_batch)."""
        snapshot = self._taken if self._taken is not None else self._take_snapshot()
        if snapshot is not None:
            snapshot.before_step()  # the device waits for the copies; the host does not
        return self.session.optimizer_step(super().optimizer_step, snapshot)

    def plain_forward_step(self, micro_batch, loss_function):
        """verl's training forward_step, without the session's hooks (probes, audits)."""
        with self._shared_scope():
            return super().forward_step(micro_batch, loss_function, forward_only=False)

    def forward_step(self, micro_batch, loss_function, forward_only):
        if self._shared is not None and self._shared.check_due:
            self_check(self._shared, micro_batch, lambda on: self._log_probs(micro_batch, on),
                       getattr(self, "_autocast_dtype", torch.bfloat16), self.session.collectives)
        with self._shared_scope():
            if forward_only or self.controller is None:
                return super().forward_step(micro_batch, loss_function, forward_only)
            index = self.session.before_forward()
            loss, output = super().forward_step(micro_batch, loss_function, forward_only)
            if self.session.records_risk():
                self.session.after_forward(index, self.loss_terms.exact_exposure(micro_batch, output))
            return loss, output

    def _log_probs(self, micro_batch, shared: bool) -> torch.Tensor:
        """The micro-batch's log-probs [tokens] from verl's forward alone, shared or in the ordinary layout."""
        with self._shared_scope(), (self._shared.trial() if shared else contextlib.nullcontext()):
            _, output = super().forward_step(micro_batch, None, forward_only=True)
        return output["model_output"]["log_probs"].values()

    def _shared_scope(self):
        """One step's shared-prompt layout (integration/shared_prompt.py), when hilore.shared_prompt is on."""
        return self._shared.scope() if self._shared is not None else contextlib.nullcontext()

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        if self._shared is not None:  # the shared layout's logits laid out as verl's packed row
            self._shared.restore(output, output_args)
        parent = super().prepare_model_outputs
        if self.runtime is None or not torch.is_grad_enabled():
            return parent(output, output_args, micro_batch, logits_processor_func)
        return self.runtime.call("head", parent, output, output_args, micro_batch, logits_processor_func)
