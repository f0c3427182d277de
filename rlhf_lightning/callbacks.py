"""Callbacks that ship with rlhf-lightning."""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from lightning import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from rlhf_lightning.episodes import turn_texts
from rlhf_lightning.fsdp2 import full_state_dict, is_sharded
from rlhf_lightning.interfaces import require
from rlhf_lightning.kl_health import CHECKS as KL_HEALTH_CHECKS
from rlhf_lightning.kl_health import KLHealth
from rlhf_lightning.models import add_lora


class ExportPolicy(Callback):
    """At the end of fit, write the trained policy with ``save_pretrained`` (LoRA merged into the
    weights) plus its tokenizer, so ``transformers.AutoModelForCausalLM.from_pretrained`` loads it.

    Args:
        dirpath: output folder; default ``<log dir>/policy``.
    """

    def __init__(self, dirpath: Optional[str] = None) -> None:
        self.dirpath = dirpath

    def on_fit_end(self, trainer, pl_module) -> None:
        target = Path(self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "policy")
        if export_policy(pl_module, target) is not None:
            print(f"exported the trained policy to {target}")


def export_policy(module, target: Path) -> Optional[Path]:
    """Save ``module.policy`` (merging a LoRA adapter into a copy) and its tokenizer to ``target``
    from global rank 0; returns None on the other ranks. Call it on every rank: a sharded (FSDP2)
    policy is first gathered into full weights on CPU, which are loaded into an unsharded copy
    built from the config."""
    policy = module.policy
    if is_sharded(policy):
        state = full_state_dict(policy)  # a collective: every rank takes part
        if module.global_rank != 0:
            return None
        with torch.random.fork_rng():  # building draws random initial weights that are then replaced
            policy, _ = module.load_policy()
            if module.lora.rank:
                policy = add_lora(policy, module.lora, module.reference_update.moves)
        policy.load_state_dict(state)
    elif module.global_rank != 0:
        return None
    elif hasattr(policy, "merge_and_unload"):
        policy = copy.deepcopy(policy)
    if hasattr(policy, "merge_and_unload"):
        policy = policy.merge_and_unload()
    policy.save_pretrained(target)
    module.tokenizer.save_pretrained(target)
    mode = new_file_mode(target)
    for path in target.rglob("*"):  # safetensors writes model.safetensors 0600 (a temporary file renamed)
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
    return target


def new_file_mode(folder: Path) -> int:
    """The permissions a file created in ``folder`` gets, as the rest of a run's files have them (0o666 less the
    umask, or the folder's default ACL): a probe file's, removed. Read so, not by setting the process's umask to
    see it, which would change it for a moment for every thread."""
    probe = folder / f".mode-probe-{os.getpid()}"
    probe.touch()
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()


def module_callbacks(trainer, runtime) -> list[Callback]:
    """What ``PPORLHF.configure_callbacks`` installs: :class:`TensorBoardViews` (``runtime``'s sample settings), and
    the KL health monitor (kl_health.py) unless ``trainer.callbacks`` holds a ``KLHealth``: Lightning would replace
    the user's with the module's, and the user's settings win (``mode: off`` included)."""
    views = TensorBoardViews(runtime.log_samples_every_n_steps, runtime.num_logged_samples)
    users = trainer.callbacks if trainer is not None else []
    return [views] if any(isinstance(callback, KLHealth) for callback in users) else [views, KLHealth()]


