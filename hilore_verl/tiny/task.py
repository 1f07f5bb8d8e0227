"""The CPU tasks the recipes name, made locally (no download): `tiny` for tests, `demo` for the main job.

    hilore-verl tiny-task                 # writes .tiny_cpu/ in the current directory (make install does)
    hilore-verl tiny-task --shape demo --out .demo_cpu   # the demo's (hilore-verl demo writes it if missing)

    .tiny_cpu/model/          a random 2-layer Qwen2-shaped policy and its word-level tokenizer
    .tiny_cpu/train.parquet   prompts as verl's data-prep scripts write them (data_source, prompt,
    .tiny_cpu/val.parquet     ability, reward_model.ground_truth, extra_info)

The task: a prompt of digits, `3 1 1 2 =`; the answer is the first digit. The reward is
`compute_score` (verl's custom reward function: `pkg://hilore_verl.tiny.task`): 1 when the
response starts with that digit, else 0. Prompts draw from three digits (`PROMPT_DIGITS`) out of
the ten in the vocabulary: a random policy scores about 1 in 16; one that learned to answer with
those three scores 1 in 3 (GRPO finds that within a few steps), and copying reaches 1.

Two shapes (`SHAPES`): `tiny` (4 digits, a 2-layer hidden-64 policy: a test's actor update is a few
milliseconds) and `demo` (64-192 digits, a 4-layer hidden-256 policy: GRPO's proportions, long prompts
and shorter responses of varying length, where the actor update is most of a step's work on a CPU).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass

DIGITS = [str(d) for d in range(10)]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
VOCAB = SPECIAL + DIGITS + ["=", "\n"]
PROMPT_DIGITS = ["1", "2", "3"]
DATA_SOURCE = "hilore_verl/first_digit"
VERSION = 7  # bump when what is written changes: an older folder is written again


@dataclass(frozen=True)
class TaskShape:
    digits: tuple[int, int]
    """Digits per prompt, drawn uniformly from this inclusive range (the prompt is these and `=`)."""
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    max_positions: int


SHAPES = {"tiny": TaskShape((4, 4), 64, 128, 2, 4, 2, 128),
          "demo": TaskShape((64, 192), 256, 704, 4, 4, 2, 256)}


def make_tokenizer():
    """A word-level tokenizer over the task's words, with a chat template that joins the messages."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # decoding joins words with spaces: "3 7 1 9 ="
    # a newline is one token (verl's agent loop checks that for Qwen-family chat templates)
    core.add_tokens([AddedToken("\n", normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def make_rows(n: int, split: str, seed: int, digits_range: tuple[int, int] = (4, 4)) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        digits = [rng.choice(PROMPT_DIGITS) for _ in range(rng.randint(*digits_range))]
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": " ".join(digits) + " ="}],
                     "ability": "copy", "reward_model": {"style": "rule", "ground_truth": digits[0]},
                     "extra_info": {"split": split, "index": i}})
    return rows


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature: 1.0 when the response starts with the answer digit. (Spaces do
    not matter: loaded beside a Qwen2 config, transformers gives the tokenizer Qwen2's byte-level
    decoder, which joins the words without them.)"""
    return 1.0 if solution_str.strip()[:1] == ground_truth else 0.0


def make_tiny_task(root: str = ".tiny_cpu", n_train: int = 512, n_val: int = 64, seed: int = 0,
                   shape: str = "tiny") -> str:
    """Write the model, tokenizer and data of task `shape` under `root` (skipped when this version is
    there); returns root."""
    import pandas as pd

    from hilore_verl.tiny.models import save_tiny_model

    if shape not in SHAPES:
        raise ValueError(f"unknown task shape {shape!r}; valid: {', '.join(SHAPES)}")
    size = SHAPES[shape]
    marker = os.path.join(root, "tiny_task.json")
    expected = {"version": VERSION, "n_train": n_train, "n_val": n_val, "seed": seed, "shape": asdict(size)}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == json.loads(json.dumps(expected)):
                return root
    os.makedirs(root, exist_ok=True)
    tokenizer = make_tokenizer()
    model_dir = os.path.join(root, "model")
    save_tiny_model(model_dir, "qwen2", seed=seed, vocab_size=len(VOCAB), hidden_size=size.hidden_size,
                    intermediate_size=size.intermediate_size, num_hidden_layers=size.layers,
                    num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                    max_position_embeddings=size.max_positions,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    tokenizer.save_pretrained(model_dir)
    for split, n in (("train", n_train), ("val", n_val)):
        pd.DataFrame(make_rows(n, split, seed, size.digits)).to_parquet(os.path.join(root, f"{split}.parquet"))
    with open(marker, "w") as f:
        json.dump(expected, f)
    return root
