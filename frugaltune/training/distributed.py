"""Data-parallel training over torch.distributed: gloo on CPU, NCCL on CUDA GPUs.

Library code used by `frugaltune.training.loop` and the `train` stage. Nothing here starts processes by itself:
`torchrun` does (the `train` stage re-launches itself under `torchrun --standalone` when
`train.distributed.nproc_per_node` > 1; on several hosts the user runs torchrun on each, see README "Scaling out").

How a step is shared: every rank builds the same length-grouped batch order from the seed, takes every
`world_size`-th sequence of each batch (batches are sorted by length, so the ranks get similar lengths), weighs
its loss by its share of the *global* batch, and the gradients are summed across ranks before clipping and the
optimizer step. The sum is exactly the gradient one process computes over the whole batch, so the run is the same
run at any world size (up to float summation order) and a checkpoint written at one world size resumes at another.

Why an explicit all-reduce of the flattened trainable gradients after the step's last backward rather than the
`DistributedDataParallel` wrapper: a rank may hold no sequence of a short last batch (DDP needs every rank in every
backward), LoRA with gradient checkpointing trips DDP's "marked ready twice" check without `static_graph`, and the
out-of-memory back-off re-runs a step with smaller chunks, which DDP's bucket hooks do not expect. What DDP would add
is overlapping communication with backward: on these CPU runs the adapters' gradients are a small fraction of the
weights and their all-reduce a small share of a step; full fine-tuning on GPUs is where DDP's overlap would pay, and
is left for when a GPU run shows it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_BYTES = 32 * 2**20  # all-reduce in buckets: one flat copy of every gradient would double their memory


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def shard(self, batch_index: list[int]) -> list[int]:
        """This rank's sequences of one batch: every size-th, so that each rank gets long and short ones."""
        return batch_index[self.rank::self.size]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64: token counts stay exact)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.cpu().tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (out of memory, a stop signal)."""
        return self.sum([float(flag)])[0] > 0 if self.distributed else flag

    def all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over ranks in place; a parameter without a gradient counts as zeros."""
        if not self.distributed:
            return
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            bucket.append(param)
            size += param.grad.numel() * param.grad.element_size()
            if size >= BUCKET_BYTES:
                _reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket)

    def broadcast_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Rank 0's values everywhere: every rank then starts from the same weights whatever its RNG did."""
        if not self.distributed:
            return
        with torch.no_grad():
            for param in params:
                dist.broadcast(param.data, src=0)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _reduce_bucket(bucket: list[torch.nn.Parameter]) -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in bucket])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for param in bucket:
        count = param.grad.numel()
        param.grad.copy_(flat[offset:offset + count].view_as(param.grad))
        offset += count


def launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(backend: str = "auto") -> World:
    """Join the process group torchrun describes in the environment; one process alone gets World() and no group."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return World()
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local_rank)


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_argv(nproc_per_node: int, module: str) -> list[str]:
    """`torchrun --standalone` on this host: a free port on loopback, no rendezvous server to run."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
            "--module", module]
