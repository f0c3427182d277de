"""Built-in rlhf-lightning plugins (installed as ``rlhf_lightning_plugins``).

Importing this package registers every built-in KL estimator, beta controller,
reward backend, advantage estimator, policy loss, loss aggregation and reference update; each module holds small classes with one idea each.
"""

from rlhf_lightning_plugins import beta_controllers, kl_estimators, reward_models, text_rewards  # noqa: F401
from rlhf_lightning_plugins import remote_reward  # noqa: F401
from rlhf_lightning_plugins import control  # noqa: F401
from rlhf_lightning_plugins import kl_straight_through  # noqa: F401
from rlhf_lightning_plugins import advantage_estimators, policy_losses  # noqa: F401
from rlhf_lightning_plugins import reference_updates  # noqa: F401
