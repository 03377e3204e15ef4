"""The autoscaling planner: replica counts from queue lag, SLO attainment and KV usage (policy.py),
run for real by ``pdserve planner`` (service.py) and evaluated in ``pdserve bench sim``."""
