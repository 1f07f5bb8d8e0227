"""Saved tensors a codec must not touch, or must take as they are laid out: per-row statistics
(attention's log-sum-exp, a norm's reciprocal RMS) are kept exact under compression and counted;
non-contiguous saved views are compressed from their values, or kept exact and counted."""

import pytest
import torch

from hilore_verl import Plan, RuntimeConfig, attach
from hilore_verl.kernels import dequantize, quantize
from hilore_verl.runtime.records import Checked, Kept
from hilore_verl.runtime.saving import RowShapes, SavedTensors, is_row_statistic
from hilore_verl.tiny.models import build_tiny_model


def _capture(monkeypatch):
    """(tensor, a copy of it at pack time, holder) for every tensor the runtime holds by a unit's plan."""
    seen, real = [], SavedTensors._store

    def store(self, t, *args, **kwargs):
        held = real(self, t, *args, **kwargs)
        seen.append((t, t.detach().clone(), held))
        return held

    monkeypatch.setattr(SavedTensors, "_store", store)
    return seen


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).mean().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_statistics_stay_exact_under_int4_and_are_counted(monkeypatch, dtype):
    """No padding mask: CPU SDPA takes its flash path, which saves an fp32 log-sum-exp (B, H, T), T a
    multiple of the group size; the norms save their reciprocal RMS (B, T, 1)."""
    B, H, T = 4, 4, 128
    model = build_tiny_model("qwen2", seed=0, dtype=dtype, hidden_size=256, num_attention_heads=H).train()
    rt = attach(model, RuntimeConfig(min_bytes=1024))  # so that per-token statistics are managed
    rt.set_plan(Plan(default="int4"))
    seen = _capture(monkeypatch)
    _step(model, torch.randint(3, 512, (B, T), generator=torch.Generator().manual_seed(0)))
    lse = [(t, copy, h) for t, copy, h in seen if tuple(t.shape) == (B, H, T)]
    rstd = [(t, copy, h) for t, copy, h in seen if t.shape[-1] == 1]
    assert len(lse) == 2 and all(t.dtype == torch.float32 for t, _, _ in lse)  # one per layer
    assert len(rstd) >= 5  # two norms per layer and the final one
    for t, copy, held in lse + rstd:
        assert isinstance(held, Kept) and torch.equal(held.get(), copy), tuple(t.shape)
    activations = [h for t, _, h in seen if t.shape[-1] in (64, 128, 256) and tuple(t.shape) != (B, H, T)]
    assert activations and all(isinstance(h, Checked) for h in activations)  # still compressed
    stats = rt.stats()
    statistic_bytes = {t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t, _, _ in lse + rstd}
    assert sum(u.statistic_bytes for u in stats.units.values()) == sum(statistic_bytes.values())
    assert all(stats.units[f"layers.{i}.attn.core"].statistic_bytes == B * H * T * 4 for i in range(2))
    assert stats.units["layers.0.attn.norm"].statistic_bytes > 0


ROWS = [(8, 4, 96, 64)]  # a per-head query (B, H, T, D) saved before


@pytest.mark.parametrize("shape, earlier, statistic", [
    ((8, 4, 96), ROWS, True),                      # SDPA flash / flash-attn: (B, H, T)
    ((8, 4, 128), ROWS, True),                     # SDPA's efficient kernel: T padded to a multiple of 32
    ((4, 768), [(768, 4, 64)], True),              # flash-attn varlen: (H, total) for a (total, H, D) query
    ((768,), [(768, 256)], True),                  # a fused norm's rstd, one per row
    ((8, 96, 1), [], True),                        # a norm's rstd with keepdim
    ((8, 4, 96, 96), ROWS, False),                 # attention probabilities
    ((8, 4, 64, 96), ROWS, False),                 # a key, transposed
    ((8, 96, 256), [(8, 96, 256)], False),         # hidden states
    ((768, 4), [(768, 256)], False),               # router probabilities
])
def test_row_statistics_are_told_from_activations(shape, earlier, statistic):
    """A statistic is a non-differentiable output (LSE, a fused norm's rstd) or a keepdim reduction: the
    same shape requiring grad (an activation autograd differentiates through) is one only with last dim 1."""
    rows = RowShapes()
    for s in earlier:
        rows.note(torch.Size(s))
    assert is_row_statistic(torch.empty(shape), rows) == statistic
    assert is_row_statistic(torch.empty(shape, requires_grad=True), rows) == (shape[-1] == 1)


