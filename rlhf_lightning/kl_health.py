"""A KL health monitor: checks that the KL the run configures and logs is the one its update optimises.

The failures users of RLHF frameworks report are a KL that is configured, logged, and not what the update
optimises: a KL coefficient computed and never applied, a reference that drifted across resumes, whole batches
masked to a loss of 0 with no error. :class:`KLHealth` runs five checks beside the loop (the module installs
it by default, ``PPORLHF.configure_callbacks``; docs/metrics.md, "KL health"):

1. ``dead_kl``: beta > 0 and a KL estimate that is not 0, but the KL's share of the update nil.
2. ``reference_moved``: the frozen reference's fingerprint changed during the run, or differs from the checkpoint's.
3. ``sampler_mismatch``: the sampler's log-probs far from the trainer's, a batch staler than allowed, or a low
   effective sample size.
4. ``estimate_vs_exact``: the KL estimator's mean KL per response outside a band around the exact full-vocabulary KL.
5. ``reward_up_kl_zero``: the reward rising while the KL stays 0 (the reference is the policy itself).

Every decision reads global (all-rank) numbers, so every rank takes it; only rank 0 writes to TensorBoard.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Literal, Optional

import torch
from lightning import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from rlhf_lightning import ppo_math as pm
from rlhf_lightning import sampling
from rlhf_lightning.interfaces import require
from rlhf_lightning.metrics import weighted_kl
from rlhf_lightning.models import local_tensor
from rlhf_lightning.trajectory import Scored, Trajectory

CHECKS = ("dead_kl", "reference_moved", "sampler_mismatch", "estimate_vs_exact", "reward_up_kl_zero")
PREFIX = "system/kl_health/"  # after objective/ in TensorBoard's groups, beside system/kl_guard/ (docs/metrics.md)


class KLHealthError(RuntimeError):
    """A KL health check fired under ``KLHealth.mode: stop``; the message names the check and the setting to change."""


class Condition:
    """A check's failure episodes: a failing observation ``patience`` times in a row starts one (reported once),
    a passing one ends it; an inconclusive one (None) changes nothing."""

    def __init__(self, patience: int) -> None:
        self.patience, self.count, self.firing = patience, 0, False

    def observe(self, failing: Optional[bool]) -> bool:
        """Record one observation; True when it starts an episode of failure."""
        if failing is None:
            return False
        if not failing:
            self.count, self.firing = 0, False
            return False
        self.count += 1
        if self.count >= self.patience and not self.firing:
            self.firing = True
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "firing": self.firing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.firing = state["count"], state["firing"]


class KLHealth(Callback):
    """Checks that the KL to the reference is what the update optimises, and says so when it is not.

    Every check logs ``system/kl_health/<check>`` each time it runs (1 while it fires, 0 otherwise) and warns
    once per episode of failure (``patience`` failing observations in a row; a passing one ends the episode),
    with ``rank_zero_warn`` and, with a TensorBoardLogger, as text under ``kl_health``. The probes run on every
    ``every_n_iterations``-th iteration (iterations n, 2n, ... counted from 1); the other checks on every one.

    * ``dead_kl`` (probe): with beta > 0 and a KL estimate that is not 0 everywhere, the KL's share of the
      update, ``system/kl_health/kl_share``: with the KL in the reward, ||A - A_0|| / ||A|| over the response
      tokens, A the module's advantages of the per-token rewards it built (captured from ``PPORLHF.score``) and
      A_0 those of the same scores without the KL; with the KL in the loss, ||beta grad L_KL|| / (||beta grad
      L_KL|| + ||grad L_pg||) on the policy's trainable parameters on the first minibatch (``torch.autograd.grad``:
      no optimizer step, no ``.grad`` written); with both, the larger. Fails at ``kl_share <= min_kl_share``.
    * ``reference_moved`` (no patience: weights that changed are not noise): a fingerprint of the frozen reference
      (the float64 sum and absolute sum of ``fingerprint_tensors`` of its frozen tensors, evenly spaced; a LoRA
      reference's base weights), taken at the start of fit and saved with checkpoints, compared within
      ``fingerprint_rtol``. Fires on a probe when it changed while the reference update plugin keeps it frozen
      (``moves`` False), and at the start of a resumed fit when it differs from the checkpoint's (either plugin).
    * ``sampler_mismatch`` (every iteration): ``rollout/logprob_diff_mean > max_logprob_diff``,
      ``off_policy/ess < min_ess``, or ``off_policy/cap_removed > max_cap_removed`` (the cap or the mask removes that
      share of the exact weights' mass: the regime where a long response's ``sequence`` weight is biased, docs/async.md,
      "The correction on long responses"), ``patience`` iterations in a row; a batch staler than
      ``model.off_policy.max_staleness`` (``off_policy/staleness_max``) at once.
    * ``estimate_vs_exact`` (probe): the estimator's mean KL per response (``system/kl_health/kl_estimate``, as
      ``objective/kl``: weighed by a rollout correction's weights)
      against the exact full-vocabulary KL of the same responses (``system/kl_health/kl_exact``), sum_t sum_v
      pi_old(v) (log pi_old(v) - log pi_ref(v)) on the sampler's kept set, from the trajectory's logits (kept on
      probe iterations). Fails when they differ by more than ``max(estimate_rel_tol * |exact|, estimate_abs_tol)``
      and by more than ``estimate_z`` standard errors of the per-response difference.
    * ``reward_up_kl_zero`` (every iteration): ``objective/kl`` below ``kl_zero`` while ``objective/reward`` rose
      by more than ``min_reward_rise`` over the last ``reward_window`` iterations (a least-squares line).

    ``mode``: ``warn``; ``stop`` raises :class:`KLHealthError` at the first firing, which ends the run; ``off``
    runs nothing. Condition counters and the fingerprint are saved with checkpoints.

    Args:
        mode: ``warn``, ``stop`` or ``off``.
        every_n_iterations: the probes' period in PPO iterations.
        patience: failing observations in a row (probes for the probe checks) before a check fires.
        checks: which checks run, of ``dead_kl``, ``reference_moved``, ``sampler_mismatch``, ``estimate_vs_exact``,
            ``reward_up_kl_zero``; None: all.
        min_kl_share: ``dead_kl`` fails at a KL share at or below this.
        max_logprob_diff: ``sampler_mismatch``'s bound on ``rollout/logprob_diff_mean`` (nats per token).
        min_ess: ``sampler_mismatch``'s bound on ``off_policy/ess``.
        max_cap_removed: ``sampler_mismatch``'s bound on ``off_policy/cap_removed``.
        estimate_rel_tol: ``estimate_vs_exact``'s band, relative to the exact KL.
        estimate_abs_tol: its floor, in nats per response.
        estimate_z: standard errors the difference must exceed too.
        kl_zero: ``reward_up_kl_zero``'s "zero" KL, nats per response.
        reward_window: iterations of the reward's trend.
        min_reward_rise: the rise of that trend over the window that counts as rising.
        fingerprint_tensors: frozen reference tensors in the fingerprint.
        fingerprint_rtol: a change of a tensor's sum or absolute sum within this share of its absolute sum is no
            change (LoRA's merge for generation rounds the base weights; another model or a nudge moves them by far more).
    """

    def __init__(
        self,
        mode: Literal["warn", "stop", "off"] = "warn",
        every_n_iterations: int = 5,
        patience: int = 3,
        checks: Optional[list[str]] = None,
        min_kl_share: float = 1e-6,
        max_logprob_diff: float = 0.1,
        min_ess: float = 0.1,
        max_cap_removed: float = 0.25,
        estimate_rel_tol: float = 0.5,
        estimate_abs_tol: float = 0.5,
        estimate_z: float = 3.0,
        kl_zero: float = 1e-6,
        reward_window: int = 5,
        min_reward_rise: float = 0.0,
        fingerprint_tensors: int = 8,
        fingerprint_rtol: float = 1e-4,
    ) -> None:
        args = dict(locals())

        def check(ok: bool, field: str, requirement: str) -> None:
            require(ok, f"KLHealth.{field}", requirement, args[field])

        checks = list(CHECKS) if checks is None else list(checks)
        check(mode in ("warn", "stop", "off"), "mode", "one of warn, stop, off")
        for field in ("every_n_iterations", "patience", "reward_window", "fingerprint_tensors"):
            check(isinstance(args[field], int) and args[field] >= 1, field, "an integer >= 1")
        require(all(name in CHECKS for name in checks), "KLHealth.checks", f"a list of {', '.join(CHECKS)}", checks)
        tolerances = ("min_kl_share", "max_logprob_diff", "estimate_rel_tol", "estimate_abs_tol", "estimate_z", "kl_zero")
        for field in (*tolerances, "fingerprint_rtol"):
            check(args[field] >= 0, field, ">= 0")
        check(0 <= min_ess <= 1, "min_ess", "in [0, 1]")
        check(0 <= max_cap_removed <= 1, "max_cap_removed", "in [0, 1]")
        check(reward_window >= 2, "reward_window", ">= 2 (a trend needs two points)")
        self.mode, self.every_n_iterations, self.patience, self.checks = mode, every_n_iterations, patience, list(checks)
        self.min_kl_share, self.max_logprob_diff, self.min_ess = min_kl_share, max_logprob_diff, min_ess
        self.max_cap_removed = max_cap_removed
        self.estimate_rel_tol, self.estimate_abs_tol, self.estimate_z = estimate_rel_tol, estimate_abs_tol, estimate_z
        self.kl_zero, self.min_reward_rise = kl_zero, min_reward_rise
        self.fingerprint_tensors, self.fingerprint_rtol = fingerprint_tensors, fingerprint_rtol
        self.conditions = {name: Condition(patience) for name in CHECKS}
        # a batch older than allowed, and a reference whose weights changed, are bugs at once, never noise
        self.conditions.update(staleness=Condition(1), reference_moved=Condition(1))
        self.rewards: deque[float] = deque(maxlen=reward_window)
        self.fingerprint: Optional[list[float]] = None  # the reference's, at the start of fit
        self.saved_fingerprint: Optional[list[float]] = None  # the checkpoint's, on resume
        self.module = None  # the PPORLHF, for state_dict's fingerprint
        self.probing: Optional[dict[str, Any]] = None  # what a probe iteration captured (scored, betas)
        self.seconds: dict[str, float] = {}  # each probe check's last cost, for the docs' table (tests)

    def active(self, name: str) -> bool:
        return self.mode != "off" and name in self.checks

    @property
    def state_key(self) -> str:
        return self._generate_state_key(checks=tuple(self.checks))

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        self.module = pl_module
        if not self.active("reference_moved"):
            return
        self.fingerprint = reference_fingerprint(pl_module.networks, self.fingerprint_tensors)
        saved, self.saved_fingerprint = self.saved_fingerprint, None
        if saved is not None and len(saved) == len(self.fingerprint):
            changed = not same_fingerprint(saved, self.fingerprint, self.fingerprint_rtol)
            if self.conditions["reference_moved"].observe(changed):
                self._fire(
                    trainer,
                    pl_module,
                    "reference_moved",
                    "the reference's fingerprint differs from the checkpoint's: the resumed run rebuilt another reference "
                    f"than the one it trained against (checkpoint {_short(saved)}, now {_short(self.fingerprint)}); resume "
                    "with the checkpoint's model.policy, model.reference, model.tiny_config and model.seed",
                )

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop_probing(pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop_probing(pl_module)

    def is_probe(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` (counted from 1) is a probe."""
        return self.mode != "off" and iteration % self.every_n_iterations == 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.is_probe(pl_module.iteration + 1) or not (self.active("dead_kl") or self.active("estimate_vs_exact")):
            return
        # Instrument the iteration: capture the scores and rewards the module builds, and keep pi_old's and
        # pi_ref's logits (computed anyway) in the trajectory for the exact KL.
        self.probing = {"needs_logits": pl_module.sampler.needs_logits, "reference_signal": pl_module.sampler.reference_signal}
        score = pl_module.score

        def captured_score(rollout: Trajectory, betas: Tensor) -> Scored:
            scored = score(rollout, betas)
            self.probing.update(scored=scored, betas=betas)
            return scored

        pl_module.score = captured_score
        if self.active("estimate_vs_exact"):  # the whole logits, not what the estimator reads of them (a top k)
            pl_module.sampler.needs_logits, pl_module.sampler.reference_signal = True, None

    def _stop_probing(self, pl_module) -> Optional[dict[str, Any]]:
        probing, self.probing = self.probing, None
        if probing is not None:
            del pl_module.score  # the class's method again
            pl_module.sampler.needs_logits, pl_module.sampler.reference_signal = probing["needs_logits"], probing["reference_signal"]
        return probing

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        probing = self._stop_probing(pl_module)
        if self.mode == "off" or outputs.get("skipped", True):
            return
        metrics, logged = outputs["metrics"], {}
        if self.active("sampler_mismatch"):
            logged.update(self.sampler_mismatch(trainer, pl_module, metrics))
        if self.active("reward_up_kl_zero"):
            logged.update(self.reward_up_kl_zero(trainer, pl_module, metrics))
        if self.is_probe(pl_module.iteration):
            if self.active("reference_moved") and not pl_module.reference_update.moves:
                logged.update(self.reference_moved(trainer, pl_module))
            if probing is not None and "scored" in probing:
                if self.active("dead_kl"):
                    logged.update(self.dead_kl(trainer, pl_module, outputs, probing["scored"], probing["betas"]))
                if self.active("estimate_vs_exact"):
                    logged.update(self.estimate_vs_exact(trainer, pl_module, outputs))
        if logged:
            pl_module.log_dict({PREFIX + name: float(value) for name, value in logged.items()}, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------ the checks
    def dead_kl(self, trainer, pl_module, outputs, scored: Scored, betas: Tensor) -> dict[str, float]:
        beta, kl = outputs["metrics"]["objective/beta"], outputs["kl"]
        present = float(pl_module._reduce(kl.detach().abs().sum().double())) > 0  # exactly 0 while the reference is the policy
        shares, where = [], []
        settings = pl_module.kl
        with _timed(self, "dead_kl"):
            if settings.in_reward and present:
                shares.append(advantage_share(pl_module, outputs["rollout"], scored))
                where.append("the advantages (model.kl.placement: reward)")
            if settings.in_loss and present and not pl_module.networks.sharded:
                shares.append(gradient_share(pl_module, outputs["rollout"], scored, betas))
                where.append("the loss's gradient (model.kl.placement: loss)")
        if not shares:
            return {}
        share = max(shares)
        failing = beta > 0 and share <= self.min_kl_share
        message = (
            f"beta = {beta:.4g} > 0 and the KL estimate is not 0, but the KL's share of the update is {share:.3g} "
            f"(<= KLHealth.min_kl_share = {self.min_kl_share:g}) for {self.patience} probes: the KL does not reach "
            f"{' or '.join(where)}; check model.kl.placement ({settings.placement}), the KL estimator and divergence "
            "plugins, and whatever builds the rewards or the loss (PPORLHF.score, Regulariser.loss_term)"
        )
        return {"kl_share": share, **self._observe(trainer, pl_module, "dead_kl", failing, message)}

    def reference_moved(self, trainer, pl_module) -> dict[str, float]:
        with _timed(self, "reference_moved"):
            now = reference_fingerprint(pl_module.networks, self.fingerprint_tensors)
        if self.fingerprint is None:
            self.fingerprint = now
        changed = not same_fingerprint(now, self.fingerprint, self.fingerprint_rtol)
        message = (
            f"the frozen reference's weights changed during the run (fingerprint {_short(self.fingerprint)} at the start "
            f"of fit, {_short(now)} now) while model.reference_update is "
            f"{type(pl_module.reference_update).__name__}: something writes to the reference (a shared tensor, an "
            "optimizer over its parameters, a callback); set model.reference_update to move it on purpose"
        )
        return self._observe(trainer, pl_module, "reference_moved", changed, message)

    def sampler_mismatch(self, trainer, pl_module, metrics: dict[str, float]) -> dict[str, float]:
        causes = []
        diff = metrics.get("rollout/logprob_diff_mean")
        # A declared behaviour policy differs from pi on purpose: the exploring mixture, or weights k versions old
        # (whose health the correction's ESS says).
        declared = metrics.get("sampling/explore", 0.0) > 0 or pl_module.off_policy.max_staleness > 0
        if diff is not None and diff > self.max_logprob_diff and not declared:
            causes.append(
                f"rollout/logprob_diff_mean = {diff:.4g} > KLHealth.max_logprob_diff = {self.max_logprob_diff:g}: the rollout "
                f"engine {type(pl_module.rollout_engine).__name__}'s log-probs are not the trainer's (its dtype, kernels or "
                "weight sync); set model.sampling.old_logprobs: forward or a model.sampling.rollout_correction"
            )
        ess = metrics.get("off_policy/ess")
        if ess is not None and ess < self.min_ess:
            causes.append(
                f"off_policy/ess = {ess:.4g} < KLHealth.min_ess = {self.min_ess:g}: a few samples carry the batch; "
                "lower model.off_policy.max_staleness"
            )
        removed = metrics.get("off_policy/cap_removed")
        if removed is not None and removed > self.max_cap_removed:
            causes.append(
                f"off_policy/cap_removed = {removed:.3g} > KLHealth.max_cap_removed = {self.max_cap_removed:g}: the "
                f"correction's cap or mask removes that share of the exact weights, so the update follows another objective "
                f"(model.off_policy.correction {pl_module.off_policy.correction}; a long response's sequence weight past "
                "model.off_policy.correction_cap); use model.off_policy.correction: token, or lower model.off_policy.max_staleness"
            )
        out = self._observe(trainer, pl_module, "sampler_mismatch", bool(causes), "; ".join(causes) + f", for {self.patience} iterations")
        staleness, allowed = metrics.get("off_policy/staleness_max"), pl_module.off_policy.max_staleness
        if staleness is not None:
            stale = staleness > allowed
            message = (
                f"off_policy/staleness_max = {staleness:g} > model.off_policy.max_staleness = {allowed}: a batch older than "
                "allowed reached the update (the asynchronous sampler's versions); raise model.off_policy.max_staleness "
                "only if that is meant"
            )
            stale_firing = self._observe(trainer, pl_module, "staleness", stale, message)["staleness"]
            out["sampler_mismatch"] = max(out["sampler_mismatch"], stale_firing)
        return out

    def estimate_vs_exact(self, trainer, pl_module, outputs) -> dict[str, float]:
        rollout = outputs["rollout"]
        kl = weighted_kl(rollout, outputs["kl"].detach())  # as objective/kl: under pi_old where a rollout correction weighs it
        with _timed(self, "estimate_vs_exact"):
            exact = exact_kl(pl_module, rollout)  # (batch, response_len)
            difference = (kl.double() - exact).sum(-1)  # per response
            count = torch.tensor(float(len(difference)), dtype=torch.float64, device=kl.device)
            sums = torch.stack([count, kl.double().sum(), exact.sum(), difference.sum(), (difference**2).sum()])
            n, estimate, exact_total, d, d2 = pl_module._reduce(sums).tolist()
        estimate, exact_mean, d = estimate / n, exact_total / n, d / n
        se = max(d2 / n - d * d, 0.0) ** 0.5 / max(n - 1, 1) ** 0.5
        band = max(self.estimate_rel_tol * abs(exact_mean), self.estimate_abs_tol)
        failing = abs(d) > band and abs(d) > self.estimate_z * se
        name = type(pl_module.kl_estimator).__name__
        message = (
            f"the {name} estimate's mean KL per response {estimate:.4g} differs from the exact full-vocabulary KL of the "
            f"same responses {exact_mean:.4g} by {d:+.4g} nats (band {band:.3g}: KLHealth.estimate_rel_tol "
            f"{self.estimate_rel_tol:g} x exact, floor estimate_abs_tol {self.estimate_abs_tol:g}; {abs(d) / max(se, 1e-12):.1f} "
            f"standard errors) for {self.patience} probes: the estimator is biased on these samples; set "
            "model.kl_estimator: full (exact) or k1, or widen KLHealth.estimate_rel_tol"
        )
        out = {"kl_estimate": estimate, "kl_exact": exact_mean}
        return {**out, **self._observe(trainer, pl_module, "estimate_vs_exact", failing, message)}

    def reward_up_kl_zero(self, trainer, pl_module, metrics: dict[str, float]) -> dict[str, float]:
        self.rewards.append(metrics["objective/reward"])
        kl = metrics["objective/kl"]
        failing: Optional[bool] = None
        rise = 0.0
        if abs(kl) >= self.kl_zero:
            failing = False
        elif len(self.rewards) == self.rewards.maxlen:
            rise = trend(list(self.rewards)) * (len(self.rewards) - 1)
            failing = rise > self.min_reward_rise
        message = (
            f"objective/reward rose by {rise:.4g} over the last {len(self.rewards)} iterations (KLHealth.reward_window) while "
            f"objective/kl = {kl:.3g} < KLHealth.kl_zero = {self.kl_zero:g} for {self.patience} iterations: the reference "
            "is the policy itself (a reference synced every iteration, or loaded from the policy's current weights); check "
            "model.reference_update and model.reference"
        )
        return self._observe(trainer, pl_module, "reward_up_kl_zero", failing, message)

    # ------------------------------------------------------------------ reports
    def _observe(self, trainer, pl_module, name: str, failing: Optional[bool], message: str) -> dict[str, float]:
        condition = self.conditions[name]
        if condition.observe(failing):
            self._fire(trainer, pl_module, "sampler_mismatch" if name == "staleness" else name, message)
        return {name: float(condition.firing)}

    def _fire(self, trainer, pl_module, name: str, message: str) -> None:
        text = f"KLHealth {name} at iteration {pl_module.step}: {message}"
        if self.mode == "stop":
            raise KLHealthError(f"{text}. Stopping (KLHealth.mode: stop; mode: warn goes on, checks without {name} skips it)")
        rank_zero_warn(text + f" (KLHealth.checks without {name} silences it)")
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text("kl_health", text, global_step=max(pl_module.step, 0))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        fingerprint = self.fingerprint
        if self.module is not None and self.active("reference_moved") and self.module.networks is not None:
            fingerprint = reference_fingerprint(self.module.networks, self.fingerprint_tensors)  # a moving reference's now
        return {
            "conditions": {name: condition.state_dict() for name, condition in self.conditions.items()},
            "rewards": list(self.rewards),
            "fingerprint": fingerprint,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, state in state_dict["conditions"].items():
            self.conditions[name].load_state_dict(state)
        self.rewards = deque(state_dict["rewards"], maxlen=self.rewards.maxlen)
        self.saved_fingerprint = state_dict["fingerprint"]


# ---------------------------------------------------------------------- the measurements
def reference_fingerprint(networks, count: int) -> list[float]:
    """The float64 sum and absolute sum of ``count`` of the reference's frozen tensors, evenly spaced in
    parameter order (first and last included), the policy's trained ones left out: under LoRA the base weights
    (the adapter disabled; a moving reference's adapter too), under FSDP2 each rank's shards summed over the
    ranks. Two floats per tensor."""
    trained = {id(p) for p in networks.policy.parameters() if p.requires_grad}  # PEFT freezes the adapter it disables
    with networks.reference() as reference:
        frozen = [p for p in reference.parameters() if not p.requires_grad and id(p) not in trained]
        if not frozen:
            return []
        picks = sorted({round(i * (len(frozen) - 1) / max(count - 1, 1)) for i in range(count)})
        sums = []
        for i in picks:
            t = local_tensor(frozen[i]).detach()
            sums += [t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)]
        sums = torch.stack(sums)
    if networks.sharded:
        sums = networks.reduce(sums)
    return sums.tolist()


def advantage_share(pl_module, rollout: Trajectory, scored: Scored) -> float:
    """||A - A_0|| / ||A|| over the response tokens of all ranks: A the module's advantages of ``scored.rewards``
    (what its update used), A_0 those of the same scores with no KL (``ppo_math.token_rewards`` at beta 0)."""
    mask = rollout.response_mask
    without = pm.token_rewards(scored.scores.to(scored.rewards.dtype), torch.zeros_like(scored.rewards), mask, 0.0)
    advantages, _ = pl_module.compute_advantages(scored.rewards, rollout)
    base, _ = pl_module.compute_advantages(without, rollout)
    sums = torch.stack([(((advantages - base) * mask) ** 2).sum().double(), ((advantages * mask) ** 2).sum().double()])
    delta, total = pl_module._reduce(sums).tolist()
    return (delta / total) ** 0.5 if total > 0 else (1.0 if delta > 0 else 0.0)


def gradient_share(pl_module, rollout: Trajectory, scored: Scored, betas: Tensor) -> float:
    """||beta grad L_KL|| / (||beta grad L_KL|| + ||grad L_pg||) on the policy's trainable parameters, on the
    update's first minibatch (its first 1 / num_minibatches rows) at the current weights: the KL's loss term
    (``Regulariser.loss_term``) and the policy-loss plugin's, each summed with the loss aggregation's weights.
    ``torch.autograd.grad``: no ``.grad`` written, no optimizer step."""
    networks, rows = pl_module.networks, rollout.input_ids.shape[0]
    idx = torch.arange(max(rows // pl_module.ppo.num_minibatches, 1), device=rollout.input_ids.device)
    mask = rollout.response_mask[idx]
    advantages, _ = pl_module.compute_advantages(scored.rewards, rollout)
    params = [p for p in networks.policy.parameters() if p.requires_grad]
    with torch.enable_grad():
        logits, _ = networks.policy_outputs(rollout.input_ids[idx], rollout.attention_mask[idx], rollout.responses.shape[1], critic=False)
        logits = sampling.restrict(logits, None if rollout.kept is None else rollout.kept[idx])
        logprobs = pm.logprobs_of(logits, rollout.responses[idx])
        pg_loss, _ = pl_module.policy_loss(logprobs, rollout.old_logprobs[idx], advantages[idx], mask)
        kl_loss, _ = pl_module.regulariser.loss_term(rollout, idx, logprobs, logits)
        weights = pl_module.loss_aggregation.weights(mask, pl_module.sampling.max_new_tokens, pl_module._reduce)
        row_betas = betas.to(kl_loss.dtype)[idx, None]
        terms = [(weights * pg_loss).sum(), (weights * row_betas * kl_loss).sum()]
        norms = []
        for i, term in enumerate(terms):
            grads = torch.autograd.grad(term, params, retain_graph=i == 0, allow_unused=True) if term.requires_grad else []
            norms.append(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    pg, kl = (value**0.5 for value in pl_module._reduce(torch.tensor(norms, dtype=torch.float64)).tolist())
    return kl / (kl + pg) if kl + pg > 0 else 0.0


@torch.no_grad()
def exact_kl(pl_module, rollout: Trajectory) -> Tensor:
    """The exact KL(pi_old || pi_ref) at each response position on the sampler's kept set, sum_v p(v) (log p(v) -
    log q(v)) in float64, zero off the KL mask: (batch, response_len). From the trajectory's logits, or where it
    did not keep them one forward each (the policy's then is the updated one, pi_old's stand-in)."""
    networks, response_len = pl_module.networks, rollout.responses.shape[1]
    logits, ref_logits = rollout.old_logits, rollout.ref_logits
    if logits is None:
        logits = networks.kept_logits(networks.policy, rollout.input_ids, rollout.attention_mask, response_len, rollout.kept)
    if ref_logits is None:
        ref_logits = networks.reference_logits(rollout.input_ids, rollout.attention_mask, response_len, rollout.kept)
    logp, ref_logp = logits.double().log_softmax(-1), ref_logits.double().log_softmax(-1)
    p = logp.exp()
    per_position = torch.where(p > 0, p * (logp - ref_logp), torch.zeros_like(p)).sum(-1)
    return pm.masked_select(per_position, pl_module.regulariser.kl_mask(rollout.responses, rollout.response_mask).double())


def trend(values: list[float]) -> float:
    """The least-squares slope of ``values`` against 0, 1, 2, ..."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum((x - mean_x) ** 2 for x in range(n))


def same_fingerprint(a: list[float], b: list[float], rtol: float) -> bool:
    """Whether two fingerprints (sum, absolute sum per tensor) agree within ``rtol`` of each tensor's absolute sum:
    LoRA's merge for generation and unmerge round the base weights within a step each time."""
    if len(a) != len(b):
        return False
    for i in range(0, len(a), 2):
        scale = rtol * max(abs(a[i + 1]), abs(b[i + 1]))
        if abs(a[i] - b[i]) > scale or abs(a[i + 1] - b[i + 1]) > scale:
            return False
    return True


def _short(fingerprint: list[float]) -> str:
    return f"sum {sum(fingerprint[0::2]):.12g}, abs-sum {sum(fingerprint[1::2]):.12g}"


class _timed:
    """Wall-clock seconds of a probe check into ``monitor.seconds`` (the docs' cost table is measured with them)."""

    def __init__(self, monitor: KLHealth, name: str) -> None:
        self.monitor, self.name = monitor, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.monitor.seconds[self.name] = time.perf_counter() - self.start
