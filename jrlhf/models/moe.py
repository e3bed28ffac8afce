"""Mixture-of-experts MLP: a softmax top-k router and stacked SwiGLU experts (Qwen3-MoE, Mixtral).

Routing: ``probs = softmax(x @ router)`` in float32, the ``num_experts_per_tok`` largest kept as
the token's experts, their probabilities renormalized to sum to 1 where the family does
(``norm_topk_prob``: always for Mixtral, whose softmax over the top-k logits is the same thing).
Dropless: every token reaches every expert it chose; there is no capacity and nothing to report
as dropped.

Two ways to run the experts, same numbers (``ModelConfig.moe_impl``):

* ``ragged``: the (token, choice) pairs sorted by expert, one grouped matmul per projection
  (``jax.lax.ragged_dot``) over the contiguous groups, the outputs gathered back and weighted;
  the work is what the routing asks for (top_k / num_experts of the dense form's).
* ``dense``: every expert on every token, the outputs combined by the (mostly zero) routing
  weights; num_experts / top_k times the work, but plain einsums that GSPMD partitions over an
  ``expert`` mesh axis like any other weight axis.

Weights carry logical axes ``experts`` (the expert mesh axis), ``embed`` (FSDP) and
``expert_mlp`` (tensor), so expert, FSDP and tensor parallelism compose through the rule set
(jrlhf.meshes.rules).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrlhf.meshes.context import constrain, current_layout, shard_count
from jrlhf.meshes.rules import axis_size, logical_to_spec
from jrlhf.models.config import ModelConfig

# What a routed layer reports per token (stacked over layers by Transformer.run_layers):
# the router's float32 logits (..., num_experts) and the chosen experts (..., top_k).
ROUTER_LOGITS = "router_logits"
EXPERTS = "experts"


def choose_impl(requested: str) -> str:
    """The expert computation to trace: ``requested`` ("ragged" or "dense"), or for "auto"
    "ragged" unless the current rule set splits the experts over devices, then "dense".

    "ragged" with the experts split runs them expert-parallel under ``shard_map``
    (``experts_expert_parallel``) where the rows divide, else leaves the sorted form to GSPMD.
    Measured (forward + backward of a 2-layer model, hidden 128, 8 experts of 256, top-2,
    8 x 128 tokens, on the 8 fake CPU devices of a 2-core host; min of 5): one device ragged
    317 ms, dense 644 ms. Experts split, expert=8 / expert=4,tensor=2 / fsdp=2,expert=4:
    expert-parallel ragged 686 / 560 / 377 ms, dense 376 / 387 / 383 ms (GSPMD's ragged
    640 / 864 / 1997 ms: it cannot partition the sort-by-expert gather and replicates the
    tokens). On fake devices that share two cores the dense form's extra FLOPs cost less than
    the all-gather and sort of the expert-parallel one, hence "dense"; on real devices measure
    again (``moe_impl="ragged"``).
    """
    if requested != "auto":
        return requested
    return "dense" if shard_count("experts") > 1 else "ragged"


def route(logits_nx: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights (n, top_k) float32, experts (n, top_k) int32) from float32 router logits: the
    top-k of the softmax, renormalized over the chosen ones when ``normalize``."""
    probs = jax.nn.softmax(logits_nx.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def gated_activation(gate: jax.Array, up: jax.Array, act: str) -> jax.Array:
    """A gated MLP's hidden activation, ``act(gate) * up`` (``ModelConfig.hidden_act``:
    "gelu_tanh", else SiLU): the dense MLP's, the experts' and the shared expert's."""
    if act == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    return jax.nn.silu(gate) * up


def experts_ragged(x_ne, weights_nk, experts_nk, w_gate, w_up, w_down, act: str):
    """The experts' outputs combined, (n, e): the (token, choice) pairs sorted by expert and
    each projection one ``ragged_dot`` over the expert groups."""
    n, k = experts_nk.shape
    num = w_gate.shape[0]
    flat = experts_nk.reshape(-1)
    # stable: a token's pairs keep their order within an expert, so the result is deterministic
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=num).astype(jnp.int32)
    xs = jnp.take(x_ne, token, axis=0)
    gate = jax.lax.ragged_dot(xs, w_gate, sizes)
    up = jax.lax.ragged_dot(xs, w_up, sizes)
    out = jax.lax.ragged_dot(gated_activation(gate, up, act), w_down, sizes)  # (n * k, e), sorted
    unsort = jnp.argsort(order)
    out_nke = jnp.take(out, unsort, axis=0).reshape(n, k, -1)
    return jnp.einsum("nke,nk->ne", out_nke, weights_nk.astype(out_nke.dtype))