class TensorBoardViews(Callback):
    """What ``PPORLHF`` adds to a TensorBoard log beside its scalars (the module installs it through
    ``configure_callbacks``): the Custom Scalars page (:func:`custom_scalars_layout`), the first view
    worth opening, and every ``every_n_steps`` iterations a markdown table of ``num_samples`` prompts,
    responses, scores and KL as text (``samples``). With a prompt file, every iteration also the histograms
    ``prompts/kl`` and ``prompts/beta``: the mean KL (in the beta controller's unit) of each prompt sampled in the
    iteration and the beta it was penalised with (``PPORLHF.prompt_stats``), and with KL budgets ``prompts/kl_over_budget``,
    each prompt's KL / budget (TensorBoard's Histograms and Distributions tabs)."""

    def __init__(self, every_n_steps: int = 10, num_samples: int = 4) -> None:
        self.every_n_steps, self.num_samples = every_n_steps, num_samples

    def on_fit_start(self, trainer, pl_module) -> None:
        if not isinstance(trainer.logger, TensorBoardLogger) or trainer.global_rank != 0:
            return
        layout = custom_scalars_layout(
            unit=getattr(pl_module.beta_controller, "unit", "sequence_sum"),
            has_target=hasattr(pl_module.beta_controller, "target"),
            has_gold=pl_module.gold_reward_model is not None,
            reference=pl_module.hparams.get("reference"),
            asynchronous=bool(getattr(getattr(pl_module, "off_policy", None), "max_staleness", 0)),
            inflight=bool(getattr(getattr(pl_module, "off_policy", None), "inflight_every", 0)),
            kl_health=any(isinstance(callback, KLHealth) and callback.mode != "off" for callback in trainer.callbacks),
            episodes=getattr(pl_module, "environment", None) is not None,
        )
        trainer.logger.experiment.add_custom_scalars(layout)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs["skipped"] or not isinstance(trainer.logger, TensorBoardLogger) or trainer.global_rank != 0:
            return
        prompts = outputs["prompts"]
        if prompts is not None:
            histograms = {"prompts/kl": prompts.kl, "prompts/beta": prompts.betas}
            if prompts.budgets is not None:
                histograms["prompts/kl_over_budget"] = prompts.kl / prompts.budgets
            for tag, values in histograms.items():
                # TensorBoard's histogram raises ("The histogram is empty") on values none of which is finite, or whose
                # bins overflow (a beta near float32's largest): such a view is left out, never the run stopped for it
                with contextlib.suppress(ValueError):
                    trainer.logger.experiment.add_histogram(tag, values[torch.isfinite(values)], global_step=pl_module.step)
        if not self.every_n_steps or pl_module.step % self.every_n_steps:
            return
        rollout, scores, kl = outputs["rollout"], outputs["scores"], outputs["kl"]
        rows = ["| prompt | response | score | KL |", "|---|---|---|---|"]
        turns = None if rollout.episode is None else turn_texts(rollout, pl_module.tokenizer, pl_module.environment.role)
        for i in range(min(self.num_samples, len(rollout.prompts))):
            response = _md(rollout.response_texts[i]) if turns is None else "<br>".join(f"**{r}**: {_md(t)}" for r, t in turns[i])
            cells = [_md(rollout.prompts[i]), response, f"{scores[i]:.3f}", f"{kl[i].sum():.3f}"]
            rows.append("| " + " | ".join(cells) + " |")
        trainer.logger.experiment.add_text("samples", "\n".join(rows), global_step=pl_module.step)


# The Custom Scalars page. TensorBoard colours a chart's lines by run (tf-custom-scalar-helpers.js:
# DataSeriesColorScale), so a run's lines on one chart share a colour, told apart only by the hover
# tooltip, and a layout has no legend: each chart draws one line, its title naming it and its tag,
# and charts of one quantity sit side by side (the KL's mean, max and target). The y axis fits the
# runs drawn (one config's runs: --logdir lightning_logs/<config>).
SEEDS_CATEGORY = "rlhf-lightning: reward, KL, beta, net objective"
MORE_CATEGORY = "rlhf-lightning: entropy, lengths, the PPO update"
HEALTH_CATEGORY = "rlhf-lightning: KL health"


