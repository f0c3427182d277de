"""Asynchronous rollouts (``model.off_policy.max_staleness`` k > 0; docs/async.md): the sampler runs
ahead of the trainer with its own copy of the policy's weights.

A *version* is the number of PPO iterations done (each one update of the weights; a skipped iteration
leaves them as they were). The batch of iteration i is sampled from version max(0, i - k), with the
sampling seed of iteration i (``Sampler.seed``): so which responses a batch gets does not depend
on when, where or in which thread it was sampled. At the start of iteration i the trainer publishes its
weights as version i and hands the sampler the prompts of iteration i + k (read ahead from the data
loader, ``data.Lookahead``), which the sampler draws while iteration i scores and updates. A batch whose
prompts could not be read ahead (the first k of an epoch, a loader without look-ahead) is sampled when
it arrives, from the published version it needs, kept until then: the same responses, less overlap.

The sampler is a worker thread (``concurrent``) or the trainer's own thread (the in-line reference the
tests compare against): the same jobs in the same order on the same copy of the weights. What does not
depend on the weights being trained, the reward and a frozen reference's log-probs, the sampler computes
right after the draw (``model.off_policy.score_in_sampler``); pi_old and the critic run in the trainer when
the batch is consumed, on the weights of that moment: the PPO ratio is anchored at the current weights (the
proximal policy) and the sampler's log-probs are kept as the behaviour policy's (``Trajectory.sampler_logprobs``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from rlhf_lightning import fsdp2
from rlhf_lightning.args import OffPolicyArgs
from rlhf_lightning.checks import ConfigError, require
from rlhf_lightning.inflight import InflightDraw
from rlhf_lightning.models import full_tensor
from rlhf_lightning.networks import Networks
from rlhf_lightning.sampler import Drawn, Sampler

THREAD_NAME = "rlhf-lightning-sampler"
_POLL_S = 0.25  # the trainer waits for a batch in slices this long: a Ctrl+C is seen between them


class SamplerError(ConfigError):
    """The sampler failed or did not answer in time: one line naming ``model.off_policy`` and the cause."""


class SamplerInterrupted(SamplerError):
    """Ctrl+C while the trainer waited for the sampler: one line, and the shell's status for SIGINT (130)."""

    status = 130


class _ScoringFailed(Exception):
    """The sampler's thread drew the batch and failed scoring it (``score_in_sampler``): ``__cause__`` says why."""


