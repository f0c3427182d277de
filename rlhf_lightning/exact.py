"""Ground truth for PPO-RLHF: a toy task small enough to enumerate every response.

The KL-regularised objective

    J(pi) = E_x [ E_{y~pi(.|x)} r(x, y)  -  beta * KL(pi(.|x) || pi_ref(.|x)) ]

has the closed-form maximiser pi*(y|x) = pi_ref(y|x) exp(r(x, y) / beta) / Z(x) with
Z(x) = sum_y pi_ref(y|x) exp(r(x, y) / beta), and J* = J(pi*) = beta * E_x log Z(x)
(e.g. Rafailov et al. 2023, "Direct Preference Optimization", eq. 4). For any pi,
J(pi) = J* - beta * KL(pi || pi*), so the objective gap measures the distance to the optimum
in the KL that matters.

The toy task: a handful of one-token prompts, K content tokens and responses of exactly L
tokens, so there are K**L responses per prompt and every expectation above is a finite sum.
The policy is a randomly initialised tiny Llama trained by the unchanged PPORLHF loop
(rollout -> score -> GAE -> PPO update); E_x is uniform over the prompts (every training
batch holds each prompt equally often).

Fixed-length responses: PPORLHF ends a response at its first EOS, and ``min_new_tokens``
works by suppressing EOS inside ``generate`` only, so the forward pass would score a
different distribution from the one sampled. Here the language-model head itself adds a
constant -1e4 to the logits of every token that is not a content token (EOS, pad, unk,
prompt tokens): generate and the forward pass both read the same head, so both see
probability exactly 0 there (exp(-1e4) underflows to 0 even in float64), the sampler can
never emit EOS, and with ``max_new_tokens = L`` every response is L content tokens with a
response mask of all ones. The bias is finite rather than -inf so that entropies and the
``full`` estimator's sum_a pi(a) (log pi(a) - log pi_ref(a)) stay 0 * finite = 0, not NaN.

A reference that moves (PPORLHF's ``reference_update``): if the policy converges to the optimum
of its reference before every sync or reset, the reference after k of them is the iterated optimum

    pi_k(y|x) ∝ pi_0(y|x) exp(k r(x, y) / beta),

the optimum of the original objective at beta / k (:func:`iterated_optimal_logprobs`): resets anneal
beta. An EMA reference ref <- (1 - alpha) ref + alpha pi moves its log-probabilities by the
geometric mixture (exact when they are linear in the averaged parameters, first order otherwise),
log ref' = (1 - alpha) log ref + alpha log pi - log norm; with the policy at ref's optimum that is
ref' ∝ ref exp(alpha r / beta), so n updates give pi_{n alpha} (:func:`ema_reference_logprobs`). Its
only fixed points (ref = pi*(ref)) are distributions on argmax_y r(x, y): no KL-regularised
interior optimum survives a reference that keeps following the policy.

What it shows (tests/test_optimum.py, tools/optimum_check.py): with the penalty in the reward
only k1 reaches pi*. PPO differentiates the rewards only through log pi of the sampled token, so
E_pi[grad kl_t] is lost; it is 0 for k1, but not for k3 nor for full, which collapse towards the
reward maximiser there and reach pi* with kl_penalty 'both' and unwhitened advantages.

With ``top_k`` / ``top_p`` (rlhf_lightning/sampling.py) every distribution here is the declared one:
tempered and restricted, at each prefix, to the kept set the policy's own sampler keeps there, for
the reference too (:meth:`ExactPPORLHF.exact_logprobs`); the optimum is then that of the declared
objective at those kept sets (docs/rollout-engines.md).

Functions on log-probabilities take tensors of shape (num_prompts, num_responses), one row per
prompt, each row a distribution over all responses in the order of :func:`enumerate_responses`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader

from rlhf_lightning import ppo_math as pm
from rlhf_lightning import sampling
from rlhf_lightning.checks import require
from rlhf_lightning.cli import QUIET_TRAINER
from rlhf_lightning.module import PPORLHF, Rollout
from rlhf_lightning.tabular import enumerate_responses, reward_to_go, sum_after

BANNED_LOGIT = -1e4  # added to the logits of non-content tokens: probability exactly 0, entropy still finite
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
EXACT_TINY_CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=16,
    initializer_range=0.2,
)


# ---------------------------------------------------------------------- pure functions
def log_partition(ref_logprobs: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """log Z(x) = log sum_y pi_ref(y|x) exp(r(x, y) / beta): (prompts, responses) -> (prompts,)."""
    return torch.logsumexp(ref_logprobs.double() + rewards.double() / beta, dim=-1)


def optimal_logprobs(ref_logprobs: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """log pi*(y|x) = log pi_ref(y|x) + r(x, y) / beta - log Z(x)."""
    return ref_logprobs.double() + rewards.double() / beta - log_partition(ref_logprobs, rewards, beta).unsqueeze(-1)


def iterated_optimal_logprobs(initial_logprobs: Tensor, rewards: Tensor, beta: float, k: float) -> Tensor:
    """log pi_k = log pi_0 + k r / beta - log Z_k: the optimum after k converged reference resets
    (k may be fractional: an EMA reference), i.e. the optimum at beta / k."""
    return optimal_logprobs(initial_logprobs, rewards, beta / k)


def ema_reference_logprobs(ref_logprobs: Tensor, rewards: Tensor, beta: float, alpha: float) -> Tensor:
    """One EMA update of a reference whose policy sits at its optimum, as a normalised geometric
    mixture: log ref' = (1 - alpha) log ref + alpha log pi*(ref) - log norm."""
    mixed = (1 - alpha) * ref_logprobs.double() + alpha * optimal_logprobs(ref_logprobs, rewards, beta)
    return mixed - torch.logsumexp(mixed, dim=-1, keepdim=True)


