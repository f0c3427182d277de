"""The closed-form lab: toy tasks small enough to enumerate every response, where the KL-regularised
optimum is known exactly and PPO can be measured against it.

One idea per file, each importing only the files above it in this list:

- :mod:`~rlhf_lightning.exact.tabular`: tabular policies (one logit vector per prefix) and sums over response trees
  (fixed-length, or ending at EOS: the tree over K + 1 symbols);
- :mod:`~rlhf_lightning.exact.f_divergence`: the optimum of every f-divergence (``model.divergence``), its J*_f and
  the exact D_f of a policy;
- :mod:`~rlhf_lightning.exact.closed_form`: pi*, J*, the per-token fixed point, where a length-weighted loss settles,
  where a controller's unit rests, and the distances to them;
- :mod:`~rlhf_lightning.exact.episodes`: two-turn episodes with an environment's chance node between the turns: the
  soft-Bellman optimum, the episode tilt it is not, and where counting the environment's token settles;
- :mod:`~rlhf_lightning.exact.frontier`: the reward-KL plane, best-of-N, and the distance to pi* from samples;
- :mod:`~rlhf_lightning.exact.meter`: :class:`KLToOptimum`, that distance measured during a real run;
- :mod:`~rlhf_lightning.exact.tasks`: the enumerable tasks and the tiny network PPORLHF trains on them;
- :mod:`~rlhf_lightning.exact.episode_tasks`: two-turn episode tasks, their environment (``lab_chance``, registered
  on import) and their exact row;
- :mod:`~rlhf_lightning.exact.training`: the sampled loop, its exact expectation and PPO on a table.

Import the file you use (``from rlhf_lightning.exact.closed_form import optimal_logprobs``): this package
re-exports nothing, so the command, which imports :mod:`~rlhf_lightning.exact.meter` for ``class_path:
KLToOptimum``, loads the meter and the math it reads (frontier, closed_form, f_divergence, tabular), not the
tasks and the training harness. The framework never imports the lab.
"""
