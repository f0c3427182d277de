"""What an iteration logs, as pure functions of the trajectory, its scores and the betas (docs/metrics.md names
each). ``reduce(t, op="sum" | "max")`` sums (or maxes) a tensor over the ranks: the strategy's, or the identity
on one process, so every rank returns the same numbers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor, nn

from rlhf_lightning import sampling
from rlhf_lightning.data import PromptTable
from rlhf_lightning.episodes import ENDINGS, EpisodeLayout
from rlhf_lightning.trajectory import PromptStats, Scored, Trajectory

Reduce = Callable[..., Tensor]


def weighted_kl(rollout: Trajectory, kl: Tensor) -> Tensor:
    """The per-token KL as an estimate under pi_old: weighed by the rollout correction's weights, E_sampler[w k] = E_pi_old[k]."""
    return kl if rollout.is_weights is None else kl * rollout.is_weights


def rollout_metrics(
    rollout: Trajectory,
    scored: Scored,
    betas: Tensor,
    reduce: Reduce,
    *,
    per_token_divergence: bool,
    kl_to_initial: Optional[Tensor] = None,
    gold_scores: Optional[Tensor] = None,
    kl_target: Optional[float] = None,
    reference_updates: int = 0,
    exploration: Optional[float] = None,
    iteration: Optional[int] = None,
    off_policy_weights: Optional[tuple[str, float]] = None,
) -> dict[str, float]:
    """Global (all-rank) means of what the rollout saw, ``betas`` each row's beta (batch,). ``per_token_divergence``:
    the divergence is the reverse KL (its value per response the KL estimate's sum); ``kl_to_initial``: the same
    estimate against pi_0 (batch, response_len), where the reference moves or is another model (else the KL is it);
    ``gold_scores`` (batch,) of a gold reward model; ``kl_target`` the controller's; ``exploration`` epsilon where
    the run explores; ``iteration`` the trained version where batches may be stale (``off_policy/staleness_*``) and
    ``off_policy_weights`` (mode, cap) of their correction (``off_policy/ess``, ``off_policy/clipped_fraction``)."""
    mask, raw_scores, scores = rollout.response_mask, scored.raw_scores, scored.scores
    kl = weighted_kl(rollout, scored.kl)
    kl_seq = kl.sum(-1)
    device = kl.device
    counts = [torch.tensor(float(len(raw_scores)), device=device), raw_scores.to(device).sum(), scores.to(device).sum()]
    sums = [kl_seq.sum(), kl.sum(), mask.sum(), (rollout.entropy * mask).sum(), rollout.ended_with_eos.float().sum()]
    # the divergence's value per response (the reverse KL's: the KL estimate's sum, which the rollout correction weighs)
    divergence_seq = kl_seq if per_token_divergence else scored.divergence.to(device)
    sums.append(divergence_seq.sum())
    betas = betas.to(device)
    penalty = [betas.sum(), (betas * divergence_seq.double()).sum()]
    totals = reduce(torch.stack([t.double() for t in counts + sums + penalty]))
    n, reward, reward_trained, kl_total, kl_tokens, n_tokens, entropy, n_eos, divergence_total, beta_total, penalty_total = totals.tolist()
    out = {
        "objective/reward": reward / n,
        "objective/reward_trained": reward_trained / n,
        "objective/kl": kl_total / n,
        "objective/kl_per_token": kl_tokens / n_tokens,
        "objective/kl_max": float(reduce(kl_seq.max().double(), op="max")),
        # the same estimate against pi_0, which is the reference unless it moves
        "objective/kl_to_initial": kl_total / n if kl_to_initial is None else float(reduce(kl_to_initial.sum().double())) / n,
        "reference/updates": float(reference_updates),
        "objective/divergence": divergence_total / n,
        "objective/non_score_reward": -penalty_total / n,  # -E[beta_x D_x]: -beta * objective/divergence with one beta
        "objective/net": reward / n - penalty_total / n,
        "objective/entropy": entropy / n_tokens,
        "objective/beta": beta_total / n,  # the mean over the responses: the beta, with one
        "response/length": n_tokens / n,
        "response/eos_fraction": n_eos / n,
        "response/truncated_fraction": 1.0 - n_eos / n,  # cut at max_new_tokens without EOS
        "response/count": n,
        **sampling.mismatch_metrics(rollout.trainer_logprobs, rollout.sampler_logprobs, mask, reduce),
    }
    if kl_target is not None:
        out["objective/kl_target"] = float(kl_target)
    if gold_scores is not None:
        out["objective/gold_reward"] = float(reduce(gold_scores.sum().double().to(device))) / n
    if exploration is not None:
        out["sampling/explore"] = exploration
    if iteration is not None:
        out.update(staleness_metrics(rollout.policy_version, iteration, reduce))
        if rollout.token_versions is not None:
            out.update(inflight_metrics(rollout.token_versions, rollout.response_mask, reduce))
    if off_policy_weights is not None:
        logprobs = (rollout.trainer_logprobs, rollout.sampler_logprobs, rollout.response_mask)
        out.update(sampling.off_policy_weight_metrics(*logprobs, *off_policy_weights, sum_fn=reduce))
    if rollout.episode is not None:
        out.update(episode_metrics(rollout.episode, reduce))
    return out


