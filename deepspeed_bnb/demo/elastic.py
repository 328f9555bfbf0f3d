"""What a training script needs to survive a changing number of ranks: a batch plan for any world size, data order as a
function of the global step, a held-out set that is the same at every size, a checkpoint cadence, and an event log.

With these, a run restarted by torchrun's elastic agent at another world size (a node lost or back) trains exactly
the global batches it would have trained, sees the same validation set, and the log tells what happened when.
"""

import json
import os
import time
from typing import Optional, Set, Tuple

import torch
from deepspeed import comm as dist


def batch_plan(global_batch: int, world: int, max_micro: int) -> Tuple[int, int]:
    """(micro-batch per rank, gradient-accumulation steps) giving exactly `global_batch` sequences per optimizer step
    on `world` ranks, the largest micro-batch up to `max_micro`; ValueError if `world` does not divide it."""
    if global_batch % world:
        raise ValueError(f"the global batch of {global_batch} sequences cannot be split evenly over {world} ranks "
                         f"(each rank takes the same number): run on a world size that divides {global_batch}, or "
                         f"pick a --global_batch that every world size you expect divides (e.g. a multiple of "
                         f"{world * max(1, global_batch // world)}).")
    per_rank = global_batch // world
    for accumulation in range(1, per_rank + 1):
        if per_rank % accumulation == 0 and per_rank // accumulation <= max_micro:
            return per_rank // accumulation, accumulation
    raise AssertionError("unreachable: accumulation == per_rank gives a micro-batch of 1")


def step_windows(length: int, context: int, global_batch: int, step: int, seed: int) -> torch.Tensor:
    """Start offsets of the `global_batch` training windows of global step `step`: the same at every world size."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, length - context - 1, (global_batch,), generator=generator)


def rank_rows(starts: torch.Tensor, micro: int, accumulation_step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's windows for one micro-step: the global batch is dealt out micro-step by micro-step, rank by rank."""
    first = (accumulation_step * world + rank) * micro
    return starts[first:first + micro]


def windows(data: torch.Tensor, starts: torch.Tensor, context: int):
    x = torch.stack([data[s:s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + context] for s in starts.tolist()])
    return x, y


class HeldOut:
    """`chunks` fixed chunks of `chunk` validation windows. Chunk k is evaluated by rank k % world as one batch, so
    each chunk's loss has the same value at any world size; the ranks' sums are joined per chunk (one contributor per
    element, so the all-reduce adds zeros) and added in chunk order: the same number at every world size."""

    def __init__(self, data: torch.Tensor, context: int, chunks: int = 8, chunk: int = 8, seed: int = 12345):
        generator = torch.Generator().manual_seed(seed)
        self.data, self.context, self.chunk = data, context, chunk
        self.starts = torch.randint(0, len(data) - context - 1, (chunks * chunk,), generator=generator)
        self.chunks = chunks

    @torch.no_grad()
    def loss(self, engine) -> float:
        """Mean next-byte loss (nats) over every held-out window."""
        rank, world = dist.get_rank(), dist.get_world_size()
        sums = torch.zeros(self.chunks, dtype=torch.float64)
        was_training = engine.training
        engine.eval()
        rounds = -(-self.chunks // world)  # every rank runs as many forwards (ZeRO-3 gathers weights in each)
        for k in range(rank, rounds * world, world):
            x, y = windows(self.data, self.starts[(k % self.chunks) * self.chunk:][:self.chunk], self.context)
            loss = engine(x, y).double() * x.numel()
            if k < self.chunks:
                sums[k] = loss
        if was_training:
            engine.train()
        dist.all_reduce(sums)
        total = 0.0
        for value in sums.tolist():  # a fixed order
            total += value
        return total / (self.chunks * self.chunk * self.context)


class SaveCadence:
    """Save every `every` steps and/or every `seconds` seconds of training; the time rule is decided by rank 0 and
    shared, so that every rank saves at the same step."""

    def __init__(self, every: int = 0, seconds: float = 0.0):
        self.every, self.seconds, self.last = every, seconds, time.monotonic()

    def due(self, step: int) -> bool:
        by_step = bool(self.every) and step % self.every == 0
        flag = torch.tensor([1 if by_step or (self.seconds and time.monotonic() - self.last >= self.seconds) else 0])
        if self.seconds:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def saved(self) -> None:
        self.last = time.monotonic()


def parse_holds(specs) -> Set[Tuple[int, int]]:
    """{(step, world size)} from STEP@WORLD strings (train.py --hold_at)."""
    holds = set()
    for spec in specs:
        step, sep, world = spec.partition("@")
        if not (sep and step.isdigit() and world.isdigit() and int(world) > 0):
            raise ValueError(f"--hold_at {spec!r}: expected STEP@WORLD, e.g. 7@2")
        holds.add((int(step), int(world)))
    return holds


def hold_here(holds: Set[Tuple[int, int]], step: int, world: int, events: "Events", poll_seconds: float = 0.2) -> None:
    """At a step boundary (the step's checkpoint, if one was due, complete): if (step, world) is one of `holds`, log a
    'hold' event and wait there for the job to change size; then this never returns. A collective every
    `poll_seconds` fails once a peer is gone (the process exits with that error and the elastic agent restarts the
    survivors at the smaller size); when a node joins, the agent stops the workers itself. Either way the run stops
    between steps, so a failure triggered on this event loses exactly the steps since the last checkpoint, however
    fast the machine runs."""
    if (step, world) not in holds:
        return
    events.log("hold", step=step, world=world)
    while True:
        dist.barrier()
        time.sleep(poll_seconds)


class Events:
    """One JSON object per line (rank 0 only): what the run did, when, at which world size and step."""

    def __init__(self, path: Optional[str]):
        self.path = path if dist.get_rank() == 0 else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def log(self, event: str, **fields) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"t": round(time.time(), 3), "event": event, "pid": os.getpid(), **fields}) + "\n")
