"""Reward hacking with and without the KL penalty: train configs/reward_hacking.yaml twice and compare.

    python -m tools.studies.reward_hacking_report                    # 40 iterations per run, report in runs/reward_hacking
    python -m tools.studies.reward_hacking_report --fast             # 10 iterations per run (the tests)
    python -m tools.studies.reward_hacking_report --config my.yaml --iterations 60 --out /tmp/hacking

The proxy reward of the config counts exclamation marks. Run ``no_penalty`` is the config with its
controller replaced by ``FixedBeta(0)``; run ``penalised`` is the config as written (its KL
penalty). After training, each final policy answers the validation prompts once (so does the
untrained reference, for the base rates) and the report gives, per run: the exploit frequency
(share of response characters that are "!", share of responses with at least 3 "!"), the proxy
reward and the KL to the reference (nats per response) on those answers, and one sample answer.
The markdown table is printed and written to ``<out>/reward_hacking.md``; each run's
TensorBoard logs go under ``<out>/<run>/``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tools._cli_args import existing_file, option_number, tool_parser
from tools.studies.sweep_beta import REPO, RUN_OVERRIDES, fixed_beta, prepare, train

DEFAULT_CONFIG = REPO / "configs" / "reward_hacking.yaml"
EXPLOIT = "!"
MIN_EXPLOITS = 3  # a response with this many "!" counts as exploiting the proxy


@dataclass
class HackingRow:
    run: str
    char_share: float  # share of response characters that are "!"
    exploiting: float  # share of responses with >= MIN_EXPLOITS "!"
    proxy_reward: float  # mean raw proxy score
    kl: float  # mean summed KL estimate per response
    sample: str
    beta: Optional[float] = None  # the final beta of the run's controller (None: the untrained reference)
    train_reward: Optional[float] = None  # mean objective/reward over the last training iterations


def exploit_stats(responses: Sequence[str]) -> tuple[float, float]:
    """(share of characters that are "!", share of responses with at least MIN_EXPLOITS of them)."""
    chars = sum(len(r) for r in responses)
    marks = [r.count(EXPLOIT) for r in responses]
    return sum(marks) / max(chars, 1), sum(m >= MIN_EXPLOITS for m in marks) / len(responses)


def evaluate(module, prompts: Sequence[str], batch_size: int) -> tuple[list[str], float, float]:
    """The final policy's responses to ``prompts``, their mean proxy score and mean KL per response."""
    import torch

    module.eval()  # rollout seeds its sampler from the run's seed and iteration: runs answer alike
    responses, scores, kls = [], [], []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            rollout = module.rollout(list(prompts[start : start + batch_size]))
            responses += rollout.response_texts
            scores += module.reward_model.checked_scores(rollout.prompts, rollout.response_texts).tolist()
            kls += module.regulariser.kl_per_token(rollout).sum(-1).tolist()
    return responses, sum(scores) / len(scores), sum(kls) / len(kls)


def report_row(name: str, module, datamodule, **extra) -> HackingRow:
    responses, proxy_reward, kl = evaluate(module, datamodule.val_prompts, datamodule.val_batch_size)
    char_share, exploiting = exploit_stats(responses)
    return HackingRow(name, char_share, exploiting, proxy_reward, kl, responses[0], **extra)


def reference_row(config) -> HackingRow:
    """The untrained policy (the reference itself): the exploit's base rate."""
    from rlhf_lightning.cli import build_cli

    cli = build_cli(["--config", str(config), *RUN_OVERRIDES], run=False)
    cli.model.configure_model()
    cli.datamodule.setup("validate")
    return report_row("reference (untrained)", cli.model, cli.datamodule)


def run(name: str, config, overrides: Sequence[str], iterations: int, last: int, out: Path) -> HackingRow:
    cli, history = train(config, overrides, iterations, out / name)
    return report_row(
        name,
        cli.model,
        cli.datamodule,
        beta=cli.model.beta_controller.beta,
        train_reward=history.last_mean("objective/reward", last),
    )


def format_report(rows: Sequence[HackingRow], config: str, iterations: int) -> str:
    lines = [
        f"Reward hacking on `{Path(config).name}`, {iterations} PPO iterations per run; the final policies answer the validation prompts.",
        "",
        f'| run | final beta | "!" share of characters | responses with >= {MIN_EXPLOITS} "!" | proxy reward | KL (nats) | train reward |',
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        beta, train_reward = ("-", "-") if r.beta is None else (f"{r.beta:.3g}", f"{r.train_reward:.2f}")
        lines.append(f"| {r.run} | {beta} | {r.char_share:.1%} | {r.exploiting:.1%} | {r.proxy_reward:.2f} | {r.kl:.2f} | {train_reward} |")
    lines += ["", "First validation answer of each run:", ""]
    lines += [f"- {r.run}: `{r.sample[:160]!r}`" for r in rows]
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--config", type=existing_file, default=str(DEFAULT_CONFIG), help="default: configs/reward_hacking.yaml")
    parser.add_argument("--iterations", type=option_number(integer=True, at_least=1), help="PPO iterations per run (default 40, --fast 10)")
    parser.add_argument(
        "--last", type=option_number(integer=True, at_least=1), default=5, help="average the training reward over the last K iterations"
    )
    parser.add_argument("--out", default="runs/reward_hacking", help="folder for the report and the TensorBoard logs")
    parser.add_argument(
        "--threads", type=option_number(integer=True, at_least=0), default=1, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument("--fast", action="store_true", help="10 iterations per run (for tests)")
    args = parser.parse_args(argv)
    args.iterations = (10 if args.fast else 40) if args.iterations is None else args.iterations
    return args


def main(argv: Optional[Sequence[str]] = None) -> list[HackingRow]:
    args = parse_args(argv)
    out = prepare(args.threads, args.out)
    last = min(args.last, args.iterations)
    rows = [
        reference_row(args.config),
        run("no_penalty", args.config, fixed_beta(0.0), args.iterations, last, out),
        run("penalised", args.config, [], args.iterations, last, out),
    ]
    report = format_report(rows, args.config, args.iterations)
    (out / "reward_hacking.md").write_text(report + "\n")
    print(report)
    print(f"\nwrote {out / 'reward_hacking.md'}")
    return rows


if __name__ == "__main__":
    main()