def episode_metrics(episode: EpisodeLayout, reduce: Reduce) -> dict[str, float]:
    """``env/*`` over all ranks' episodes: the policy's turns per episode, the environment's share of the episodes'
    tokens, the policy's turns cut at max_new_tokens, tool calls per episode and the share that succeeded, the
    environment's rewards per episode (``Step.reward`` summed over its turns), the share of episodes ended by each
    end (``episodes.ENDINGS``: the environment's done, or a limit)."""
    environment_tokens = episode.episode_mask.sum() - episode.policy_mask.sum()
    ended = [(episode.ended_by == i).sum() for i in range(len(ENDINGS))]
    counts = (episode.policy_turns.sum(), episode.turns_cut.sum(), episode.tool_calls.sum(), episode.tool_ok.sum(), *ended)
    sums = torch.stack(
        [
            torch.tensor(float(len(episode.ended_by)), device=environment_tokens.device),
            episode.episode_mask.sum(),
            environment_tokens,
            episode.turn_rewards.sum(),
        ]
    )
    totals = reduce(torch.cat([sums.double(), torch.stack(counts).double().to(sums.device)])).tolist()
    n, tokens, env_tokens, env_reward, turns, cut, calls, ok, *ended_totals = totals
    out = {
        "env/turns": turns / n,
        "env/environment_token_share": env_tokens / max(tokens, 1.0),
        "env/turns_cut_fraction": cut / max(turns, 1.0),
        "env/tool_calls": calls / n,
        "env/tool_success": ok / calls if calls else 0.0,
        "env/reward": env_reward / n,
    }
    out.update({f"env/ended_by_{name}": count / n for name, count in zip(ENDINGS, ended_totals, strict=True)})
    return out


def staleness_metrics(versions: Tensor, iteration: int, reduce: Reduce) -> dict[str, float]:
    """``off_policy/staleness_mean`` and ``off_policy/staleness_max`` over all ranks' responses: how many updates
    older than the trained weights (``iteration``) the weights that sampled each were (``versions``, (batch,))."""
    staleness = (iteration - versions).double()
    total = reduce(torch.stack([staleness.sum(), torch.tensor(float(len(staleness)), dtype=torch.float64, device=staleness.device)]))
    return {
        "off_policy/staleness_mean": float(total[0] / total[1]),
        "off_policy/staleness_max": float(reduce(staleness.max(), op="max")),
    }


def switches(versions: Tensor, mask: Tensor) -> Tensor:
    """(batch,) how many times each response's version changes between consecutive real tokens (``mask``): the
    in-flight switches it went through. ``versions``, ``mask``: (batch, response_len)."""
    both = (mask[:, 1:] * mask[:, :-1]).bool()
    return ((versions[:, 1:] != versions[:, :-1]) & both).sum(-1)


