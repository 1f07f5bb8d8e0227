"""The memory model's terms on hand-made cost tables: the head's rows, the weight copies, the two phases'
transients and what a plan's backward regenerates (planner/costs.py, Controller.predicted_peak)."""

import pytest

from hilore_verl.planner import BudgetConfig, Controller, CostTable, Tokens, UnitProfile
from hilore_verl.runtime import KEEP, RECOMPUTE, UnitPlan

INT8 = UnitPlan.parse("int8")


def _table(**kwargs) -> CostTable:
    """Two layers of two units and a head, probed at 100 tokens of which 40 were the head's rows."""
    units = [UnitProfile(f"layers.{i}.{part}", saved, 0.0, 1e-3, fixed_bytes=copies)
             for i in range(2) for part, saved, copies in (("attn", 1000.0, 50.0), ("mlp", 3000.0, 0.0))]
    units.append(UnitProfile("head", 800.0, 100.0, 1e-3, element_size=4.0, fixed_bytes=70.0))
    return CostTable(units, tokens=100, unmanaged_bytes=0.0, head_rows=40, **kwargs)


def _all(table, plan):
    return {u.name: plan for u in table.units}


def test_the_head_follows_its_rows_and_the_layers_their_tokens():
    table = _table()
    head, mlp = table.units[-1], table.units[1]
    assert table.saved(head, Tokens(300, head=120)) == pytest.approx(800.0 * 3)  # 120 / 40 rows
    assert table.saved(head, Tokens(300, head=60)) == pytest.approx(800.0 * 1.5)  # fewer responses per token
    assert table.saved(mlp, Tokens(300, head=60)) == pytest.approx(3000.0 * 3)  # 300 / 100 tokens
    assert table.saved(head, 300) == pytest.approx(800.0 * 3)  # a plain count: the probe's share
    assert table.scale(Tokens(300, head=None), head) == 3.0  # the host said nothing: the tokens
    without = _table()
    without.head_rows = 0  # a probe without head rows: the tokens, whatever the micro-batch says
    assert without.saved(head, Tokens(300, head=60)) == pytest.approx(800.0 * 3)
    assert Tokens(300, head=60) + 1 == 301 and Tokens(7, 3).head == 3


def test_weight_copies_are_fixed_and_held_unless_recomputed():
    table = _table()
    attn = table.units[0]
    for tokens in (100, 400):
        options = {o.plan: o.memory for o in table.options(attn, tokens)}
        assert options[KEEP] == pytest.approx(1000.0 * tokens / 100 + 50.0)
        assert options[RECOMPUTE] == 0.0
        codes = 1000.0 * tokens / 100 * table.payload(attn, "int8", table.group_size)
        assert options[INT8] == pytest.approx(codes + 50.0)
    # a codec's payload follows the elements: the head's fp32 saves cost half the bytes per byte
    assert table.payload(table.units[-1], "int8", 64) == pytest.approx(table.payload(attn, "int8", 64) / 2)


def test_a_plan_regenerates_its_largest_recomputed_layer_in_backward():
    table = _table(transient_bytes=5000.0, forward_transient_bytes=2000.0)
    gc = {u.name: RECOMPUTE for u in table.units if u.name.startswith("layers.")}
    assert table.regenerated(None, 100) == table.regenerated(gc, 100) == 4000.0
    one_kept = dict(gc, **{"layers.0.mlp": KEEP, "layers.1.mlp": KEEP})
    assert table.regenerated(one_kept, 100) == 1000.0
    assert table.backward_transient(gc, 100) == 5000.0
    assert table.backward_transient(one_kept, 100) == 5000.0 - 3000.0
    assert table.backward_transient(_all(table, KEEP), 100) == 1000.0  # the backward's own working memory
    unmeasured = _table()
    assert unmeasured.backward_transient(one_kept, 100) == unmeasured.transient(100) == 3000.0  # largest unit


