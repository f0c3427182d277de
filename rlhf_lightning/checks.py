"""Configuration checks: the one error type and the one helper every setting is checked with; the start-up
checks, of what the arguments alone do not tell (the tokenizer, the prompt files, a model's context, the
first rollout: the rules across the arguments are args.py's); and the fault counts of a run.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from rlhf_lightning.args import PPOArgs, PromptArgs, SamplingArgs


def finite_number(value: Any) -> bool:
    """An int or float that is neither inf nor nan (what a numeric setting must be)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


# Where a number that multiplies or divides the float32 KLs and rewards must lie (a beta; a KL target or budget): float32's
# normal numbers, rounded inward, so that none is an inf there, or a 0 that drops the regulariser without a word.
FLOAT32_RANGE = (1e-37, 3e38)


class ConfigError(ValueError):
    """A setting, a file it names, or a plugin's output that cannot work; its message names the
    field. The command prints it and exits with status 2, without a traceback."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """A file that a setting names does not exist; ``missing``, where set, is the path as the setting gives it
    (the command looks for it in the config's header, which may name the command that makes it)."""


def missing_file(message: str, path) -> ConfigFileNotFoundError:
    """:class:`ConfigFileNotFoundError` of ``message`` for the setting's ``path``."""
    err = ConfigFileNotFoundError(message)
    err.missing = str(path)
    return err


def require(condition: bool, field: str, requirement: str, value: Any) -> None:
    """Unless ``condition``: ``ConfigError("<field> must be <requirement>, got <value>")``, the one
    shape of every configuration error (``field`` as the user writes it: ``model.optim.lr``,
    ``KLGuard.max_kl``). A plugin names its arguments by its kind (``beta_controller.target``); while
    the command builds it for a module argument, the field is that argument's
    (``model.entropy_controller.init_args.target``: :func:`plugin_field`)."""
    if not condition:
        raise ConfigError(f"{plugin_field(field)} must be {requirement}, got {value!r}")


# A plugin's own argument as it names it: its kind, then the argument (``reward_model.url``).
_PLUGIN_FIELD = re.compile(r"(?!(?:model|data|trainer|cpu)\.)[a-z][a-z0-9_]*\.(\w+)")

# The module argument (``model.entropy_controller``) whose plugin the command is building, if any.
_BUILDING: ContextVar[Optional[str]] = ContextVar("building_plugin_for", default=None)


@contextlib.contextmanager
def building_plugin_for(key: str) -> Iterator[None]:
    """Within: plugins are built for the module argument ``key`` (``model.entropy_controller``), so
    their checks name their arguments under it (:func:`plugin_field`). The command enters it around
    its parser's building of each ``model.*`` argument (``cli.name_plugin_arguments``)."""
    token = _BUILDING.set(key)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def plugin_field(field: str) -> str:
    """``field`` as the user wrote it: a plugin's argument (``beta_controller.target``) is qualified by
    the module argument the command is building the plugin for (:func:`building_plugin_for`;
    ``model.entropy_controller``: the same class serves two arguments), into
    ``model.entropy_controller.init_args.target``; any other field, or a plugin built in Python, as it is."""
    match = _PLUGIN_FIELD.fullmatch(field)
    key = _BUILDING.get()
    return field if match is None or key is None else f"{key}.init_args.{match.group(1)}"


def unused_settings(prefix: str, group: Any, names: tuple[str, ...], why: str) -> Optional[str]:
    """The warning of the fields ``names`` of the settings dataclass ``group`` (``model.off_policy.``: ``prefix``) set away
    from their defaults where ``why`` says nothing reads them (a timeout without a sampler thread), so that a setting is
    never ignored unsaid; None where every one is at its default."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(group)}
    changed = [f"{prefix}{name} {getattr(group, name)!r}" for name in names if getattr(group, name) != defaults[name]]
    return f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} not used {why}" if changed else None


def require_number(
    field: str,
    value: Any,
    *,
    above: Optional[float] = None,
    at_least: Optional[float] = None,
    below: Optional[float] = None,
    at_most: Optional[float] = None,
    integer: bool = False,
    optional: bool = False,
) -> None:
    """The one check of a numeric setting: an int or float (an int with ``integer``; never a bool),
    finite (YAML's ``.inf`` and ``.nan`` parse as floats), within the bounds given, or None with
    ``optional``. Else ``ConfigError("<field> must be a finite number > 0, got inf")``, the
    requirement spelt from the bounds (``an integer >= 1``, ``a finite number in (0, 1]``)."""
    if optional and value is None:
        return
    low = (f"> {above}", f"({above}") if above is not None else (f">= {at_least}", f"[{at_least}") if at_least is not None else None
    high = (f"< {below}", f"{below})") if below is not None else (f"<= {at_most}", f"{at_most}]") if at_most is not None else None
    bounds = f" in {low[1]}, {high[1]}" if low and high else f" {(low or high)[0]}" if low or high else ""
    requirement = ("an integer" if integer else "a finite number") + bounds + (", or null" if optional else "")
    number = isinstance(value, int) if integer else finite_number(value)
    # Short-circuit: the bounds are compared only once the value is a number.
    ok = number and not isinstance(value, bool)
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    ok = ok and (below is None or value < below) and (at_most is None or value <= at_most)
    require(ok, field, requirement, value)


def check_prompt_table(table, controller, teacher_template: Optional[str], datamodule) -> None:
    """What names the training prompts by their file's rows has one: a per-prompt beta controller (their ids and
    budgets) and ``model.prompts.teacher_template`` (their teacher prompts); ``table`` the ``data.PromptTable`` of
    the training prompts, None where batches come from no prompt file."""
    data = f"data {type(datamodule).__name__ if datamodule is not None else 'from a dataloader'}"
    require(
        table is not None or not controller.keyed_by_prompt,
        "model.beta_controller",
        "a controller with one beta for all prompts when the training batches come from no prompt file (a "
        "per-prompt controller names its prompts by the ids of PromptDataModule's data.train_path)",
        f"{type(controller).__name__} with {data}",
    )
    require(
        teacher_template is None or (table is not None and table.teacher is not None),
        "model.prompts.teacher_template",
        "null when the training batches come from no prompt file (the teacher's prompt is rendered from each prompt's row "
        "of PromptDataModule's data.train_path)",
        f"{teacher_template!r} with {data}",
    )


def check_setup(module, datamodule, stage: str, check_prompts: Callable, prompt_place: Callable) -> Optional[int]:
    """At start-up, once the tokenizer is loaded and before any model is: the batch split; every
    prompt of the data module's files (special-token strings, rendered length, and each reward
    backend's own check: ``RewardModel.check_prompts``); a nucleus that keeps one token; an entropy
    target the policy can reach. Returns the longest rendered prompt in tokens, the teacher's
    (``model.prompts.teacher_template``) among them (None without prompt files), for
    :func:`check_context` once the policy's context is known. ``check_prompts`` and ``prompt_place`` are data.py's
    (handed in: data.py reads this file's checks)."""
    if stage == "fit" and getattr(datamodule, "batch_size", None):
        check_batch_split(datamodule.batch_size, module.sampling, module.ppo)
        world = module.trainer.world_size if module._trainer is not None else 1
        for role in ("beta_controller", "entropy_controller"):
            if getattr(module, role) is not None:
                per_prompt = module.sampling.num_generations
                getattr(module, role).check_batch(datamodule.batch_size * per_prompt * world, per_prompt, f"model.{role}")
    longest, settings = None, module.prompts
    for name in ("train_prompts", "val_prompts"):
        prompts, field = getattr(datamodule, name, None), f"data.{name.split('_')[0]}_path"
        if prompts:
            path = getattr(datamodule, field.split(".")[1], None)
            place = (
                (lambda prompt, path=path, field=field: prompt_place(path, getattr(datamodule, "prompt_column", "prompt"), field, prompt))
                if path
                else None
            )
            length = check_prompts(
                module.tokenizer, prompts, settings.chat_template, settings.max_length, settings.special_tokens, field, place
            )
            longest = max(longest or 0, length)
            for role in ("reward_model", "gold_reward_model"):
                if getattr(module, role) is not None:
                    getattr(module, role).check_prompts(prompts, field, f"model.{role}")
    table = getattr(module, "prompt_table", None)
    if table is not None and table.teacher is not None:  # the teacher's prompts are scored in the same context
        enc = module.prompts.encode(module.tokenizer, list(table.teacher.values()), "model.prompts.teacher_template")
        longest = max(longest or 0, int(enc["attention_mask"].sum(-1).max()))
    sampling, vocab = module.sampling, len(module.tokenizer)
    # The most likely token always stays in the nucleus; at top_p <= 1 / V no other ever joins it.
    require(
        not sampling.do_sample or sampling.top_p * vocab > 1,
        "model.sampling.top_p",
        f"> 1 / V = {1 / vocab:.3g} with the tokenizer's V = {vocab} tokens (below it the nucleus is the most likely token alone at "
        "every position: sampling is greedy, every log-prob of the sampled distribution is 0 and nothing is learnt)",
        sampling.top_p,
    )
    controller = module.entropy_controller
    if controller is not None and getattr(controller, "target", None) is not None:
        # The entropy is of the sampled distribution, over its kept set: at most log of its size (uniform).
        kept = min(vocab, sampling.top_k) if sampling.do_sample and sampling.top_k else vocab
        per_response = controller.unit == "sequence_sum"
        most = math.log(kept) * (sampling.max_new_tokens if per_response else 1)
        within = f"model.sampling.top_k = {kept} kept tokens" if kept < vocab else f"the tokenizer's V = {vocab} tokens"
        bound = f"max_new_tokens x log {'top_k' if kept < vocab else 'V'}" if per_response else f"log {'top_k' if kept < vocab else 'V'}"
        require(
            controller.target < most,
            "model.entropy_controller.init_args.target",
            f"< {most:.4g} nats per {'response' if per_response else 'token'} ({bound}) with {within} (no policy's entropy is "
            "higher: the coefficient would only grow)",
            controller.target,
        )
    return longest


# Where a model's config keeps its context, in positions (transformers' names across architectures).
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_field(config: Any) -> Optional[str]:
    """The name of the field where a model's ``config`` keeps its context in positions (``CONTEXT_FIELDS``); None
    for a config that declares none."""
    return next((name for name in CONTEXT_FIELDS if isinstance(getattr(config, name, None), int)), None)


def check_context(
    prompts: PromptArgs, sampling: SamplingArgs, config: Any, longest_prompt: Optional[int] = None, whose: str = "the policy's"
) -> None:
    """The policy (and a foreign reference, ``whose`` "model.reference's") must hold a prompt and its response: the longest prompt (``longest_prompt`` tokens,
    the prompt files' as rendered: ``check_setup`` returns it; unknown, as when prompts come only in
    batches: one token) plus ``model.sampling.max_new_tokens`` within the context its ``config``
    declares (``max_position_embeddings``). Past it the positions are ones the model never saw
    (rotary embeddings extrapolate, learnt ones index out of range): sampling goes on silently on
    garbage. A config that declares no context is not checked."""
    name = context_field(config)
    if name is None:
        return
    context, prompt = getattr(config, name), 1 if longest_prompt is None else longest_prompt
    what = (
        "a one-token prompt" if longest_prompt is None else f"the longest prompt (model.prompts.max_length {prompts.max_length} bounds it)"
    )
    require(
        prompt + sampling.max_new_tokens <= context,
        f"{what} + model.sampling.max_new_tokens",
        f"<= {context} positions, {whose} context (its {type(config).__name__}'s {name}); lower model.sampling.max_new_tokens "
        f"to at most {max(context - prompt, 0)}, or shorten the prompts",
        f"{prompt} + {sampling.max_new_tokens} = {prompt + sampling.max_new_tokens}",
    )


# Past this share of the first rollout's response positions sampled from one token alone, next to nothing is learnt.
POINT_MASS_SHARE = 0.5
# A token of probability above 1 - this under pi_old is sampled from a point mass, as far as float32 tells.
POINT_MASS_GAP = 1e-6


def point_mass_warning(sampling: SamplingArgs, old_logprobs: Any, kept: Any, mask: Any) -> Optional[str]:
    """For the first rollout (the module warns with it): why the run will learn next to nothing when
    on most response positions (more than ``POINT_MASS_SHARE``) the sampled distribution is a point
    mass: a kept set of one token (a nucleus so small, or top_k 1), or a sampled token of probability
    1 to float32 (a temperature so low). There the log-prob is 0 whatever the weights: no gradient.
    Tensors (batch, response_len) for ``old_logprobs`` and ``mask``, (batch, response_len, vocab) bool or
    None for ``kept``. None when the share is below the bound."""
    real = mask.bool()
    single = old_logprobs.detach() > -POINT_MASS_GAP
    if kept is not None:
        single = single | (kept.sum(-1) == 1)
    share = float((single & real).sum()) / max(float(real.sum()), 1.0)
    if share <= POINT_MASS_SHARE:
        return None
    setting = (
        f"model.sampling.top_p {sampling.top_p}"
        if sampling.top_p < 1
        else f"model.sampling.top_k {sampling.top_k}"
        if sampling.top_k
        else f"model.sampling.temperature {sampling.temperature}"
    )
    return (
        f"{setting}: at the first rollout {share:.0%} of the response positions were sampled from one token alone (a point mass: "
        "its log-prob is 0 whatever the weights, so no gradient reaches the policy there) and next to nothing will be learnt; "
        "raise it (or leave model.sampling.top_p 1, top_k 0, temperature 1)"
    )


def check_batch_split(batch_size: int, sampling: SamplingArgs, ppo: PPOArgs) -> None:
    """Each rank's rollout (``batch_size`` prompts x ``num_generations``) splits evenly into minibatches and micro-batches."""
    parts = ppo.num_minibatches * ppo.gradient_accumulation_steps
    require(
        batch_size * sampling.num_generations % parts == 0,
        "data.batch_size * model.sampling.num_generations",
        f"divisible by model.ppo.num_minibatches * model.ppo.gradient_accumulation_steps = {ppo.num_minibatches} * "
        f"{ppo.gradient_accumulation_steps}",
        f"{batch_size} * {sampling.num_generations}",
    )


def nonfinite_terms(terms: dict[str, Any], total: Any) -> str:
    """Which of a loss's logged terms (``policy/loss``, ``value/loss``, ...) are not finite, for the
    fault message of a skipped optimizer step; when none is, the sum itself (its weights) or, with
    a finite total here, another rank's loss."""
    names = [name for name, value in terms.items() if not math.isfinite(float(value))]
    return ", ".join(names) or ("the weighted sum of finite terms" if not math.isfinite(float(total)) else "another rank's loss")


@dataclass
class Faults:
    """Iterations and optimizer steps skipped for a non-finite reward, KL or loss (the weights untouched),
    and how many iterations in a row have had one; a run stops at ``limit`` in a row
    (``model.runtime.max_consecutive_faults``). The counts are checkpointed (``state_dict``)."""

    limit: int
    skipped_iterations: int = 0
    skipped_steps: int = 0
    consecutive: int = 0
    last_cause: str = ""
    COUNTS = ("skipped_iterations", "skipped_steps", "consecutive")

    def record(self, cause: str, iteration_skipped: bool, steps: int = 0) -> None:
        """Count one faulty iteration: skipped whole, or ``steps`` of its optimizer steps skipped."""
        self.skipped_iterations += int(iteration_skipped)
        self.skipped_steps += steps
        self.consecutive += 1
        self.last_cause = cause

    def stop_if_too_many(self) -> None:
        if self.consecutive >= self.limit:
            raise RuntimeError(
                f"stopping: {self.consecutive} iterations in a row had faults "
                f"(model.runtime.max_consecutive_faults={self.limit}); last cause: {self.last_cause}"
            )

    def metrics(self, iteration_skipped: bool) -> dict[str, float]:
        """``system/faults/iteration_skipped`` (1 at a skipped iteration's step, else 0) and the running counts."""
        counts = {f"system/faults/{name}": float(getattr(self, name)) for name in ("skipped_iterations", "skipped_steps")}
        return {"system/faults/iteration_skipped": float(iteration_skipped), **counts}

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.COUNTS}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name in self.COUNTS:
            setattr(self, name, int(state[name]))
