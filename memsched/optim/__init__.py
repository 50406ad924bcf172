"""The hybrid optimizer and its update paths (DeepSpeed ZeRO-Offload's CPU Adam, PatrickStar's chunk-wise
placement).

:mod:`.hybrid_adamw` is :class:`HybridAdamW`, the step's order; it holds :mod:`.grads` (the step's gradient
checks and clipping), :mod:`.host_updates` (the CPU worker of ``overlap=True``, with its own intra-op
threads; the gradients' D2H during backward is :mod:`memsched.chunks.grad_offload`), :mod:`.early_update`
(``overlap="backward"``) and :mod:`.precision` (the fp16 loss scaler). :mod:`.adam` is the fused kernel
call, :mod:`.clipping` the norm arithmetic, :mod:`.hyperparams` the param groups, :mod:`.state_dict` torch's
AdamW state-dict format.
"""
