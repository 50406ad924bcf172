"""Imported by the ZeRO tests' fork server (tests/_dist_utils.py): the stand-in device is registered there, so
the ranks it forks know ``torch.device("sim")``; no backward runs there (the forked ranks use autograd)."""

from memsched.devices import sim_backend

sim_backend.load(check_autograd=False)