def optimal_objective(ref_logprobs: Tensor, rewards: Tensor, beta: float) -> float:
    """J* = beta * E_x log Z(x)."""
    return float(beta * log_partition(ref_logprobs, rewards, beta).mean())


def kl_divergence(logp: Tensor, logq: Tensor) -> float:
    """E_x KL(p(.|x) || q(.|x)) = E_x sum_y p (log p - log q), with 0 log 0 = 0."""
    logp, logq = logp.double(), logq.double()
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros((), dtype=torch.float64))
    return float(terms.sum(-1).mean())


def expected_reward(logprobs: Tensor, rewards: Tensor) -> float:
    """E_x E_{y~pi} r(x, y)."""
    return float((logprobs.double().exp() * rewards.double()).sum(-1).mean())


def objective(logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor, beta: float) -> float:
    """J(pi) = E_x [ E_{y~pi} r(x, y) - beta * KL(pi(.|x) || pi_ref(.|x)) ]."""
    return expected_reward(logprobs, rewards) - beta * kl_divergence(logprobs, ref_logprobs)


def backward_induction(ref_logprobs: Tensor, rewards: Tensor, beta: float, num_tokens: int, soft: bool = True) -> Tensor:
    """The policy built token by token from the last position back, pi(a | s) ∝ pi_ref(a | s) exp(Q(s, a) / beta),
    as log pi(y|x) over whole responses (same layout as ``ref_logprobs``; responses in the order of
    :func:`enumerate_responses` over ``num_tokens`` content tokens; the reward is terminal).

    ``soft=True``: Q(s, a) = V(s + a) with V(s) = beta log sum_a pi_ref(a|s) exp(Q(s, a) / beta), the
    soft value that charges the KL of every later token: this is pi* itself (equal to
    :func:`optimal_logprobs`). ``soft=False``: V(s) = E_{a~pi}[Q(s, a)], the expected reward to go
    with no KL of later tokens: the fixed point of a per-token KL loss, grad E[r] - beta E_s grad
    KL(pi(.|s) || pi_ref(.|s)) = 0 at every visited s, which never charges a token for the KL of the
    states it leads to (Tang & Munos, 2025, "On a few pitfalls in KL divergence gradient estimation
    for RL", sec. 4).

    The two differ whenever the KL still to be paid after a token depends on the tokens already chosen:
    soft Q(s, a) = E[r | s, a] - beta * (the KL the optimal continuation of s + a pays), and the
    per-token fixed point drops the second part. That is so for almost every reward that depends on
    token order (pairs, transitions, positions), even under a reference that ignores the prefix, a
    uniform one included (:meth:`ExactTask.random` tasks: gaps of 0.07-0.23 at beta 1); it vanishes when the
    continuation's optimal KL is the same after every token, as on a one-token bandit or with a terminal
    reward that counts tokens under a prefix-independent reference.
    """
    prompts, responses = ref_logprobs.shape
    length = round(math.log(responses, num_tokens))
    shape = (prompts, *[num_tokens] * length)
    ref, value = ref_logprobs.double().view(shape), rewards.double().view(shape)
    logprobs = torch.zeros(shape, dtype=torch.float64)
    for t in reversed(range(length)):  # value: (prompts, K ** (t + 1)) over prefixes of t + 1 tokens
        prefix_and_token = sum_after(ref, t + 1, log=True)
        logits = prefix_and_token - prefix_and_token.logsumexp(-1, keepdim=True) + value / beta
        policy = logits.log_softmax(-1)  # log pi(a | prefix of t tokens)
        value = beta * logits.logsumexp(-1) if soft else (policy.exp() * value).sum(-1)
        logprobs = logprobs + policy.view(*policy.shape, *[1] * (length - t - 1))
    return logprobs.view(prompts, responses)


def per_token_residuals(
    logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor, beta: float, num_tokens: int
) -> list[tuple[Tensor, Tensor]]:
    """How far a policy is from the per-token fixed point, state by state: for each position t, over the prefixes s
    of t tokens, the residual KL(pi(. | s) || pi_ref(. | s) exp(Q(s, .) / beta) / Z(s)), with Q(s, a) = E_pi[r | s, a]
    the reward to go under pi's own continuation (no KL of later tokens), beside the prefix's probability P_pi(s);
    each (prompts, K ** t). Every residual is 0 exactly at :func:`backward_induction` (``soft=False``), the only
    policy that meets the per-token condition at every state; pi* misses it where the KL still to be paid after a
    token depends on that token (docs/results.md, "Ninth round": where random:3's noisy runs miss it)."""
    prompts, responses = logprobs.shape
    length = round(math.log(responses, num_tokens))
    shape = (prompts, *[num_tokens] * length)
    joint, ref, reward = logprobs.double().view(shape), ref_logprobs.double().view(shape), rewards.double().view(shape)
    probs, out = joint.exp(), []
    for t in range(length):
        log_sa, ref_sa = sum_after(joint, t + 1, log=True), sum_after(ref, t + 1, log=True)  # log P(s, a)
        q = reward_to_go(probs, reward, t + 1)
        policy = log_sa - log_sa.logsumexp(-1, keepdim=True)
        target = (ref_sa - ref_sa.logsumexp(-1, keepdim=True) + q / beta).log_softmax(-1)
        residual = (policy.exp() * (policy - target)).sum(-1)
        out.append((residual.reshape(prompts, -1), log_sa.logsumexp(-1).exp().reshape(prompts, -1)))
    return out


