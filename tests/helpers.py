"""Helpers shared by the tests: tiny randomly initialised modules and short CPU fits, the
command-line runs of configs/tiny.yaml, a hand-made PPO batch, and a scripted HTTP scoring server.
(Fixtures live in conftest.py; callbacks the command-line runs name by class path live in
fault_callbacks.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from lightning import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback

from rlhf_lightning import args
from rlhf_lightning.cpu import CPUSettings, apply_cpu_settings
from rlhf_lightning.data import PromptDataModule
from rlhf_lightning.interfaces import Environment, Samples, Step
from rlhf_lightning.module import PPORLHF
from rlhf_lightning.ppo_math import logprobs_of
from rlhf_lightning_plugins.rewards.function import CallableReward

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def cli(cwd: Path, *args: str, timeout: float = 600, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``rlhf-lightning <args>`` as a user runs it, in ``cwd``, with the tests folder importable
    (for test reward functions and callbacks named in the arguments), ``env`` added to the environment."""
    Path(cwd).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_lightning.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def tool(module: str, *args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` (``tools.summarize_run``) as a user runs a tool: from the repository root."""
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=check, timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeResult:
    """One node's process of ``run_nodes``: exit status, output, and when it ended (seconds after the start)."""

    def __init__(self, returncode: int, stdout: str, stderr: str, seconds: float) -> None:
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds


def run_nodes(root, launcher: str, nodes: int, *args: str, timeout: float = 600) -> list[NodeResult]:
    """``rlhf-lightning fit --config configs/tiny.yaml RUN_ARGS args --trainer.num_nodes=nodes
    --trainer.devices=1`` as ``nodes`` machines would run it, all here, in ``root``: one process
    per node, started at once, given the node's rank as a multi-node launch gives it.
    ``launcher``: ``env`` (Lightning's own environment variables: MASTER_ADDR, MASTER_PORT,
    NODE_RANK, WORLD_SIZE) or ``torchrun`` (``torchrun --nnodes N --nproc-per-node 1 --node-rank r``)."""
    import time

    Path(root).mkdir(parents=True, exist_ok=True)
    port = free_port()
    cli_args = ["fit", "--config", str(CONFIGS / "tiny.yaml"), *RUN_ARGS, f"--trainer.num_nodes={nodes}", "--trainer.devices=1", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    procs, start = [], time.monotonic()
    for rank in range(nodes):
        if launcher == "env":
            command = [sys.executable, "-m", "rlhf_lightning.cli", *cli_args]
            node_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(rank), "WORLD_SIZE": str(nodes)}
        else:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc-per-node=1", f"--node-rank={rank}"]
            command += ["--master-addr=127.0.0.1", f"--master-port={port}", "-m", "rlhf_lightning.cli", *cli_args]
            node_env = env
        out, err = open(Path(root) / f"node{rank}.out", "w+"), open(Path(root) / f"node{rank}.err", "w+")  # noqa: SIM115
        procs.append((subprocess.Popen(command, cwd=root, env=node_env, stdout=out, stderr=err), out, err))
    ended: dict[int, float] = {}
    while len(ended) < nodes:  # each node's end time, whichever ends first
        for rank, (proc, _, _) in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.monotonic() - start
        if time.monotonic() - start > timeout:
            for rank, (proc, _, _) in enumerate(procs):
                if rank not in ended:
                    proc.kill()
                    proc.wait()
                    ended[rank] = time.monotonic() - start
        time.sleep(0.2)
    results = []
    for rank, (proc, out, err) in enumerate(procs):
        with out, err:
            out.seek(0)
            err.seek(0)
            results.append(NodeResult(proc.returncode, out.read(), err.read(), ended[rank]))
    return results


# configs/tiny.yaml for 6 iterations, a checkpoint every 2, a beta controller with state to restore.
RUN_ARGS = (
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=6",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    "--model.beta_controller=BandBeta",
    "--model.beta_controller.init_args.target=0.5",
    "--model.sampling.max_new_tokens=10",
    "--trainer.callbacks.every_n_iterations=2",
)


def run_cli(root, *extra: str) -> subprocess.CompletedProcess:
    """``rlhf-lightning fit --config configs/tiny.yaml`` with ``RUN_ARGS`` run in ``root`` (its default_root_dir)."""
    return cli(root, "fit", "--config", str(CONFIGS / "tiny.yaml"), *RUN_ARGS, *extra)


# Multi-process runs against one process: the global batch and the metrics compared.
GLOBAL_BATCH = 8
COMPARED = ("objective/reward", "objective/kl", "objective/kl_max", "objective/beta", "objective/entropy", "response/length", "value/loss")


def global_batch_run(root, devices: int, *extra: str) -> dict[str, list[float]]:
    """configs/tiny.yaml for 4 greedy iterations on ``devices`` processes (DDP above one) sharing
    :data:`GLOBAL_BATCH` prompts, one minibatch (with more, one process and two draw differently composed
    minibatches) and a reward the greedy answers earn from the start (so the policy really moves): each
    logged tag's values by iteration, to compare one process with two."""
    from tools.summarize_run import read_scalars

    result = run_cli(
        root,
        f"--trainer.devices={devices}",
        "--trainer.strategy=ddp" if devices > 1 else "--trainer.strategy=auto",
        f"--data.batch_size={GLOBAL_BATCH // devices}",
        "--trainer.limit_train_batches=4",
        "--model.sampling.do_sample=false",
        "--model.ppo.num_minibatches=1",
        "--model.reward_model.init_args.kwargs.chars=etaoinshrdlu",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    scalars = read_scalars(str(root / "lightning_logs" / "tiny" / "version_0"))
    return {tag: list(by_step.values()) for tag, by_step in scalars.items()}


def betas_by_iteration(lines: list[str]) -> dict[int, dict[int, float]]:
    """``{iteration: {rank: beta}}`` from the lines fault_callbacks.RecordBeta writes."""
    betas = {}
    for line in filter(None, lines):
        rank, iteration, beta = line.split()
        betas.setdefault(int(iteration), {})[int(rank)] = float(beta)
    return betas


def char_reward(chars: str = "e") -> CallableReward:
    return CallableReward(function="rlhf_lightning_plugins.rewards.toy:char_count", kwargs={"chars": chars})


TEACHER_SEED = 7  # a teacher for model.reference: the tiny model from another seed than the policy's 0
SHARPEN = 30.0  # the teacher's output layer times this: peaked, tens of nats per response from the near-uniform student


def response_logprobs(model, rollout) -> torch.Tensor:
    """log p(y_t) of each response token under ``model``, by a plain forward over the whole sequences: (batch, response_len)."""
    response_len = rollout.responses.shape[1]
    with torch.no_grad():
        logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits[:, -response_len - 1 : -1]
    return logprobs_of(logits.float(), rollout.responses) * rollout.response_mask


def save_tiny_teacher(folder, seed: int = TEACHER_SEED, tokenizer=None) -> str:
    """A tiny random Llama initialised from ``seed``, its output layer times :data:`SHARPEN`, and the character
    tokenizer (or ``tokenizer``), saved as a checkpoint folder (safetensors) for ``model.reference``."""
    from rlhf_lightning.models import char_tokenizer, load_causal_lm

    tokenizer = tokenizer or char_tokenizer()
    model = load_causal_lm("tiny", len(tokenizer), seed)
    with torch.no_grad():
        model.lm_head.weight *= SHARPEN
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def make_module(**overrides) -> PPORLHF:
    """A configured PPORLHF on the tiny model with the char-count reward; ``overrides`` are merged into
    the defaults field by field within a group (``ppo=dict(epochs=1)`` keeps the optimizer's settings;
    ``args.merge_settings``). Seeded first: the module
    draws its sampling seed from torch's at construction, which would otherwise be whatever the
    previous test left."""
    defaults = dict(
        policy="tiny", reward_model=char_reward(), sampling=dict(max_new_tokens=12), ppo=dict(epochs=2), optim=dict(lr=3e-3, critic_lr=3e-3)
    )
    seed_everything(0, verbose=False)
    module = PPORLHF(**args.merge_settings(defaults, overrides))
    module.configure_model()
    return module


class MetricsHistory(Callback):
    """Records the logged metrics after every training batch, and what ``training_step`` returned."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.outputs: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.outputs.append(outputs)

    def series(self, key: str) -> list[float]:
        return [row[key] for row in self.rows]


def fit(
    module: PPORLHF,
    tmp_path,
    iterations: int,
    batch_size: int = 8,
    seed: int = 0,
    callbacks=(),
    datamodule=None,
    ckpt_path=None,
    cpu_settings: Optional[CPUSettings] = None,
    **trainer_kwargs,
):
    """Run ``iterations`` PPO iterations on CPU, with ``cpu_settings`` applied as the command applies
    its ``cpu`` section; return (trainer, metrics history)."""
    seed_everything(seed, verbose=False)
    history = MetricsHistory()
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=iterations,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[history, *callbacks],
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    kwargs.update(trainer_kwargs)
    trainer = Trainer(**kwargs)
    if cpu_settings is not None:
        apply_cpu_settings(trainer, cpu_settings)
    trainer.fit(module, datamodule=datamodule or PromptDataModule(batch_size=batch_size), ckpt_path=ckpt_path)
    return trainer, history


# The terminal task's model that vLLM's CPU attention can serve (one head of 32; heads of 16 have no kernel).
ONE_HEAD = {"num_attention_heads": 1, "num_key_value_heads": 1}
# tools/studies/optimum_check/recipes.py's settings on the terminal task: 100 iterations of 48 responses, the learning rate decaying to 0.1x
EXACT_RUN = dict(lr=2e-3, critic_lr=2e-3, vf_coef=0.5, num_minibatches=2, log_samples_every_n_steps=0, lr_final=0.1, every=100)


def declared_optimum_run(iterations: int = 100, **overrides) -> tuple[dict[str, float], dict[str, float]]:
    """``optimum_check --heads 1 --temperature 0.7 --top-p 0.8 --beta 1`` (any engine by ``overrides``):
    the last exact row (gap, optimum_kl_to_ref, ...) and the final kept sets' report (``kept_report``)."""
    from rlhf_lightning.exact.tasks import TASKS
    from rlhf_lightning.exact.training import train
    from rlhf_lightning_plugins.advantage_estimators import GAE
    from rlhf_lightning_plugins.beta_controllers import FixedBeta

    settings = dict(temperature=0.7, top_p=0.8, tiny_config=ONE_HEAD, beta_controller=FixedBeta(1.0), advantage_estimator=GAE(lam=1.0))
    module, tracker = train(TASKS["terminal"], iterations, **{"batch_size": 48, **settings, **EXACT_RUN, **overrides})
    return tracker.last, module.kept_report()


def policy_batch():
    """A hand-made PPO batch: ``(logprobs, old_logprobs, advantages, mask, ratios)`` with the ratios
    r = exp(logprobs - old_logprobs) chosen directly (log pi_old = -1); cliprange 0.2 clips to [0.8, 1.2]."""
    ratios = torch.tensor([[1.5, 0.5, 1.1, 3.0], [0.5, 1.0, 2.0, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, -2.0, 5.0], [-1.0, 3.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    old_logprobs = torch.full((2, 4), -1.0, dtype=torch.float64)
    logprobs = (old_logprobs + ratios.log()).requires_grad_(True)
    return logprobs, old_logprobs, advantages, mask, ratios


def length_scores(n: int, payload: dict) -> tuple[int, Any]:
    """The correct scoring server: score = number of characters of each response."""
    return 200, {"scores": [len(r) for r in payload["responses"]]}


class Server:
    """A ThreadingHTTPServer whose answer to the n-th POST (from 0) is ``respond(n, payload)``.

    ``respond`` returns ``(status, body)`` or ``(status, body, delay_seconds)``; a dict body is
    sent as JSON, a str as-is. Every request's parsed payload and headers are recorded.
    """

    def __init__(self, respond: Callable[[int, dict], tuple]) -> None:
        self.respond = respond
        self.payloads: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()  # wakes handlers that are still delaying at teardown
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                payload = json.loads(raw.decode("utf-8"))
                with server.lock:
                    n = len(server.payloads)
                    server.payloads.append(payload)
                    server.headers.append(dict(self.headers))
                status, body, *delay = server.respond(n, payload)
                if delay:
                    server.stop.wait(delay[0])
                data = (json.dumps(body) if isinstance(body, (dict, list)) else body).encode("utf-8")
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout) and closed the socket
                    pass

            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.payloads)

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def command(tmp_path, monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """``rlhf-lightning fit --config configs/tiny.yaml <args>`` in this process, in ``tmp_path``, with
    loading a model an error (the checks must come first): its exit status and the last line it printed
    to stderr."""
    from rlhf_lightning.cli import main

    def no_models(self, empty=False):
        raise AssertionError("a model loaded before the check")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(PPORLHF, "load_policy", no_models)
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(CONFIGS / "tiny.yaml"), "--trainer.enable_progress_bar=false", *args])
    return stopped.value.code, capsys.readouterr().err.strip().splitlines()[-1]


class RecordWeights(Callback):
    """The policy's weights at the start of each iteration: version i is the weights after i updates."""

    def __init__(self) -> None:
        self.versions: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.versions.append({name: p.detach().clone() for name, p in pl_module.policy.named_parameters()})


class StopAfter(Callback):
    """Save a full checkpoint after iteration ``n`` and stop the run there."""

    def __init__(self, n: int, path) -> None:
        self.n, self.path = n, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.iteration == self.n:
            trainer.save_checkpoint(self.path, weights_only=False)
            trainer.should_stop = True


class Scripted:
    """A rollout engine that answers each turn with fixed ids per row and turn (log-probs -1 each) and records the
    contexts it was handed."""

    def __init__(self, turns: list[list[list[int]]]) -> None:
        self.turns, self.contexts = turns, []

    def stale(self, module) -> bool:
        return False

    def checked_sample(self, module, enc, seed) -> Samples:
        turn = len(self.contexts)
        self.contexts.append([ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)])
        rows = [list(r) for r in self.turns[turn][: len(enc["input_ids"])]]
        width = max(map(len, rows))
        new = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        return Samples(torch.cat([enc["input_ids"], new], dim=1), logprobs=torch.full(new.shape, -1.0))


class Echo(Environment):
    """Answers each turn with the ids ``answer`` (or the text ``text``), reward ``reward`` per turn; done after
    ``turns`` policy turns."""

    def __init__(self, answer=None, text=None, reward=None, turns: int = 2, **limits) -> None:
        super().__init__(**limits)
        self.answer, self.text, self.reward, self.turns = answer, text, reward, turns

    def reset(self, prompt, seed):
        return {"turn": 0, "seeds": seed}

    def step(self, state, turn_text, turn_ids):
        state["turn"] += 1
        done = state["turn"] >= self.turns
        return Step(
            observation=self.text, observation_ids=self.answer, reward=self.reward, done=done, info={"tool_call": True, "tool_ok": not done}
        )


class Slow(Environment):
    """Answers after ``seconds`` (writing the file ``stepping`` in the working folder when a step starts): an
    environment the run waits for."""

    def __init__(self, seconds: float = 600.0, **limits) -> None:
        super().__init__(**{"timeout_s": 600.0, **limits})
        self.seconds = seconds

    def reset(self, prompt, seed):
        return {}

    def step(self, state, turn_text, turn_ids):
        import time

        Path("stepping").touch()
        time.sleep(self.seconds)
        return Step(done=True)


# ---------------------------------------------------------------------- the exact lab's stale paths

# The recommended recipes the stale-sample lab tests follow (test_off_policy, test_inflight).
STALE_RECIPES = {
    "k3-loss": dict(kl_estimator="k3", kl_penalty="loss"),
    "k1-reward": dict(kl_estimator="k1", kl_penalty="reward"),
    "full-both": dict(kl_estimator="full", kl_penalty="both"),
}


def stale_objectives(recipe: str, staleness: int, correction: str, iterations: int = 6, **kwargs) -> list[float]:
    """J of each iteration of ``exact.training.expected_train`` on random:3 at beta 1, one AdamW step an iteration,
    the sampler ``staleness`` versions behind under ``correction`` (``kwargs``: in-flight settings and the like)."""
    from rlhf_lightning.exact.tasks import task_named
    from rlhf_lightning.exact.training import expected_train

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = expected_train(
            task_named("random:3"),
            iterations,
            1.0,
            every=1,
            staleness=staleness,
            correction=correction,
            ppo_epochs=1,
            num_minibatches=1,
            **STALE_RECIPES[recipe],
            **kwargs,
        )
    return [row["objective"] for row in rows]
