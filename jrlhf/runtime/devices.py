"""Host-device setup for command-line entry points.

On a machine without an accelerator, the entry points ask XLA for several virtual CPU devices so
that meshes, shardings and mesh switches are real. This must happen before JAX initializes its
backends, so call ``ensure_host_devices`` before the first JAX computation. This module is the one
place that writes XLA's device-count flag: the entry points (directly or through
``jrlhf.runtime.distributed``) and the multi-process launcher (``jrlhf.cli.launch``) all use it.
"""

from __future__ import annotations

import os
import re

HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# The flag with its value, as XLA accepts it (``--flag=N``; a space before the value is not read).
_FLAG_RE = re.compile(r"\s*--xla_force_host_platform_device_count(=\S*)?")


def with_host_device_count(flags: str, count: int) -> str:
    """``flags`` (an XLA_FLAGS value) with the virtual CPU device count set to ``count``.

    Replaces a count already in ``flags``: the launcher uses this to give each process exactly the
    count it was asked for, whatever the caller's environment held.
    """
    if count < 1:
        raise ValueError(f"host device count must be >= 1, got {count}")
    rest = _FLAG_RE.sub("", flags).strip()
    return f"{rest} {HOST_DEVICE_FLAG}={count}".strip()


def ensure_host_devices(count: int = 8) -> None:
    """Request ``count`` virtual CPU devices unless the user already chose a device setup."""
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICE_FLAG.lstrip("-") in flags:
        return
    os.environ["XLA_FLAGS"] = with_host_device_count(flags, count)
