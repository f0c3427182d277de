"""Toy tasks small enough to enumerate every response, and the tiny network PPORLHF trains on them.

A task: a handful of one-token prompts, K content tokens and responses of at most L tokens, so every
expectation of the closed forms (:mod:`rlhf_lightning.exact.closed_form`) is a finite sum. The policy
is a randomly initialised tiny Llama trained by the unchanged PPORLHF loop (rollout -> score -> GAE ->
PPO update); E_x is uniform over the prompts (every training batch holds each prompt equally often).

Two kinds of response. The language-model head itself adds a constant -1e4 to the logits of every
token the task does not allow (pad, unk, prompt tokens; EOS too on a fixed-length task): generate and
the forward pass both read the same head, so both see probability exactly 0 there (exp(-1e4)
underflows to 0 even in float64). The bias is finite rather than -inf so that entropies and the
``full`` estimator's sum_a pi(a) (log pi(a) - log pi_ref(a)) stay 0 * finite = 0, not NaN.

- Fixed length (``eos=False``): the sampler can never emit EOS, and with ``max_new_tokens = L``
  every response is L content tokens with a response mask of all ones: K ** L responses.
- Ending at EOS (``eos=True``): EOS is one more token the network scores like any other, so a
  response is n < L content tokens then EOS (n + 1 tokens, the KL at EOS included, as PPORLHF
  masks it), or L content tokens cut at ``max_new_tokens`` without EOS, which the reward backend's
  ``missing_eos_penalty`` charges: sum_{n <= L} K ** n responses, laid out in the tree over K + 1
  symbols of :mod:`~rlhf_lightning.exact.tabular` (a path with a token after EOS has probability
  0). ``min_new_tokens`` m bans EOS at the first m positions of the declared distribution
  (rlhf_lightning/sampling.py), for the policy and the reference alike: responses of fewer than m
  content tokens then have probability 0.

With ``top_k`` / ``top_p`` (rlhf_lightning/sampling.py) every distribution here is the declared one:
tempered and restricted, at each prefix, to the kept set the policy's own sampler keeps there, for
the reference too (:meth:`ExactPPORLHF.exact_logprobs`); the optimum is then that of the declared
objective at those kept sets (docs/rollout-engines.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from rlhf_lightning import args, models, sampling
from rlhf_lightning import ppo_math as pm
from rlhf_lightning.checks import require
from rlhf_lightning.data import PromptTable, prompt_id
from rlhf_lightning.exact.closed_form import OptimumReport, backward_induction, optimum_logprobs, optimum_report
from rlhf_lightning.exact.tabular import enumerate_responses, response_lengths, valid_responses
from rlhf_lightning.interfaces import RewardModel
from rlhf_lightning.models import SPECIAL_TOKENS, char_tokenizer
from rlhf_lightning.module import PPORLHF
from rlhf_lightning.registry import registry

BANNED_LOGIT = -1e4  # added to the logits of non-content tokens: probability exactly 0, entropy still finite
EXACT_TINY_CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=16,
    initializer_range=0.2,
)


def target_count(prompts: Sequence[str], responses: Sequence[str], scale: float = 1.0) -> list[float]:
    """Reward for the ``callable`` backend: scale * how often the prompt's letter, lower-cased,
    occurs in the response (prompt "A" rewards "a"). Terminal: it scores the whole sequence."""
    return [scale * response.count(prompt.strip().lower()) for prompt, response in zip(prompts, responses, strict=True)]


def toy_tokenizer(prompt_tokens: Sequence[str], content_tokens: Sequence[str]):
    """The character tokenizer (``models.char_tokenizer``) over a task's prompt tokens, then its content
    tokens, each one character."""
    tokens = [*prompt_tokens, *content_tokens]
    require(
        len(set(tokens)) == len(tokens) and all(len(t) == 1 for t in tokens) and not set(tokens) & set(SPECIAL_TOKENS),
        "the task's prompt and content tokens",
        "distinct single characters",
        tokens,
    )
    return char_tokenizer(tokens)


def order_reward(prompts: Sequence[str], responses: Sequence[str], tokens: str, tables: dict[str, dict]) -> list[float]:
    """Reward for the ``callable`` backend that depends on token order: with the prompt's ``tables``
    (``position`` (L, K), ``transition`` (K, K), optionally ``pair`` (K, K) and ``length`` (L + 1,) as nested
    lists, ``offset`` a number) and y_t the index of the t-th character in ``tokens``, n the response's
    characters,

        r(x, y) = offset + length[n] + sum_t position[t][y_t] + sum_t transition[y_t][y_{t+1}] + sum_{t < t'} pair[y_t][y_t'].

    Positions reward a token at one place, transitions one token right after another, pairs one
    token anywhere before another (asymmetric: "a..b" is not "b..a"), lengths a response of n tokens; an
    optional ``bonus`` [text, value] adds value to the one response with that text."""
    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        table = tables[prompt]
        y = [tokens.index(c) for c in response]
        score = table["offset"] + (table["length"][len(y)] if "length" in table else 0.0)
        score += sum(table["position"][t][a] for t, a in enumerate(y))
        score += sum(table["transition"][a][b] for a, b in itertools.pairwise(y))
        if "pair" in table:
            score += sum(table["pair"][y[t]][b] for t in range(len(y)) for b in y[t + 1 :])
        if "bonus" in table and response == table["bonus"][0]:
            score += table["bonus"][1]
        scores.append(score)
    return scores


@dataclass(frozen=True)
class ExactTask:
    """Prompts, content tokens and a fixed response length; the reward is a ``module:function``
    for the ``callable`` backend, so training and the exact sums score with the same code.

    ``model_seed`` seeds the tiny model's initialisation, which is the reference pi_ref = pi_0 and so
    part of the task; None (the hand-made tasks) leaves it to the run's seed, as before tasks had one.
    ``teacher_seed``: the reference is instead a second network of the same shape initialised from this seed
    (the teacher, ``model.reference``; docs/reference.md), and pi_0 is the policy the first seeds: the optimum
    is pi* ∝ pi_teacher exp(r / beta), pi_teacher itself with a reward of 0 (on-policy distillation).
    ``position_embedding`` gives the tiny model a learned absolute position embedding, zero at the start
    so pi_ref is unchanged (:class:`PositionEmbedding`).

    ``eos``: responses end at EOS (at most ``response_length`` tokens, EOS counted; one of
    ``response_length`` content tokens without EOS is cut there and loses ``missing_eos_penalty``);
    ``eos_scale`` multiplies the initial network's EOS logit (its output row), so the reference's
    chance to stop differs more from prompt to prompt and from prefix to prefix."""

    prompts: tuple[str, ...] = ("A", "B", "C")
    content_tokens: tuple[str, ...] = ("a", "b", "c")
    response_length: int = 3
    reward_function: str = "rlhf_lightning.exact.tasks:target_count"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    model_seed: Optional[int] = None
    position_embedding: bool = False
    eos: bool = False
    missing_eos_penalty: Optional[float] = None
    eos_scale: float = 1.0
    teacher_seed: Optional[int] = None

    def __post_init__(self) -> None:
        require(
            self.eos or (self.missing_eos_penalty is None and self.eos_scale == 1.0),
            "missing_eos_penalty and eos_scale",
            "for a task with eos=True",
            (self.missing_eos_penalty, self.eos_scale),
        )

    @classmethod
    def random(
        cls,
        seed: int,
        num_prompts: int = 2,
        num_tokens: int = 4,
        length: int = 3,
        scale: float = 1.0,
        eos: bool = False,
        missing_eos_penalty: float = 0.5,
        eos_scale: float = 4.0,
        teacher_seed: Optional[int] = None,
    ) -> ExactTask:
        """A seeded task whose reward depends on token order (:func:`order_reward`). Per prompt, times
        ``scale``: position weights 0.1 N(0, 1) and sparse transitions, a quarter of the (a, b) pairs
        (drawn at random) worth +-2 (1 + 0.5 |N(0, 1)|), the others 0. The reference is the tiny model
        initialised from ``seed`` (non-uniform and prefix-dependent), so one seed fixes the whole task;
        training samples with a seed of its own (:func:`~rlhf_lightning.exact.training.train`). ``offset``
        centres each prompt's reward under the reference, E_ref[r | x] = 0: J(pi_ref) = 0 and the gap (J* - J) / J* is the fraction of
        the attainable improvement a policy misses.

        A sparse transition makes the KL still to be paid depend on the token just chosen (after a token
        with a rewarded successor the optimal continuation leaves pi_ref, elsewhere it stays close), so
        the per-token fixed point (:func:`backward_induction`, ``soft=False``) lies away from pi* (its gap:
        :func:`per_token_fixed_point_gap`). The defaults (64 responses per prompt, strong sparse transitions,
        no pair term) are chosen so that on every seed from 1 to 5 the two lie clearly apart and PPO converges
        within the iterations ``python -m tools.studies.optimum_check --matrix`` gives a random task.

        The tiny model gets a position embedding (zero at the start: the reference is the same): the
        per-token fixed point asks for conditionals that differ by position after the same tokens where
        pi* and pi_ref hardly do, and one rotary layer did not learn that under sampling noise: without the
        embedding rloo's per-token cell ended well short of the fixed point's gap.

        ``eos=True``: responses end at EOS (:class:`ExactTask`'s ``eos``), the network's EOS logit scaled by
        ``eos_scale`` (its chance to stop then differs by prompt and prefix), responses cut at ``length``
        lose ``missing_eos_penalty``, and the reward gains a length term, ``scale`` N(0, 1) per number of
        content tokens per prompt: the length the optimum prefers is the task's, not a constant.

        ``teacher_seed``: the reference is the teacher, the same network initialised from that seed
        (:class:`ExactTask`), and the offset centres each prompt's reward under it (J(pi_teacher) = 0); ``scale``
        0 is a reward of 0 everywhere, where the optimum is the teacher itself."""
        require(
            1 <= num_prompts <= 26 and 1 <= num_tokens <= 26 and length >= 1,
            "a random task's size",
            "1-26 prompts, 1-26 tokens, length >= 1",
            (num_prompts, num_tokens, length),
        )
        generator = torch.Generator().manual_seed(seed)
        prompts = tuple(chr(ord("A") + i) for i in range(num_prompts))
        tokens = tuple(chr(ord("a") + i) for i in range(num_tokens))

        def normal(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=generator, dtype=torch.float64)

        tables = {}
        for prompt in prompts:
            position, transition = 0.1 * normal(length, num_tokens), normal(num_tokens, num_tokens)
            kept = torch.rand(num_tokens, num_tokens, generator=generator) < 0.25
            transition = torch.where(kept, 2 * (transition.sign() + 0.5 * transition), torch.zeros((), dtype=torch.float64))
            tables[prompt] = {"offset": 0.0, "position": (scale * position).tolist(), "transition": (scale * transition).tolist()}
            if eos:
                tables[prompt]["length"] = (scale * normal(length + 1)).tolist()
        task = cls(
            prompts=prompts,
            content_tokens=tokens,
            response_length=length,
            reward_function="rlhf_lightning.exact.tasks:order_reward",
            reward_kwargs={"tokens": "".join(tokens), "tables": tables},
            model_seed=seed,
            position_embedding=True,
            eos=eos,
            missing_eos_penalty=missing_eos_penalty if eos else None,
            eos_scale=eos_scale if eos else 1.0,
            teacher_seed=teacher_seed,
        )
        centres = (reference_logprobs(task).exp() * task.rewards()).sum(-1)  # E_ref[r | x] with offset 0
        for prompt, centre in zip(prompts, centres.tolist(), strict=True):
            tables[prompt]["offset"] = -centre  # the task's own reward_kwargs: set before anyone else sees it
        return task

    def with_rare_mode(self, beta: float, share: float = 0.9, reference_below: float = 0.01) -> ExactTask:
        """This random task (:func:`order_reward`) with, per prompt, a bonus on the response the reference
        gives closest to half of ``reference_below``, sized so that pi* at ``beta`` puts ``share`` of the
        prompt's mass on it: a rare high-reward mode that on-policy sampling meets about once in 200
        responses. The offsets are centred again (E_ref r = 0)."""
        require(
            self.reward_function.endswith(":order_reward"), "a task with a rare mode", "a random task (order_reward)", self.reward_function
        )
        ref, rewards = reference_logprobs(self), self.rewards()
        tables = {prompt: dict(table) for prompt, table in self.reward_kwargs["tables"].items()}
        for row, prompt in enumerate(self.prompts):
            candidates = ref[row].exp().masked_fill(~self.valid, math.inf)
            rare = int((candidates.log() - math.log(reference_below / 2)).abs().argmin())
            others = torch.arange(len(candidates)) != rare
            rest = torch.logsumexp(ref[row, others] + rewards[row, others] / beta, -1)  # log Z without the rare response
            bonus = beta * (math.log(share / (1 - share)) + float(rest) - float(ref[row, rare])) - float(rewards[row, rare])
            tables[prompt]["bonus"] = [self.responses[rare], bonus]
        task = dataclasses.replace(self, reward_kwargs={**self.reward_kwargs, "tables": tables})
        centres = (ref.exp() * task.rewards()).sum(-1)
        for prompt, centre in zip(self.prompts, centres.tolist(), strict=True):
            tables[prompt]["offset"] -= centre
        return task

    @property
    def num_symbols(self) -> int:
        """The symbols of the response tree: the K content tokens, and EOS (index K) when responses end at it."""
        return len(self.content_tokens) + self.eos

    @property
    def indices(self) -> Tensor:
        """Every path of the response tree, (num_symbols ** L, L) symbol indices in the order of
        :func:`enumerate_responses`; with ``eos`` some are no response (:attr:`valid`)."""
        return enumerate_responses(self.num_symbols, self.response_length)

    @property
    def valid(self) -> Tensor:
        """Which paths are responses, (paths,) bool: all of them on a fixed-length task."""
        return valid_responses(self.indices, len(self.content_tokens))

    @property
    def lengths(self) -> Tensor:
        """Each path's length in tokens, EOS included (what PPORLHF's response mask covers): (paths,) long."""
        return response_lengths(self.indices, len(self.content_tokens))

    @property
    def ended_with_eos(self) -> Tensor:
        """Whether each path ends at EOS (False: cut at ``response_length``), (paths,) bool."""
        return (self.indices == len(self.content_tokens)).any(-1)

    @property
    def responses(self) -> list[str]:
        """Every path as the text the reward reads (its content tokens before EOS), in the order of
        :func:`enumerate_responses`."""
        tokens = self.content_tokens
        return ["".join(tokens[i] for i in itertools.takewhile(lambda i: i < len(tokens), row)) for row in self.indices.tolist()]

    def reward_model(self) -> RewardModel:
        """The task's reward backend, built through the registry by its short name (``callable``), as the module builds its plugins."""
        return registry("reward_model").create(
            "callable", function=self.reward_function, kwargs=dict(self.reward_kwargs), missing_eos_penalty=self.missing_eos_penalty
        )

    def rewards(self) -> Tensor:
        """r(x, y) for every prompt and path: (prompts, paths), from the reward backend itself, less
        ``missing_eos_penalty`` for a response cut without EOS (the backend's shaping); 0 for a path that
        is no response."""
        responses = self.responses
        backend = self.reward_model()
        rewards = torch.tensor([backend.score([p] * len(responses), responses) for p in self.prompts], dtype=torch.float64)
        if self.missing_eos_penalty is not None:
            rewards = rewards - self.missing_eos_penalty * (~self.ended_with_eos).double()
        return rewards.masked_fill(~self.valid, 0.0)

    def dataloader(self, iterations: int, batch_size: int, end_batch_size: Optional[int] = None, end_iterations: int = 0) -> DataLoader:
        """``iterations`` batches that each hold every prompt ``batch_size / len(prompts)`` times,
        so each rollout estimates E_x with x uniform, exactly as the exact sums weigh it; the last
        ``end_iterations`` of them hold ``end_batch_size`` prompts instead."""
        sizes = [batch_size] * (iterations - end_iterations) + [end_batch_size or batch_size] * end_iterations
        for name, size in (("batch_size", batch_size), ("end_batch_size", end_batch_size or batch_size)):
            require(size % len(self.prompts) == 0, name, f"a multiple of the {len(self.prompts)} prompts", size)
        batches = [list(self.prompts) * (size // len(self.prompts)) for size in sizes]
        return DataLoader(batches, batch_size=None, shuffle=False, collate_fn=list)


TEACHER_SEED_OFFSET = 1000  # a teacher task's teacher is initialised from its seed + this (its student from the seed)

TASKS = {
    "terminal": ExactTask(),
    "bandit": ExactTask(response_length=1),
    # terminal's reward with responses that end at EOS: a longer response has more chances at the letter,
    # and one cut at 3 tokens without EOS loses 0.5
    "terminal-eos": ExactTask(eos=True, missing_eos_penalty=0.5),
}


RANDOM_KINDS = ("random", "random-eos", "rare-eos", "teacher", "random-teacher")
TASK_CHOICES = f"one of {sorted(TASKS)}, " + ", ".join(f"{kind}:SEED" for kind in RANDOM_KINDS)


def task_named(name: str) -> ExactTask:
    """A task of :data:`TASKS` by name, ``random:SEED`` for ``ExactTask.random(SEED)``, ``random-eos:SEED``
    for ``ExactTask.random(SEED, eos=True)`` (responses that end at EOS), ``rare-eos:SEED`` (a mode the
    reference rarely samples), or with a teacher initialised from SEED + :data:`TEACHER_SEED_OFFSET` as the
    reference: ``teacher:SEED``, a reward of 0 (on-policy distillation: the optimum is the teacher), and
    ``random-teacher:SEED``, ``random:SEED``'s reward centred under the teacher."""
    kind, _, seed = name.partition(":")
    if kind in RANDOM_KINDS:
        require(seed.isdigit(), "a random task", f"{kind}:SEED with SEED a non-negative integer", name)
        if kind == "rare-eos":  # 7-token responses over 2 tokens, a peaked reference, a mode it gives ~0.5%
            return ExactTask.random(int(seed), num_tokens=2, length=7, eos=True, eos_scale=2.0).with_rare_mode(beta=1.0)
        if kind in ("teacher", "random-teacher"):
            teacher = int(seed) + TEACHER_SEED_OFFSET
            return ExactTask.random(int(seed), scale=0.0 if kind == "teacher" else 1.0, teacher_seed=teacher)
        return ExactTask.random(int(seed), eos=kind == "random-eos")
    require(name in TASKS, "the task", TASK_CHOICES, name)
    return TASKS[name]


class MaskedHead(nn.Module):
    """The LM head plus a constant bias of BANNED_LOGIT on every id outside ``allowed_ids``."""

    def __init__(self, head: nn.Module, vocab_size: int, allowed_ids: Sequence[int]) -> None:
        super().__init__()
        self.head = head
        bias = torch.full((vocab_size,), BANNED_LOGIT)
        bias[list(allowed_ids)] = 0.0
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.head(hidden) + self.bias.to(hidden.dtype)


class PositionEmbedding(nn.Module):
    """A learned absolute position embedding added to the input of a decoder's first layer (a forward
    pre-hook that reads the layer's ``position_ids``), zero at the start so the model computes what it
    did. The hook is a method of this module, so ``copy.deepcopy`` of the model (the reference, a
    separate critic's trunk) carries a copy that reads the copy's own weights."""

    def __init__(self, positions: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(positions, width))

    @classmethod
    def attach(cls, model: nn.Module) -> None:
        """Add one to a causal LM (``model.model.layers[0]``), as ``model.model.position_embedding``."""
        config, trunk = model.config, model.model
        trunk.position_embedding = cls(config.max_position_embeddings, config.hidden_size)
        trunk.layers[0].register_forward_pre_hook(trunk.position_embedding.add_to_input, with_kwargs=True)

    def add_to_input(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        positions = kwargs.get("position_ids")
        if positions is None:
            raise RuntimeError("PositionEmbedding: the decoder layer was called without position_ids")
        hidden, *rest = args
        return (hidden + self.weight[positions], *rest), kwargs


class ExactPPORLHF(PPORLHF):
    """PPORLHF on an :class:`ExactTask`: the toy tokenizer, a tiny Llama that can only emit
    content tokens, and ``max_new_tokens`` = the task's response length. Every other argument
    (estimator, controller, PPO settings) goes to PPORLHF unchanged. ``kl_budgets``, one per task prompt, are the
    prompts' KL budgets for a per-prompt beta controller (the task has no prompt file to hold them)."""

    def __init__(
        self,
        task: ExactTask = TASKS["terminal"],
        logged: Optional[Sequence[str]] = None,
        kl_budgets: Optional[Sequence[float]] = None,
        **kwargs: Any,
    ) -> None:
        kwargs = args.merge_settings(kwargs)
        fixed = {"policy", "tokenizer", "reference", "reward_model"} & set(kwargs)
        own = ("max_new_tokens",) if task.eos else ("max_new_tokens", "min_new_tokens")  # min_new_tokens bans EOS: only with one
        fixed |= {f"sampling.{name}" for name in own if name in kwargs.get("sampling", {})}
        fixed |= {"lora.rank"} if "rank" in kwargs.get("lora", {}) else set()
        require(not fixed, "ExactPPORLHF's arguments", "free of what the task sets itself", sorted(fixed))
        loading = kwargs.setdefault("loading", {})
        if task.model_seed is not None:  # the task's reference: the initialisation is the task's, not the run's
            require(
                loading.setdefault("seed", task.model_seed) == task.model_seed,
                "ExactPPORLHF's seed",
                f"the task's model_seed {task.model_seed} (it defines pi_ref)",
                loading["seed"],
            )
        require(
            not task.position_embedding or kwargs.get("rollout_engine", "hf") == "hf",
            "the rollout engine of a task with a position embedding",
            "hf (another engine serves the model without it)",
            kwargs.get("rollout_engine"),
        )
        loading["tiny_config"] = {**EXACT_TINY_CONFIG, **(loading.get("tiny_config") or {})}
        # A task's prompts are 1-2 tokens: sharing them saves nothing and costs a second forward call per pass.
        task_settings = dict(runtime=dict(shared_prompts=False), sampling=dict(max_new_tokens=task.response_length))
        networks = dict(policy="tiny", reward_model=task.reward_model())
        if task.teacher_seed is not None:  # a foreign reference: built by load_reference, named for the checkpoint
            networks["reference"] = f"teacher:{task.teacher_seed}"
        super().__init__(**args.merge_settings(task_settings, kwargs, networks))
        self.task, self.logged = task, logged
        budget_column = getattr(self.beta_controller, "budget_column", None)
        require(
            kl_budgets is None or (self.beta_controller.keyed_by_prompt and len(kl_budgets) == len(task.prompts)),
            "ExactPPORLHF's kl_budgets",
            f"one per task prompt ({len(task.prompts)}), with a per-prompt beta controller",
            kl_budgets,
        )
        require(budget_column is None, "beta_controller.budget_column", "null on a task (no prompt file: give kl_budgets)", budget_column)
        self.kl_budgets = None if kl_budgets is None else list(kl_budgets)
        self.tokenizer = toy_tokenizer(task.prompts, task.content_tokens)
        self.content_ids = self.tokenizer.convert_tokens_to_ids(list(task.content_tokens))
        self.symbol_ids = [*self.content_ids, self.tokenizer.eos_token_id][: task.num_symbols]  # the tree's symbols as token ids
        self.sampled_token_ids = list(self.symbol_ids)  # MaskedHead's set, for an engine serving the bare model (vllm)

    def training_prompt_table(self, datamodule) -> PromptTable:
        """The task's prompts, ids from their text, each with its ``kl_budgets`` entry."""
        budgets = self.kl_budgets or [None] * len(self.task.prompts)
        records = [(f"prompt {p!r}", p, {"kl_budgets": b}) for p, b in zip(self.task.prompts, budgets, strict=True)]
        return PromptTable.of(records, "ExactPPORLHF", budget_column=None if self.kl_budgets is None else "kl_budgets")

    def exact_beta(self) -> float | Tensor:
        """The beta the optimum is tilted at: the controller's, or each task prompt's own (a per-prompt
        controller; (prompts,) float64)."""
        if not self.beta_controller.keyed_by_prompt:
            return self.beta_controller.beta
        return self.beta_controller.betas_of([prompt_id(prompt) for prompt in self.task.prompts])

    def log_dict(self, dictionary, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``log_dict`` of the metrics named in ``logged`` (all where None): each
        ``self.log`` has a fixed cost, a noticeable share of a tiny matrix cell's time when spent on metrics
        its tracker never reads."""
        if self.logged is not None:
            dictionary = {name: value for name, value in dictionary.items() if name in self.logged}
        super().log_dict(dictionary, *args, **kwargs)

    def load_policy(self, empty: bool = False):
        policy, rows = super().load_policy(empty)
        self._as_task_network(policy)  # before the reference and a critic are copied from it
        return policy, rows

    def load_reference(self, empty: bool = False):
        """The teacher: the task's network initialised from ``task.teacher_seed``, on the task's tokenizer."""
        teacher, rows = models.load_policy("tiny", self.tokenizer, self.sampling, self.task.teacher_seed, False, self.loading.tiny_config)
        self._as_task_network(teacher)
        return teacher, rows

    def _as_task_network(self, model: nn.Module) -> None:
        """The task's changes to a freshly initialised tiny Llama: its position embedding, its EOS logit scaled."""
        if self.task.position_embedding:
            PositionEmbedding.attach(model)
        if self.task.eos_scale != 1.0:
            with torch.no_grad():
                model.lm_head.weight[self.tokenizer.eos_token_id] *= self.task.eos_scale

    def check_reference(self) -> None:
        """Nothing to check: the teacher is built on the task's own tokenizer."""

    def reference_identity(self) -> Optional[dict[str, str]]:
        """The teacher is its seed (``load_reference``): the spec is its own fingerprint."""
        spec = self.hparams.reference
        return None if spec is None else {"reference": spec, "fingerprint": spec}

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        super().configure_model()
        for model in filter(None, (self.policy, self.ref_model, self.initial_model)):
            model.lm_head = MaskedHead(model.lm_head, len(self.tokenizer), self.symbol_ids)

    def _all_responses(self) -> tuple[Tensor, Tensor, Tensor]:
        """input_ids, attention_mask and response mask of every (prompt, path) pair, (prompts * paths, len) and
        (prompts * paths, L), as PPORLHF's rollout builds them: pad after EOS, the mask up to and including EOS."""
        enc = self.sampler.encode(list(self.task.prompts))
        response_ids = torch.tensor(self.symbol_ids, device=self.device)[self.task.indices.to(self.device)]  # (paths, L)
        mask = pm.response_mask(response_ids, self.tokenizer.eos_token_id)
        response_ids = torch.where(mask.bool(), response_ids, self.tokenizer.pad_token_id)
        n_prompts, n_responses = enc["input_ids"].shape[0], response_ids.shape[0]
        input_ids = torch.cat([enc["input_ids"].repeat_interleave(n_responses, 0), response_ids.repeat(n_prompts, 1)], dim=1)
        response_mask = mask.repeat(n_prompts, 1)
        attention_mask = torch.cat([enc["attention_mask"].repeat_interleave(n_responses, 0), response_mask.long()], dim=1)
        return input_ids, attention_mask, response_mask

    @torch.no_grad()
    def exact_logprobs(self, model: Optional[nn.Module] = None) -> Tensor:
        """log pi(y|x) of ``model`` (default: the policy) for every prompt and response, from one
        batched forward pass scored exactly as PPO scores rollouts: the declared distribution
        (``sampling``), restricted at each prefix to the kept set the policy's sampler keeps there
        (with top_k / top_p, and EOS banned before ``min_new_tokens``; a response outside them has probability
        0), summed over each response's mask: (prompts, paths), float64, -inf for a path that is no response."""
        input_ids, attention_mask, mask = self._all_responses()
        length = self.task.response_length
        logits = self.networks.response_logits(model or self.policy, input_ids, attention_mask, length)
        kept = None
        if self.truncates:  # the policy's kept sets, also for another model
            policy_logits = logits if model is None else self.networks.response_logits(self.policy, input_ids, attention_mask, length)
            banned = sampling.min_new_tokens_ban(logits.shape, self.tokenizer.eos_token_id, self.sampling.min_new_tokens, logits.device)
            kept = sampling.kept_tokens(policy_logits, self.sampling.top_k, self.sampling.top_p, banned)
        token_logprobs = pm.logprobs_of(sampling.restrict(logits, kept), input_ids[:, -length:]).double()
        logprobs = (token_logprobs * mask).sum(-1).view(len(self.task.prompts), -1).cpu()
        return logprobs.masked_fill(~self.task.valid, -math.inf)

    @property
    def truncates(self) -> bool:
        """Whether sampling keeps a subset of the tokens (top_k, top_p, EOS banned by min_new_tokens): the
        declared reference then depends on the policy's kept sets, and is recomputed with them."""
        bans_eos = self.task.eos and self.sampling.min_new_tokens > 0
        return bans_eos or (self.sampling.do_sample and (bool(self.sampling.top_k) or self.sampling.top_p < 1))

    def exact_ref_logprobs(self) -> Tensor:
        with self.networks.reference() as ref:
            return self.exact_logprobs(ref)

    def exact_report(self, rewards: Optional[Tensor] = None) -> OptimumReport:
        """The policy's exact distances from the optimum of its divergence at the current (fixed) beta."""
        rewards = self.task.rewards() if rewards is None else rewards
        return optimum_report(self.exact_logprobs(), self.exact_ref_logprobs(), rewards, self.exact_beta(), divergence=self.divergence)

    def kept_report(self) -> dict[str, float]:
        """What the policy's kept sets (top_k / top_p) leave of the task, means over the prompts: the
        ``responses`` with a positive declared probability, the declared optimum's largest probability
        ``optimum_top_prob`` (max_y pi*(y|x)) and the best reward among them, ``best_kept_reward``. One
        response and a top probability of 1 make the optimum a point mass (KL 0, a gap of 0 by construction)."""
        rewards = self.task.rewards()
        kept = self.exact_logprobs() > sampling.OUTSIDE_LOGIT / 2  # a response with a dropped token: log q <= OUTSIDE_LOGIT
        optimum = optimum_logprobs(self.exact_ref_logprobs(), rewards, self.exact_beta(), self.divergence).exp()
        return {
            "responses": kept.sum(-1).double().mean().item(),
            "optimum_top_prob": optimum.amax(-1).mean().item(),
            "best_kept_reward": rewards.masked_fill(~kept, -math.inf).amax(-1).mean().item(),
        }


def reference_logprobs(task: ExactTask, seed: int = 0) -> Tensor:
    """log pi_ref(y|x) of ``task`` exactly as :func:`~rlhf_lightning.exact.training.train` builds it (the tiny model initialised from
    ``task.model_seed``, else from ``seed``): (prompts, responses), float64."""
    init = task.model_seed if task.model_seed is not None else seed
    module = ExactPPORLHF(task, seed=init)
    module.configure_model()
    return module.exact_ref_logprobs()


def per_token_fixed_point_gap(task: ExactTask, beta: float, seed: int = 0) -> float:
    """Exact gap (J* - J) / |J*| of the fixed point of a per-token KL loss on ``task`` at ``beta``
    (:func:`backward_induction`, ``soft=False``): what a loss path without the sequence term converges to."""
    ref, rewards = reference_logprobs(task, seed), task.rewards()
    fixed_point = backward_induction(ref, rewards, beta, task.num_symbols, soft=False)
    return optimum_report(fixed_point, ref, rewards, beta).gap
