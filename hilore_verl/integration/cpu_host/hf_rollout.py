"""A rollout backend for hosts without an accelerator: Hugging Face `generate` behind verl's server API.

verl 0.9.1 generates with vLLM, SGLang or TensorRT-LLM, none of which runs on a CPU. On a CPU host
the plugin registers this backend as `actor_rollout_ref.rollout.name=hf` (for CPU development and
tests; on an accelerator host the name is refused at start-up and vLLM stays the choice).

It has verl's two rollout halves:

    trainer process                        actor worker, rank r (FSDP)
    LLMServerManager                       HFGenerateAdapter (verl's `self.rollout`)
      HFGenerateReplica, one per replica     update_weights(): full tensors after every update
        HFGenerateServer (Ray actor, CPU) <--- load_weights(), from the replica's rollout rank 0
          generate(prompt_ids, sampling_params) -> TokenOutput(token_ids, log_probs)

A replica is `tensor * data * pipeline` parallel ranks, as for vLLM; here those sizes only group
ranks: each replica is one process holding a full fp32 copy of the policy. The copy is loaded from
`model.path` at start and replaced by the actor's weights on every sync, as verl syncs vLLM's, so
generation always samples from the policy being trained.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

def _server_name(replica_rank: int, suffix: str = "") -> str:
    return f"hilore_hf_rollout_{replica_rank}{suffix}"


def _model_config(model_config):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig

    if isinstance(model_config, HFModelConfig):
        return model_config
    return omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)


class HFGenerateServer:
    """One replica's generator: a full copy of the policy and `transformers` generate, one request at a
    time (requests wait on a lock; the HF model is not shared between threads)."""

    def __init__(self, config, model_config, replica_rank: int):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.model_config = _model_config(model_config)
        self.replica_rank = replica_rank
        self.global_steps: Optional[int] = None
        path = self.model_config.local_path or self.model_config.path
        overrides = dict(self.model_config.override_config or {})
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=self.model_config.trust_remote_code,
            attn_implementation=overrides.get("attn_implementation", "sdpa")).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else (self.eos_token_ids or [0])[0]
        self.rng = torch.Generator().manual_seed(int(config.seed) + replica_rank)
        self.lock = asyncio.Lock()
        self.requests = 0

    def describe(self) -> dict:
        return {"replica_rank": self.replica_rank, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "parameters": sum(p.numel() for p in self.model.parameters())}

    async def load_weights(self, named: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> int:
        """Replace the copy's weights with the actor's (HF state-dict names). Every tensor of the copy
        must arrive, or share its storage with one that does (tied embeddings); a name the copy lacks is
        an error. Returns how many tensors were loaded."""
        async with self.lock:
            own = self.model.state_dict(keep_vars=True)  # tied weights appear under each of their names
            unknown = sorted(set(named) - set(own))
            if unknown:
                raise KeyError(f"hf rollout: the actor sent weights the model does not have: {unknown[:5]}")
            arrived = {id(own[n]) for n in named}
            missing = sorted(n for n in own if n not in named and id(own[n]) not in arrived)
            if missing:
                raise KeyError(f"hf rollout: the actor's weights miss {missing[:5]}: the copy would be stale")
            with torch.no_grad():
                for name, tensor in named.items():
                    own[name].copy_(tensor.to(own[name].dtype))
            if global_steps is not None:
                self.global_steps = global_steps
            return len(named)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _max_tokens(self, n_prompt: int, params: dict) -> int:
        room = (self.config.max_model_len or self.config.prompt_length + self.config.response_length) - n_prompt
        if room < 1:
            raise ValueError(f"hf rollout: a prompt of {n_prompt} tokens leaves no room to generate")
        wanted = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if wanted is None:
            wanted = min(self.config.response_length,
                         self.config.prompt_length + self.config.response_length - n_prompt)
        return max(1, min(int(wanted), room))

    def _generate(self, prompt_ids: list[int], params: dict) -> TokenOutput:
        from transformers import GenerationConfig

        max_tokens = self._max_tokens(len(prompt_ids), params)
        temperature = float(params.get("temperature", 1.0))
        top_k, top_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0))
        sample = temperature > 0 and top_k != 1
        ignore_eos = bool(params.get("ignore_eos", False))
        gen = GenerationConfig(
            max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else 0, do_sample=sample,
            temperature=temperature if sample else 1.0, top_k=max(top_k, 0) if sample else 0,
            top_p=top_p if sample else 1.0, repetition_penalty=float(params.get("repetition_penalty", 1.0)),
            eos_token_id=self.eos_token_ids or None, pad_token_id=self.pad_token_id,
            return_dict_in_generate=True, output_scores=True, output_logits=True)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        torch_state = torch.get_rng_state()
        torch.set_rng_state(self.rng.get_state())  # transformers samples from torch's global generator
        try:
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        finally:
            self.rng.set_state(torch.get_rng_state())
            torch.set_rng_state(torch_state)
        tokens = out.sequences[0, len(prompt_ids):]  # [T]; batch of one: generation stops at EOS, no padding
        log_probs = None
        if params.get("logprobs"):
            processed = str(self.config.logprobs_mode).startswith("processed")
            steps = torch.stack(out.scores if processed else out.logits)[:, 0].float()  # [T, V]
            log_probs = torch.log_softmax(steps, -1).gather(-1, tokens[:, None])[:, 0].tolist()
        return TokenOutput(token_ids=tokens.tolist(), log_probs=log_probs, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str, image_data=None,
                       video_data=None, audio_data=None, mm_processor_kwargs=None, **kwargs) -> TokenOutput:
        if any(x is not None for x in (image_data, video_data, audio_data)):
            raise NotImplementedError("hf rollout: text only (no image, video or audio inputs)")
        from verl.utils import normalize_token_ids

        prompt_ids = list(normalize_token_ids(prompt_ids))
        async with self.lock:
            self.requests += 1
            return await asyncio.to_thread(self._generate, prompt_ids, dict(sampling_params))

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    # verl's server lifecycle. Weights and cache live in host memory for the run: nothing to free or
    # resume, and a request runs to its end (no partial rollout).
    async def wake_up(self, tags: Optional[list[str]] = None):
        pass

    async def sleep(self):
        pass

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        pass

    async def clear_kv_cache(self):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass

    async def wait_for_requests_to_drain(self):
        async with self.lock:
            pass


class HFGenerateReplica(RolloutReplica):
    """verl's replica for the hf backend: one `HFGenerateServer` on the node of the replica's first rank."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        node_id = ray.get_runtime_context().get_node_id()
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda w: ray.get_runtime_context().get_node_id())
        kind = "_reward" if self.is_reward_model else "_teacher" if self.is_teacher_model else ""
        name = _server_name(self.replica_rank, kind + self.name_suffix)
        strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        server = ray.remote(HFGenerateServer).options(
            name=name, num_cpus=0, scheduling_strategy=strategy, max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        await server.describe.remote()  # the model is loaded
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"ray-actor://{name}"  # no HTTP endpoint: token-in, token-out through Ray


class HFGenerateAdapter(BaseRollout):
    """The actor worker's side (verl's `self.rollout`): ships the actor's full weights to its replica's
    server after every update. Every rank consumes the weights (gathering them is collective)."""

    def __init__(self, config, model_config, device_mesh, *args, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.sleep_level = 2

    async def resume(self, tags: list[str]):
        pass

    async def release(self):
        pass

    async def update_weights(self, weights, wire_format: str = "named_tensors", peft_config=None,
                             global_steps: Optional[int] = None, **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout: weights arrive as named tensors, not {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError("hf rollout: LoRA adapters are synced merged only "
                                      "(actor_rollout_ref.model.lora.merge=true)")
        named = {}
        for name, tensor in weights:
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            named[name] = tensor.detach().to("cpu", copy=True)
        if self.rollout_rank == 0:
            server = ray.get_actor(_server_name(self.replica_rank))
            await server.load_weights.remote(named, global_steps)