@dataclass
class OptimumReport:
    """Exact distances of a policy from the KL-regularised optimum."""

    objective: float  # J(pi)
    optimum: float  # J*
    gap: float  # (J* - J(pi)) / |J*|
    kl_to_optimum: float  # E_x KL(pi || pi*)
    kl_to_ref: float  # E_x KL(pi || pi_ref)
    optimum_kl_to_ref: float  # E_x KL(pi* || pi_ref): where an exact learner's KL should land
    reward: float  # E_x E_pi r
    fixed_point_distance: float = math.nan  # beta E_x KL(pi || per-token fixed point) / |J*| (given num_tokens)


def optimum_report(logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor, beta: float, num_tokens: Optional[int] = None) -> OptimumReport:
    """Every exact quantity of ``logprobs`` against the optimum defined by ``ref_logprobs``, ``rewards``, ``beta``.

    The gap is a distance: J* - J(pi) = beta KL(pi || pi*) for every pi, so gap = beta KL(pi || pi*) / |J*|. With
    ``num_tokens`` (responses in the order of :func:`enumerate_responses`) ``fixed_point_distance`` is the same
    distance from the per-token fixed point (:func:`backward_induction`, ``soft=False``), in the same unit: where a
    per-token cell should be 0. Its gap is no such distance: J is not stationary at the fixed point, so the gap of a
    policy near it moves at first order (a run 0.004 nats from the fixed point of random:3 lies 0.026 from its gap;
    docs/results.md, "Tenth round")."""
    opt = optimal_logprobs(ref_logprobs, rewards, beta)
    j, j_star = objective(logprobs, ref_logprobs, rewards, beta), optimal_objective(ref_logprobs, rewards, beta)
    distance = math.nan
    if num_tokens is not None:
        fixed_point = backward_induction(ref_logprobs, rewards, beta, num_tokens, soft=False)
        distance = beta * kl_divergence(logprobs, fixed_point) / abs(j_star)
    return OptimumReport(
        objective=j,
        optimum=j_star,
        gap=(j_star - j) / abs(j_star),
        kl_to_optimum=kl_divergence(logprobs, opt),
        kl_to_ref=kl_divergence(logprobs, ref_logprobs),
        optimum_kl_to_ref=kl_divergence(opt, ref_logprobs),
        reward=expected_reward(logprobs, rewards),
        fixed_point_distance=distance,
    )


# ---------------------------------------------------------------------- the toy task
def target_count(prompts: Sequence[str], responses: Sequence[str], scale: float = 1.0) -> list[float]:
    """Reward for the ``callable`` backend: scale * how often the prompt's letter, lower-cased,
    occurs in the response (prompt "A" rewards "a"). Terminal: it scores the whole sequence."""
    return [scale * response.count(prompt.strip().lower()) for prompt, response in zip(prompts, responses, strict=True)]


