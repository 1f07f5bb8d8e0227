"""The `hf` rollout's server on its own (no Ray): generation against the plain HF model, log-probs, lengths,
sampling seeds, and weight loading that refuses a partial or foreign weight set."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from hilore_verl.integration.cpu_host.hf_rollout import HFGenerateServer
from hilore_verl.tiny.task import make_tokenizer


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from hilore_verl.tiny.task import make_tiny_task

    return make_tiny_task(str(tmp_path_factory.mktemp("tiny") / "task"))


def _server(task, replica_rank=0, seed=7, logprobs_mode="processed_logprobs"):
    from omegaconf import OmegaConf

    config = SimpleNamespace(seed=seed, max_model_len=None, prompt_length=16, response_length=6,
                             logprobs_mode=logprobs_mode)
    return HFGenerateServer(config, OmegaConf.create({"path": f"{task}/model"}), replica_rank)


def _generate(server, prompt, **params):
    return asyncio.run(server.generate(prompt, params, request_id="r"))


PROMPT = [5, 6, 7, 5, 14]  # "1 2 3 1 ="


def test_greedy_matches_the_model_and_log_probs_are_the_models(task):
    server = _server(task)
    out = _generate(server, PROMPT, temperature=0, top_p=1.0, top_k=-1, logprobs=True)
    ids = torch.tensor([PROMPT])
    for token, log_prob in zip(out.token_ids, out.log_probs):  # step by step, the plain model's argmax
        with torch.no_grad():
            logits = server.model(ids).logits[0, -1]
        assert token == int(logits.argmax())
        assert log_prob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert 1 <= len(out.token_ids) <= 6 and out.stop_reason == "completed"
    eos = make_tokenizer().eos_token_id
    assert len(out.token_ids) == 6 or out.token_ids[-1] == eos  # stops at EOS, else at response_length


def test_lengths_sampling_seeds_and_raw_log_probs(task):
    server = _server(task)
    assert len(_generate(server, PROMPT, temperature=1.0, max_tokens=3, ignore_eos=True).token_ids) == 3
    a = [_generate(_server(task, seed=3), PROMPT, temperature=1.0, ignore_eos=True).token_ids for _ in range(2)]
    assert a[0] == a[1]  # a fresh server with the same seed samples the same
    replica = _server(task, seed=3, replica_rank=1)  # each replica its own stream: seed + replica rank
    assert [_generate(replica, PROMPT, temperature=1.0, ignore_eos=True).token_ids for _ in range(3)] != [a[0]] * 3
    raw = _server(task, logprobs_mode="raw_logprobs")
    cold = _generate(raw, PROMPT, temperature=0.5, top_k=2, logprobs=True, ignore_eos=True)
    assert all(lp <= 0 for lp in cold.log_probs) and len(cold.log_probs) == len(cold.token_ids)
    assert _generate(server, PROMPT, temperature=1.0).log_probs is None  # not asked for


def test_load_weights_replaces_the_copy_and_refuses_partial_or_foreign_sets(task):
    server = _server(task)
    state = server.state_dict()
    changed = {name: tensor + 0.01 for name, tensor in state.items()}
    assert asyncio.run(server.load_weights(changed, global_steps=4)) == len(changed)
    assert all(torch.equal(server.state_dict()[n], t) for n, t in changed.items())
    assert server.global_steps == 4 and _generate(server, PROMPT).extra_fields["global_steps"] == 4
    partial = dict(changed)
    partial.pop(next(n for n in partial if "layers.0" in n))
    with pytest.raises(KeyError, match="miss"):
        asyncio.run(server.load_weights(partial))
    with pytest.raises(KeyError, match="does not have"):
        asyncio.run(server.load_weights({**changed, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}))


def test_tied_embeddings_load_from_either_name(task, tmp_path):
    from transformers import AutoModelForCausalLM

    from hilore_verl.tiny.models import save_tiny_model

    server = _server(task)
    save_tiny_model(str(tmp_path / "tied"), "qwen2", seed=1, vocab_size=16, tie_word_embeddings=True)
    server.model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tied"), dtype=torch.float32).eval()
    state = {n: t + 0.5 for n, t in server.state_dict().items()}
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    without_head = {n: t for n, t in state.items() if n != "lm_head.weight"}  # one name of the tied pair
    asyncio.run(server.load_weights(without_head))
    assert torch.equal(server.model.lm_head.weight, state["model.embed_tokens.weight"])
    asyncio.run(server.load_weights(state))  # both names: the same tensor written twice


def test_multimodal_inputs_are_refused(task):
    with pytest.raises(NotImplementedError, match="text only"):
        asyncio.run(_server(task).generate(PROMPT, {}, request_id="r", image_data=[object()]))


def test_a_newline_is_one_token():
    tokenizer = make_tokenizer()
    assert len(tokenizer.encode("\n", add_special_tokens=False)) == 1  # verl's Qwen chat handling needs it
