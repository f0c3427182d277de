"""The ``callable`` reward backend: any Python function ``module:function(prompts, responses, **kwargs)``.

Toy functions for it are in :mod:`rlhf_lightning_plugins.rewards.toy`."""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

from torch import Tensor

from rlhf_lightning.checks import plugin_field
from rlhf_lightning.interfaces import ConfigError, RewardModel, require_number
from rlhf_lightning.registry import canonical_class_path, register


def import_function(spec: str, field: str = "reward_model.function") -> Callable:
    """Import ``package.module:function`` (only what the config names; a built-in function named
    where it lived before it moved, ``rlhf_lightning_plugins.toy_rewards:char_count``, where it is now)."""
    field = plugin_field(field)
    module_name, sep, attr = canonical_class_path(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{field} must look like 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{field}: {module_name!r} has no callable {attr!r}")
    return fn


@register("reward_model", "callable", description="any Python function module:function(prompts, responses) -> scores")
class CallableReward(RewardModel):
    """Scores with ``function(prompts, responses, **kwargs)``, named as ``'package.module:function'``.

    The function's signature is checked against ``(prompts, responses, **kwargs)`` at start-up,
    before any model loads. With ``timeout`` (seconds) a call that has not returned by then stops
    the run with a TimeoutError; Python cannot stop a thread, so the call keeps running in the
    background until it returns. A function that exits (``sys.exit``, SystemExit,
    KeyboardInterrupt) stops the run with a RuntimeError naming it, like one that raises.
    """

    def __init__(
        self,
        function: str = "rlhf_lightning_plugins.rewards.toy:char_count",
        kwargs: Optional[dict[str, Any]] = None,
        timeout: Optional[float] = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        require_number("reward_model.timeout", timeout, above=0, optional=True)
        self.function = function
        self.kwargs = dict(kwargs or {})
        self.timeout = timeout
        self.fn = import_function(function)
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # some builtins have none to check
            signature = None
        if signature is not None:
            try:
                signature.bind(["prompt"], ["response"], **self.kwargs)
            except TypeError as err:
                empty = inspect.Parameter.empty  # shown without annotations: the names are what must match
                signature = signature.replace(
                    parameters=[q.replace(annotation=empty) for q in signature.parameters.values()], return_annotation=empty
                )
                raise ConfigError(
                    f"{plugin_field('reward_model.function')} {function}{signature} cannot be called as (prompts, responses"
                    f"{''.join(f', {k}=...' for k in self.kwargs)}) with {plugin_field('reward_model.kwargs')} {self.kwargs}: {err}"
                ) from None

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor | Sequence[float]:
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["scores"] = self.fn(list(prompts), list(responses), **self.kwargs)
            except BaseException as err:  # SystemExit and KeyboardInterrupt too: they must not end a worker silently
                outcome["error"] = err

        if self.timeout is None:
            call()
        else:
            worker = threading.Thread(target=call, name=f"reward {self.function}", daemon=True)
            worker.start()
            worker.join(self.timeout)
            if worker.is_alive():
                raise TimeoutError(f"reward function {self.function} did not return within reward_model.timeout={self.timeout}s")
        err = outcome.get("error")
        if isinstance(err, SystemExit):
            raise RuntimeError(
                f"reward function {self.function} called sys.exit({err.code!r}); a reward function must return scores"
            ) from err
        if err is not None:
            raise RuntimeError(f"reward function {self.function} raised {type(err).__name__}: {err}") from err
        return outcome["scores"]
