"""``skyrl_gym``: an environment of SkyRL-Gym (pip package ``skyrl-gym``, NovaSky-AI/SkyRL), the text-in, text-out
Gymnasium-style environments of the SkyRL trainer, as an rlhf-lightning environment.

SkyRL-Gym's ``BaseTextEnv`` has this project's shape: ``init(prompt)`` starts an episode from the prompt's chat
messages, ``step(action: str)`` takes the policy's turn and returns ``observations`` (chat messages), ``reward``,
``done`` and ``metadata``. The library is imported when the environment is built, so the plugin costs nothing
where it is not used and a missing package is one line naming it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from rlhf_lightning.interfaces import ConfigError, Environment, Step, require
from rlhf_lightning.registry import register
from rlhf_lightning_plugins.rewards.function import import_function

PACKAGE = "skyrl-gym"


def import_skyrl_gym():
    """The ``skyrl_gym`` module, or a ConfigError naming the pip package where it is not installed."""
    try:
        import skyrl_gym
    except ImportError as err:
        raise ConfigError(
            f"model.environment skyrl_gym needs the package {PACKAGE}: pip install {PACKAGE} "
            f"(or pip install -e '.[skyrl]' in this checkout); {err}"
        ) from err
    return skyrl_gym


@register("environment", "skyrl_gym", description="an environment of SkyRL-Gym (pip install skyrl-gym) by its id: gsm8k_multi_turn, ...")
class SkyRLGym(Environment):
    """A SkyRL-Gym environment (``skyrl_gym.make(env_id, env_config=..., extras=...)``), a fresh instance per
    episode: ``reset`` builds it and calls its ``init`` with the prompt as a user message, ``step`` passes the
    policy's turn (its text) and answers with the environment's observation messages joined by newlines (their
    contents, in ``role``), its reward (``Step.reward`` of the turn), ``done`` and its ``metadata`` as ``info``;
    the instance is closed when its episode ends.

    SkyRL's trainer gives each episode the ``env_extras`` of its dataset row (``reward_spec.ground_truth``, ...);
    here an episode gets ``extras`` (the same for every episode) with ``max_turns`` set to this environment's
    own and, where ``ground_truth`` names a function ``module:function(prompt) -> answer``, the prompt's answer
    as ``reward_spec.ground_truth`` and ``reward_model.ground_truth`` (a string, as SkyRL's datasets hold it):
    ``rlhf_lightning_plugins.rewards.verifiable:question_answer`` serves the arithmetic prompts. An environment
    whose ``init`` rewrites the prompt (adds a system message) is refused at its first episode: the prompt the
    policy sees is the prompt file's, so write what it adds there. SkyRL's environments take no seed.

    Args:
        env_id: the SkyRL-Gym id (``skyrl_gym.registry``: ``gsm8k``, ``gsm8k_multi_turn``, ``aime``, ...) or
            ``module:EnvName``.
        env_config: the environment's ``env_config`` (an OmegaConf config in SkyRL; a mapping here).
        extras: every episode's ``extras``, over the defaults above.
        ground_truth: ``module:function`` giving a prompt's answer, or null.
        role: the chat role of the environment's turns (SkyRL's environments answer as ``user``).
        **limits: the limits every environment takes (:class:`~rlhf_lightning.interfaces.Environment`).
    """

    thread_safe = True  # an instance per episode

    def __init__(
        self,
        env_id: str = "gsm8k_multi_turn",
        env_config: Optional[dict[str, Any]] = None,
        extras: Optional[dict[str, Any]] = None,
        ground_truth: Optional[str] = None,
        role: str = "user",
        **limits: Any,
    ) -> None:
        super().__init__(**limits)
        require(isinstance(role, str) and role != "", "environment.role", "a chat role (user, tool, ...)", role)
        skyrl_gym = import_skyrl_gym()
        try:
            skyrl_gym.spec(env_id)
        except Exception as err:  # skyrl_gym.error.Error, or an ImportError of a module:EnvName
            known = ", ".join(sorted(skyrl_gym.registry))
            raise ConfigError(
                f"environment.env_id must be a SkyRL-Gym environment ({known}) or module:EnvName, got {env_id!r} ({err})"
            ) from err
        self.env_id, self.role = env_id, role
        self.env_config = None if env_config is None else _omegaconf(env_config)
        self.extras = dict(extras or {})
        self.ground_truth: Optional[Callable[[str], Any]] = (
            None if ground_truth is None else import_function(ground_truth, "environment.ground_truth")
        )

    def episode_extras(self, prompt: str) -> dict[str, Any]:
        """The ``extras`` of ``prompt``'s episode (class docstring)."""
        extras: dict[str, Any] = {"max_turns": self.max_turns, "extra_info": {}}
        if self.ground_truth is not None:
            answer = str(self.ground_truth(prompt))
            extras["reward_spec"] = {"ground_truth": answer}
            extras["reward_model"] = {"ground_truth": answer}
        return {**extras, **self.extras}

    def reset(self, prompt: str, seed: int) -> Any:
        skyrl_gym = import_skyrl_gym()
        env = skyrl_gym.make(self.env_id, env_config=self.env_config, extras=self.episode_extras(prompt))
        messages = [{"role": "user", "content": prompt}]
        shown, _ = env.init(list(messages))
        if list(shown) != messages:
            env.close()
            raise ConfigError(
                f"model.environment: SkyRL-Gym environment {self.env_id!r} rewrites the prompt in init() ({shown!r}); "
                "put what it adds in the prompt file (data.train_path)"
            )
        return env

    def step(self, state: Any, turn_text: str, turn_ids: Sequence[int]) -> Step:
        out = state.step(turn_text)
        observation = "\n".join(str(message["content"]) for message in out.get("observations") or [])
        done = bool(out["done"])
        if done:
            state.close()
        reward = out.get("reward")
        return Step(
            observation=observation or None,
            reward=None if reward is None else float(reward),
            done=done,
            info=dict(out.get("metadata") or {}),
        )


def _omegaconf(config: dict[str, Any]) -> Any:
    """``config`` as the OmegaConf DictConfig SkyRL's environments read (``omegaconf`` comes with skyrl-gym)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(config)
