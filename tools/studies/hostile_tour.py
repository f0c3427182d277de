"""A tour of hostile inputs (issue #65): each case runs ``rlhf-lightning fit`` on configs/tiny.yaml for two short
iterations from a fresh folder, and prints its exit status, its time, the last line of its stderr and the
warnings it printed, for a person to classify (silent / unclear / late / crash / fine).

    .venv/bin/python -m tools.studies.hostile_tour [--only SUBSTRING] [--jobs 2]

A case is ``(name, args, files, yaml)``: ``files`` are written in the run's folder first (a prompt file, a
checkpoint folder), ``yaml`` is a second ``--config`` layered over tiny.yaml. Cases whose name ends in ``+resume``
run twice: the first args, then the second with ``--ckpt_path last`` (a checkpoint every iteration).
The regression tests of the classes found here are tests/test_hostile_input.py.

The tour of 2026-12-07 (133 cases, before the fixes of that day; a 2-core machine at a load of 2-20): silent 16
(max_staleness-0 settings and explore_iterations without explore ignored; alpha 1e-300 and 1e-16 a penalty of 0 or
inexact, alpha 1e300 one that vanishes on one side; budgets 1e-320 and 1e308 and target 1e-320 accepted; init_beta
1e-320; a per-prompt horizon of 1e-300 driving betas to 0; NUL bytes in prompts; model.sampling left empty; a
resume on other prompt ids; a resume on another engine), unclear 6 (a text file as model.reference said "no such
file"; a horizon below a batch named the negative beta, not the horizon; model:, data:, trainer:, cpu: left empty
"Unexpected config"; an empty init_args), late 3 (that horizon, at the first low KL; a policy or reference folder
without config.json, at load), crash 13 (init_beta 1e300 and 1e308: TensorBoard's "The histogram is empty"; a
policy folder of text: transformers' sentencepiece ImportError; cpu.threads 100000: a segmentation fault; a lone
surrogate in a JSON prompt: the tokenizer's TypeError; eight model groups left empty in YAML: a TypeError),
nothing lost; the rest fine (clear refusals, or runs that are right). Each class is closed and tested.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
QUICK = (
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.callbacks=[]",
    "--model.sampling.max_new_tokens=4",
    "--data.batch_size=4",
)
ASYNC = ("--model.sampling.old_logprobs=forward", "--model.off_policy.max_staleness=1")
BUDGETS = ("--model.beta_controller=per_prompt", "--data.train_path=p.jsonl", "--data.id_column=id")
COLUMN = (*BUDGETS, "--model.beta_controller.init_args.budget_column=b")


def jsonl(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def budget_rows(budget=1.0, n=8, **extra):
    return [{"prompt": f"Write about the number {i}.", "id": f"q{i}", "b": budget if i == 3 else 1.0, **extra} for i in range(n)]


PROMPTS = {"p.jsonl": jsonl(budget_rows())}


def cases():
    c = []
    add = lambda name, *args, files=None, yaml=None: c.append((name, list(args), files or {}, yaml))
    # asynchronous settings
    add("async/ok", *ASYNC)
    add("async/sampler-logprobs", "--model.off_policy.max_staleness=1")
    for v in ("-1", "1.5", "two", "true"):
        add(f"async/staleness={v}", "--model.sampling.old_logprobs=forward", f"--model.off_policy.max_staleness={v}")
    for v in ("0", "-1", ".inf", ".nan", "never", "null", "10s", "true"):
        add(f"async/timeout={v}", *ASYNC, f"--model.off_policy.sampler_timeout_s={v}")
    add("async/timeout-no-staleness", "--model.off_policy.sampler_timeout_s=5")
    for v in ("foo", "none", "token"):
        add(f"async/correction={v}", *ASYNC, f"--model.off_policy.correction={v}")
    add("async/correction-no-staleness", "--model.off_policy.correction=token")
    for v in ("0.5", ".inf", ".nan", "1e308"):
        add(f"async/cap={v}", *ASYNC, f"--model.off_policy.correction_cap={v}")
    add("async/vllm", *ASYNC, "--model.rollout_engine=vllm")
    add("async/strategy=ddp1", *ASYNC, "--trainer.strategy=ddp", "--trainer.devices=1")
    add("async/strategy=fsdp", *ASYNC, "--trainer.strategy=fsdp")
    add("async/score-in-sampler-no", *ASYNC, "--model.off_policy.score_in_sampler=false")
    add("async/grpo", *ASYNC, "--model.advantage_estimator=grpo", "--model.sampling.num_generations=2")
    add("async/rollout-correction", *ASYNC, "--model.sampling.rollout_correction=tis")
    # any reference
    add("ref/missing", "--model.reference=nope")
    add("ref/empty-folder", "--model.reference=empty", files={"empty/.keep": ""})
    add("ref/text-file", "--model.reference=notes.txt", files={"notes.txt": "hello"})
    add("ref/folder-of-text", "--model.reference=folder", files={"folder/readme.md": "hi"})
    add("ref/bad-config", "--model.reference=bad", files={"bad/config.json": "{not json"})
    add("ref/blank", "--model.reference=' '")
    add("ref/policy=folder-not-model", "--model.policy=folder", files={"folder/readme.md": "hi"})
    add("ref/smollm2-other-tokenizer", "--model.reference=smollm2")
    # divergences
    for v in ("1e-300", "1e-320", "1e300", "-1e300", "1e-16", ".nan"):
        add(f"div/alpha={v}", "--model.divergence=alpha", f"--model.divergence.init_args.alpha={v}")
    for v in ("1e-300", "0.9999999999999999"):
        add(f"div/js-mixture={v}", "--model.divergence=js", f"--model.divergence.init_args.mixture={v}")
    add("div/forward-kl-loss", "--model.divergence=forward_kl", "--model.kl.placement=loss")
    add("div/chi2-per-prompt", "--model.divergence=chi2", *BUDGETS, files=PROMPTS)
    for v in ("1e-320", "1e308", "1e300"):
        add(f"beta/init_beta={v}", f"--model.beta_controller.init_args.init_beta={v}")
    add("beta/adaptive-horizon=1e-300", "--model.beta_controller=adaptive", "--model.beta_controller.init_args.horizon=1e-300")
    add("beta/adaptive-target=1e-320", "--model.beta_controller=adaptive", "--model.beta_controller.init_args.target=1e-320")
    # per-prompt budgets
    add("budget/ok", *COLUMN, files=PROMPTS)
    add("budget/missing-column", *COLUMN, files={"p.jsonl": jsonl([{k: v for k, v in r.items() if k != "b"} for r in budget_rows()])})
    add(
        "budget/missing-in-one-row",
        *COLUMN,
        files={"p.jsonl": jsonl([r if r["id"] != "q3" else {"prompt": r["prompt"], "id": "q3"} for r in budget_rows()])},
    )
    add("budget/negative", *COLUMN, files={"p.jsonl": jsonl(budget_rows(-1.0))})
    add("budget/zero", *COLUMN, files={"p.jsonl": jsonl(budget_rows(0))})
    add("budget/nan", *COLUMN, files={"p.jsonl": jsonl(budget_rows()).replace('"b": 1.0}', '"b": NaN}', 1)})
    add("budget/inf", *COLUMN, files={"p.jsonl": jsonl(budget_rows()).replace('"b": 1.0}', '"b": Infinity}', 1)})
    add("budget/text", *COLUMN, files={"p.jsonl": jsonl(budget_rows("lots"))})
    add("budget/numeric-text", *COLUMN, files={"p.jsonl": jsonl(budget_rows("2.5"))})
    add("budget/null", *COLUMN, files={"p.jsonl": jsonl(budget_rows(None))})
    add("budget/bool", *COLUMN, files={"p.jsonl": jsonl(budget_rows(True))})
    add("budget/1e-320", *COLUMN, files={"p.jsonl": jsonl(budget_rows(1e-320))})
    add("budget/1e308", *COLUMN, files={"p.jsonl": jsonl(budget_rows(1e308))})
    add("budget/duplicate-ids", *COLUMN, files={"p.jsonl": jsonl(budget_rows()).replace('"id": "q4"', '"id": "q3"')})
    add(
        "budget/csv-empty-cell",
        *(a.replace("p.jsonl", "p.csv") for a in COLUMN),
        files={"p.csv": "prompt,id,b\n" + "".join(f"Say {i},q{i},{'' if i == 2 else 1}\n" for i in range(8))},
    )
    add(
        "budget/column-no-ids",
        "--model.beta_controller=per_prompt",
        "--data.train_path=p.jsonl",
        "--model.beta_controller.init_args.budget_column=b",
        files=PROMPTS,
    )
    add("budget/id-column-without-per-prompt", "--data.train_path=p.jsonl", "--data.id_column=id", files=PROMPTS)
    add("budget/id-column-missing", "--data.train_path=p.jsonl", "--data.id_column=nope", files=PROMPTS)
    for v in ("0", "-1", "1e-300", ".nan"):
        add(f"budget/horizon={v}", *COLUMN, f"--model.beta_controller.init_args.horizon={v}", files=PROMPTS)
    add(
        "budget/beta_min>beta_max",
        *COLUMN,
        "--model.beta_controller.init_args.beta_min=0.05",
        "--model.beta_controller.init_args.beta_max=0.01",
        files=PROMPTS,
    )
    add("budget/target-1e-320", *BUDGETS, "--model.beta_controller.init_args.target=1e-320", files=PROMPTS)
    # exploration
    for v in ("1", "-0.1", ".nan", "1e-320"):
        add(f"explore/explore={v}", f"--model.sampling.explore={v}", "--model.sampling.explore_iterations=5")
    add("explore/no-iterations", "--model.sampling.explore=0.5")
    add("explore/iterations-without-explore", "--model.sampling.explore_iterations=5")
    add("explore/iterations=-1", "--model.sampling.explore=0.5", "--model.sampling.explore_iterations=-1")
    add("explore/greedy", "--model.sampling.explore=0.5", "--model.sampling.explore_iterations=5", "--model.sampling.do_sample=false")
    add("explore/async", *ASYNC, "--model.sampling.explore=0.5", "--model.sampling.explore_iterations=5")
    add("explore/vllm", "--model.rollout_engine=vllm", "--model.sampling.explore=0.5", "--model.sampling.explore_iterations=5")
    add("explore/top_k", "--model.sampling.explore=0.5", "--model.sampling.explore_iterations=5", "--model.sampling.top_k=2")
    add(
        "explore/grpo",
        "--model.sampling.explore=0.5",
        "--model.sampling.explore_iterations=5",
        "--model.advantage_estimator=grpo",
        "--model.sampling.num_generations=2",
    )
    add(
        "explore/correction",
        "--model.sampling.explore=0.5",
        "--model.sampling.explore_iterations=5",
        "--model.sampling.old_logprobs=forward",
        "--model.sampling.rollout_correction=tis",
    )
    # cpu.threads
    for v in ("0", "-1", "1.5", "many", "100000", ".nan", "true"):
        add(f"cpu/threads={v}", f"--cpu.threads={v}")
    # malformed prompt files
    add("file/nul-bytes", "--data.train_path=p.txt", files={"p.txt": "".join(f"prompt {i}\x00x\n" for i in range(8))})
    add("file/bom", "--data.train_path=p.jsonl", files={"p.jsonl": "\ufeff" + jsonl(budget_rows())})
    add("file/crlf-txt", "--data.train_path=p.txt", files={"p.txt": "".join(f"prompt {i}\r\n" for i in range(8))})
    add("file/utf16", "--data.train_path=p.txt", files={"p.txt": "\ufeff" + "".join(f"prompt {i}\n" for i in range(8))}, yaml="utf16")
    add("file/lone-surrogate", "--data.train_path=p.jsonl", files={"p.jsonl": jsonl(budget_rows()).replace("number 2", "number \\ud800")})
    add("file/json-object", "--data.train_path=p.json", files={"p.json": json.dumps({"prompt": ["a", "b"]})})
    add("file/tsv", "--data.train_path=p.tsv", files={"p.tsv": "prompt\tid\n" + "".join(f"p {i}\t{i}\n" for i in range(8))})
    add("file/binary-txt", "--data.train_path=p.txt", files={"p.txt": "\x89PNG\r\n\x1a\n" * 3}, yaml="binary")
    add("file/blank-lines-jsonl", "--data.train_path=p.jsonl", files={"p.jsonl": "\n\n" + jsonl(budget_rows()).replace("\n", "\n\n")})
    add("file/control-chars", "--data.train_path=p.txt", files={"p.txt": "".join(f"prompt {i}\x1b[31m red\x07\n" for i in range(8))})
    add("file/val-malformed", "--data.val_path=v.jsonl", "--trainer.limit_val_batches=1", files={"v.jsonl": '{"prompt": "ok"}\n{bad\n'})
    add("file/duplicate-prompts", "--data.train_path=p.txt", files={"p.txt": "same\n" * 8})
    add("file/empty-string-column", "--data.train_path=p.jsonl", "--data.prompt_column=", files=PROMPTS)
    # a settings group left empty in YAML
    for group in ("sampling", "off_policy", "kl", "ppo", "prompts", "runtime", "lora", "loading", "optim"):
        add(f"yaml/model.{group}-empty", yaml=f"model:\n  {group}:\n")
    add("yaml/model.sampling-{}", yaml="model:\n  sampling: {}\n")
    add("yaml/model-empty", yaml="model:\n")
    add("yaml/data-empty", yaml="data:\n")
    add("yaml/trainer-empty", yaml="trainer:\n")
    add("yaml/cpu-empty", yaml="cpu:\n")
    add("yaml/beta_controller-empty", yaml="model:\n  beta_controller:\n")
    add("yaml/init_args-empty", yaml="model:\n  beta_controller:\n    class_path: adaptive\n    init_args:\n")
    add("yaml/reward_model-empty", yaml="model:\n  reward_model:\n")
    add("yaml/divergence-empty", yaml="model:\n  divergence:\n")
    add("yaml/rollout_engine-empty", yaml="model:\n  rollout_engine:\n")
    add("yaml/callbacks-empty", yaml="trainer:\n  callbacks:\n")
    add("yaml/kl.ignore_tokens-empty-list", yaml="model:\n  kl:\n    ignore_tokens: []\n")
    # recipes
    add("recipe/k3+both", "--model.kl_estimator=k3+", "--model.kl.placement=both")
    add("recipe/k3-loss-unweighted", "--model.kl_estimator=k3", "--model.kl.placement=loss", "--model.kl.loss_weighting=none")
    add(
        "recipe/entropy-target-high",
        "--model.entropy_controller=adaptive",
        "--model.entropy_controller.init_args.target=100",
        "--model.entropy_controller.init_args.unit=token_mean",
    )
    return c


def run(case, root: Path, timeout: float) -> dict:
    name, args, files, yaml = case
    folder = root / name.replace("/", "__").replace("=", "_")
    folder.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        data = (
            text.encode("utf-16")
            if yaml == "utf16"
            else text.encode("latin-1")
            if yaml == "binary"
            else text.encode("utf-8", "surrogatepass")
        )
        (folder / rel).write_bytes(data)
    extra = []
    if yaml and yaml not in ("utf16", "binary"):
        (folder / "extra.yaml").write_text(yaml)
        extra = ["--config", "extra.yaml"]
    command = [sys.executable, "-m", "rlhf_lightning.cli", "fit", "--config", TINY, *extra, *QUICK, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")}
    start = time.monotonic()
    try:
        result = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout, env=env)
        rc, err = result.returncode, result.stderr
    except subprocess.TimeoutExpired as expired:
        rc, err = "timeout", (expired.stderr or b"").decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr or ""
    lines = [line for line in err.splitlines() if line.strip()]
    warned = re.compile(r"\.py:\d+: ")  # a warning: "file.py:line: message" (Lightning's rank_zero_warn) or "...: UserWarning: ..."
    noise = ("Trainer(", "does not have many workers")
    warnings = [line.strip() for line in lines if warned.search(line) and not any(n in line for n in noise)]
    return {
        "name": name,
        "rc": rc,
        "s": round(time.monotonic() - start, 1),
        "last": lines[-1][:400] if lines else "",
        "warnings": [w[:300] for w in warnings],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--out", default=None, help="write the results as JSON lines here")
    a = parser.parse_args(argv)
    chosen = [case for case in cases() if a.only in case[0]]
    root = Path(tempfile.mkdtemp(prefix="hostile_tour_"))
    out = open(a.out, "w") if a.out else None  # noqa: SIM115
    with ThreadPoolExecutor(a.jobs) as pool:
        for result in pool.map(lambda case: run(case, root, a.timeout), chosen):
            print(json.dumps(result), flush=True)
            if out:
                out.write(json.dumps(result) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
