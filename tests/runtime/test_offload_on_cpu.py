"""The runtime's asynchronous-device paths, run on the CPU: the host offload pool, and the inf / nan
check of compressed tensors deferred until its result reaches the host (CUDA's path, forced here)."""

import random
import weakref

import pytest
import torch

import hilore_verl.runtime.saving as saving
from hilore_verl import Plan, UnitPlan, attach
from hilore_verl.runtime import Mode
from hilore_verl.runtime.offload import OffloadPool
from hilore_verl.runtime.finite_checks import Unchecked
from hilore_verl.runtime.records import Checked
from hilore_verl.tiny.models import build_tiny_model
from hilore_verl.tiny.workload import make_grpo_batch
from tests.harness.models import WORKLOAD

IN_PLACE = Plan(default=UnitPlan(Mode.COMPRESS, fmt="int8"))
OFFLOAD = Plan(default=UnitPlan(Mode.COMPRESS, fmt="int8", offload=True))


def _model():
    # head_dim 64: per-head q / k / v codes have as many elements as the hidden states' (other shapes)
    return build_tiny_model("qwen2", seed=0, hidden_size=256, num_attention_heads=4).train()


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _ids(batch, tokens, seed):
    return torch.randint(3, 512, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def test_offload_runs_a_second_step_with_equal_sized_payloads_of_other_shapes():
    model = _model()
    rt = attach(model)
    ids = _ids(2, 96, 0)
    rt.set_plan(IN_PLACE)
    in_place = _step(model, ids)
    rt.set_plan(OFFLOAD)
    for _ in range(2):  # the second step reuses the first one's host buffers for other shapes
        offloaded = _step(model, ids)
        assert all(torch.equal(offloaded[n], g) for n, g in in_place.items())


def test_offload_pool_stays_bounded_under_varying_token_counts(monkeypatch):
    model = _model()
    rt = attach(model)
    pool_offload, need = OffloadPool.offload, [0]

    def counting(self, payload, shape):  # the bytes a step offloads, counted apart from the pool
        need[0] += payload.codes.numel() * payload.codes.element_size() + payload.scales.numel() * 4
        return pool_offload(self, payload, shape)

    monkeypatch.setattr(OffloadPool, "offload", counting)
    rng, needs, held = random.Random(0), [], []
    for step in range(20):
        ids = _ids(rng.randint(1, 4), rng.randint(8, 160), step)
        rt.set_plan(IN_PLACE)
        in_place = _step(model, ids)
        rt.set_plan(OFFLOAD)
        need[0] = 0
        offloaded = _step(model, ids)
        assert all(torch.equal(offloaded[n], g) for n, g in in_place.items()), step
        pool = rt.saving.pools[torch.device("cpu")]
        needs.append(need[0])
        held.append(pool.held_bytes)
        stats = rt.stats()
        assert (stats.offload_pool_bytes, stats.offload_pool_peak_bytes) == (pool.held_bytes, pool.peak_bytes)
        assert pool.in_use_bytes == 0  # every buffer came back once its graph was freed
    assert max(held) <= 2 * max(needs) and pool.peak_bytes <= 2 * max(needs), (held, needs, pool.peak_bytes)
    assert stats.offload_pool_peak_bytes > 0 and "offload pool" in stats.table()


class _Event:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


def test_pool_reuses_a_buffer_once_its_copy_completed_and_holds_no_more_than_its_peak_in_use():
    pool = OffloadPool(torch.device("cpu"))
    a, b = pool.acquire(3000), pool.acquire(4096)
    assert a.dtype == torch.uint8 and a.numel() == b.numel() == 4096  # size classes: powers of two
    assert pool.allocated == 2 and pool.in_use_bytes == pool.held_bytes == pool.peak_bytes == 8192
    pool.release(a, _Event(done=False))
    pool.release(b, _Event(done=True))
    c = pool.acquire(2049)  # the same class: b, whose copy completed, not a
    assert c.data_ptr() == b.data_ptr() and pool.allocated == 2
    pool.acquire(2500)  # a's copy still runs: a new buffer, and a is freed (the pool stays at its peak)
    assert pool.allocated == 3 and pool.held_bytes == pool.peak_bytes == 8192 and pool.idle_bytes == 0
    pool.release(c, None)
    big = pool.acquire(6000)  # a new class: idle buffers are freed first, oldest first
    assert big.numel() == 8192 and pool.held_bytes == pool.peak_bytes == 12288
    pool.release(big, None)
    assert pool.in_use_bytes == 4096 and pool.idle_bytes == 8192


# ------------------------------------------------------------------ the deferred inf / nan check

class _DeviceReads(torch.Tensor):
    """Payload flags that count every read of their data by the host (a device sync on CUDA)."""

    reads: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__",
                                             "numpy", "cpu", "nonzero"):
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def _counting_setup(monkeypatch, lagging: bool):
    """Deferred checks forced on; flags count host reads; events and syncs counted; a lagging device's
    events complete only once waited for. Returns (log, recorded Checked holders)."""
    monkeypatch.setattr(saving, "defers_checks", lambda device: True, raising=False)
    real_quantize, log, holders = saving.quantize, {"syncs": 0}, []

    def quantize(*args, **kwargs):
        q = real_quantize(*args, **kwargs)
        q.flags = q.flags.as_subclass(_DeviceReads)
        return q

    class Recording(Checked):
        def __init__(self, *args):
            super().__init__(*args)
            holders.append(weakref.ref(self))

    class Event(torch.cpu.Event):
        def __init__(self, *args, **kwargs):
            self.waited = False

        def query(self):
            return self.waited or not lagging

        def synchronize(self):
            log["syncs"] += 1
            self.waited = True

    monkeypatch.setattr(saving, "quantize", quantize)
    monkeypatch.setattr(saving, "Checked", Recording)
    monkeypatch.setattr(torch.cpu, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.__setitem__("syncs", log["syncs"] + 1))
    _DeviceReads.reads = []
    return log, holders


