"""Compiled, cached transitions between shardings; the zero-redundancy layout chooser; memory plan.

Only this package moves parameters between layouts (design.md section 3).
"""

from jrlhf.reshard.layout import (
    bytes_moved,
    bytes_per_device,
    choose_generation_mesh,
    moved_bytes_per_device,
    naive_generation_mesh,
)
from jrlhf.reshard.memory import (
    ParkedTree,
    host_memory_kind,
    live_bytes,
    park_to_host,
    restore_from_host,
)
from jrlhf.reshard.resharder import (
    MemoryBudgetError,
    Resharder,
    Transition,
    TransitionKey,
    backend_compile_count,
    transition_key,
)

__all__ = [
    "MemoryBudgetError",
    "ParkedTree",
    "Resharder",
    "Transition",
    "TransitionKey",
    "backend_compile_count",
    "bytes_moved",
    "bytes_per_device",
    "choose_generation_mesh",
    "host_memory_kind",
    "live_bytes",
    "moved_bytes_per_device",
    "naive_generation_mesh",
    "park_to_host",
    "restore_from_host",
    "transition_key",
]