def test_the_peak_is_the_higher_phase_and_a_first_micro_batch_has_no_gradients_in_its_forward():
    table = _table(transient_bytes=5000.0, forward_transient_bytes=2000.0, gradients_at_peak=0.25)
    ctl = Controller(None, table, None, BudgetConfig("gc_ratio", 10.0), static_bytes=10_000.0, gradient_bytes=4000.0)
    gc = ctl.gc_plan()
    held = 10_000.0 + ctl.held_bytes(gc, 100)
    assert ctl.predicted_peak(gc, 100) == pytest.approx(held + 5000.0)  # the backward's
    assert ctl.predicted_peak(gc, 100, gradients=False) == pytest.approx(held - 0.75 * 4000.0 + 5000.0)
    keep = _all(table, KEEP)  # nothing regenerated: the forward's transient is the larger, less the layers'
    held = 10_000.0 + ctl.held_bytes(keep, 100)  # weight copies, which GC's forward held in autocast's cache
    assert ctl.predicted_peak(keep, 100) == pytest.approx(held + 2000.0 - 100.0)
    assert ctl.predicted_peak(keep, 100, gradients=False) == pytest.approx(max(held - 4000.0 + 1900.0,
                                                                              held - 3000.0 + 1000.0))


def test_the_heads_part_follows_its_rows_as_the_larger_of_two_ops():
    """The head's part of a phase: the larger of the op highest at the probe (fixed here) and the op that
    grows most, each by the head's rows; a phase is the larger of its layers' part and its head's."""
    table = _table(transient_bytes=600.0, head_transient_bytes=500.0, head_transient_fixed=1.0,
                   head_transient_steep_bytes=400.0, head_transient_steep_fixed=0.0,
                   forward_transient_bytes=300.0, head_forward_transient_bytes=900.0, head_forward_transient_fixed=0.5)
    gc = {u.name: RECOMPUTE for u in table.units if u.name.startswith("layers.")}
    assert table.backward_transient(gc, Tokens(100, head=40)) == 600.0  # the probe: the layers' part
    assert table.backward_transient(gc, Tokens(100, head=80)) == 800.0  # twice the rows: the steep op
    grown = table.growth(Tokens(300, head=40))  # the layers' saves, 3x: the head's rows do not count
    assert grown == pytest.approx(3.0) and table.backward_transient(gc, Tokens(300, head=40)) == pytest.approx(1800.0)
    assert table.forward_transient(Tokens(100, head=120)) == 900.0 * (0.5 + 0.5 * 3)
    # the level the head's ops start from (lm_head's logits) follows the tokens, the ops above it the rows
    based = _table(forward_transient_bytes=300.0, head_forward_transient_bytes=900.0, head_forward_transient_fixed=0.5,
                   head_forward_base_bytes=200.0, head_forward_base_fixed=0.25)
    assert based.forward_transient(Tokens(100, head=40)) == pytest.approx(1100.0)  # the probe: 200 + 900
    assert based.forward_transient(Tokens(300, head=40)) == pytest.approx(200.0 * (0.25 + 0.75 * 3) + 900.0)
    assert based.forward_transient(Tokens(100, head=120)) == pytest.approx(200.0 + 900.0 * 2)
    # a head that compresses: its saves exist until its call ends, and its backward makes them again
    compressed = dict(gc, head=INT8)
    options = {o.plan: o.memory for o in table.options(table.units[-1], Tokens(100, head=40))}
    assert table.forward_transient(Tokens(100, head=40), compressed) == pytest.approx(
        900.0 + options[KEEP] - options[INT8])
    assert table.backward_transient(compressed, Tokens(100, head=80)) == pytest.approx(800.0 + 800.0 * 2)


def test_the_codecs_working_memory_follows_the_largest_compressed_saves_up_to_its_cap():
    table = _table(transient_bytes=600.0, forward_transient_bytes=300.0, codec_transient=2.0, codec_transient_cap=5000.0)
    gc = {u.name: RECOMPUTE for u in table.units if u.name.startswith("layers.")}
    mlp_int8 = dict(gc, **{"layers.0.mlp": INT8})  # 3000 bytes of bf16 saves: 1500 elements
    assert table.forward_transient(100, mlp_int8) == pytest.approx(300.0 + 2.0 * 1500)
    assert table.backward_transient(mlp_int8, 100) == pytest.approx(600.0 - 3000.0 + 3000.0 + 2.0 * 1500)
    assert table.forward_transient(400, mlp_int8) == pytest.approx(4 * 300.0 + 5000.0)  # the cap: chunks
    assert table.forward_transient(100, gc) == 300.0  # GC's plan compresses nothing
