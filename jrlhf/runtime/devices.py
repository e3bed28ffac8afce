"""Host-device setup for command-line entry points.

On a machine without an accelerator, the entry points ask XLA for several virtual CPU devices so
that meshes, shardings and mesh switches are real. This must happen before JAX initializes its
backends, so call ``ensure_host_devices`` before the first JAX computation.
"""

from __future__ import annotations

import os


def ensure_host_devices(count: int = 8) -> None:
    """Request ``count`` virtual CPU devices unless the user already chose a device setup."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
