"""Every training loss of a mixture-of-experts model carries its router losses: SFT, the reward
model's Bradley-Terry, DPO, the PPO actor and the critic each add exactly
``router_aux_loss_coef * aux + router_z_loss_coef * z`` of their own forward's rows (the router
losses recomputed here from the model's routing stats over the rows' real tokens), and report
them in their metrics; with both coefficients 0 the loss is the dense one's form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrlhf.config import DPOConfig, RLConfig
from jrlhf.data.batch import pack
from jrlhf.models import ModelDef, tiny_config
from jrlhf.models.moe import EXPERTS, ROUTER_LOGITS, router_losses
from jrlhf.pipeline import supervised
from jrlhf.ppo import losses

P, R, AUX, Z = 4, 6, 0.5, 0.25


def _batch(name: str, rows: int = 4) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 60, 1 + i % P).tolist() for i in range(rows)]
    responses = [rng.integers(1, 60, 2 + i % (R - 1)).tolist() for i in range(rows)]
    b = pack(prompts, responses, P, R, 0)
    b.update(
        old_logprobs=rng.normal(-3, 0.1, (rows, R)).astype(np.float32),
        advantages=rng.normal(0, 1, (rows, R)).astype(np.float32),
        old_values=rng.normal(0, 1, (rows, R)).astype(np.float32),
        returns=rng.normal(0, 1, (rows, R)).astype(np.float32),
        # DPO's: a sequence's; the actor's KL term's: a token's
        ref_logprobs=rng.normal(-20, 1, (rows,) if name == "dpo" else (rows, R)),
        kl_coef=np.full((rows,), 0.1, np.float32),
    )
    return {
        k: jnp.asarray(v, jnp.float32 if v.dtype == np.float64 else v.dtype) for k, v in b.items()
    }


def _module(value_head: bool, aux: float, z: float):
    cfg = tiny_config(
        architecture="mixtral", num_experts=4, num_experts_per_tok=2, vocab_size=64,
        router_aux_loss_coef=aux, router_z_loss_coef=z,
    )  # fmt: skip
    model = ModelDef(cfg, head="value" if value_head else "lm")
    return model.bind(model.init(jax.random.key(0)))


LOSSES = {
    "sft": (False, lambda: supervised.sft_loss_fn(P)),
    "rm": (True, lambda: supervised.reward_loss_fn),
    "dpo": (False, lambda: supervised.dpo_loss_fn(P, DPOConfig())),
    "actor": (False, lambda: losses.actor_loss(P, RLConfig(), kl_in_loss=True)),
    "critic": (True, lambda: losses.critic_loss(P, RLConfig())),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_each_training_loss_adds_its_rows_router_losses(name):
    value_head, make = LOSSES[name]
    batch = _batch(name)
    plain, plain_metrics = make()(_module(value_head, 0.0, 0.0), batch)
    module = _module(value_head, AUX, Z)
    loss, metrics = make()(module, batch)
    _, stats = module.hidden(
        batch["tokens"], batch["positions"], batch["segment_ids"], with_stats=True
    )
    want = router_losses(stats[ROUTER_LOGITS], stats[EXPERTS], batch["segment_ids"] > 0)
    assert float(want["router_aux_loss"]) > 0.5 and float(want["router_z_loss"]) > 0
    np.testing.assert_allclose(
        float(loss - plain), AUX * want["router_aux_loss"] + Z * want["router_z_loss"],
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    for key in ("router_aux_loss", "router_z_loss", "moe_max_load"):
        np.testing.assert_allclose(metrics[key], want[key], rtol=1e-6, err_msg=key)
        np.testing.assert_allclose(plain_metrics[key], want[key], rtol=1e-6, err_msg=key)
