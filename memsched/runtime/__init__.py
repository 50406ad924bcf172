"""The per-step runtime hooks a :class:`memsched.Scheduler` installs on the model.

:mod:`.warmup` runs the tracer of the warmup steps; :mod:`.waits` makes each module wait for its chunks' H2D
copies; :mod:`.read_guard` catches parameters read before their module's wait; :mod:`.param_fetch` brings
parameters kept on the host (or ZeRO-3's shards) to the device for their reads, with its rooms beside it
(:mod:`.fetch_hooks`, :mod:`.fetch_schedule`, :mod:`.residency`, :mod:`.saved_params`,
:mod:`.read_recording`); :mod:`.elastic_hooks` feeds the inputs' shapes and out-of-memory errors to the
re-planner; :mod:`.compile_stance` keeps ``torch.compile`` eager while tracing (graphs on the stand-in run
through ``aot_eager``, said once: :mod:`memsched.devices.sim_backend`); :mod:`.move_guard` refuses moving or
converting the attached model after attach; :mod:`.device_errors` explains torch's errors in its forward (an
input on another device, a CUDA out-of-memory error's numbers).
"""
