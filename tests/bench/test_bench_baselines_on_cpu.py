"""The bench's verl_offload baseline: its optimizer holds the parameters FSDP2 put in place, its process
group takes a free port; the GPU bench refuses method copies that cannot all stay resident."""

import socket

import pytest
import torch

from hilore_verl.bench import methods as M
from hilore_verl.bench.method import full
from hilore_verl.bench import run as R
from hilore_verl.bench import actor_update as W
from hilore_verl.bench.actor_update import BenchConfig, make_batch

TINY = BenchConfig(hidden_size=64, num_layers=2, vocab_size=256, num_groups=2, group_size=2, max_prompt_len=8,
                   max_response_len=8)


def test_verl_offload_steps_the_parameters_sharding_put_in_place(monkeypatch):
    import hilore_verl.integration.tools.verl_offload as baselines

    def fake_shard(model):  # fully_shard swaps every parameter for a new (DTensor) one
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(p.detach().clone())

    monkeypatch.setattr(baselines, "enable_verl_activation_offload", fake_shard)
    monkeypatch.setattr(M.torch.cuda, "is_available", lambda: True)  # the baseline's own CUDA check
    monkeypatch.setattr(W, "device", lambda: torch.device("cpu"))
    batch = {k: v.cpu() for k, v in make_batch(TINY).items()}
    method = M.build("verl_offload", TINY, batch)
    held = {id(p) for group in method.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in method.model.parameters()}


def test_free_port_is_bindable():
    from hilore_verl.integration.tools.launch import free_port

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_dtensor_gradient_is_gathered_whole():
    class Sharded:
        def full_tensor(self):
            return torch.ones(3)

    assert torch.equal(full(Sharded()), torch.ones(3))
    assert torch.equal(full(torch.zeros(2)), torch.zeros(2))


def test_the_gpu_bench_refuses_copies_that_cannot_stay_resident(monkeypatch):
    monkeypatch.setattr(R.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(R.torch.cuda, "mem_get_info", lambda *a: (2**20, 2**30))  # 1 MiB free
    with pytest.raises(R.WorkloadRefused, match="gpu-check"):
        R._refuse_if_resident_copies_do_not_fit(TINY, ("gc", "hilore"))


def test_master_adamw_steps_fp32_masters_and_rounds_back():
    from hilore_verl.bench.actor_update import MasterAdamW, make_optimizer, static_bytes

    torch.manual_seed(0)
    low = torch.nn.Linear(64, 32).to(torch.bfloat16)
    ref = torch.nn.Linear(64, 32)
    ref.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    opt, ref_opt = MasterAdamW(low.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(8, 64)
        low(x.bfloat16()).float().pow(2).sum().backward()
        for p, q in zip(low.parameters(), ref.parameters()):
            q.grad = p.grad.float()  # the same gradient, widened
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        for p, q in zip(low.parameters(), ref.parameters()):
            assert torch.equal(p, q.detach().to(torch.bfloat16))  # the weight is its master rounded
    assert all(p.grad is None for p in low.parameters())
    assert isinstance(make_optimizer(low, BenchConfig(master_fp32=True)), MasterAdamW)
    assert isinstance(make_optimizer(ref, BenchConfig(master_fp32=True)), torch.optim.AdamW)  # fp32: no copy
    n = sum(p.numel() for p in low.parameters())
    assert static_bytes(low, BenchConfig(master_fp32=True)) == 16 * n and static_bytes(low) == 8 * n
