"""Run pipesim schedules on real devices and reconcile them with the simulator.

Not built yet: the multi-process runtime that executes the schedule IR, the
profiler and the reconciliation report arrive with the validation-harness issue.
"""
