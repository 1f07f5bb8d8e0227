"""verl's batch in the project's terms: the one place that reads its loss fields.

verl hands the engine a TensorDict whose per-token fields are nested (one row per sequence) or padded.
This module turns them into what the session and the planner reason with: tokens per sequence, the
loss coefficients c_t (what verl's loss multiplies each log-prob's gradient by) and their exposure
(L2 of c, plus the entropy bound where the actor's entropy_coeff is not 0).

    padded(data, "advantages")              # [B, T] (nested: padded with zeros)
    sequence_lengths(data)                  # tokens per sequence
    zero_exposure(data)                     # per sequence: no advantage anywhere; and its tokens
    chunks(index, size, at_least)           # verl's fixed-size split of sequences `index`
    terms = LossTerms(vocab)                # vocab(): the model's vocabulary size (the entropy bound)
    terms.actor_config = config             # verl's actor config (the engine's, or the bound ppo_loss's)
    terms.check(data)                       # the mini-batch's loss inputs, once (nan / inf, negative weights)
    terms.coefficients(micro_batch)         # c, predicted on-policy (log_prob given: exact)
    terms.exposure_l2(micro_batch)          # 0-d tensor, unread
    terms.exact_exposure(micro_batch, out)  # a function computing it from verl's output, called later
"""

from __future__ import annotations

from typing import Callable

import torch

from hilore_verl.integration.actor.loss import actor_exposure, check_values, loss_coefficients
from hilore_verl.integration.actor.loss import padded as padded_tensor
from verl.workers.utils.padding import no_padding_2_padding

LOSS_INPUTS = ("old_log_probs", "advantages", "rollout_is_weights", "ref_log_prob")


def padded(data, key):
    """A field of verl's batch as a padded tensor (nested: padded with zeros, `loss.padded`)."""
    return padded_tensor(key, data[key])


def sequence_lengths_tensor(data) -> torch.Tensor:
    """Tokens per sequence of a batch (nested: its offsets; padded: its attention mask), unread."""
    ids = data["input_ids"]
    if ids.is_nested:
        return ids.offsets().diff()
    if "attention_mask" in data:
        return data["attention_mask"].sum(-1)
    return torch.full((ids.shape[0],), ids.shape[-1])


def sequence_lengths(data) -> list[int]:
    return sequence_lengths_tensor(data).tolist()


def zero_exposure(data) -> tuple[list[bool], list[int]]:
    """Per sequence: no advantage on any response token, and its tokens (read together, in one transfer)."""
    lengths = sequence_lengths_tensor(data)
    advantages, mask = padded(data, "advantages"), padded(data, "response_mask").bool()
    moved = ((advantages != 0) & mask).any(-1)
    both = torch.stack([moved.to(torch.long), lengths.to(device=moved.device, dtype=torch.long)]).tolist()
    return [not m for m in both[0]], both[1]


def chunks(index: list[int], size: int, at_least: int) -> list[list[int]]:
    """`index` in order, in max(ceil(len / size), at_least) near-equal parts of at most `size` (at most
    len(index) parts): verl's split of a fixed micro-batch size (`micro_batch_size_per_gpu`), which the
    engine runs where it splits the sequences itself (the zero-exposure skip's kept ones)."""
    count = min(len(index), max(-(-len(index) // size), at_least))
    base, extra = divmod(len(index), count)
    out, start = [], 0
    for k in range(count):
        end = start + base + (k < extra)
        out.append(index[start:end])
        start = end
    return out


def vocab_size(model_config, module) -> int | None:
    """The model's vocabulary size V (the entropy bound is 2 ln V), from verl's model config, else the
    module's own config as the model was built."""
    config = getattr(model_config, "hf_config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    return vocab


class LossTerms:
    """What verl's loss says of a batch: its coefficients and exposure (the module's docstring). Without an
    actor config the coefficients are unknown: every micro-batch counts as exposed (exposure 1)."""

    def __init__(self, vocab: Callable[[], int | None], actor_config=None):
        self.vocab = vocab
        self.actor_config = actor_config

    def check(self, data) -> None:
        """The mini-batch's loss inputs, checked once (nan / inf, negative IS weights: one read of device
        data); its micro-batches' coefficients are then computed without checks."""
        if self.actor_config is None:
            return
        tensors = {k: padded(data, k) for k in LOSS_INPUTS if k in data}
        names = {"old_log_probs": "old_log_prob"}
        check_values(padded(data, "response_mask"), **{names.get(k, k): t for k, t in tensors.items()})

    def coefficients(self, micro_batch, log_prob=None) -> torch.Tensor:
        """Loss coefficients of a micro-batch: predicted (on-policy) without log_prob, exact with it (its
        inputs' values were checked with the mini-batch's: `check`)."""
        mask = padded(micro_batch, "response_mask")
        old = padded(micro_batch, "old_log_probs")
        optional = {k: padded(micro_batch, k) for k in ("rollout_is_weights", "ref_log_prob") if k in micro_batch}
        return loss_coefficients(old if log_prob is None else log_prob.to(old.device), old,
                                 padded(micro_batch, "advantages"), mask, self.actor_config,
                                 check=False, **optional)

    def exposure_l2(self, micro_batch, log_prob=None) -> torch.Tensor:
        """L2 of the micro-batch's exposure, a 0-d tensor (unread): |c_t|, plus the entropy bound when the
        actor's entropy_coeff is not 0 (the entropy bonus acts on the logits, so c leaves it out; a
        zero-advantage micro-batch still moves the policy through it)."""
        if self.actor_config is None:
            return torch.ones(())
        c = self.coefficients(micro_batch, log_prob)
        vocab = self.vocab() if getattr(self.actor_config, "entropy_coeff", 0) else None
        return actor_exposure(c, padded(micro_batch, "response_mask"), self.actor_config, vocab).l2_tensor()

    def exact_exposure(self, micro_batch, output) -> Callable[[], torch.Tensor]:
        """The exact exposure of a trained micro-batch, deferred: a function the controller calls with the
        mini-batch's metrics, after the last backward (it converts verl's log-probs to the padded layout
        and runs verl's loss for the coefficients, both of which read device data)."""
        log_probs = output["model_output"]["log_probs"]  # detached by verl

        def exact() -> torch.Tensor:
            return self.exposure_l2(micro_batch, no_padding_2_padding(log_probs, micro_batch))

        return exact


__all__ = ["LossTerms", "padded", "sequence_lengths", "sequence_lengths_tensor", "vocab_size", "zero_exposure"]
