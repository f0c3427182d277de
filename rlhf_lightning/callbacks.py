"""Callbacks that ship with rlhf-lightning."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Optional, Sequence

import torch
from lightning import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lightning.fsdp2 import full_state_dict, is_sharded
from rlhf_lightning.interfaces import require


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
            policy = module._load_policy()
            if module.hparams.lora_rank:
                policy = module._add_lora(policy)
        policy.load_state_dict(state)
    elif module.global_rank != 0:
        return None
    elif hasattr(policy, "merge_and_unload"):
        policy = copy.deepcopy(policy)
    if hasattr(policy, "merge_and_unload"):
        policy = policy.merge_and_unload()
    policy.save_pretrained(target)
    module.tokenizer.save_pretrained(target)
    return target


class IterationCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that saves every ``every_n_iterations`` PPO iterations (plus ``last.ckpt``).

    Lightning's ``every_n_train_steps`` counts optimizer steps, of which one PPO iteration takes
    ``ppo_epochs * num_minibatches`` per optimizer; this counts iterations (training batches).
    Writes are atomic (Lightning saves through a temporary file that is renamed into place), so
    a kill during a save leaves the previous checkpoint loadable.
    """

    def __init__(self, every_n_iterations: int = 10, save_last: bool = True, save_top_k: int = 1, **kwargs) -> None:
        if every_n_iterations < 1:
            raise ValueError(f"every_n_iterations must be >= 1, got {every_n_iterations!r}")
        super().__init__(save_last=save_last, save_top_k=save_top_k, every_n_train_steps=0, **kwargs)
        self.every_n_iterations = every_n_iterations

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.iteration % self.every_n_iterations or self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1): the chance that k of the n, drawn without
    replacement, hold at least one correct, 1 - C(n - c, k) / C(n, k)."""
    require(1 <= k <= n, "PassAtK.ks", f"integers in [1, n] (n = {n} samples)", k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


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
        scores = pl_module.reward_model.checked_scores(rollout.prompts, rollout.responses)  # (prompts * n,)
        correct = (scores >= self.threshold).view(len(batch), self.n).sum(-1).tolist()  # per prompt
        metrics = {f"val/pass@{k}": sum(pass_at_k(self.n, c, k) for c in correct) / len(correct) for k in self.ks}
        pl_module.log_dict(metrics, batch_size=len(batch), sync_dist=True)
