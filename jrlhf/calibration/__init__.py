"""Device profiles for the cost estimator, measured by running real steps.

``measure``: a profile from timed train, scoring, decode and reshard steps of small models on the
devices at hand (``python -m jrlhf.plan.calibrate``). ``from_bench``: a profile fitted to the
reports of ``python -m jrlhf.bench gpu`` (``--from-bench-gpu``), for accelerators measured
elsewhere. This package sits above ppo/ and pipeline/: it builds their steps to time them.
"""
