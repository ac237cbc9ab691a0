"""Health rules over the checkpoint metrics: owner, normal range, persistence, mitigation.

`rules.py` the options (HealthConfig, HealthRule, NormalRange, Persistence) and the default rules; `observe.py`
metrics from event documents; `evaluate.py` the rule engine (HealthEvaluator, Transition); `mitigations.py` the
actions (alert, lower the frequency, skip when busy, drill now, stop; user mitigations on their own thread);
`plugin.py` HealthWatch, the plug-in every front door runs.
"""