class _Attention(torch.autograd.Function):
    """Causal attention with a flash-style backward from its saved log-sum-exp, saving (q, k, v, out, lse)
    in a given order: what a compiled kernel (FlexAttention) may do differently from SDPA."""

    @staticmethod
    def forward(ctx, q, k, v, scale, lse_first):
        T = q.shape[-2]
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, -1)  # (B, H, T) fp32, non-differentiable
        out = (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype)
        ctx.scale = scale
        ctx.save_for_backward(*((lse, q, k, v, out) if lse_first else (q, k, v, out, lse)))
        ctx.lse_first = lse_first
        return out

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        lse, q, k, v, out = saved if ctx.lse_first else (saved[4], *saved[:4])
        T = q.shape[-2]
        scores = (q.float() @ k.float().transpose(-1, -2)) * ctx.scale
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(scores - lse[..., None])
        g = g.float()
        dv = p.transpose(-1, -2) @ g
        ds = p * (g @ v.float().transpose(-1, -2) - (g * out.float()).sum(-1, keepdim=True))
        dq, dk = ds @ k.float() * ctx.scale, ds.transpose(-1, -2) @ q.float() * ctx.scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _attention(lse_first: bool):
    """A transformers attention function over `_Attention`."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = _Attention.apply(query, key, value, scaling, lse_first)
        return out.transpose(1, 2).contiguous(), None

    return attend


def test_a_statistic_is_kept_exact_whatever_the_order_its_op_saves_it_in(monkeypatch):
    """The attention saves its log-sum-exp before or after the query it describes (no tensor of its rows seen
    before it in the first order): either way it is held exact and counted as a statistic, the rest is
    compressed, and the gradients are bitwise the same."""
    from transformers import AttentionInterface

    B, H, T = 2, 4, 128
    ids = torch.randint(3, 512, (B, T), generator=torch.Generator().manual_seed(0))
    results = {}
    for lse_first in (True, False):
        name = f"hilore_test_lse_{'first' if lse_first else 'last'}"
        AttentionInterface.register(name, _attention(lse_first))
        model = build_tiny_model("qwen2", seed=0, hidden_size=256, num_attention_heads=H).train()
        model.config._attn_implementation = name
        rt = attach(model, RuntimeConfig(min_bytes=1024))
        rt.set_plan(Plan(default="int4"))
        seen = _capture(monkeypatch) if lse_first else seen  # noqa: F821 (the hook stays patched)
        seen.clear()
        _step(model, ids)
        lse = [(t, copy, h) for t, copy, h in seen if tuple(t.shape) == (B, H, T)]
        assert len(lse) == 2 and all(torch.equal(h.get(), copy) for _, copy, h in lse)  # one per layer, exact
        queries = [h for t, _, h in seen if tuple(t.shape) == (B, H, T, 64)]
        assert queries and all(isinstance(h, Checked) for h in queries)  # compressed
        core = [rt.stats().units[f"layers.{i}.attn.core"].statistic_bytes for i in range(2)]
        assert core == [B * H * T * 4] * 2
        results[lse_first] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


class _SavesTransposed(torch.autograd.Function):
    """SiLU that saves a transposed view of its input (a non-contiguous saved tensor)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.transpose(-1, -2))
        return torch.nn.functional.silu(x)

    @staticmethod
    def backward(ctx, grad):
        (xt,) = ctx.saved_tensors
        x = xt.transpose(-1, -2)
        s = torch.sigmoid(x)
        return grad * s * (1 + x * (1 - s))


@pytest.mark.parametrize("tokens, compressed", [(192, True), (100, False)])
def test_non_contiguous_saves_are_compressed_from_their_values_or_kept_exact(monkeypatch, tokens, compressed):
    model = build_tiny_model("qwen2", seed=0, hidden_size=256, num_attention_heads=4).train()
    for layer in model.model.layers:
        layer.mlp.act_fn = type("Act", (torch.nn.Module,), {"forward": lambda self, x: _SavesTransposed.apply(x)})()
    rt = attach(model)
    rt.set_plan(Plan(default="int8"))
    seen = _capture(monkeypatch)
    _step(model, torch.randint(3, 512, (2, tokens), generator=torch.Generator().manual_seed(0)))
    views = [(t, copy, h) for t, copy, h in seen if tuple(t.shape) == (2, 128, tokens)]
    assert len(views) == 2 and all(not t.is_contiguous() for t, _, _ in views)
    for t, copy, held in views:
        if compressed:  # grouped along its last dim, from its values in their logical order
            assert isinstance(held, Checked)
            assert torch.equal(held.get(), dequantize(quantize(copy.contiguous(), "int8", 64)))
        else:  # neither its last dim nor a flat grouping fits: kept exact, counted
            assert isinstance(held, Kept) and torch.equal(held.get(), copy)
    proj = [rt.stats().units[f"layers.{i}.mlp.proj"] for i in range(2)]
    assert all(u.incompressible == (0 if compressed else 1) for u in proj)


@pytest.mark.parametrize("width, group", [(96, 32), (100, None)])
def test_a_save_the_plans_group_does_not_fit_takes_a_finer_group_or_stays_exact(monkeypatch, width, group):
    """One sequence of an odd token count: the MLP's (1, 33, width) saves fit a group of 64 neither along
    their last dim nor over their flat elements. Width 96 fits 32: compressed with groups of 32, so whether
    a save compresses does not turn on the row count; width 100 fits none: kept exact and counted."""
    model = build_tiny_model("qwen2", seed=0, hidden_size=256, num_attention_heads=4, intermediate_size=width).train()
    rt = attach(model, RuntimeConfig(min_bytes=1024))  # so that these small saves are managed
    rt.set_plan(Plan(default="int8"))
    seen = _capture(monkeypatch)
    _step(model, torch.randint(3, 512, (1, 33), generator=torch.Generator().manual_seed(0)))
    narrow = [(copy, held) for t, copy, held in seen if t.shape[-1] == width and t.numel() == 33 * width]
    assert len(narrow) >= 4  # the activation's input and the down projection's, per layer
    for copy, held in narrow:
        if group:
            assert isinstance(held, Checked)
            assert torch.equal(held.get(), dequantize(quantize(copy, "int8", group)))
        else:
            assert isinstance(held, Kept) and torch.equal(held.get(), copy)
    assert sum(u.incompressible for u in rt.stats().units.values()) == (0 if group else len(narrow))