def custom_scalars_layout(
    unit: str = "sequence_sum",
    has_target: bool = True,
    has_gold: bool = False,
    reference: Optional[str] = None,
    asynchronous: bool = False,
    kl_health: bool = False,
    episodes: bool = False,
    inflight: bool = False,
) -> dict:
    """The Custom Scalars layout, ``{category: {chart title: ["Multiline", ["^tag$"]]}}``, one line per chart,
    in the order TensorBoard shows it: first the run at a glance (reward; the KL's mean and max and the
    controller's target, in the controller's ``unit``; beta; the net objective reward - beta * KL),
    then what explains it (entropy, response length, the PPO update's approximate KL and clip
    fraction). ``has_target``: the controller holds a KL target (``objective/kl_target`` is logged);
    ``has_gold``: a gold reward is watched.
    ``reference``: another model is the reference (``model.reference``, a teacher): the KL charts name it and the
    direction (the reverse KL, KL(pi || reference)), and the drift from the starting policy gets a chart of its own.
    ``asynchronous``: the sampler runs ahead (``model.off_policy.max_staleness`` > 0): how stale the batches were,
    the off-policy correction's clipped share and effective sample size, and the trainer's wait for the sampler;
    ``inflight``: it moves responses to newer weights between tokens (``model.off_policy.inflight_every``): the versions
    a batch's tokens came from and the switches per response.
    ``kl_health``: a ``KLHealth`` monitor runs (kl_health.py): a third row, the KL's share of the update, the
    estimate and the exact KL, and which checks fire. ``episodes``: an environment answers the policy
    (``model.environment``): turns per episode, the environment's share of the tokens, tool calls and their success."""
    seeds = [("reward, training batch", "objective/reward"), ("reward, held-out prompts", "val/reward")]
    if has_gold:
        seeds.append(("gold reward (watched, not trained on)", "objective/gold_reward"))
    kl = "KL" if reference is None else f"KL(pi || {reference}), the reverse KL to the reference model,"
    per = "response" if unit == "sequence_sum" else "token"
    if unit != "sequence_sum":  # the target is per token; the largest response's KL is a sum over its tokens
        seeds.append((f"{kl} per token (nats), mean", "objective/kl_per_token"))
    else:
        seeds.append((f"{kl} per response (nats), mean", "objective/kl"))
    if has_target:
        seeds.append((f"the controller's KL target (nats per {per})", "objective/kl_target"))
    if unit != "sequence_sum":
        seeds.append((f"{kl} per response (nats), mean", "objective/kl"))
    seeds.append((f"{kl} per response (nats), max", "objective/kl_max"))
    if reference is not None:
        seeds.append(("drift from the starting policy, KL(pi || pi_0) per response (nats)", "objective/kl_to_initial"))
    seeds += [
        ("beta, the KL coefficient", "objective/beta"),
        ("net objective, reward - beta * KL, training batch", "objective/net"),
        ("net objective, reward - beta * KL, held-out prompts", "val/net"),
    ]
    more = [
        ("entropy (nats per token)", "objective/entropy"),
        ("response length (tokens), training batch", "response/length"),
        ("response length (tokens), held-out prompts", "val/length"),
        ("PPO update: approximate KL to the rollout's policy", "policy/approxkl"),
        ("PPO update: fraction of tokens clipped", "policy/clipfrac"),
    ]
    if asynchronous:
        more += [
            ("staleness (updates), mean", "off_policy/staleness_mean"),
            ("staleness (updates), max", "off_policy/staleness_max"),
            ("off-policy correction: share of tokens clipped", "off_policy/clipped_fraction"),
            ("off-policy correction: effective sample size", "off_policy/ess"),
            ("off-policy correction: mean weight per token", "off_policy/weight_mass"),
            ("off-policy correction: share of the exact weights removed", "off_policy/cap_removed"),
            ("off-policy correction: share of tokens outside the trust region", "off_policy/trust_masked_fraction"),
            ("seconds: the trainer's wait for the sampler", "timing/sampler_wait_s"),
            ("seconds: the sampler's draw", "timing/rollout_s"),
        ]
    if asynchronous and inflight:
        more += [
            ("in-flight updates: oldest version of the batch's tokens", "off_policy/version_min"),
            ("in-flight updates: newest version of the batch's tokens", "off_policy/version_max"),
            ("in-flight updates: versions spanned per response (newest - oldest), mean", "off_policy/version_spread_mean"),
            ("in-flight updates: versions spanned per response, max", "off_policy/version_spread_max"),
            ("in-flight updates: switches per response", "off_policy/inflight_switches_mean"),
        ]
    if episodes:
        more += [
            ("episodes: the policy's turns per episode", "env/turns"),
            ("episodes: the environment's share of the tokens", "env/environment_token_share"),
            ("episodes: tool calls per episode", "env/tool_calls"),
            ("episodes: share of tool calls that succeeded", "env/tool_success"),
        ]
    rows = [(SEEDS_CATEGORY, seeds), (MORE_CATEGORY, more)]
    if kl_health:
        health = [
            ("the KL's share of the update (0: the KL does not reach it)", "system/kl_health/kl_share"),
            ("KL per response (nats), the estimator's", "system/kl_health/kl_estimate"),
            ("KL per response (nats), the exact", "system/kl_health/kl_exact"),
            *((f"check {name}: firing (1) or not (0)", f"system/kl_health/{name}") for name in KL_HEALTH_CHECKS),
        ]
        rows.append((HEALTH_CATEGORY, health))
    return {category: {f"{name}: {tag}": ["Multiline", [f"^{tag}$"]] for name, tag in charts} for category, charts in rows}


