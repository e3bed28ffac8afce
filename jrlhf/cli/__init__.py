"""Command-line entry points, thin: parse arguments, check them, call the library.

``python -m jrlhf.train`` (and ``evaluate``, ``generate``, ``convert``, ``plan``, ``bench``,
``launch``) run the ``main`` of the module of the same name here.
"""
