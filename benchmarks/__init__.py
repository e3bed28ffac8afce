"""Benchmarks, outside the library: ``python -m jrlhf.bench NAME`` runs ``benchmarks/NAME.py``
from a source checkout, each printing one JSON object."""
