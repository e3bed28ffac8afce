"""Native CPU kernels called from XLA:CPU through the XLA FFI, and the one place that builds them.

``jrlhf.native.build`` compiles a kernel's C++ source on first use with the system's compiler,
caches the library and registers its handler with JAX; each kernel's Python side says what it
falls back to where no compiler is found. The kernels: the few-row matmul over packed weight
panels (``jrlhf.native.matmul``, decode steps on CPU) here, and paged decode attention in
``jrlhf.decode.kernels.native_cpu``.
"""
