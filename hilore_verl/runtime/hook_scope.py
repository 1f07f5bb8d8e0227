"""The saved-tensor hooks of one forward, switched off inside the calls where they could only keep
what they are handed.

Every save of a forward passes the runtime's pack hook, and in backward its unpack hook, which reads
the held tensor's version. In a forward that counts nothing, a kept unit's call whose every float
input would be kept wherever it is saved (`Forward.kept_made`) ends each save in the tensor autograd
would hold without hooks. For such a call the hooks are popped, and autograd holds the call's saves and
checks their versions itself; they are pushed back when the call returns, for a call inside it that
needs them, and for the rest of its own code once a call inside it returns a tensor that is not kept
wherever it is saved. They are popped only while they are the innermost saved-tensor hooks: hooks
pushed inside the model's forward (HF checkpointing around a layer, the user's) stay as they are.

    open forward          push                         on
      kept call, kept in   pop   (depth d recorded)    off
        recompute call     push  (depth d+1)           on
        ... returns        pop                         off
      ... returns          push                        on
    close                  pop
"""

from __future__ import annotations

import torch

# the innermost (pack, unpack) pair, or None; private in torch, present in every supported version
_innermost = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class HookScope:
    """The runtime's saved-tensor hooks for one forward: on from `__init__` to `close`, off in between
    for the calls `enter` is told need nothing of them."""

    __slots__ = ("hooks", "on", "switched")

    def __init__(self, pack, unpack):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.hooks.__enter__()
        self.on = True
        self.switched: list[int] = []  # frame depths where a call switched the hooks, innermost last

    def enter(self, depth: int, needed: bool) -> None:
        """The call at frame `depth` opens; `needed`: whether its saves must pass the hooks."""
        if needed == self.on:
            return
        if needed:
            self.hooks.__enter__()
        elif _innermost is None or (_innermost(False) or (None,))[0] is not self.hooks.pack_hook:
            return  # someone's hooks are inside ours: theirs see the saves, as without this scope
        else:
            self.hooks.__exit__()
        self.on = needed
        self.switched.append(depth)

    def leave(self, depth: int) -> None:
        """The calls at `depth` and deeper have returned (or an exception cut them short): the hooks
        as they were before the call at `depth` opened."""
        switched = self.switched
        while switched and switched[-1] >= depth:
            switched.pop()
            if self.on:
                self.hooks.__exit__()
            else:
                self.hooks.__enter__()
            self.on = not self.on

    def close(self) -> None:
        self.leave(0)
        self.hooks.__exit__()
