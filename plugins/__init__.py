"""Built-in rlhf-lightning plugins (installed as ``rlhf_lightning_plugins``).

Importing this package registers every built-in KL estimator, beta controller,
reward backend, advantage estimator, policy loss, loss aggregation and reference update; each module holds small classes with one idea each.
"""

from rlhf_lightning_plugins import (  # noqa: F401  # noqa: F401
    advantage_estimators,
    beta_controllers,
    control,  # noqa: F401
    kl_estimators,
    kl_straight_through,  # noqa: F401
    policy_losses,
    reference_updates,  # noqa: F401
    remote_reward,  # noqa: F401
    reward_models,
    text_rewards,
    verifiable_rewards,  # noqa: F401
)
