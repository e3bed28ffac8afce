"""``python -m jrlhf.plan`` and ``python -m jrlhf.plan.calibrate``: the planner's commands.

The plans, the cost model and the search live in jrlhf.placement; the commands in jrlhf.cli.
"""
