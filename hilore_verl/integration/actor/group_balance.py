"""Each prompt's responses on one rank, together, where `actor.use_prefix_grouper` asks for it.

verl 0.9.1 has two trainers. The legacy one (`trainer.use_v1=false`) balances whole uid groups over
the data-parallel ranks when `actor_rollout_ref.actor.use_prefix_grouper` is set. The v1 trainer (the
default) reads neither that flag nor `trainer.balance_batch`: it always balances single sequences
(`PPOTrainer._balance_batch`), and its batch arrives in the order the rollouts finished. A group's
responses then spread over the ranks and over each rank's mini-batches, and the shared prompt
(`hilore.shared_prompt`) finds few of them in one micro-batch. Measured on the demo (2 ranks, n = 8,
16 sequences per rank per mini-batch): verl's micro-batches of 8 held pieces of 2-3 prompts, and the
shared layout computed 31-40% of the packed tokens where whole groups compute about 20%.

With the flag set, the v1 trainer's `_balance_batch` is wrapped when verl imports it: verl's own
balance runs first (it also pads the batch to the multiple its ranks and mini-batches need), then
the samples are laid out group by group and the groups are partitioned over the ranks by verl's own
`get_group_balanced_partitions` (Karmarkar-Karp on the groups' summed workloads, the same number of
groups per rank), each group contiguous on its rank, so a rank's mini-batches hold whole groups when
its mini-batch is a multiple of the group size. The `global_seqlen/*` metrics describe that layout.

A group is read from verl's sample key, `{uid}_{session}_{output}` (v1's agent loop). Where the
groups cannot be balanced whole (a key of another form, groups of different sizes such as verl's
padding samples, a group count that does not divide over the ranks), verl's balance stands and the
reason is logged once. Which responses share a mini-batch changes, as verl's own balance changes it;
every sequence is trained once per epoch either way, and a group's advantages are computed before.
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence

from hilore_verl.integration.cpu_host.after_import import when_imported

logger = logging.getLogger(__name__)

TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
_said: set[str] = set()


def group_of(key: str) -> str | None:
    """The uid in verl's v1 sample key `{uid}_{session}_{output}`, or None for a key of another form."""
    parts = key.rsplit("_", 2)
    if len(parts) != 3 or not parts[0] or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return parts[0]


def group_order(keys: Sequence[str], seq_lens: Sequence[int], ranks: int) -> tuple[list[int] | None, str | None]:
    """(new order of the samples, None): whole groups balanced over `ranks` equal contiguous chunks, each
    group contiguous; or (None, why not)."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        uid = group_of(key)
        if uid is None:
            return None, f"sample key {key!r} is not verl's uid_session_output"
        groups.setdefault(uid, []).append(i)
    sizes = sorted({len(members) for members in groups.values()})
    if len(sizes) != 1:
        return None, f"groups of {sizes} samples (whole groups per rank need one size)"
    if len(groups) % ranks:
        return None, f"{len(groups)} groups do not divide over {ranks} ranks"
    from verl.utils.seqlen_balancing import get_group_balanced_partitions

    laid_out = [i for members in groups.values() for i in members]  # group by group
    uids = [uid for uid, members in groups.items() for _ in members]
    parts = get_group_balanced_partitions(seqlen_list=[int(seq_lens[i]) for i in laid_out], uid_list=uids,
                                          k_partitions=ranks)
    return [laid_out[j] for part in parts for j in part], None


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning("hilore-verl: %s", message)


def _wrap(module) -> None:
    trainer_cls = module.PPOTrainer
    balance = trainer_cls._balance_batch
    if getattr(balance, "__hilore_groups__", False):
        return

    @functools.wraps(balance)
    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", *args, **kwargs):
        batch = balance(self, batch, metrics, logging_prefix, *args, **kwargs)
        if not self.config.actor_rollout_ref.actor.get("use_prefix_grouper", False):
            return batch
        ranks = max(self.actor_rollout_wg._dispatch_info["actor"]) + 1  # verl's balance cached it
        if ranks < 2:
            return batch
        seq_lens = [int(tag["seq_len"]) for tag in batch.tags]
        order, why = group_order(batch.keys, seq_lens, ranks)
        if order is None:
            _say_once(f"actor.use_prefix_grouper: verl's balance of single sequences kept: {why}")
            return batch
        _say_once(f"actor.use_prefix_grouper: whole prompt groups balanced over {ranks} ranks")
        batch.reorder(order)
        per_rank = len(order) // ranks
        metrics.update(module.log_seqlen_unbalance(
            seqlen_list=[seq_lens[i] for i in order],
            partitions=[list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ranks)], prefix=logging_prefix))
        return batch

    _balance_batch.__hilore_groups__ = True
    trainer_cls._balance_batch = _balance_batch


def install() -> list[str]:
    when_imported(TRAINER_MODULE, _wrap)
    return ["trainer:prefix-groups"]
