"""RL and preference-optimisation math in pure torch (no Ray, no process launch).

Each function states its formula, paper and tensor shapes; see the module docstrings.
"""

from megalith_chat.algorithms.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from megalith_chat.algorithms.aggregation import AGG_MODES, AggMode, aggregate_loss
from megalith_chat.algorithms.kl import KLEstimator, kl_estimate, kl_shaped_rewards
from megalith_chat.algorithms.logprobs import (
    IGNORE_INDEX,
    masked_mean,
    masked_sum,
    masked_whiten,
    sequence_logprobs,
    token_logprobs,
)
from megalith_chat.algorithms.policy_loss import (
    PolicyLossConfig,
    PolicyLossOutput,
    PolicyLossResult,
    clipped_value_loss,
    policy_loss,
    ppo_clip_token_losses,
    truncated_is_weights,
)
from megalith_chat.algorithms.preference import (
    PreferenceLossOutput,
    bradley_terry_loss,
    dpo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
)

__all__ = [
    "AGG_MODES",
    "IGNORE_INDEX",
    "AggMode",
    "KLEstimator",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "PolicyLossResult",
    "PreferenceLossOutput",
    "aggregate_loss",
    "bradley_terry_loss",
    "clipped_value_loss",
    "discounted_returns",
    "dpo_loss",
    "dr_grpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "kl_estimate",
    "kl_shaped_rewards",
    "kto_loss",
    "kto_reference_point",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "orpo_loss",
    "policy_loss",
    "ppo_clip_token_losses",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_logprobs",
    "simpo_loss",
    "token_logprobs",
    "truncated_is_weights",
]
