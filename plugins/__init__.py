"""Built-in rlhf-lightning plugins (installed as ``rlhf_lightning_plugins``), one module per kind.

Importing this package registers every built-in KL estimator, beta controller, reward backend
(the ``rewards`` subpackage), advantage estimator, policy loss, loss aggregation, reference
update and rollout engine; each module holds small classes with one idea each.
"""

from rlhf_lightning_plugins import (  # noqa: F401
    advantage_estimators,
    beta_controllers,
    kl_estimators,
    policy_losses,
    reference_updates,
    rewards,
    rollout_engines,
)
