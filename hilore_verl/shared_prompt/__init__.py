"""A GRPO group's prompt computed once: one prompt, then its n responses, in one packed row.

With causal attention a prompt's hidden states do not depend on the response that follows, so a
group's n copies of its prompt can be computed once. `layout` packs a micro-batch that way,
`attention` serves it as a transformers attention implementation, `logprobs` returns each response's
log-probs (and entropies) equal to the ordinary per-sequence forward; autograd sums each prompt's
gradient over its responses. Nothing here imports verl.

A leaf: imports nothing else of hilore_verl.
"""

from hilore_verl.shared_prompt.attention import (
    ATTENTION_NAME,
    LAYOUT_KWARG,
    install,
    shared_attention,
    shared_layout,
    shared_prompt_attention,
    uninstall,
)
from hilore_verl.shared_prompt.layout import GroupSpan, SharedLayout, ShareRule, shared_token_count
from hilore_verl.shared_prompt.logprobs import shared_log_probs, shared_logits, unshared_log_probs

__all__ = [
    "ATTENTION_NAME",
    "LAYOUT_KWARG",
    "GroupSpan",
    "ShareRule",
    "SharedLayout",
    "install",
    "shared_attention",
    "shared_layout",
    "shared_log_probs",
    "shared_logits",
    "shared_prompt_attention",
    "shared_token_count",
    "uninstall",
    "unshared_log_probs",
]
