"""Devices: what memory the run has and how bytes cross between host and device.

:mod:`.spec` parses ``device=`` (``cuda``, ``cpu``, the stand-in ``sim:SIZE``, optionally with ``host=`` and
``link=``) into a :class:`DeviceSpec`; :mod:`.simdevice` is the capacity-limited stand-in accelerator;
:mod:`.host_memory` the pinned host budget; :mod:`.gpus` reads the GPUs through NVML; :mod:`.transfers` holds
the H2D/D2H copy streams (and the stand-in's modelled link) and byte counters.
"""
