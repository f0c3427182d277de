"""Write arithmetic questions with integer answers, for the ``exact_answer`` reward backend.

    python -m tools.make_arithmetic_prompts --out-dir rlhf_lightning/prompts     # the shipped files
    python -m tools.make_arithmetic_prompts --out-dir rlhf_lightning/prompts --calculator --ops + - "*" --max-operand 60

Each line of ``<out-dir>/arithmetic_train.jsonl`` and ``arithmetic_validation.jsonl`` is
``{"prompt": "What is 17 + 25? Answer with the number only.", "answer": 42}``: the prompt is what
the policy reads and what ``exact_answer`` computes the answer from; ``answer`` is there for a
reader (the reward does not read it). Questions ``a OP b`` draw a and b uniformly from
``[0, --max-operand]`` and OP from ``--ops``; the held-out questions are distinct from every
training question (as the pair a, b and the operation), so pass@k on them measures arithmetic,
not recall. The default (sums and differences of numbers up to 20) is what SmolLM2-135M-Instruct
gets right a fraction of the time, so sampled answers both succeed and fail.

``--calculator`` writes ``calculator_train.jsonl`` and ``calculator_validation.jsonl`` instead, whose prompts
also tell the policy how to call the ``calculator`` environment (``<calc>expression</calc>``,
configs/calculator.yaml); the shipped ones hold sums, differences and products of numbers up to 60, products the policy
cannot work out unaided.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from tools._cli_args import option_number, tool_parser

TEMPLATE = "What is {a} {op} {b}? Answer with the number only."
# One worked call in the prompt (other numbers than the question's): SmolLM2-135M made no call in 32 episodes when the
# prompt only described the syntax.
CALCULATOR_TEMPLATE = (
    "What is {a} {op} {b}? You have a calculator: write <calc>the expression</calc> (for example <calc>12 * 5</calc>) "
    "and it replies with the result. Then answer with the number only."
)


def arithmetic_questions(
    n_train: int, n_val: int, max_operand: int, ops: Sequence[str], seed: int, template: str = TEMPLATE
) -> tuple[list[dict], list[dict]]:
    """(train, validation) lists of {"prompt", "answer"}, no question in both or twice in one."""
    from rlhf_lightning_plugins.rewards.verifiable import question_answer

    space = [(a, op, b) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if n_train + n_val > len(space):
        raise ValueError(f"{n_train} + {n_val} distinct questions asked, but --max-operand and --ops allow only {len(space)}")
    picked = random.Random(seed).sample(space, n_train + n_val)
    rows = [{"prompt": (prompt := template.format(a=a, op=op, b=b)), "answer": question_answer(prompt)} for a, op, b in picked]
    return rows[:n_train], rows[n_train:]


def main(argv: Optional[Sequence[str]] = None) -> tuple[Path, Path]:
    p = tool_parser(__spec__.name, __doc__)
    p.add_argument("--out-dir", type=Path, default=Path("runs/arithmetic"))
    p.add_argument("--train", type=option_number(integer=True, at_least=1), default=400, help="training questions")
    p.add_argument("--val", type=option_number(integer=True, at_least=1), default=64, help="held-out questions")
    p.add_argument("--max-operand", type=option_number(integer=True, at_least=1), default=20)
    p.add_argument("--ops", nargs="+", default=["+", "-"], choices=["+", "-", "*"])
    p.add_argument("--seed", type=option_number(integer=True), default=0)
    p.add_argument("--calculator", action="store_true", help="prompts that offer the calculator environment: calculator_*.jsonl")
    args = p.parse_args(argv)
    template, name = (CALCULATOR_TEMPLATE, "calculator") if args.calculator else (TEMPLATE, "arithmetic")
    train, val = arithmetic_questions(args.train, args.val, args.max_operand, args.ops, args.seed, template)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    paths = args.out_dir / f"{name}_train.jsonl", args.out_dir / f"{name}_validation.jsonl"
    for path, rows in zip(paths, (train, val), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {len(rows)} questions to {path}")
    return paths


if __name__ == "__main__":
    main()
