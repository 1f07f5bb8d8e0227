"""The bench's shared-prompt rows (`--shared-prompt`): no_gc, gc and hilore with each group's prompt computed
once, against the same methods attending per sequence; the gradient is theirs within fp32 reordering."""

import dataclasses

import pytest
import torch

from hilore_verl.bench import methods as M
from hilore_verl.bench.run import run_bench
from hilore_verl.bench.actor_update import BenchConfig, make_batch, shared_inputs

TINY = BenchConfig(hidden_size=64, num_layers=2, vocab_size=256, num_groups=3, group_size=4, max_prompt_len=24,
                   max_response_len=16, zero_advantage_share=0.0, autocast=False, per_sequence_attention=True)


def test_the_shared_layout_computes_each_prompt_once_and_reads_the_same_positions():
    batch = {k: v.cpu() for k, v in make_batch(TINY).items()}
    inputs, mapped = shared_inputs(batch)
    layout = inputs["shared_prompt_layout"]
    prompts = batch["prompt_lens"].view(TINY.num_groups, TINY.group_size)
    assert (prompts == prompts[:, :1]).all()  # one prompt per group
    # each group's prompt once: the ordinary row less (group size - 1) copies of every prompt
    assert layout.shared_tokens == int(batch["tokens"]) - (TINY.group_size - 1) * int(prompts[:, 0].sum())
    # every logit the loss reads predicts the same token from the same context in both layouts
    assert torch.equal(layout.input_ids[0, mapped["logit_index"]], batch["input_ids"][0, batch["logit_index"]])
    alone, _ = shared_inputs(batch, share=False)
    assert alone["shared_prompt_layout"].shared_tokens == int(batch["tokens"])  # per sequence, nothing shared


@pytest.mark.parametrize("name", ["no_gc", "gc"])
def test_shared_rows_train_the_same_gradient(name):
    batch = {k: v.cpu() for k, v in make_batch(TINY).items()}
    plain, shared = M.build(name, TINY, batch), M.build(f"{name}_shared", TINY, batch)
    a, b = plain.gradient(batch), shared.gradient(batch)
    assert float((a - b).norm() / a.norm()) <= 1e-5 and float(a @ b / (a.norm() * b.norm())) >= 0.999999
    dense = M.build(name, dataclasses.replace(TINY, per_sequence_attention=False), batch)
    assert float((dense.gradient(batch) - a).norm() / a.norm()) <= 1e-5  # per-sequence attention: the same update


def test_the_cli_adds_the_shared_rows_and_refuses_a_padded_batch(monkeypatch, capsys):
    from hilore_verl import cli

    seen = []
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")  # as set by the bench's own re-exec: run in this process
    monkeypatch.setattr("hilore_verl.bench.run.run_bench", lambda config, methods, **kw: seen.append((config, methods))
                        or (_ for _ in ()).throw(SystemExit(0)))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--shared-prompt", "--methods", "gc,hilore", "--prompt-len", "128", "--no-peaks"])
    config, methods = seen[0]
    assert methods == ("gc", "hilore", "no_gc_shared", "gc_shared", "hilore_shared")
    assert config.per_sequence_attention and config.max_prompt_len == 128
    assert cli.main(["bench", "--shared-prompt", "--no-pack"]) == 2
    assert "drop --no-pack" in capsys.readouterr().err


def test_a_bench_run_with_shared_rows_reports_them():
    report = run_bench(dataclasses.replace(TINY, rounds=2), methods=("no_gc", "gc", "hilore_shared"), sweep=False,
                       peaks=False, risk_budget=0.0)  # keep / recompute: exact up to fp32 reordering
    rows = report["methods"]
    assert all(rows[m]["status"] == "ok" for m in rows), rows
    assert rows["hilore_shared"]["grad_rel_error"] <= 1e-5 and len(rows["hilore_shared"]["x_gc"]) == 3, rows