def experts_dense(x_ne, weights_nk, experts_nk, w_gate, w_up, w_down, act: str):
    """The experts' outputs combined, (n, e): every expert on every token, weighted by the
    routing weights (zero for experts a token did not choose)."""
    num = w_gate.shape[0]
    combine_nx = jnp.sum(
        jax.nn.one_hot(experts_nk, num, dtype=x_ne.dtype)
        * weights_nk[..., None].astype(x_ne.dtype),
        axis=1,
    )
    gate = jnp.einsum("ne,xef->nxf", x_ne, w_gate)
    up = jnp.einsum("ne,xef->nxf", x_ne, w_up)
    hidden = constrain(
        gated_activation(gate, up, act) * combine_nx[..., None], ("batch", "act_experts", "act_mlp")
    )
    return jnp.einsum("nxf,xfe->ne", hidden, w_down)


def _axes(part) -> tuple[str, ...]:
    if part is None:
        return ()
    return (part,) if isinstance(part, str) else tuple(part)


def expert_parallel_plan(batch: int):
    """(mesh, specs) for running the experts under ``shard_map`` (``experts_expert_parallel``),
    or None where that does not apply: outside ``activation_sharding``, experts not split, a
    batch the row axes do not divide, or expert axes that do not also split the rows."""
    layout = current_layout()
    if layout is None:
        return None
    mesh, rules = layout
    w_in = logical_to_spec(("experts", "embed", "expert_mlp"), mesh, rules)
    w_out = logical_to_spec(("experts", "expert_mlp", "embed"), mesh, rules)
    rows = logical_to_spec(("batch", None, None), mesh, rules)
    ep = _axes(w_in[0])
    if not ep or not set(ep) <= set(_axes(rows[0])) or batch % axis_size(mesh, rows[0]):
        return None
    return mesh, dict(w_in=w_in, w_out=w_out, rows=rows, ep=ep)


def experts_expert_parallel(x_bte, weights_btk, experts_btk, w_gate, w_up, w_down, act, plan):
    """The experts' outputs combined, (b, t, e), with the experts split over devices.

    Under ``shard_map``: each device all-gathers its expert group's tokens (their rows are
    split over the expert axis too), runs the (token, choice) pairs routed to its own experts
    through ``ragged_dot`` (pairs routed elsewhere sort last, outside every group, and come out
    zero), and the partial sums are reduce-scattered back to the rows' owners over the expert
    axis (summed over tensor, which splits each expert's width). FSDP-split weights are
    all-gathered over their ``embed`` axes first, as a dense layer's would be.
    """
    mesh, sp = plan
    ep, rows = sp["ep"], sp["rows"]
    tp = _axes(sp["w_in"][2])
    fsdp_in, fsdp_out = _axes(sp["w_in"][1]), _axes(sp["w_out"][2])
    num = w_gate.shape[0]
    local_num = num // axis_size(mesh, ep)

    def local(x, w, e, g, u, d):
        if fsdp_in:
            g = jax.lax.all_gather(g, fsdp_in, axis=1, tiled=True)
            u = jax.lax.all_gather(u, fsdp_in, axis=1, tiled=True)
        if fsdp_out:
            d = jax.lax.all_gather(d, fsdp_out, axis=2, tiled=True)
        b, t, emb = x.shape
        k = e.shape[-1]
        x = jax.lax.all_gather(x.reshape(b * t, emb), ep, axis=0, tiled=True)
        w = jax.lax.all_gather(w.reshape(b * t, k), ep, axis=0, tiled=True)
        e = jax.lax.all_gather(e.reshape(b * t, k), ep, axis=0, tiled=True)
        first = jax.lax.axis_index(ep) * local_num
        mine = (e >= first) & (e < first + local_num)
        # pairs of other devices' experts get group id local_num: after every group
        flat = jnp.where(mine, e - first, local_num).reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=local_num + 1)[:local_num].astype(jnp.int32)
        xs = jnp.take(x, order // k, axis=0)
        hidden = gated_activation(
            jax.lax.ragged_dot(xs, g, sizes), jax.lax.ragged_dot(xs, u, sizes), act
        )
        out = jax.lax.ragged_dot(hidden, d, sizes)
        out = jnp.take(out, jnp.argsort(order), axis=0).reshape(x.shape[0], k, emb)
        w = jnp.where(mine, w, 0).astype(out.dtype)
        y = jnp.einsum("nke,nk->ne", out, w)
        if tp:
            y = jax.lax.psum(y, tp)
        y = jax.lax.psum_scatter(y, ep, scatter_dimension=0, tiled=True)
        return y.reshape(b, t, emb)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, sp["w_in"], sp["w_in"], sp["w_out"]),
        out_specs=rows,
        check_vma=False,
    )(x_bte, weights_btk, experts_btk, w_gate, w_up, w_down)


