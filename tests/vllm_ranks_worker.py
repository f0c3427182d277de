"""One rank of ``test_two_ranks_sampling_with_vllm_reach_the_declared_optimum`` (run by torchrun, 2
processes): ``declared_optimum_run``'s vLLM settings on the terminal task under DDP, each rank
sampling 24 of the iteration's 48 responses with its own engine (both ranks hold every prompt: the
task's dataloader, not split). Rank 0 prints ``RESULT [last exact row, kept report]`` as JSON."""

import json
import sys

from lightning.pytorch.strategies import DDPStrategy

from rlhf_lightning_plugins.rollout_engines import VLLMEngine

from helpers import declared_optimum_run

if __name__ == "__main__":
    ddp = dict(devices=2, strategy=DDPStrategy(), use_distributed_sampler=False)
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0  # the sampling seed (exact.training.train's)
    engine = sys.argv[2] if len(sys.argv) > 2 else "vllm"
    iterations = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    last, kept = declared_optimum_run(
        rollout_engine=VLLMEngine(kv_cache_gib=0.125) if engine == "vllm" else engine,
        seed=seed,
        iterations=iterations,
        old_logprobs="forward",
        rollout_correction="tis",
        top_p=0.9,
        batch_size=24,
        trainer_options=ddp,
    )
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print("RESULT " + json.dumps([last, kept]), flush=True)
