"""`hilore_packed_sdpa`: attention per sequence of a packed row (what a GPU's varlen kernel computes),
against transformers' sdpa on the same packed row and against each sequence run alone (fp32); any other
call is sdpa's own."""

import torch

from hilore_verl.integration.cpu_host.packed_attention import NAME, register
from hilore_verl.tiny.models import build_tiny_model


def _model():
    return build_tiny_model("qwen2", dtype=torch.float32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=50).eval()


def test_a_packed_row_attends_within_each_sequence_as_sdpa_does():
    register()
    model = _model()
    lengths = [7, 30, 1, 12, 19]
    ids = torch.randint(0, 50, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    sdpa = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    model.config._attn_implementation = NAME
    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    alone = torch.cat([model(input_ids=ids[:, s:e], use_cache=False).logits for s, e in zip(starts, starts[1:])], 1)
    assert float((packed - sdpa).abs().max()) <= 1e-5 and float((packed - alone).abs().max()) <= 1e-5
    # a batch of left-padded rows (generation) is sdpa's own
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    rows = torch.randint(0, 50, (2, 10))
    model.config._attn_implementation = "sdpa"
    reference = model(input_ids=rows, attention_mask=mask, use_cache=False).logits
    model.config._attn_implementation = NAME
    assert torch.equal(model(input_ids=rows, attention_mask=mask, use_cache=False).logits, reference)
