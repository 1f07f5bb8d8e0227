"""The tiny CPU task (`hilore-verl tiny-task`, run by `make install`): written locally, read by verl's
own dataset, tokenizer and reward loading at the paths tiny_cpu.yaml names by default."""

import json
import os

import pytest
import torch

from hilore_verl.cli import main
from hilore_verl.tiny.task import DATA_SOURCE, compute_score, make_tiny_task
from tests.integration.test_recipes_on_cpu import compose


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tiny") / ".tiny_cpu")
    assert main(["tiny-task", "--out", root]) == 0
    return root


def test_files_and_a_second_call_that_writes_nothing(task):
    for name in ("model/config.json", "model/model.safetensors", "model/tokenizer.json", "train.parquet",
                 "val.parquet"):
        assert os.path.exists(os.path.join(task, name)), name
    stamp = os.path.getmtime(os.path.join(task, "train.parquet"))
    make_tiny_task(task)
    assert os.path.getmtime(os.path.join(task, "train.parquet")) == stamp
    with open(os.path.join(task, "tiny_task.json")) as f:
        assert json.load(f)["n_train"] == 512


def test_verls_dataset_tokenizer_and_reward_read_it(task):
    from omegaconf import OmegaConf
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.import_utils import load_extern_object

    tokenizer = hf_tokenizer(os.path.join(task, "model"))
    config = OmegaConf.create({"max_prompt_length": 16, "prompt_key": "prompt", "truncation": "error",
                               "filter_overlong_prompts": True})
    data = RLHFDataset(data_files=os.path.join(task, "train.parquet"), tokenizer=tokenizer, config=config)
    row = data[3]
    assert len(data) == 512 and row["data_source"] == DATA_SOURCE
    prompt = row["prompt"][0]["content"]
    ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    # four digits and "="; decoded by the byte-level decoder transformers pairs with a Qwen2 config
    assert len(ids) == 5 and tokenizer.decode(ids).replace(" ", "") == prompt.replace(" ", "")
    assert row["reward_model"]["ground_truth"] == prompt.split()[0]
    score = load_extern_object("pkg://hilore_verl.tiny.task", "compute_score")
    answer = row["reward_model"]["ground_truth"]
    assert score(DATA_SOURCE, f"{answer} 4", answer) == 1.0
    assert score(DATA_SOURCE, tokenizer.decode([tokenizer.convert_tokens_to_ids(answer), tokenizer.eos_token_id],
                                               skip_special_tokens=True), answer) == 1.0
    wrong = str((int(answer) + 1) % 10)
    assert score(DATA_SOURCE, wrong, answer) == 0.0 and compute_score(DATA_SOURCE, "", answer) == 0.0
    assert score(DATA_SOURCE, f"{wrong}{answer}", answer) == 0.0 and score(DATA_SOURCE, f" {answer}9", answer) == 1.0


def test_the_policy_generates_with_its_tokenizer(task):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = os.path.join(task, "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.vocab_size == len(tokenizer) and model.config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer("3 7 1 9 =", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1] and torch.equal(out[0, :5], ids[0])


def test_the_tiny_recipe_names_these_paths_by_default():
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = compose("tiny_cpu")
    assert cfg.actor_rollout_ref.model.path == ".tiny_cpu/model"
    assert (cfg.data.train_files, cfg.data.val_files) == (".tiny_cpu/train.parquet", ".tiny_cpu/val.parquet")
    reward = get_custom_reward_fn(cfg)
    assert reward(DATA_SOURCE, "5", "5") == 1.0
