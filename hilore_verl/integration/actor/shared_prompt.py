"""verl's actor forward on the shared-prompt layout (`hilore.shared_prompt`): each group's prompt once.

verl's FSDP engine packs a micro-batch's sequences into one row (`prepare_model_inputs`, remove-padding),
runs the model and reads log-probs and entropy off the row's logits (`prepare_model_outputs`). With the
shared layout the engine runs the model on `SharedLayout.input_ids` instead (every group's prompt once,
shared_prompt/) and hands verl the logits laid out as the ordinary row, gathered by
`SharedLayout.unshared_index`: every position's logits depend only on its own sequence's tokens up to
it and their positions, which are the same in both layouts, so verl's log-probs, entropies, loss and
metrics are computed by verl's own code from the same values. The gather's backward sums the prompt
positions' gradients over the group's responses.

    with shared.scope():                             # one forward step
        model_inputs, output_args = shared.rewrite(micro_batch, model_inputs, output_args)
        output = model(**model_inputs)               # the head on verl's N positions (`logits_to_keep`)
        shared.restore(output, output_args)          # else: output.logits [1, L, V] -> [1, N, V]

Groups are found by prompt tokens, not by verl's group ids: sequences whose prompts are equal share one
copy, whatever group they came from, and sequences of one group whose prompts differ (a reordered data
pipeline) cannot be shared by mistake. Micro-batches the layout cannot serve run as before, each reason logged
once: no remove-padding, sequence parallelism or a static pad (a padded row), fused kernels (no logits),
multi-modal inputs or 3-D positions, an attention with sinks (checked at start-up).
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch

from hilore_verl.shared_prompt import LAYOUT_KWARG, SharedLayout, ShareRule, install, shared_layout, shared_token_count
from hilore_verl.shared_prompt.grouping import group_micro_batches

logger = logging.getLogger(__name__)

INDEX_KEY = "hilore_shared_index"  # output_args: [N] row position of each ordinary packed position
PLAIN_INPUTS = {"input_ids", "attention_mask", "position_ids"}


ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def unsupported_model(model: torch.nn.Module) -> str | None:
    """Why the shared attention cannot serve `model` (None: it can): attention sinks (GPT-OSS), a layer
    that mixes tokens outside the attention interface (linear attention, state-space or convolution
    layers of hybrid models), or non-causal attention."""
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        return "its attention has sinks (e.g. GPT-OSS), which the shared-prompt attention does not compute"
    types = set(getattr(model.config, "layer_types", None) or ()) - ATTENTION_LAYERS
    if types:
        return f"it has {', '.join(sorted(types))} layers, which mix tokens outside the attention interface"
    if any(getattr(module, "is_causal", True) is False for module in model.modules()):
        return "it has non-causal attention layers"
    return None


def _response_lengths(micro_batch, offsets: list[int]) -> list[int] | None:
    """Response tokens per sequence: the jagged `response_mask`'s lengths (verl's trainer), or the valid
    tokens of the right-padded response part of `attention_mask` (the padded layout converted by
    left_right_2_no_padding). None when neither is there. A split that takes part of a response for the
    prompt is still exact (a shared prefix is a shared prefix); it only shares less."""
    response_mask = micro_batch.get("response_mask", None)
    if response_mask is None:
        return None
    if response_mask.is_nested:
        lengths = response_mask.offsets().diff().tolist()
        totals = [b - a for a, b in zip(offsets, offsets[1:])]
        return None if any(r > t for r, t in zip(lengths, totals)) else lengths
    mask = micro_batch.get("attention_mask", None)
    if mask is None or mask.is_nested:
        return None
    return mask[:, -response_mask.shape[-1]:].sum(-1).tolist()  # responses are right-padded


def _sequences(micro_batch) -> list | None:
    """(prompt ids, prompt ids [P], response ids [R]) per sequence of verl's no-padding micro-batch; the
    group key is the prompt itself. None when the prompt / response split cannot be read."""
    input_ids = micro_batch["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        return None
    offsets = input_ids.offsets().tolist()
    response_lens = _response_lengths(micro_batch, offsets)
    if response_lens is None:
        return None
    values = input_ids.values().cpu()
    out = []
    for i, response_len in enumerate(response_lens):
        tokens = values[offsets[i]:offsets[i + 1]]
        prompt_len = tokens.numel() - int(response_len)
        if prompt_len < 1:
            return None
        prompt = tokens[:prompt_len]
        out.append((tuple(prompt.tolist()), prompt, tokens[prompt_len:]))
    return out


class SharedPrompt:
    """The two halves of one micro-batch's shared forward (module docstring); says each refusal once."""

    def __init__(self, keeps_logits: bool = False, sp_size: int = 1, rule: ShareRule | None = None) -> None:
        self._said: set[str] = set()
        self.stats: list[tuple[int, int]] = []  # per forward: (shared tokens, unshared tokens)
        self.keeps_logits = keeps_logits  # the model's forward takes `logits_to_keep` (an index tensor)
        self.sp_size = sp_size
        self.rule = rule  # which groups pay to share (None: every group with one prompt)
        self._active = contextlib.ExitStack()
        self._keys: tuple | None = None  # (mini-batch, per sequence (prompt key, tokens, prompt tokens))
        self.on = True  # off for the run once the first-use self-check failed (shared_check.py)
        self.check: dict | None = None  # the self-check's outcome: {"ok", "why", "seconds"}
        self._trial = False  # inside `trial()`: the shared half of the self-check

    @property
    def check_due(self) -> bool:
        """The self-check has not run yet (it runs at the first micro-batch some rank would share)."""
        return self.on and self.check is None

    @property
    def active(self) -> bool:
        """Micro-batches run shared: after the self-check passed, or inside its shared forward."""
        return self._trial or (self.on and self.check is not None)

    def checked(self, ok: bool, why: str, seconds: float) -> None:
        self.check = {"ok": ok, "why": why, "seconds": seconds}
        self.on = ok
        self.stats = []  # the check's own forwards are not the run's

    @contextlib.contextmanager
    def trial(self):
        """Inside the block micro-batches run shared before the self-check has passed (its shared half)."""
        self._trial = True
        try:
            yield
        finally:
            self._trial = False

    def would_share(self, micro_batch) -> bool:
        """Whether `micro_batch` would run shared: servable, and its layout computes fewer tokens."""
        why = self._refusal(micro_batch) if self.on else None
        if why is not None:
            self._refuse(why)  # said once, whether or not the check ever runs
        if not self.on or self._said:
            return False
        sequences = _sequences(micro_batch)
        if sequences is None:
            return False
        shared = shared_token_count([(key, p.numel(), r.numel()) for key, p, r in sequences], self.rule)
        return shared < int(micro_batch["input_ids"].values().numel())

    @classmethod
    def install(cls, model: torch.nn.Module, sp_size: int = 1) -> "SharedPrompt":
        """The model's attention switched to the shared-prompt implementation (its base without a layout)."""
        install(model)
        return cls("logits_to_keep" in inspect.signature(type(model).forward).parameters, sp_size,
                   ShareRule.of(model))

    @contextlib.contextmanager
    def scope(self):
        """Around one forward step: the layout `rewrite` makes is the current one (so the model builds no
        [L, L] mask of its own) until the step ends, also when it raises."""
        try:
            yield
        finally:
            self._active.close()

    def _refuse(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            logger.warning("hilore-verl: shared prompt off for micro-batches with %s; they run in verl's "
                           "ordinary layout", why)

    def _refusal(self, micro_batch) -> str | None:
        """Why a micro-batch cannot be shared, as far as its own flags tell (None: it may be)."""
        import verl.utils.tensordict_utils as tu
        from verl.utils.model import extract_multi_modal_inputs

        if self.sp_size > 1:
            return "sequence parallelism (each rank holds part of the packed row)"
        if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            return "use_remove_padding off"
        if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
            return "fused kernels (they return log-probs, not logits)"
        if extract_multi_modal_inputs(micro_batch.get("multi_modal_inputs", [])):  # as prepare_model_inputs reads them
            return "inputs beyond ids and 1-D positions (multi-modal, cu_seqlens)"
        return None

    def split(self, data, index: list[int], at_least: int) -> list[list[int]] | None:
        """The sequences `index` of verl's mini-batch `data` in micro-batches within verl's bounds (its
        token limit with dynamic batch sizes, else its micro-batch size), each group's sequences
        together where the bound allows (shared_prompt/grouping.py); None where the split cannot be
        read or the sequences cannot fill `at_least` micro-batches (then verl's split is used)."""
        import verl.utils.tensordict_utils as tu

        if not self.on or self._refusal(data) is not None:
            return None
        if self._keys is None or self._keys[0] is not data:
            sequences = _sequences(data)
            self._keys = (data, None if sequences is None else
                          [(key, prompt.numel() + response.numel(), prompt.numel()) for key, prompt, response in sequences])
        rows = self._keys[1]
        if rows is None:
            return None
        keys, lengths, prompts = (list(col) for col in zip(*(rows[i] for i in index)))
        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            bound = {"max_tokens": int(data["max_token_len_per_gpu"]) * self.sp_size}
        elif tu.get_non_tensor_data(data=data, key="return_model_output", default=False):
            return None  # verl puts outputs back in order only for dynamic batch sizes: keep its order
        else:
            bound = {"size": int(data["micro_batch_size_per_gpu"])}
        parts = group_micro_batches(keys, lengths, prompts, at_least, **bound)
        return None if parts is None else [[index[j] for j in part] for part in parts]

    def agreed_split(self, data, collectives, rounds: int = 8) -> list[list[int]] | None:
        """`split` of every sequence of `data` on every data-parallel rank, again into at least the largest
        count until all ranks have the same number of micro-batches (verl's FSDP collectives run once per
        micro-batch on every rank; one gather per try); None on every rank when a rank cannot split (or
        the count does not settle)."""
        every = list(range(len(data)))
        parts = self.split(data, every, 1)
        for _ in range(rounds):
            counts = [row[0] for row in collectives.gather([float(len(parts)) if parts is not None else -1.0])]
            if min(counts) < 0:
                return None
            if min(counts) == max(counts):
                return parts
            parts = self.split(data, every, int(max(counts)))
        return None

    def forget_split(self) -> None:
        """The mini-batch's prompt keys are read once per mini-batch; drop them after its step."""
        self._keys = None

    def tokens(self, micro_batch) -> int:
        """The tokens the model's layers will compute for `micro_batch`: the shared layout's row L, or
        verl's packed row N where the layout will not be used (what the planner sizes a micro-batch by;
        after any refusal in this run, N, so that a micro-batch is never planned smaller than it runs)."""
        row = int(micro_batch["input_ids"].values().numel())
        if not self.active or self._said or self._refusal(micro_batch) is not None:
            return row
        sequences = _sequences(micro_batch)
        if sequences is None:
            return row
        return shared_token_count([(key, prompt.numel(), response.numel()) for key, prompt, response in sequences],
                                  self.rule)

    def rewrite(self, micro_batch, model_inputs: dict, output_args: dict) -> tuple[dict, dict]:
        """verl's model inputs for the ordinary packed row -> the shared layout's (or unchanged)."""
        if not self.active:  # before the self-check passed, or after it failed
            return model_inputs, output_args
        why = self._refusal(micro_batch)
        if why is not None:
            self._refuse(why)
        elif output_args.get("pad_size", 0):
            self._refuse("a padded packed row (sequence parallelism or pad_to_length)")
        elif set(model_inputs) - PLAIN_INPUTS or model_inputs["position_ids"].dim() != 2:
            self._refuse("inputs beyond ids and 1-D positions (multi-modal, cu_seqlens)")
        else:
            sequences = _sequences(micro_batch)
            if sequences is None:
                found = {k: ("nested" if getattr(v, "is_nested", False) else tuple(v.shape))
                         for k in ("attention_mask", "response_mask") if (v := micro_batch.get(k, None)) is not None}
                self._refuse(f"no readable prompt / response split (attention_mask and response_mask: {found})")
                return model_inputs, output_args
            row, positions = model_inputs["input_ids"], model_inputs["position_ids"]
            layout = SharedLayout.build(sequences, device=row.device, rule=self.rule)
            index = layout.unshared_index
            if layout.unshared_tokens != row.shape[-1] or not (
                    torch.equal(layout.input_ids[0, index], row[0])
                    and torch.equal(layout.position_ids[0, index], positions[0])):
                raise RuntimeError("hilore-verl: the shared layout does not reproduce verl's packed row and its "
                                   "positions (a prompt / response split or positions that verl did not make)")
            self.stats.append((layout.shared_tokens, layout.unshared_tokens))
            if layout.shared_tokens == layout.unshared_tokens:  # nothing shared: the ordinary forward
                return model_inputs, output_args
            self._active.enter_context(shared_layout(layout))
            model_inputs = dict(model_inputs, input_ids=layout.input_ids, position_ids=layout.position_ids,
                                **{LAYOUT_KWARG: layout})
            if self.keeps_logits:  # the head runs on verl's N positions only, in verl's order: [1, N, V]
                model_inputs["logits_to_keep"] = index
            else:
                output_args[INDEX_KEY] = index
        return model_inputs, output_args

    @staticmethod
    def restore(output, output_args: dict) -> None:
        """The shared forward's logits [1, L, V] -> the ordinary row's [1, N, V], in place on `output`."""
        index = output_args.pop(INDEX_KEY, None)
        if index is not None:
            output.logits = output.logits.index_select(1, index)

    def take_metrics(self) -> dict[str, float]:
        """Whether sharing is on (off after a failed self-check), the self-check's seconds once it ran, and
        since the last call the share of packed tokens the shared layout computed (1: nothing shared);
        then the record starts again."""
        stats, self.stats = self.stats, []
        out = {"hilore/shared_prompt_on": 1.0 if self.on else 0.0}
        if self.check is not None:
            out["hilore/shared/self_check_s"] = self.check["seconds"]
        if stats:
            out["hilore/shared/token_share"] = sum(s[0] for s in stats) / max(sum(s[1] for s in stats), 1)
        return out
