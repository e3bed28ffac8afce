"""Command-line entry points, thin: parse arguments, check them, call the library.

``python -m jrlhf.train`` (and ``evaluate``, ``generate``, ``convert``, ``plan``, ``bench``,
``launch``) run the ``main`` of the module of the same name here.
"""

from jrlhf.devices import keep_host_memory

# Before any entry point imports JAX, whose import starts a thread: see keep_host_memory.
keep_host_memory()
