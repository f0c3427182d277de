"""tools/train_reward_model.py on a separable toy preference set: the chosen response is full of
"e", the rejected one has few. Training a tiny Llama with the Bradley-Terry loss must lift the
held-out pair accuracy from chance to near 1, and the saved folder must work as the
``hf_classifier`` reward backend."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rlhf_lightning_plugins.rewards.classifier import HFClassifierReward
from tools import train_reward_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
OTHER_LETTERS = "abcdfghijklmnopqrstuvwxyz"


def toy_response(rng: random.Random, e_share: float) -> str:
    """20 to 30 characters: each an "e" with probability ``e_share``, else another letter or a space."""
    return "".join("e" if rng.random() < e_share else rng.choice(OTHER_LETTERS + " ") for _ in range(rng.randint(20, 30)))


def write_toy_pairs(path, n: int = 120, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            pair = {"prompt": f"Say {i}.", "chosen": toy_response(rng, 0.5), "rejected": toy_response(rng, 0.05)}
            f.write(json.dumps(pair) + "\n")


def test_training_separates_toy_pairs_and_the_model_loads_as_hf_classifier(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    write_toy_pairs(pairs)
    out = tmp_path / "rm"
    result = train_reward_model.main(
        [
            "--trunk",
            "tiny",
            "--pairs",
            str(pairs),
            "--out",
            str(out),
            "--epochs",
            "4",
            "--batch-size",
            "8",
            "--threads",
            "1",
        ]
    )

    # 120 distinct prompts, 20% held out by prompt.
    assert (result["train_pairs"], result["val_pairs"]) == (96, 24)
    # A random score head ranks pairs by chance; the Bradley-Terry fit learns to count "e".
    assert result["val_accuracy_before"] <= 0.75
    assert result["val_accuracy"] >= 0.9
    assert result["path"] == out / "model"
    assert list((out / "lightning_logs").glob("version_*/events.out.tfevents.*"))

    reward = HFClassifierReward(path=str(out / "model"))
    reward.setup("cpu")
    assert reward.model.config.num_labels == 1 and reward.model.config.pad_token_id == reward.tokenizer.pad_token_id
    scores = reward.checked_scores(["Say 7.", "Say 7."], ["e" * 25, "x" * 25])
    assert scores[0] > scores[1]


def test_pair_file_with_a_missing_field_names_the_field_and_line(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        json.dumps({"prompt": "Hi.", "chosen": "Hello!", "rejected": "Go away."})
        + "\n"
        + json.dumps({"prompt": "Hi.", "chosen": "Hello!"})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"line 2 has no field 'rejected'"):
        train_reward_model.main(["--trunk", "tiny", "--pairs", str(pairs), "--out", str(tmp_path / "rm")])


def test_sampled_pairs_are_labelled_by_the_gold_scorer_and_cached(tmp_path, capsys):
    """Pairs sampled from the tiny policy, gold = count of "e": the chosen response never has fewer
    "e" than the rejected one, ties are dropped, and a re-run reuses the cached pairs."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write {i} words."}) + "\n" for i in range(12)))
    out = tmp_path / "rm"
    args = [
        "--trunk",
        "tiny",
        "--policy",
        "tiny",
        "--gold",
        "rlhf_lightning_plugins.rewards.toy:char_count",
        "--prompts",
        str(prompts),
        "--num-prompts",
        "10",
        "--max-new-tokens",
        "40",
        "--epochs",
        "1",
        "--val-fraction",
        "0.3",
        "--out",
        str(out),
        "--threads",
        "1",
    ]
    first = train_reward_model.main(args)

    cached = train_reward_model.read_pairs(out / "pairs.jsonl")
    assert len(cached) == first["train_pairs"] + first["val_pairs"] <= 10
    for pair in cached:
        assert pair["chosen"].count("e") == pair["chosen_score"] > pair["rejected_score"] == pair["rejected"].count("e")
    capsys.readouterr()
    second = train_reward_model.main(args)
    assert "reusing" in capsys.readouterr().out
    assert (second["train_pairs"], second["val_pairs"]) == (first["train_pairs"], first["val_pairs"])