def _forward_loss(model):
    batch = make_grpo_batch(WORKLOAD, seed=0)  # padded: the attention core saves the -inf mask
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits
    return torch.log_softmax(logits.float(), -1)[..., 7].mean()


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("offload", [False, True], ids=["in_place", "offload"])
@pytest.mark.parametrize("lagging", [False, True], ids=["device_done", "device_lagging"])
def test_deferred_check_reads_nothing_in_forward_and_keeps_non_finite_tensors_exact(monkeypatch, lagging, offload):
    plan = OFFLOAD if offload else IN_PLACE
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model)
    rt.set_plan(plan)
    immediate = _grads(model, _forward_loss(model))  # the CPU's path: checked at pack time
    expected = rt.stats()
    assert {n for n, u in expected.units.items() if u.nonfinite} == {"layers.0.attn.core", "layers.1.attn.core"}

    log, holders = _counting_setup(monkeypatch, lagging)
    loss = _forward_loss(model)
    assert _DeviceReads.reads == [] and log["syncs"] == 0  # no host read, no wait, in the forward
    deferred = [h() for h in holders if h() is not None and isinstance(h().held, Unchecked)]
    assert deferred
    if lagging:  # nothing has landed yet: tensor and payload both held
        assert all(h.held.tensor is not None and h.held.payload is not None for h in deferred)
    stats = rt.stats()  # resolves every pending check first
    assert all((h.held.tensor is None) != (h.held.payload is None) for h in deferred)  # one of the two
    exact = [h for h in deferred if h.held.payload is None]
    assert len(exact) == 2 and all(not torch.isfinite(h.held.tensor).all() for h in exact)
    for name, unit in expected.units.items():
        got = stats.units[name]
        assert (got.saved_bytes, got.stored_bytes, got.nonfinite) == \
            (unit.saved_bytes, unit.stored_bytes, unit.nonfinite), name
    grads = _grads(model, loss)
    assert all(torch.equal(grads[n], g) for n, g in immediate.items())
    assert _DeviceReads.reads == []


def test_deferred_check_is_resolved_at_unpack_when_nothing_asked_before(monkeypatch):
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model)
    rt.set_plan(IN_PLACE)
    immediate = _grads(model, _forward_loss(model))
    expected = rt.stats()
    log, _ = _counting_setup(monkeypatch, lagging=True)
    grads = _grads(model, _forward_loss(model))  # backward waits for each check it meets
    assert log["syncs"] > 0 and all(torch.equal(grads[n], g) for n, g in immediate.items())
    stats = rt.stats()
    assert all((stats.units[n].stored_bytes, stats.units[n].nonfinite) == (u.stored_bytes, u.nonfinite)
               for n, u in expected.units.items())


def test_deferred_check_corrects_a_tensor_held_only_for_a_recompute(monkeypatch):
    """A projection output no op saves, held compressed for the attention core's re-run, holding inf."""
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model)
    rt.set_plan({"layers.0.attn.proj": "int8", "layers.0.attn.core": "recompute"})
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda mod, args, out: out.index_fill(-1, torch.tensor([3]), float("inf")), prepend=True)
    immediate = _grads(model, _forward_loss(model))
    expected = rt.stats().units["layers.0.attn.proj"]
    assert expected.held_bytes > 0
    _counting_setup(monkeypatch, lagging=True)
    loss = _forward_loss(model)
    assert rt.stats().units["layers.0.attn.proj"] == expected
    grads = _grads(model, loss)
    for name, g in immediate.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, equal_nan=True)


def test_landed_checks_let_their_exact_copies_go_by_the_forward_s_end(monkeypatch):
    """A device that keeps up: every check has landed by the end of the unit that made it, so no exact
    copy beside a payload lives into the next units (nor through the head and loss)."""
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model)
    rt.set_plan(IN_PLACE)
    log, holders = _counting_setup(monkeypatch, lagging=False)
    loss = _forward_loss(model)  # its graph holds the saved tensors
    deferred = [h() for h in holders if h() is not None and isinstance(h().held, Unchecked)]
    assert deferred and all((h.held.tensor is None) != (h.held.payload is None) for h in deferred)
    assert rt.saving.pending_exact == 0 and log["syncs"] == 0 and rt.host_waits == 0
    loss.backward()


def test_pending_exact_copies_are_capped_by_waiting_for_the_oldest(monkeypatch):
    """A device far behind the host: once the exact copies held beside payloads pass the cap, the oldest
    check is waited for (counted in host_waits), so they never grow past the cap by more than one tensor."""
    model = build_tiny_model("qwen2", seed=0).train()
    rt = attach(model)
    rt.set_plan(IN_PLACE)
    immediate = _grads(model, _forward_loss(model))
    cap = 64 * 1024
    monkeypatch.setattr(saving, "PENDING_EXACT_BYTES", cap)
    log, _ = _counting_setup(monkeypatch, lagging=True)
    most = []
    settle = type(rt.saving).settle_checks

    def watched(self, wait):
        settle(self, wait)
        most.append(self.pending_exact)

    monkeypatch.setattr(type(rt.saving), "settle_checks", watched)
    loss = _forward_loss(model)
    assert log["syncs"] > 0 and rt.host_waits == log["syncs"]
    assert most and max(most) <= cap  # after every settling pass; a new save adds at most one tensor
    grads = _grads(model, loss)
    assert all(torch.equal(grads[n], g) for n, g in immediate.items())
