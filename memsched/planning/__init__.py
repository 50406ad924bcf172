"""Planning: from the warmup trace to a placement plan, and the plan's life after it.

:mod:`.planner` holds the plan in force (end of warmup, re-plans, chunk moves); :mod:`.problem` builds the
:class:`policies.PlacementProblem` from the model and the trace; :mod:`.first_use` orders parameters by the
traced modules; :mod:`.cost_model` predicts a plan's step from the last warmup step; :mod:`.elastic` re-plans
when the inputs' shapes change; :mod:`.prediction` and :mod:`.capacity` answer ``memsched plan`` under
``FakeTensorMode``.
"""
