"""Telemetry of the steady-state step: :mod:`.step_timeline` records where each step's time went (compute,
copies, CPU update, waits), for the reports and the cost model."""