def inflight_metrics(token_versions: Tensor, mask: Tensor, reduce: Reduce) -> dict[str, float]:
    """In-flight weight updates (inflight.py), over all ranks' responses, from each real token's version
    (``token_versions``, ``mask``: (batch, response_len)): ``off_policy/version_min`` and ``version_max``, the oldest
    and newest version among the batch's tokens; ``off_policy/version_spread_mean`` and ``version_spread_max``, each
    response's newest minus oldest, averaged and at most; ``off_policy/inflight_switches_mean``, the version changes per
    response (:func:`switches`; the declared schedule moves one version at a switch, so it is the spread)."""
    real = mask.bool()
    big = torch.iinfo(torch.long).max
    oldest = token_versions.masked_fill(~real, big).amin(-1)
    newest = token_versions.masked_fill(~real, -big).amax(-1)
    spread = torch.where(real.any(-1), newest - oldest, torch.zeros_like(newest)).double()
    switched = switches(token_versions, mask).double()
    n = torch.tensor(float(len(spread)), dtype=torch.float64, device=spread.device)
    total = reduce(torch.stack([spread.sum(), switched.sum(), n]))
    return {
        "off_policy/version_min": -float(reduce(-oldest.min().double(), op="max")),
        "off_policy/version_max": float(reduce(newest.max().double(), op="max")),
        "off_policy/version_spread_mean": float(total[0] / total[2]),
        "off_policy/version_spread_max": float(reduce(spread.max(), op="max")),
        "off_policy/inflight_switches_mean": float(total[1] / total[2]),
    }


def prompt_stats(
    rollout: Trajectory,
    scored: Scored,
    betas: Tensor,
    table: PromptTable,
    reduce: Reduce,
    *,
    per_response: bool,
    budgets_of: Callable[[list[str]], Optional[Tensor]],
) -> PromptStats:
    """Each training prompt's mean KL (per response with ``per_response``, the controller's ``sequence_sum``
    unit, else per token), its responses and the beta its rows used, over all ranks: one row per prompt of
    ``table`` summed through ``reduce``, so every rank holds the same; its budget (``budgets_of(ids)``)."""
    kl = weighted_kl(rollout, scored.kl)
    device = kl.device
    ones = torch.ones_like(betas)
    per_row = torch.stack([kl.sum(-1).double(), rollout.response_mask.sum(-1).double(), ones, betas]).to(device)  # (4, batch)
    rows = table.rows(rollout.prompts).to(device)
    sums = torch.zeros(4, len(table.ids), dtype=torch.float64, device=device).index_add_(1, rows, per_row)
    sums = reduce(sums).cpu()
    seen = sums[2] > 0
    kl_total, tokens, responses, beta_total = sums[:, seen]
    ids = [table.ids[row] for row in seen.nonzero().flatten().tolist()]
    kl_mean = kl_total / (responses if per_response else tokens)
    return PromptStats(ids, kl_mean, responses, beta_total / responses, budgets_of(ids))


def entropy_controller_input(metrics: dict[str, float], unit: str, target: Optional[float]) -> float:
    """What an entropy controller is fed from the iteration's ``metrics``: the entropy (per token, or per response
    with ``unit`` sequence_sum), or with a ``target`` target^2 / H, the entropy mirrored about the target in log space
    (log(input / target) = -log(H / target)), which a KL controller (raising beta while its input exceeds the target)
    turns into raising the coefficient while the entropy is below its target: the same log error with the opposite
    sign, and never negative."""
    entropy = metrics["objective/entropy"]  # nats per token
    if unit == "sequence_sum":
        entropy *= metrics["response/length"]
    return entropy if target is None else target**2 / max(entropy, 1e-6)


def update_means(update_stats: nn.ModuleDict) -> dict[str, float]:
    """Means of the update statistics (torchmetrics ``MeanMetric``s named with ``__`` for ``/``) over every micro-batch
    of the iteration (all ranks), each reset for the next."""
    out = {}
    for key, metric in update_stats.items():
        if metric.update_count:
            out[key.replace("__", "/")] = float(metric.compute())
        metric.reset()
    return out