class MoE(nnx.Module):
    """The routed MLP of one layer: returns (output (b, t, e), routing stats)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param: Callable[..., nnx.Param]):
        """``param(rngs, cfg, shape, axes)`` makes each weight (the transformer's initializer,
        passed in so both modules draw their weights the same way)."""
        _param = param
        e, f, x = cfg.hidden_size, cfg.expert_size, cfg.num_experts
        self.dtype = cfg.jnp_dtype
        self.hidden_act = cfg.hidden_act
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.impl = cfg.moe_impl
        # the router's expert axis stays whole: every token needs all its logits for the top-k
        self.router_kernel = _param(rngs, cfg, (e, x), ("embed", None))
        self.gate_experts = _param(rngs, cfg, (x, e, f), ("experts", "embed", "expert_mlp"))
        self.up_experts = _param(rngs, cfg, (x, e, f), ("experts", "embed", "expert_mlp"))
        self.down_experts = _param(rngs, cfg, (x, f, e), ("experts", "expert_mlp", "embed"))
        self.shared = cfg.shared_expert_size
        if self.shared:  # Qwen2-MoE's shared expert: a dense SwiGLU MLP and a sigmoid gate
            s = cfg.shared_expert_size
            self.shared_gate_kernel = _param(rngs, cfg, (e, s), ("embed", "mlp"))
            self.shared_up_kernel = _param(rngs, cfg, (e, s), ("embed", "mlp"))
            self.shared_down_kernel = _param(rngs, cfg, (s, e), ("mlp", "embed"))
            self.shared_expert_gate = _param(rngs, cfg, (e, 1), ("embed", None))

    def __call__(self, x_bte: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        dt = self.dtype
        lead, e = x_bte.shape[:-1], x_bte.shape[-1]
        x_ne = x_bte.reshape(-1, e)
        logits_nx = jnp.matmul(
            x_ne, self.router_kernel[...].astype(dt), preferred_element_type=jnp.float32
        )
        weights_nk, experts_nk = route(logits_nx, self.top_k, self.normalize)
        # HF rounds the routing weights to the compute dtype before the weighted sum
        weights_nk = weights_nk.astype(dt)
        weights = (
            self.gate_experts[...].astype(dt),
            self.up_experts[...].astype(dt),
            self.down_experts[...].astype(dt),
        )
        impl = choose_impl(self.impl)
        plan = expert_parallel_plan(lead[0]) if impl == "ragged" and len(lead) == 2 else None
        if plan is not None:  # experts split over devices: dispatch under shard_map
            k = self.top_k
            out_ne = experts_expert_parallel(
                x_bte,
                weights_nk.reshape(*lead, k),
                experts_nk.reshape(*lead, k),
                *weights,
                self.hidden_act,
                plan,
            ).reshape(-1, e)
        else:
            run = experts_ragged if impl == "ragged" else experts_dense
            out_ne = run(x_ne, weights_nk, experts_nk, *weights, self.hidden_act)
        if self.shared:
            hidden = gated_activation(
                jnp.matmul(x_ne, self.shared_gate_kernel[...].astype(dt)),
                jnp.matmul(x_ne, self.shared_up_kernel[...].astype(dt)),
                self.hidden_act,
            )
            shared = jnp.matmul(hidden, self.shared_down_kernel[...].astype(dt))
            gate = jax.nn.sigmoid(jnp.matmul(x_ne, self.shared_expert_gate[...].astype(dt)))
            out_ne = out_ne.astype(dt) + gate * shared
        stats = {
            ROUTER_LOGITS: logits_nx.reshape(*lead, -1),
            EXPERTS: experts_nk.reshape(*lead, -1),
        }
        return out_ne.reshape(*lead, e).astype(dt), stats


def router_losses(
    logits_lbtx: jax.Array, experts_lbtk: jax.Array, mask_bt: jax.Array
) -> dict[str, jax.Array]:
    """The load-balancing loss and the router z-loss over the real tokens (``mask_bt``),
    averaged over layers, from the per-layer routing stats (leading ``layers`` axis).

    balance: ``num_experts * sum_e f_e * P_e`` with f_e the fraction of (token, choice) pairs
    routed to e and P_e the mean router probability of e (1.0 when perfectly balanced);
    z: mean ``logsumexp(logits)^2``. Also the busiest expert's share of the pairs over its fair
    share (``moe_max_load``, 1.0 balanced), for the metrics.
    """
    num = logits_lbtx.shape[-1]
    mask = mask_bt.astype(jnp.float32)[None]  # (1, b, t)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    probs = jax.nn.softmax(logits_lbtx.astype(jnp.float32), axis=-1)
    mean_prob_lx = jnp.sum(probs * mask[..., None], axis=(1, 2)) / tokens
    counts = jnp.sum(jax.nn.one_hot(experts_lbtk, num) * mask[..., None, None], axis=(1, 2, 3))
    frac_lx = counts / (tokens * experts_lbtk.shape[-1])
    balance = num * jnp.mean(jnp.sum(jax.lax.stop_gradient(frac_lx) * mean_prob_lx, axis=-1))
    lse = jax.nn.logsumexp(logits_lbtx.astype(jnp.float32), axis=-1)
    z = jnp.mean(jnp.sum(lse**2 * mask, axis=(1, 2)) / tokens)
    max_load = jnp.mean(jnp.max(frac_lx, axis=-1) * num)
    return {"router_aux_loss": balance, "router_z_loss": z, "moe_max_load": max_load}


def add_router_losses(cfg, stats, real_bt: jax.Array, loss: jax.Array, metrics: dict):
    """A training loss with a routed model's router losses (:func:`router_losses` over the
    real tokens ``real_bt`` of the rows, from ``Transformer.hidden``'s ``stats``) added times
    ``cfg.router_aux_loss_coef`` / ``cfg.router_z_loss_coef``, and the metrics with them (and
    ``moe_max_load``) whatever the coefficients; both unchanged for a dense model (no stats)."""
    if not stats:
        return loss, metrics
    router = router_losses(stats[ROUTER_LOGITS], stats[EXPERTS], real_bt)
    loss = loss + cfg.router_aux_loss_coef * router["router_aux_loss"]
    loss = loss + cfg.router_z_loss_coef * router["router_z_loss"]
    return loss, dict(metrics, **jax.lax.stop_gradient(router))


def routing_mismatch(rollout: np.ndarray, train: np.ndarray) -> dict[str, float]:
    """How often a training pass routed differently from the rollout, over the same tokens:
    ``rollout`` and ``train`` are (tokens, layers, top_k) chosen experts (the decode engine's
    ``GenerationResult.routes`` and ``Transformer.hidden``'s stats at the same columns).

    ``layer_mismatch``: the fraction of (token, layer) pairs whose expert sets differ (the
    order within the top-k is not a difference); ``token_mismatch``: the fraction of tokens
    with a difference in any layer.
    """
    rollout, train = np.sort(np.asarray(rollout), -1), np.sort(np.asarray(train), -1)
    if rollout.shape != train.shape:
        raise ValueError(f"routes of shapes {rollout.shape} and {train.shape} do not pair up")
    differ = np.any(rollout != train, axis=-1)  # (tokens, layers)
    if differ.size == 0:
        return {"layer_mismatch": 0.0, "token_mismatch": 0.0}
    return {
        "layer_mismatch": float(differ.mean()),
        "token_mismatch": float(differ.any(axis=-1).mean()),
    }


def rollout_routing_metrics(
    rollout_brlk, train_brlk, rollout_lp_br, train_lp_br, mask_br
) -> dict[str, float]:
    """The ``moe/*`` metrics of a training batch: ``routing_mismatch`` of the rollout's
    recorded routes against the training pass's over the real response tokens (``mask_br``),
    and the mean ``|rollout log-prob - training log-prob|`` over all of them, over those routed
    differently in some layer and over the rest (each left out when it has no tokens)."""
    real = np.asarray(mask_br, bool)
    rollout, train = np.asarray(rollout_brlk)[real], np.asarray(train_brlk)[real]
    gap = np.abs(np.asarray(rollout_lp_br, np.float64) - np.asarray(train_lp_br))[real]
    rerouted = np.any(np.sort(rollout, -1) != np.sort(train, -1), axis=(-1, -2))
    out = {f"moe/{k}": v for k, v in routing_mismatch(rollout, train).items()}
    for name, tokens in (("", gap), ("_rerouted", gap[rerouted]), ("_same_routes", gap[~rerouted])):
        if tokens.size:
            out[f"moe/logprob_gap{name}"] = float(tokens.mean())
    return out