def _md(text: str, limit: int = 300) -> str:
    return text[:limit].replace("|", "\\|").replace("\n", " ")


class Timer:
    """Wall-clock seconds per named phase (synchronising CUDA so GPU work is counted) and, on a
    GPU, each phase's peak allocated memory (``torch.cuda.max_memory_allocated`` since it began)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.peak_gb: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(self.device)
            self.peak_gb[name] = max(self.peak_gb.get(name, 0.0), torch.cuda.max_memory_allocated(self.device) / 2**30)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``timing/<phase>_s`` and (GPU) ``system/memory/<phase>_peak_gb``."""
        return {
            **{f"timing/{k}_s": v for k, v in self.seconds.items()},
            **{f"system/memory/{k}_peak_gb": v for k, v in self.peak_gb.items()},
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1): the chance that k of the n, drawn without
    replacement, hold at least one correct, 1 - C(n - c, k) / C(n, k)."""
    require(1 <= k <= n, "PassAtK.ks", f"integers in [1, n] (n = {n} samples)", k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class PromptLog(Callback):
    """Appends each training prompt's KL and beta of every iteration, by prompt id, to ``<log dir>/prompts.csv``
    (columns ``iteration, id, kl, responses, beta, budget``): what the histograms ``prompts/kl`` and ``prompts/beta``
    pool, one row per prompt sampled in the iteration (``PPORLHF.prompt_stats``, all ranks, written by rank 0), so a
    prompt's own KL can be followed over a run, or grouped by budget. ``kl`` is the mean KL of the prompt's
    ``responses`` in the beta controller's unit, ``beta`` the beta its rows were penalised with, ``budget`` its KL
    budget (a ``per_prompt`` controller's; another controller's ``target``; empty: none). Needs a prompt file
    (``PromptDataModule``); a resumed run appends to the file of its log folder.

    Args:
        filename: the file's name in the log folder.
    """

    def __init__(self, filename: str = "prompts.csv") -> None:
        require(isinstance(filename, str) and bool(filename.strip()), "PromptLog.filename", "a file name", filename)
        self.filename = filename

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        prompts = outputs.get("prompts")
        if outputs.get("skipped", True) or prompts is None or not trainer.is_global_zero:
            return
        path = Path(trainer.log_dir or trainer.default_root_dir) / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        budgets = prompts.budgets.tolist() if prompts.budgets is not None else [None] * len(prompts.ids)
        with path.open("a", newline="") as file:
            writer = csv.writer(file)
            if new:
                writer.writerow(["iteration", "id", "kl", "responses", "beta", "budget"])
            for row in zip(prompts.ids, prompts.kl.tolist(), prompts.responses.tolist(), prompts.betas.tolist(), budgets, strict=True):
                prompt_id, kl, responses, beta, budget = row
                writer.writerow([pl_module.step, prompt_id, repr(kl), int(responses), repr(beta), "" if budget is None else repr(budget)])


class PassAtK(Callback):
    """Logs ``val/pass@k`` for each k in ``ks``: after each validation batch, max(ks) responses are
    sampled for every held-out prompt (as a rollout samples, at the policy's temperature) and
    scored by the training reward; a response counts as correct when its raw score is at least
    ``threshold`` (1 for ``exact_answer``). pass@k is :func:`pass_at_k` averaged over prompts, so
    pass@1 is the accuracy of one sample (the mean reward when the reward is 0/1).
    """

    def __init__(self, ks: Sequence[int] = (1, 4), threshold: float = 1.0) -> None:
        ks = list(ks)
        require(len(ks) > 0 and all(isinstance(k, int) and k >= 1 for k in ks), "PassAtK.ks", "a list of integers >= 1", ks)
        self.ks, self.threshold, self.n = ks, threshold, max(ks)

    @torch.no_grad()
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.sanity_checking:  # Lightning discards what the sanity check logs: spare the sampling
            return
        prompts = [prompt for prompt in batch for _ in range(self.n)]  # a prompt's n samples adjacent
        rollout = pl_module.rollout(prompts)
        scores = pl_module.reward_model.checked_scores(rollout.prompts, rollout.response_texts)  # (prompts * n,)
        correct = (scores >= self.threshold).view(len(batch), self.n).sum(-1).tolist()  # per prompt
        metrics = {f"val/pass@{k}": sum(pass_at_k(self.n, c, k) for c in correct) / len(correct) for k in self.ks}
        pl_module.log_dict(metrics, batch_size=len(batch), sync_dist=True)


class IterationTimer(Callback):
    """Logs ``timing/iteration_s``: wall-clock seconds of each PPO iteration (training batch),
    from the end of the previous one (the first: from its own start), so everything a user waits
    for between two iterations counts, logging and callbacks included. The module's ``timing/*``
    phases add up to a little less. ``tools/benchmarks/compare_trl.py`` reads it."""

    def __init__(self) -> None:
        self._since: Optional[float] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        for logger in trainer.loggers:
            logger.log_metrics({"timing/iteration_s": now - self._since}, step=pl_module.step)  # the iteration's step, as its other scalars
        self._since = now


class InterruptibleRendezvous(Callback):
    """While the processes of a run form their world (torch.distributed's rendezvous blocks in C++, where Python's
    Ctrl+C handler cannot run until the strategy's timeout), Ctrl+C ends the process at once (SIGINT's default action),
    as the line printed before the wait says (``arm``, which the command calls); the handler before it is back once
    the world has formed (``setup``, which Lightning calls after the rendezvous). The command adds it to every run."""

    def __init__(self) -> None:
        self.previous = None

    def arm(self, trainer) -> None:
        import signal
        import sys

        import torch.distributed

        if trainer.world_size > 1 and not torch.distributed.is_initialized():
            self.previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
            timeout = getattr(trainer.strategy, "_timeout", "unknown")
            print(
                f"waiting for the world of trainer.num_nodes={trainer.num_nodes} x trainer.devices={trainer.num_devices} processes "
                f"to form (trainer.strategy's timeout {timeout}); Ctrl+C stops at once",
                file=sys.stderr,
                flush=True,
            )

    def setup(self, trainer, pl_module, stage: str) -> None:
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None
