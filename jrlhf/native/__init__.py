"""Native CPU kernels called from XLA:CPU through the XLA FFI, and the one place that builds them.

``jrlhf.native.build`` compiles a kernel's C++ source (in this directory, with the headers beside
it: ``vector_math.h``, ``share_out.h``) on first use with the system's compiler, caches the
library and registers its handlers with JAX; each kernel's Python side says what runs instead
where no compiler is found. The kernels:

* ``panel_matmul.cc`` (``jrlhf.native.matmul``): few-row matmuls over packed weight panels, the
  decode steps' projections on CPU;
* ``masked_attention.cc`` (``jrlhf.native.attention``): full-sequence masked attention, forward
  and backward, for training, scoring and prefill on one CPU device;
* ``paged_attention_cpu.cc`` (``jrlhf.decode.kernels.native_cpu``): paged decode attention;
* ``token_pick.cc`` (``jrlhf.native.token_pick``): a decode step's token choice (argmax or
  Gumbel-max) and its log-probs from the logits, in one call.
"""
