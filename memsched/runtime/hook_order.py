"""Forward pre-hooks that run before a module's other hooks, in a form Dynamo can guard.

[Note: prepended hooks and Dynamo's guards]
``module.register_forward_pre_hook(hook, prepend=True)`` moves the new hook to the front of the module's
``OrderedDict`` of hooks (``move_to_end(..., last=False)``). That changes the order iterating the
``OrderedDict`` gives, but not the insertion order of the plain ``dict`` underneath it. Dynamo (seen with
torch 2.11) finds a hook by iterating the ``OrderedDict`` and then names it in its guards by its position in
``dict.keys(...)``, the plain order. Where the two orders differ, a guard reads another hook than the one
traced, and compiling fails with an internal error (``InternalTorchDynamoError: AttributeError:
'H2DWaits' object has no attribute 'oom'``). Re-inserting the hooks in their order after each prepend makes
the two orders agree; the hooks, their ids and their handles stay the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


def add_forward_pre_hook(module: torch.nn.Module, hook: Callable[..., Any], *, prepend: bool,
                         **kwargs: Any) -> RemovableHandle:
    """``module.register_forward_pre_hook(hook, prepend=prepend, **kwargs)`` (``with_kwargs`` passes
    through); after a prepend the hooks' insertion order is made equal to their order (see the note above).
    Returns the handle."""
    handle = module.register_forward_pre_hook(hook, prepend=prepend, **kwargs)
    if prepend:
        hooks = module._forward_pre_hooks
        items = list(hooks.items())
        hooks.clear()
        hooks.update(items)
    return handle