def test_relabel_orders_the_given_responses_by_the_new_gold(tmp_path, capsys):
    """--relabel keeps a file's responses but lets --gold pick the chosen one: with gold = count of
    "e", a pair labelled the other way round is flipped, an equal pair dropped, the rest kept."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": "A.", "chosen": "eee", "rejected": "e"},  # agrees with the gold: kept as is
        {"prompt": "B.", "chosen": "x", "rejected": "eeee"},  # disagrees: flipped
        {"prompt": "C.", "chosen": "ee", "rejected": "e e"},  # a tie for the gold: dropped
    ]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "rm"
    args = [
        "--trunk",
        "tiny",
        "--pairs",
        str(pairs),
        "--relabel",
        "--gold",
        "rlhf_lightning_plugins.rewards.toy:char_count",
        "--val-fraction",
        "0.5",
        "--epochs",
        "1",
        "--out",
        str(out),
        "--threads",
        "1",
    ]
    result = train_reward_model.main(args)

    relabelled = train_reward_model.read_pairs(out / "pairs.jsonl")
    assert [(p["prompt"], p["chosen"], p["rejected"], p["chosen_score"], p["rejected_score"]) for p in relabelled] == [
        ("A.", "eee", "e", 3.0, 1.0),
        ("B.", "eeee", "x", 4.0, 0.0),
    ]
    assert result["train_pairs"] + result["val_pairs"] == 2
    assert "2 kept, 1 ties dropped, 1 flipped" in capsys.readouterr().out


def test_relabel_never_overwrites_the_pairs_it_reads_or_a_sampled_cache(tmp_path):
    out = tmp_path / "rm"
    out.mkdir()
    pairs = out / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "A.", "chosen": "eee", "rejected": "e"}) + "\n")
    args = ["--trunk", "tiny", "--relabel", "--gold", "rlhf_lightning_plugins.rewards.toy:char_count", "--out", str(out)]
    with pytest.raises(ValueError, match="would overwrite the pairs"):
        train_reward_model.main([*args, "--pairs", str(pairs)])
    elsewhere = tmp_path / "given.jsonl"
    elsewhere.write_text(pairs.read_text())
    (out / "pairs_meta.json").write_text("{}")  # out holds a sampled cache
    with pytest.raises(ValueError, match="would overwrite the pairs"):
        train_reward_model.main([*args, "--pairs", str(elsewhere)])
    assert pairs.read_text() == elsewhere.read_text()


def test_relabel_without_pairs_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_reward_model.main(["--trunk", "tiny", "--relabel", "--out", str(tmp_path / "rm")])
    assert "--relabel needs --pairs" in capsys.readouterr().err


def test_response_only_pairs_are_the_responses_alone():
    """--response-only trains on the text HFClassifierReward(include_prompt=False) scores: the response alone."""
    _, tokenizer = train_reward_model.load_trunk("tiny")
    pairs = [{"prompt": "Say hi.", "chosen": "hello there", "rejected": "no"}]
    blind = train_reward_model.collate_pairs(pairs, tokenizer, "\n", 64, include_prompt=False)
    seeing = train_reward_model.collate_pairs(pairs, tokenizer, "\n", 64)
    expected = tokenizer(["hello there", "no"], return_tensors="pt", padding=True)
    assert blind["input_ids"].tolist() == expected["input_ids"].tolist()
    assert (
        seeing["input_ids"].tolist()
        == tokenizer(["Say hi.\nhello there", "Say hi.\nno"], return_tensors="pt", padding=True)["input_ids"].tolist()
    )


def test_ensemble_trains_k_members_with_their_own_seeds_and_reward_stats(tmp_path):
    from rlhf_lightning_plugins.rewards.classifier import EnsembleReward

    pairs = tmp_path / "pairs.jsonl"
    write_toy_pairs(pairs)
    common = ["--trunk", "tiny", "--pairs", str(pairs), "--epochs", "2", "--batch-size", "8", "--threads", "1"]
    result = train_reward_model.main([*common, "--out", str(tmp_path / "ens"), "--ensemble", "2"])
    single = train_reward_model.main([*common, "--out", str(tmp_path / "one")])

    assert result["paths"] == [str(tmp_path / "ens" / f"member_{k}" / "model") for k in range(2)]
    prompts, responses = ["Say 1.", "Say 2.", "Say 3."], ["e" * 25, "x" * 25, "eex ex"]
    member_0, member_1, alone = (HFClassifierReward(path=str(p)) for p in (*result["paths"], single["path"]))
    # Member 0 has the single run's seed, so it is that model; member 1's seed gives another.
    torch.testing.assert_close(member_0.checked_scores(prompts, responses), alone.checked_scores(prompts, responses))
    assert not torch.allclose(member_0.checked_scores(prompts, responses), member_1.checked_scores(prompts, responses), atol=1e-3)

    # reward_stats.json: the mean and population std of the member's scores on every training
    # response, chosen and rejected, as HFClassifierReward scores them.
    train_pairs, _ = train_reward_model.split_by_prompt(train_reward_model.read_pairs(pairs), 0.2, 0)
    texts = [(p["prompt"], p[side]) for p in train_pairs for side in ("chosen", "rejected")]
    for path, member in zip(result["paths"], (member_0, member_1), strict=True):
        scores = member.checked_scores([t[0] for t in texts], [t[1] for t in texts])
        stats = json.loads((train_reward_model.Path(path) / train_reward_model.REWARD_STATS_FILE).read_text())
        assert stats["responses"] == 2 * 96
        assert stats["mean"] == pytest.approx(scores.mean().item(), abs=1e-4)
        assert stats["std"] == pytest.approx(scores.std(unbiased=False).item(), rel=1e-4)
    # Standardised by those stats, each member scores its training responses with mean 0, std 1.
    ensemble = EnsembleReward(paths=result["paths"], combine="mean")
    standardised = ensemble.member_scores([t[0] for t in texts], [t[1] for t in texts])  # (2, responses)
    torch.testing.assert_close(standardised.mean(1), torch.zeros(2), atol=1e-4, rtol=0)
    torch.testing.assert_close(standardised.std(1, unbiased=False), torch.ones(2), atol=1e-4, rtol=0)


def test_ensemble_of_fewer_than_two_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        train_reward_model.parse_args(["--ensemble", "1", "--out", str(tmp_path)])
