"""The per-step runtime hooks a :class:`memsched.Scheduler` installs on the model.

:mod:`.warmup` runs the tracer of the warmup steps; :mod:`.waits` makes each module wait for its chunks' H2D
copies; :mod:`.read_guard` catches parameters read before their module's wait; :mod:`.elastic_hooks` feeds the
inputs' shapes and out-of-memory errors to the re-planner; :mod:`.compile_stance` keeps ``torch.compile``
eager while tracing (and warns that it stays eager on the stand-in device).
"""