def toy_tokenizer(prompt_tokens: Sequence[str], content_tokens: Sequence[str]):
    """A word-level tokenizer over single characters: <pad>, <eos>, <unk>, the prompt tokens,
    then the content tokens, each one character (the layout of models.char_tokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*SPECIAL_TOKENS, *prompt_tokens, *content_tokens]
    require(
        len(set(tokens)) == len(tokens) and all(len(t) == 1 for t in (*prompt_tokens, *content_tokens)),
        "the task's prompt and content tokens",
        "distinct single characters",
        tokens[3:],
    )
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left")


def order_reward(prompts: Sequence[str], responses: Sequence[str], tokens: str, tables: dict[str, dict]) -> list[float]:
    """Reward for the ``callable`` backend that depends on token order: with the prompt's ``tables``
    (``position`` (L, K), ``transition`` (K, K), optionally ``pair`` (K, K) as nested lists, ``offset`` a number)
    and y_t the index of the t-th character in ``tokens``,

        r(x, y) = offset + sum_t position[t][y_t] + sum_t transition[y_t][y_{t+1}] + sum_{t < t'} pair[y_t][y_t'].

    Positions reward a token at one place, transitions one token right after another, pairs one
    token anywhere before another (asymmetric: "a..b" is not "b..a")."""
    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        table = tables[prompt]
        y = [tokens.index(c) for c in response]
        score = table["offset"] + sum(table["position"][t][a] for t, a in enumerate(y))
        score += sum(table["transition"][a][b] for a, b in itertools.pairwise(y))
        if "pair" in table:
            score += sum(table["pair"][y[t]][b] for t in range(len(y)) for b in y[t + 1 :])
        scores.append(score)
    return scores


@dataclass(frozen=True)
class ExactTask:
    """Prompts, content tokens and a fixed response length; the reward is a ``module:function``
    for the ``callable`` backend, so training and the exact sums score with the same code.

    ``model_seed`` seeds the tiny model's initialisation, which is the reference pi_ref = pi_0 and so
    part of the task; None (the hand-made tasks) leaves it to the run's seed, as before tasks had one.
    ``position_embedding`` gives the tiny model a learned absolute position embedding, zero at the start
    so pi_ref is unchanged (:class:`PositionEmbedding`)."""

    prompts: tuple[str, ...] = ("A", "B", "C")
    content_tokens: tuple[str, ...] = ("a", "b", "c")
    response_length: int = 3
    reward_function: str = "rlhf_lightning.exact:target_count"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    model_seed: Optional[int] = None
    position_embedding: bool = False

    @classmethod
    def random(cls, seed: int, num_prompts: int = 2, num_tokens: int = 4, length: int = 3, scale: float = 1.0) -> ExactTask:
        """A seeded task whose reward depends on token order (:func:`order_reward`). Per prompt, times
        ``scale``: position weights 0.1 N(0, 1) and sparse transitions, a quarter of the (a, b) pairs
        (drawn at random) worth +-2 (1 + 0.5 |N(0, 1)|), the others 0. The reference is the tiny model
        initialised from ``seed`` (non-uniform and prefix-dependent), so one seed fixes the whole task;
        training samples with a seed of its own (:func:`train`). ``offset`` centres each prompt's reward
        under the reference, E_ref[r | x] = 0: J(pi_ref) = 0 and the gap (J* - J) / J* is the fraction of
        the attainable improvement a policy misses.

        A sparse transition makes the KL still to be paid depend on the token just chosen (after a token
        with a rewarded successor the optimal continuation leaves pi_ref, elsewhere it stays close), so
        the per-token fixed point (:func:`backward_induction`, ``soft=False``) lies away from pi*: at beta
        1 its gap (:func:`per_token_fixed_point_gap`) is 0.113, 0.165, 0.229, 0.068, 0.114, 0.156, 0.124,
        0.024 for seeds 1-8, with KL(pi* || pi_ref) 1.0-1.8 nats. The defaults (64 responses per prompt,
        strong sparse transitions, no pair term) are chosen so that every seed 1-5 has a gap >= 0.05 and
        PPO converges within about 150 iterations (tools/optimum_check.py --matrix).

        The tiny model gets a position embedding (zero at the start: the reference is the same): the
        per-token fixed point asks for conditionals that differ by position after the same tokens where
        pi* and pi_ref hardly do (random:3: after prompt A's "c", total variation 0.33 between the second
        and third tokens' against 0.05), and one rotary layer did not learn that under sampling noise: rloo's
        per-token cell there ended 0.050 short of the fixed point's gap on average over four sampling seeds,
        0.004 with the embedding (docs/results.md, "Eleventh round")."""
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
        task = cls(
            prompts=prompts,
            content_tokens=tokens,
            response_length=length,
            reward_function="rlhf_lightning.exact:order_reward",
            reward_kwargs={"tokens": "".join(tokens), "tables": tables},
            model_seed=seed,
            position_embedding=True,
        )
        centres = (reference_logprobs(task).exp() * task.rewards()).sum(-1)  # E_ref[r | x] with offset 0
        for prompt, centre in zip(prompts, centres.tolist(), strict=True):
            tables[prompt]["offset"] = -centre  # the task's own reward_kwargs: set before anyone else sees it
        return task

    @property
    def responses(self) -> list[str]:
        """All K ** L responses as text, in the order of :func:`enumerate_responses`."""
        indices = enumerate_responses(len(self.content_tokens), self.response_length)
        return ["".join(self.content_tokens[i] for i in row) for row in indices.tolist()]

    def reward_model(self):
        from rlhf_lightning_plugins.rewards.function import CallableReward

        return CallableReward(function=self.reward_function, kwargs=dict(self.reward_kwargs))

    def rewards(self) -> Tensor:
        """r(x, y) for every prompt and response: (prompts, responses), from the reward backend itself."""
        responses = self.responses
        backend = self.reward_model()
        rows = [backend.score([p] * len(responses), responses) for p in self.prompts]
        return torch.tensor(rows, dtype=torch.float64)

    def dataloader(self, iterations: int, batch_size: int, end_batch_size: Optional[int] = None, end_iterations: int = 0) -> DataLoader:
        """``iterations`` batches that each hold every prompt ``batch_size / len(prompts)`` times,
        so each rollout estimates E_x with x uniform, exactly as the exact sums weigh it; the last
        ``end_iterations`` of them hold ``end_batch_size`` prompts instead."""
        sizes = [batch_size] * (iterations - end_iterations) + [end_batch_size or batch_size] * end_iterations
        for name, size in (("batch_size", batch_size), ("end_batch_size", end_batch_size or batch_size)):
            require(size % len(self.prompts) == 0, name, f"a multiple of the {len(self.prompts)} prompts", size)
        batches = [list(self.prompts) * (size // len(self.prompts)) for size in sizes]
        return DataLoader(batches, batch_size=None, shuffle=False, collate_fn=list)


TASKS = {
    "terminal": ExactTask(),
    "bandit": ExactTask(response_length=1),
}


def task_named(name: str) -> ExactTask:
    """A task of :data:`TASKS` by name, or ``random:SEED`` for ``ExactTask.random(SEED)``."""
    if name.startswith("random:"):
        seed = name.split(":", 1)[1]
        require(seed.isdigit(), "a random task", "random:SEED with SEED a non-negative integer", name)
        return ExactTask.random(int(seed))
    require(name in TASKS, "the task", f"one of {sorted(TASKS)} or random:SEED", name)
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
    (estimator, controller, PPO settings) goes to PPORLHF unchanged."""

    def __init__(self, task: ExactTask = TASKS["terminal"], logged: Optional[Sequence[str]] = None, **kwargs: Any) -> None:
        fixed = {"policy", "tokenizer", "reward_model", "max_new_tokens", "min_new_tokens", "lora_rank"} & set(kwargs)
        require(not fixed, "ExactPPORLHF's arguments", "free of what the task sets itself", sorted(fixed))
        if task.model_seed is not None:  # the task's reference: the initialisation is the task's, not the run's
            require(
                kwargs.setdefault("seed", task.model_seed) == task.model_seed,
                "ExactPPORLHF's seed",
                f"the task's model_seed {task.model_seed} (it defines pi_ref)",
                kwargs["seed"],
            )
        require(
            not task.position_embedding or kwargs.get("rollout_engine", "hf") == "hf",
            "the rollout engine of a task with a position embedding",
            "hf (another engine serves the model without it)",
            kwargs.get("rollout_engine"),
        )
        tiny_config = {**EXACT_TINY_CONFIG, **(kwargs.pop("tiny_config", None) or {})}
        # PyTorch's own linear: on a 32-wide model oneDNN's routing (a torch function mode that sees
        # every op) costs more than its kernel saves, 1.5x a matrix cell's time (2026-11-27).
        kwargs.setdefault("cpu_linear", "aten")
        # A task's prompts are 1-2 tokens: sharing them saves nothing and costs a second forward call per pass.
        kwargs.setdefault("shared_prompts", False)
        super().__init__(
            policy="tiny",
            reward_model=task.reward_model(),
            max_new_tokens=task.response_length,
            tiny_config=tiny_config,
            **kwargs,
        )
        self.task, self.logged = task, logged
        self.tokenizer = toy_tokenizer(task.prompts, task.content_tokens)
        self.content_ids = self.tokenizer.convert_tokens_to_ids(list(task.content_tokens))
        self.sampled_token_ids = list(self.content_ids)  # MaskedHead's set, for an engine serving the bare model (vllm)

    def log_dict(self, dictionary, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``log_dict`` of the metrics named in ``logged`` (all where None): each
        ``self.log`` costs Lightning 0.5-2 ms, a quarter of a matrix cell's time for metrics its
        tracker never reads."""
        if self.logged is not None:
            dictionary = {name: value for name, value in dictionary.items() if name in self.logged}
        super().log_dict(dictionary, *args, **kwargs)

    def _load_policy(self, empty: bool = False):
        policy, rows = super()._load_policy(empty)
        if self.task.position_embedding:  # before the reference and a critic are copied from it
            PositionEmbedding.attach(policy)
        return policy, rows

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        super().configure_model()
        for model in filter(None, (self.policy, self.ref_model, self.initial_model)):
            model.lm_head = MaskedHead(model.lm_head, len(self.tokenizer), self.content_ids)

    def _all_responses(self) -> tuple[Tensor, Tensor]:
        """input_ids and attention_mask of every (prompt, response) pair: (prompts * responses, len)."""
        enc = self.encode_prompts(list(self.task.prompts))
        indices = enumerate_responses(len(self.task.content_tokens), self.task.response_length).to(self.device)
        response_ids = torch.tensor(self.content_ids, device=self.device)[indices]  # (responses, L)
        n_prompts, n_responses = enc["input_ids"].shape[0], response_ids.shape[0]
        input_ids = torch.cat([enc["input_ids"].repeat_interleave(n_responses, 0), response_ids.repeat(n_prompts, 1)], dim=1)
        attention_mask = torch.cat(
            [enc["attention_mask"].repeat_interleave(n_responses, 0), torch.ones_like(response_ids).repeat(n_prompts, 1)], dim=1
        )
        return input_ids, attention_mask

    @torch.no_grad()
    def exact_logprobs(self, model: Optional[nn.Module] = None) -> Tensor:
        """log pi(y|x) of ``model`` (default: the policy) for every prompt and response, from one
        batched forward pass scored exactly as PPO scores rollouts: the declared distribution
        (``sampling``), restricted at each prefix to the kept set the policy's sampler keeps there
        (with top_k / top_p; a response outside them has probability 0): (prompts, responses), float64."""
        input_ids, attention_mask = self._all_responses()
        length = self.task.response_length
        logits = self.response_logits(model or self.policy, input_ids, attention_mask, length)
        kept = None
        if self.truncates:  # the policy's kept sets, also for another model
            policy_logits = logits if model is None else self.response_logits(self.policy, input_ids, attention_mask, length)
            kept = sampling.kept_tokens(policy_logits, self.hparams.top_k, self.hparams.top_p)
        logprobs = pm.logprobs_of(sampling.restrict(logits, kept), input_ids[:, -length:]).double().sum(-1)
        return logprobs.view(len(self.task.prompts), -1).cpu()

    @property
    def truncates(self) -> bool:
        """Whether sampling keeps a subset of the tokens (top_k, top_p): the declared reference then
        depends on the policy's kept sets, and is recomputed with them."""
        return self.hparams.do_sample and (bool(self.hparams.top_k) or self.hparams.top_p < 1)

    def exact_ref_logprobs(self) -> Tensor:
        with self._reference() as ref:
            return self.exact_logprobs(ref)

    def exact_report(self, rewards: Optional[Tensor] = None) -> OptimumReport:
        """The policy's exact distances from the optimum at the current (fixed) beta."""
        rewards = self.task.rewards() if rewards is None else rewards
        return optimum_report(self.exact_logprobs(), self.exact_ref_logprobs(), rewards, self.beta_controller.beta)

    def kept_report(self) -> dict[str, float]:
        """What the policy's kept sets (top_k / top_p) leave of the task, means over the prompts: the
        ``responses`` with a positive declared probability, the declared optimum's largest probability
        ``optimum_top_prob`` (max_y pi*(y|x)) and the best reward among them, ``best_kept_reward``. One
        response and a top probability of 1 make the optimum a point mass (KL 0, a gap of 0 by construction)."""
        rewards = self.task.rewards()
        kept = self.exact_logprobs() > sampling.OUTSIDE_LOGIT / 2  # a response with a dropped token: log q <= OUTSIDE_LOGIT
        optimum = optimal_logprobs(self.exact_ref_logprobs(), rewards, self.beta_controller.beta).exp()
        return {
            "responses": kept.sum(-1).double().mean().item(),
            "optimum_top_prob": optimum.amax(-1).mean().item(),
            "best_kept_reward": rewards.masked_fill(~kept, -math.inf).amax(-1).mean().item(),
        }


def reference_logprobs(task: ExactTask, seed: int = 0) -> Tensor:
    """log pi_ref(y|x) of ``task`` exactly as :func:`train` builds it (the tiny model initialised from
    ``task.model_seed``, else from ``seed``): (prompts, responses), float64."""
    init = task.model_seed if task.model_seed is not None else seed
    module = ExactPPORLHF(task, seed=init)
    module.configure_model()
    return module.exact_ref_logprobs()


def per_token_fixed_point_gap(task: ExactTask, beta: float, seed: int = 0) -> float:
    """Exact gap (J* - J) / |J*| of the fixed point of a per-token KL loss on ``task`` at ``beta``
    (:func:`backward_induction`, ``soft=False``): what a loss path without the sequence term converges to."""
    ref, rewards = reference_logprobs(task, seed), task.rewards()
    fixed_point = backward_induction(ref, rewards, beta, len(task.content_tokens), soft=False)
    return optimum_report(fixed_point, ref, rewards, beta).gap


class OptimumTracker(Callback):
    """Every ``every`` PPO iterations (and after the last), the exact OptimumReport of the policy
    against the reference it trained on in that iteration, next to ``kl_logged``: the mean of the
    logged objective/kl over the iterations since the last row. The logged value of an iteration
    estimates the KL of the policy that sampled its rollout.

    Each row also measures the policy against the iterated optimum pi_k ∝ pi_0 exp(k r / beta), with
    k = 1 + the summed weights alpha of the reference updates before that iteration (k = 1, the
    plain optimum, for a frozen reference): ``k``, ``iterated_gap`` (the gap of J at beta / k with
    reference pi_0), ``iterated_kl_to_optimum`` = KL(pi || pi_k) and ``kl_to_initial`` = KL(pi || pi_0)."""

    READS = ("objective/kl", "rollout/logprob_diff_max")  # the logged metrics it reads (ExactPPORLHF's ``logged``)

    def __init__(self, every: int = 10, total: Optional[int] = None) -> None:
        self.every, self.total = every, total
        self.rows: list[dict[str, float]] = []
        self._logged: list[float] = []
        self._rewards: Optional[Tensor] = None
        self._initial: Optional[Tensor] = None  # log pi_0: (prompts, responses)
        self._ref: Optional[Tensor] = None  # log pi_ref before the iteration
        self._k = 1.0
        self._diff_max = 0.0  # the largest rollout/logprob_diff_max so far: the sampler against the trainer

    def on_train_start(self, trainer, pl_module: ExactPPORLHF) -> None:
        self._rewards = pl_module.task.rewards()
        self._initial = pl_module.exact_ref_logprobs()
        self._ref = self._initial
        self.rows.append(self._row(pl_module, 0, math.nan))

    def on_train_batch_start(self, trainer, pl_module: ExactPPORLHF, batch, batch_idx) -> None:
        done = pl_module.iteration
        self._k = 1.0 + sum(pl_module.reference_update.weight(i) for i in range(1, done + 1))
        if pl_module.reference_update.moves:
            self._ref = pl_module.exact_ref_logprobs()

    def on_train_batch_end(self, trainer, pl_module: ExactPPORLHF, outputs, batch, batch_idx) -> None:
        self._logged.append(float(trainer.callback_metrics["objective/kl"]))
        self._diff_max = max(self._diff_max, float(trainer.callback_metrics.get("rollout/logprob_diff_max", 0.0)))
        iteration = pl_module.iteration
        if iteration % self.every == 0 or iteration == self.total:
            self.rows.append(self._row(pl_module, iteration, sum(self._logged) / len(self._logged)))
            self._logged = []

    def _row(self, pl_module: ExactPPORLHF, iteration: int, kl_logged: float) -> dict[str, float]:
        logprobs, beta = pl_module.exact_logprobs(), pl_module.beta_controller.beta
        # With top_k / top_p the optimum is that of the declared objective at the policy's own kept sets.
        ref = pl_module.exact_ref_logprobs() if pl_module.truncates else self._ref
        report = optimum_report(logprobs, ref, self._rewards, beta, len(pl_module.task.content_tokens))
        iterated = optimum_report(logprobs, self._initial, self._rewards, beta / self._k)
        return {
            "iteration": iteration,
            **vars(report),
            "kl_logged": kl_logged,
            "logprob_diff_max": self._diff_max,
            "k": self._k,
            "iterated_gap": iterated.gap,
            "iterated_kl_to_optimum": iterated.kl_to_optimum,
            "kl_to_initial": iterated.kl_to_ref,
        }

    @property
    def last(self) -> dict[str, float]:
        return self.rows[-1]


def lr_factor(iteration: int, iterations: int, final: float, hold: float = 0.0) -> float:
    """The fraction of the lr at ``iteration`` of ``iterations``: 1 for the first ``hold`` fraction,
    then falling linearly to ``final`` at the last iteration."""
    progress = iteration / max(iterations - 1, 1)
    return 1.0 - (1.0 - final) * max(progress - hold, 0.0) / (1.0 - hold)


class LinearLRDecay(Callback):
    """Learning rates hold their configured values for the first ``hold`` fraction of ``iterations``
    PPO iterations, then fall linearly to ``final`` times them at the last, and start again after each
    ``iterations`` (one decay per reference phase when the reference is reset every ``iterations``):
    with a constant step size stochastic updates only reach a noise ball around the optimum; a
    decaying one lets the last iterate settle inside it."""

    def __init__(self, iterations: int, final: float = 0.1, hold: float = 0.0) -> None:
        require(0 <= hold < 1, "hold", "in [0, 1)", hold)
        self.iterations, self.final, self.hold = iterations, final, hold
        self._initial: list[list[float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self._initial = [[group["lr"] for group in opt.param_groups] for opt in trainer.optimizers]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        factor = lr_factor(pl_module.iteration % self.iterations, self.iterations, self.final, self.hold)
        for opt, initial in zip(trainer.optimizers, self._initial, strict=True):
            for group, lr in zip(opt.param_groups, initial, strict=True):
                group["lr"] = lr * factor


def train(
    task: ExactTask,
    iterations: int,
    batch_size: int = 48,
    every: int = 10,
    seed: int = 0,
    lr_final: float = 1.0,
    lr_period: Optional[int] = None,
    lr_hold: float = 0.0,
    end_batch_size: Optional[int] = None,
    end_iterations: int = 0,
    **module_kwargs: Any,
) -> tuple[ExactPPORLHF, OptimumTracker]:
    """Train ExactPPORLHF with a Lightning Trainer on CPU; return the module and its tracker.
    ``batch_size`` counts responses per iteration (prompts x ``num_generations``).
    ``lr_final`` < 1 decays the learning rates linearly to that fraction (LinearLRDecay), over
    the whole run or, restarting, over every ``lr_period`` iterations, after holding them for the
    first ``lr_hold`` fraction of it. The last ``end_iterations`` iterations sample ``end_batch_size``
    responses each: an end with less gradient noise at the same lr (a smaller final lr quiets the end
    too, but also slows the run; docs/results.md, "Eighth round").

    ``seed`` is the sampling seed (rollouts, and the critic's head): one task can be trained with
    several. The policy's initialisation, hence pi_ref, is the task's (``task.model_seed``); for a task
    without one (``terminal``, ``bandit``) ``seed`` sets it too, as it always has."""
    from lightning import Trainer, seed_everything

    num_generations = module_kwargs.get("num_generations", 1)
    for name, size in (("batch_size", batch_size), ("end_batch_size", end_batch_size or batch_size)):
        require(size % num_generations == 0, name, f"a multiple of num_generations={num_generations}", size)
    require(0 <= end_iterations <= iterations, "end_iterations", f"between 0 and the {iterations} iterations", end_iterations)
    require(
        (end_batch_size is None) == (end_iterations == 0),
        "end_batch_size and end_iterations",
        "given together",
        (end_batch_size, end_iterations),
    )

    seed_everything(seed, verbose=False)  # the module draws its sampling seed base from torch's initial seed
    module = ExactPPORLHF(task, seed=seed if task.model_seed is None else task.model_seed, **module_kwargs)
    tracker = OptimumTracker(every=every, total=iterations)
    callbacks = [tracker] if lr_final == 1.0 else [LinearLRDecay(lr_period or iterations, lr_final, lr_hold), tracker]
    trainer = Trainer(**QUIET_TRAINER, max_epochs=1, callbacks=callbacks)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small only lose time to thread hand-offs, several-fold on a busy CPU
    try:
        trainer.fit(
            module,
            train_dataloaders=task.dataloader(
                iterations, batch_size // num_generations, (end_batch_size or batch_size) // num_generations, end_iterations
            ),
        )
    finally:
        torch.set_num_threads(threads)
    return module, tracker


def expected_train(
    task: ExactTask,
    iterations: int,
    beta: float,
    lr: float = 2e-3,
    lr_final: float = 0.1,
    lr_hold: float = 0.0,
    every: int = 50,
    num_minibatches: int = 2,
    responses: Optional[int] = None,
    seed: int = 0,
    **module_kwargs: Any,
) -> list[dict[str, float]]:
    """PPO with the KL in the loss where every rollout is replaced by its exact expectation: no sampling
    noise, so where it goes is where the loss's expected gradient leads (bias against noise: the matrix of
    ``tools/optimum_check.py --expected-gradient``).

    Each iteration: pi_old = the current policy; the "rollout" is every response of every prompt, each
    response's per-token losses weighted by pi_old(y|x) / (prompts * length) (so the weighted sum is the
    expectation of the module's token-mean loss); the advantage is exact, A_t = r(x, y) - E_{pi_old}[r | x,
    y_<t] (any baseline of the prefix leaves the expectation unchanged); then ``ppo_epochs`` x
    ``num_minibatches`` full-batch AdamW steps (as many as the sampled loop takes, each on the whole
    expectation, of which a minibatch is an unbiased half, its gradients clipped to ``max_grad_norm`` as the
    module clips them) of the module's own :meth:`PPORLHF.ppo_loss`:
    clipped surrogate plus beta times the KL loss of its ``kl_estimator``, ``kl_loss_weighting`` and
    ``kl_loss_scope``; the lr held for the first ``lr_hold`` fraction of the run, then decayed linearly
    to ``lr_final`` of ``lr``. A loss whose expected gradient is
    grad J at pi_old = pi_theta has pi* as its fixed point at every number of epochs (at a fixed point the
    first epoch's gradient is 0); a per-token one has :func:`backward_induction` (``soft=False``).
    Returns a row every ``every`` iterations and after the last: the iteration and the fields of
    :func:`optimum_report`.

    ``responses`` N puts back the sampling noise and nothing else of the sampled loop: each iteration
    draws N responses from pi_old (equally many per prompt, generator seeded by ``seed``) in
    ``num_minibatches`` minibatches, each used once per epoch, and a minibatch's step weighs each response
    by how often it was drawn instead of by pi_old (same advantage, same loss). Where the sampled matrix
    and this part ways is the sampled loop's (critic, engine); where this and the exact path part ways is
    the noise's."""
    module = ExactPPORLHF(task, kl_penalty="loss", advantage_estimator="rloo", num_generations=2, lr=lr, **module_kwargs)
    module.configure_model()
    optimizer = module.configure_optimizers()
    rewards, length = task.rewards(), task.response_length
    ref_logprobs = module.exact_ref_logprobs()
    input_ids, attention_mask = module._all_responses()
    prompts, response = rewards.shape[0], input_ids[:, -length:]
    mask = torch.ones_like(response, dtype=torch.float32)
    with module._reference() as ref:
        ref_token_logprobs = pm.logprobs_of(module.response_logits(ref, input_ids, attention_mask, length), response)
    num_tokens = len(task.content_tokens)
    shape = (prompts, *[num_tokens] * length)
    if responses is not None:
        draws = torch.Generator().manual_seed(seed)
        per_minibatch = responses // (prompts * num_minibatches)
        require(per_minibatch >= 1, "responses", f"at least one per prompt and minibatch ({prompts} x {num_minibatches})", responses)
    rows = []
    for iteration in range(iterations + 1):
        logprobs = module.exact_logprobs()
        if iteration % every == 0 or iteration == iterations:
            rows.append({"iteration": iteration, **vars(optimum_report(logprobs, ref_logprobs, rewards, beta, num_tokens))})
        if iteration == iterations:
            break
        with torch.no_grad():
            old_logprobs = pm.logprobs_of(module.response_logits(module.policy, input_ids, attention_mask, length), response)
        # V_old(x, y_<t) = E_{pi_old}[r | x, y_<t]: sums of pi_old(y) r over the responses sharing the prefix
        joint, reward_tree = logprobs.exp().view(shape), rewards.view(shape)
        values = []
        for t in range(length):
            value = reward_to_go(joint, reward_tree, t)
            values.append(value.reshape(prompts, -1).repeat_interleave(num_tokens ** (length - t), -1))
        advantages = (rewards.unsqueeze(-1) - torch.stack(values, -1)).view(-1, length).float()
        rollout = Rollout(
            # one group per row: enumerated responses are not independent samples, so no leave-one-out
            # baseline (ppo_math.kl_to_go_loss's groups); the exact expectation needs none
            prompts=[str(row) for row in range(len(input_ids))],
            responses=[],
            input_ids=input_ids,
            attention_mask=attention_mask,
            response=response,
            mask=mask,
            ended_with_eos=torch.zeros(len(input_ids), dtype=torch.bool),
            old_logprobs=old_logprobs,
            trainer_logprobs=old_logprobs,
            sampler_logprobs=old_logprobs,
            ref_logprobs=ref_token_logprobs,
            old_values=None,
            entropy=torch.zeros_like(mask),
        )
        probs = logprobs.exp()  # (prompts, responses): pi_old(y | x), float64
        if responses is None:  # the expectation itself, at every step
            shares = [probs] * num_minibatches
        else:  # each minibatch's draw, as the share of its responses that each one is
            drawn = [torch.multinomial(probs, per_minibatch, replacement=True, generator=draws) for _ in range(num_minibatches)]
            shares = [torch.zeros_like(probs).scatter_add_(1, d, torch.ones_like(d, dtype=probs.dtype)) / per_minibatch for d in drawn]
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(iteration, iterations, lr_final, lr_hold)
        rows_all = torch.arange(len(input_ids))
        for share in [share for _ in range(module.hparams.ppo_epochs) for share in shares]:
            weights = (share.view(-1, 1) / prompts).float().expand(-1, length) / length
            loss = module.ppo_loss(rollout, advantages, None, rows_all, torch.full((len(input_ids),), beta), weights)
            loss.backward()
            module.on_before_optimizer_step(optimizer)  # the module's gradient clipping, as in the sampled loop
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return rows
