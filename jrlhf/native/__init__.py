"""Native CPU kernels called from XLA:CPU through the XLA FFI, and the one place that builds them.

``jrlhf.native.build`` compiles a kernel's C++ source (in this directory, with the headers beside
it: ``vector_math.h``, ``share_out.h``) on first use with the system's compiler, caches the
library and registers its handlers with JAX; each kernel's Python side says what runs instead
where no compiler is found. The kernels:

* ``panel_matmul.cc`` (``jrlhf.native.matmul``): few-row matmuls over packed weight panels, the
  decode steps' projections on CPU;
* ``masked_attention.cc`` (``jrlhf.native.attention``): full-sequence masked attention, forward
  and backward, for training, scoring and prefill on one CPU device;
* ``paged_attention_cpu.cc`` (``jrlhf.native.paged_attention``): paged decode attention;
* ``token_pick.cc`` (``jrlhf.native.token_pick``): a decode step's token choice (argmax or
  Gumbel-max) and its log-probs from the logits, in one call.

Importing this package registers the four kernels with jrlhf.kernels for the "cpu" backend;
jrlhf.kernels imports it on a CPU process's first kernel lookup, and nothing else does: models/
and decode/ never import it, so a GPU or TPU process never loads or builds it.
"""

from jrlhf import kernels
from jrlhf.native import attention, matmul, paged_attention, token_pick


def _register() -> None:
    def kernel(op, fn, module, **queries):
        return kernels.Kernel(op, fn, module.available, module.unavailable_reason, queries)

    for k in (
        kernel("masked_attention", attention.masked_attention, attention),
        kernel("few_row_matmul", matmul.few_row_matmuls, matmul, fast_here=matmul.fast_here),
        kernel("token_pick", token_pick.pick_tokens, token_pick),
        kernel(
            "paged_attention",
            paged_attention.paged_attention_native,
            paged_attention,
            supports=paged_attention.supports,
        ),
    ):
        kernels.register("cpu", k)


_register()