def exit_process(status: int) -> NoReturn:
    """End the command with ``status`` once its one line is printed: ``sys.exit``, or, where the sampler's thread
    still runs (the run stopped while it drew, or it hangs), ``os._exit`` after flushing stdout and stderr. A
    thread inside torch when the interpreter finalises aborts the process after the message ("terminate called
    without an active exception", status 134), and waiting for it may be waiting for ever (a hung backend); what
    the run wrote is closed by then (the trainer's teardown finalises the loggers; checkpoints are whole files)."""
    if any(thread.name == THREAD_NAME and thread.is_alive() for thread in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def check_strategy(trainer, max_staleness: int) -> None:
    """At start-up, before any model loads: the strategies the sampler's copy of the weights serves: one process,
    DDP and FSDP2 (ModelParallelStrategy: each rank's sampler holds the whole policy, gathered when published);
    not FSDP version 1 nor DeepSpeed, whose sharded weights no published version gathers."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    strategy = trainer.strategy
    require(
        not isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)),
        "model.off_policy.max_staleness",
        f"0 under {type(strategy).__name__} (the sampler gathers the policy's weights under one process, DDP and FSDP2 "
        "(ModelParallelStrategy) only)",
        max_staleness,
    )


def needed_versions(versions, iteration: int, k: int, first_version: int, handed: dict[int, Any]) -> set[int]:
    """Which of the published ``versions`` a batch still to be handed over samples from, at ``iteration`` with
    staleness ``k``: batch j (iteration < j <= iteration + k, not in ``handed``) samples version
    max(first_version, j - k). Computed over the versions and the handed batches, never over the k batches (a k of
    10**9 is as cheap as 1): a version v > first_version serves batch v + k alone; first_version serves every
    j <= first_version + k, needed while one of them is not handed. So at most min(k, iterations so far) + 1
    versions are kept (docs/async.md)."""
    needed = {v for v in versions if first_version < v <= iteration < v + k and v + k not in handed}
    first_batches = first_version + k - iteration  # batches j > iteration that sample first_version
    if first_version in versions and first_batches > sum(iteration < j <= first_version + k for j in handed):
        needed.add(first_version)
    return needed


class _SamplerClosed(Exception):
    """The run stopped while the sampler waited for a version that will not be published (in-flight updates)."""


class _Done:
    """A job run in the trainer's thread: its result or its exception, as a Future holds them."""

    def __init__(self, job) -> None:
        self._result, self._error = None, None
        try:
            self._result = job()
        except Exception as err:  # re-raised by result(), as a worker's would be
            self._error = err

    def result(self, timeout: Optional[float] = None):
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return True


class _Later(_Done):
    """A job run in the trainer's thread when its result is first asked for: an in-line in-flight draw, which needs
    versions published after it is handed over (up to its iteration's i - 1, published by the time it is waited for)."""

    def __init__(self, job) -> None:
        self._job = job

    def result(self, timeout: Optional[float] = None):
        if self._job is not None:
            job, self._job = self._job, None
            super().__init__(job)
        return super().result(timeout)


def _work(jobs: queue.Queue) -> None:
    """The sampler's thread: run each ``(future, job)`` in order until ``None``."""
    while (item := jobs.get()) is not None:
        future, job = item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(job())
            except BaseException as err:  # the trainer re-raises it as one line (AsyncRollouts.wait)
                future.set_exception(err)


class AsyncRollouts:
    """The sampler that runs ahead with ``model.off_policy.max_staleness`` k > 0: the :class:`Sampler` it draws and
    scores with (on its own copy of the policy's weights), the versions published for batches still to be drawn, and
    the batches drawn ahead.

    Its inputs are explicit: the trainer's ``sampler`` (its networks hold the policy whose weights are published),
    the ``off_policy`` settings, whether the reference moves (then the trainer runs its pass), the step context the
    trainer's thread runs in (``step_context()``: the precision plugin's, thread-local), and ``concurrent``: draw in
    one worker thread (the run's default) or in the trainer's thread when a batch is handed over (the in-line path,
    the same numbers). ``skeleton``: under FSDP2, the policy's structure on the meta device, kept before sharding
    (``Networks.skeleton``), which the sampler's whole copy is made from.

    With in-flight updates (``off_policy.inflight_every`` > 0, inflight.py) a batch is drawn segment by segment, each
    segment on the version :func:`inflight.token_versions` names, which the sampler waits to be published (``_published``)."""

    def __init__(
        self,
        sampler: Sampler,
        off_policy: OffPolicyArgs,
        reference_moves: bool,
        step_context: Callable[[], Any] = contextlib.nullcontext,
        concurrent: bool = True,
        skeleton=None,
    ) -> None:
        self.trainer_sampler = sampler
        self.k = off_policy.max_staleness
        self.timeout_s = off_policy.sampler_timeout  # None: wait for ever
        self.score_in_sampler, self.reference_moves = off_policy.score_in_sampler, reference_moves
        self.step_context, self.concurrent, self.skeleton = step_context, concurrent, skeleton
        self.sampler: Optional[Sampler] = None  # the trainer's sampler over its own copy of the policy (built at the first draw)
        self.frozen: dict[str, Tensor] = {}  # the copy's frozen tensors as built (a LoRA base), restored before each draw
        self.versions: dict[int, dict[str, Tensor]] = {}  # published trainable weights by version, while a batch needs them
        self.steps: dict[int, int] = {}  # the optimizer steps (global_step) of each published version's weights
        self.first_version = 0  # the oldest version there is: 0, or the iteration a run resumed at without batches in flight
        self.jobs: dict[int, Any] = {}  # iteration -> Future (or _Done) of its Drawn
        self._queue: Optional[queue.Queue] = None  # the worker's jobs, once it runs
        self._thread: Optional[threading.Thread] = None
        self._abandoned = False  # the sampler failed, hung or was interrupted: close() does not wait for it
        self.handed_ahead = 0  # batches handed to the sampler before their iteration (read ahead)
        self.inflight = InflightDraw(off_policy.inflight_every, self.k) if off_policy.inflight_every else None
        require(
            self.inflight is None or sampler.episodes is None,
            "model.off_policy.inflight_every",
            "0 with model.environment (an episode is drawn turn by turn, on one version)",
            off_policy.inflight_every,
        )
        self._published = threading.Condition()  # guards versions and steps; notified at each publish (in-flight draws wait on it)
        self._closed = False  # the run stopped: an in-flight draw waiting for a version gives up
        self._waited = 0.0  # the sampler's seconds waiting for versions in its draw under way (not its rollout time)

    # ------------------------------------------------------------------ the trainer's side
    def draw(self, prompts: list[str], upcoming: list[list[str]], iteration: int, global_step: int, timer) -> Drawn:
        """The batch of iteration i = ``iteration`` on ``prompts`` (repeated rows), drawn from version
        max(first_version, i - k): publish version i (``global_step`` optimizer steps), hand the sampler the batches
        of ``upcoming`` (the prompts of iterations i + 1, i + 2, ..., as far as read ahead) that version i or an
        earlier one samples, and wait for batch i (``timing/sampler_wait_s``)."""
        i = iteration
        self.publish(i, global_step)
        if i not in self.jobs:  # not read ahead: drawn now, from the version it needs
            self.submit(i, prompts)
        for ahead, rows in enumerate(upcoming[: self.k], start=1):
            if i + ahead not in self.jobs:
                self.submit(i + ahead, rows)
                self.handed_ahead += 1
        with timer("sampler_wait"):
            drawn = self.wait(i)
        self.prune(i)
        if drawn.prompts != prompts:
            raise SamplerError(
                f"model.off_policy.max_staleness {self.k}: the batch drawn ahead for iteration {i} has other prompts than the "
                "data loader gives it (the training prompts' order changed since it was read ahead, or since the checkpoint)"
            )
        timer.seconds["rollout"] = timer.seconds.get("rollout", 0.0) + drawn.seconds
        if drawn.scoring_seconds:
            timer.seconds["sampler_score"] = drawn.scoring_seconds
        return drawn

    def publish(self, version: int, global_step: int) -> None:
        """Keep the policy's trainable weights as ``version`` (a LoRA policy's: its adapter; the frozen base is
        the sampler copy's own): the sampler reads them while the trainer updates its own."""
        if version not in self.versions:  # FSDP2: each trainable tensor gathered whole (a collective, on every rank alike)
            whole = lambda p: p.full_tensor() if isinstance(p, DTensor) else p.clone()  # a gathered DTensor is a new tensor
            weights = {name: whole(p.detach()) for name, p in self._trainable(self.trainer_sampler.networks.policy)}
            with self._published:
                self.versions[version], self.steps[version] = weights, global_step
                self._published.notify_all()

    def submit(self, iteration: int, prompts: list[str]) -> None:
        """Hand the sampler iteration ``iteration``'s batch on ``prompts``, to draw from version max(first_version, iteration - k)."""
        sampler = self._sampler()  # built here, in the trainer's thread, from weights no one else is changing
        version, prompts = max(self.first_version, iteration - self.k), list(prompts)
        enc = sampler.encode(prompts)  # in the trainer's thread: a fast tokenizer's padding state is not thread-safe
        if self.inflight is None:
            weights, view = self.versions[version], sampler.view(self.steps[version])
            draw = lambda: self._load(view.networks, self.frozen, weights) or view.draw(prompts, iteration, version, enc=enc)
        else:  # segment by segment, each on its version, waited for as the trainer publishes it
            draw = lambda: self.inflight.draw(self._version_view, prompts, enc, iteration, self.first_version)
        job = lambda: self._sample(sampler, draw)
        if not self.concurrent:
            self.jobs[iteration] = _Done(job) if self.inflight is None else _Later(job)
            return
        if self._queue is None:
            self._queue = queue.Queue()
            # a daemon: a sampler that hangs must not keep the process alive once the trainer has stopped
            self._thread = threading.Thread(target=_work, args=(self._queue,), name=THREAD_NAME, daemon=True)
            self._thread.start()
        future = concurrent.futures.Future()
        self._queue.put((future, job))
        self.jobs[iteration] = future

    def wait(self, iteration: int) -> Drawn:
        """Batch ``iteration``, at most ``sampler_timeout_s`` later (or for ever); a sampler that raised or hangs,
        or a Ctrl+C meanwhile, is one line, and the sampler is abandoned (``close`` and ``exit_process``)."""
        job = self.jobs.pop(iteration)
        try:
            return self._result(job)
        except SamplerError:
            raise
        except BaseException as err:
            self._abandon()
            raise self._error(iteration, job, err) from (None if isinstance(err, (KeyboardInterrupt, TimeoutError)) else err)

    def _result(self, job) -> Drawn:
        """``job``'s result within ``timeout_s`` (None: for ever), waited for in slices of ``_POLL_S``."""
        deadline = math.inf if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return job.result(timeout=max(0.0, min(_POLL_S, left)))
            except concurrent.futures.TimeoutError:
                if job.done() or left <= _POLL_S:  # the job's own TimeoutError, or the deadline
                    raise

    def _error(self, iteration: int, job, err: BaseException) -> SamplerError:
        """The one line for ``err``, which stopped the wait for batch ``iteration``."""
        k, timeout = self.k, "never" if self.timeout_s is None else self.timeout_s
        if isinstance(err, KeyboardInterrupt):
            return SamplerInterrupted(
                f"stopped by Ctrl+C while waiting for the sampler's batch of iteration {iteration} (model.off_policy.max_staleness "
                f"{k}, model.off_policy.sampler_timeout_s {timeout}); the iteration under way is not saved"
            )
        if isinstance(err, TimeoutError) and not job.done():
            return SamplerError(
                f"model.off_policy.sampler_timeout_s {timeout}: the sampler drew no batch for iteration {iteration} in that time "
                f"(model.off_policy.max_staleness {k}); raise the timeout if sampling one batch takes longer, or never to wait for ever"
            )
        if isinstance(err, _ScoringFailed):
            cause = err.__cause__
            return SamplerError(
                f"model.off_policy.score_in_sampler true: the sampler's thread failed scoring the batch of iteration {iteration} "
                f"(model.off_policy.max_staleness {k}): {type(cause).__name__}: {cause}; a reward backend that runs only in the "
                "trainer's thread needs model.off_policy.score_in_sampler false"
            )
        return SamplerError(
            f"model.off_policy.max_staleness {k}: the sampler failed drawing the batch of iteration {iteration}: {type(err).__name__}: {err}"
        )

    def _abandon(self) -> None:
        """Stop handing the sampler batches: those queued are dropped, the draw in flight is not waited for."""
        self._abandoned = True
        self._close_versions()
        for job in self.jobs.values():
            job.cancel()
        if self._queue is not None:
            self._queue.put(None)

    def prune(self, iteration: int) -> None:
        """Drop the published versions no batch still to be handed over samples from (:func:`needed_versions`); with
        in-flight updates, those no batch still to be trained on may take (batch j > i takes versions >= j - k)."""
        with self._published:
            if self.inflight is None:
                needed = needed_versions(self.versions, iteration, self.k, self.first_version, self.jobs)
            else:
                needed = {v for v in self.versions if v > iteration - self.k}
            for version in set(self.versions) - needed:
                del self.versions[version], self.steps[version]

    def _close_versions(self) -> None:
        """No version will be published any more: a draw waiting for one stops (``_SamplerClosed``)."""
        with self._published:
            self._closed = True
            self._published.notify_all()

    def close(self) -> None:
        """Stop the worker after its job in flight, dropping the batches not yet drawn (the end of fit), and wait
        for it (at most ``sampler_timeout_s``; not for a sampler already found hung): a thread still running torch
        at the interpreter's exit aborts the process ("terminate called without an active exception")."""
        for job in self.jobs.values():
            job.cancel()
        self._close_versions()
        if self._queue is not None:
            self._queue.put(None)
            if not self._abandoned:
                self._thread.join(self.timeout_s)
            self._queue = self._thread = None
        self.jobs.clear()

    # ------------------------------------------------------------------ the sampler's side
    def _sample(self, view: Sampler, draw: Callable[[], Drawn]) -> Drawn:
        """``draw`` (which loads its version's weights: every tensor set before each draw, the version's and a LoRA
        base as built, since merging the adapter for a draw and unmerging it moves the base by rounding, so a draw
        depends on its versions alone), then the scoring, on the sampler's copy (``view``)."""
        start, context = time.perf_counter(), self.step_context if self.concurrent else contextlib.nullcontext
        self._waited = 0.0
        with context():
            drawn = draw()
        drawn.seconds = time.perf_counter() - start - self._waited  # its own time, not its waits for versions
        if self.score_in_sampler:
            start = time.perf_counter()
            try:
                with context(), torch.no_grad():
                    if self.reference_in_sampler:
                        self._load(view.networks, self.frozen)  # a LoRA base as built (the draw's merge and unmerge round it)
                    view.score_drawn(drawn, self.reference_in_sampler)
            except Exception as err:  # named by score_in_sampler (a backend bound to the trainer's thread)
                raise _ScoringFailed() from err
            drawn.scoring_seconds = time.perf_counter() - start
        return drawn

    def _version_view(self, version: int) -> Sampler:
        """The sampler's copy on ``version``'s weights (its ``global_step`` the version's), once the trainer has
        published it: an in-flight draw's next segment. Its wait is not the draw's time (``_waited``)."""
        start = time.perf_counter()
        with self._published:
            while version not in self.versions:
                if self._closed:
                    raise _SamplerClosed(f"the run stopped before version {version} was published")
                self._published.wait(_POLL_S)
            weights, steps = self.versions[version], self.steps[version]
        self._waited += time.perf_counter() - start
        self._load(self.sampler.networks, self.frozen, weights)
        return self.sampler.view(steps)

    @staticmethod
    def _load(networks: Networks, *tensors: dict[str, Tensor]) -> None:
        """Copy each of ``tensors`` (name -> tensor) into the sampler copy's parameters of those names."""
        params = dict(networks.policy.named_parameters())
        with torch.no_grad():
            for named in filter(None, tensors):
                torch._foreach_copy_([params[name] for name in named], list(named.values()))

    def _sampler(self) -> Sampler:
        """The sampler over a copy of the policy alone (no critic, no reference but a frozen one it may run), run as the
        trainer's is; built in the trainer's thread, where the rollout engine starts what it needs (``RolloutEngine.start``)."""
        if self.sampler is None:
            trainer_sampler = self.trainer_sampler
            trainer = trainer_sampler.networks
            if self.skeleton is None:
                policy = copy.deepcopy(trainer.policy)
            else:  # FSDP2: the whole policy, gathered (a collective: every rank draws its first batch at the same iteration)
                whole = {name: full_tensor(t) for name, t in trainer.policy.state_dict().items()}
                policy, self.skeleton = self.skeleton, None
                policy.load_state_dict(whole, assign=True)
            self.frozen = {name: p.detach().clone() for name, p in policy.named_parameters() if not p.requires_grad}
            networks = Networks(
                policy,
                None,
                trainer.ref_model if self.reference_in_sampler else None,
                None,
                sampling=trainer.sampling,
                shared_prompts=trainer.shared_prompts,
                lora=trainer.lora,
                reference_moves=False,
                foreign_reference=False,
                eos_token_id=trainer.eos_token_id,
                reduce=lambda t, op="sum": t,
            )
            self.sampler = trainer_sampler.view(trainer_sampler.global_step, networks=networks)
            trainer_sampler.engine.start(self.sampler)
        return self.sampler

    @property
    def reference_in_sampler(self) -> bool:
        """Whether the sampler runs the reference's pass: it is frozen (``model.reference_update`` none) and
        ``score_in_sampler``. Its model there: the trainer's separate one (read, never written, by both threads), or
        under LoRA the sampler copy's own weights with the adapter disabled."""
        ref_model = self.trainer_sampler.networks.ref_model
        sharded = ref_model is not None and fsdp2.is_sharded(ref_model)  # its passes gather
        return self.score_in_sampler and not self.reference_moves and not sharded

    @staticmethod
    def _trainable(policy) -> list[tuple[str, Tensor]]:
        return [(name, p) for name, p in policy.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to go on as if never stopped: the batches in flight (drawn ahead; waited for
        here), the versions the batches not yet handed over will be drawn from, and the oldest version. With in-flight
        updates, the batches whose every version is published (by the schedule, whatever the timing); one that needs a
        version still to come is not saved, and the resumed run redraws it from its seed and versions, as this one does."""
        with self._published:
            versions, steps = dict(self.versions), dict(self.steps)
        newest = max(versions, default=self.first_version)
        length = self.trainer_sampler.sampling.max_new_tokens
        ready = [j for j in sorted(self.jobs) if self.inflight is None or self.inflight.newest(j, length, self.first_version) <= newest]
        drawn = {j: self.wait(j) for j in ready}
        self.jobs.update({j: _Done(lambda d=d: d) for j, d in drawn.items()})
        return {
            "max_staleness": self.k,
            "inflight_every": 0 if self.inflight is None else self.inflight.every,
            "first_version": self.first_version,
            "drawn": [d.state_dict() for d in drawn.values()],
            "versions": {v: {n: t.cpu() for n, t in w.items()} for v, w in versions.items()},
            "steps": steps,
        }

    def load_state_dict(self, state: Optional[dict[str, Any]], iteration: int) -> Optional[str]:
        """Resume at ``iteration`` from a checkpoint's ``state`` (None: one of the synchronous loop). Returns why
        the batches in flight were not resumed (another max_staleness, none saved), or None when they were: then
        the sampler starts afresh from the checkpoint's weights, as a run starts from its first."""
        every = 0 if self.inflight is None else self.inflight.every
        if state is None or state["max_staleness"] != self.k or state.get("inflight_every", 0) != every:
            self.jobs, self.versions, self.steps, self.first_version = {}, {}, {}, iteration
            if state is None:
                return "the checkpoint holds no batches in flight (written with model.off_policy.max_staleness 0)"
            if state["max_staleness"] != self.k:
                return f"the checkpoint's batches in flight were drawn for model.off_policy.max_staleness {state['max_staleness']}"
            return f"the checkpoint's batches in flight were drawn for model.off_policy.inflight_every {state.get('inflight_every', 0)}"
        device = self.trainer_sampler.device
        self.jobs = {d["iteration"]: _Done(lambda d=d: Drawn.from_state(d, device)) for d in state["drawn"]}
        self.versions = {int(v): {n: t.to(device) for n, t in w.items()} for v, w in state["versions"].items()}
        self.steps = {int(v): step for v, step in state["steps"].items()}
        self.first_version = state["first_version"]
        return None
