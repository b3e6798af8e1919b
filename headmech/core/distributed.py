"""Many processes with ``torch.distributed``: probe batches are sharded across ranks and
the per-head statistics are summed with ``all_reduce``.

Launch any command under ``torchrun`` (``torchrun --nproc-per-node 2 -m headmech classify
MODEL ...``; several nodes: ``--nnodes``, ``--node-rank`` and a rendezvous endpoint). Each
process joins the group from torchrun's environment (gloo on CPU, NCCL on CUDA), builds
the same probes from the same seed, streams only its share of the batches (batch ``i``
goes to rank ``i mod world``), and :func:`merge_stats` sums what every rank reduced. The
per-sequence sums behind the bootstrap intervals are placed at their global positions
before the sum, so every rank ends with exactly the single-process statistics (to
floating-point summation order) and the same intervals. Rank 0 alone writes files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from headmech.core.errors import HeadmechError
from headmech.core.stats import HeadStats

__all__ = ["gather_units", "init_from_env", "is_main", "merge_stats", "mine", "shard", "world"]


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the initialised process group; ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """True on rank 0 (and in a single process): the process that writes and prints."""
    return world()[0] == 0


def init_from_env(device: str | None = None) -> str | None:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1 in the environment):
    NCCL when CUDA is used, gloo otherwise. Returns the device this rank should use
    (``cuda:LOCAL_RANK`` when CUDA is available and no device was given)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    if device is None and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if not dist.is_initialized():
        cuda = device is not None and torch.device(device).type == "cuda"
        if device is not None and cuda:
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def _device() -> torch.device:
    """Where collective tensors live: the current CUDA device for NCCL, else CPU."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.to(_device())
    dist.all_reduce(t)
    return t.cpu()


def merge_stats(stats: HeadStats, sizes: Sequence[int]) -> HeadStats:
    """Sum every rank's statistics (``all_reduce``); per-sequence sums are placed at their
    global rows first, so the result equals a single process's.

    Args:
        stats: this rank's statistics, from the batches ``i`` with ``i mod world == rank``.
        sizes: the number of sequences of every batch of the probe, in order (all ranks).
    """
    if world()[1] == 1:
        return stats
    own = mine(len(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    out = HeadStats(stats.n_layers, stats.n_heads)
    for name in sorted(stats.sums):  # the same names on every rank: each ran a batch
        out.sums[name] = _all_reduce(stats.sums[name])
        out.counts[name] = _all_reduce(stats.counts[name])
    for name, rows in sorted(stats._units.items()):
        full_sums = torch.zeros(sum(sizes), stats.n_layers, stats.n_heads, dtype=torch.float64)
        full_counts = torch.zeros_like(full_sums)
        for la, layer in enumerate(rows):
            if not layer:
                continue
            for i, (t, c) in zip(own, layer, strict=True):  # one entry per batch
                full_sums[starts[i] : starts[i] + t.shape[0], la] = t
                full_counts[starts[i] : starts[i] + t.shape[0], la] = c
        full_sums, full_counts = _all_reduce(full_sums), _all_reduce(full_counts)
        out._units[name] = [
            [(full_sums[:, la], full_counts[:, la])] if rows[la] else []
            for la in range(stats.n_layers)
        ]
    return out


def mine(n_batches: int) -> list[int]:
    """The indices of the batches this rank runs (``i mod world == rank``); every rank
    needs one (a one-line error otherwise)."""
    rank, size = world()
    if n_batches < size:
        raise HeadmechError(
            f"{size} processes but only {n_batches} probe batches: use fewer processes "
            "or a smaller --batch-size"
        )
    return list(range(rank, n_batches, size))


def gather_units(parts: dict[int, torch.Tensor], n_batches: int) -> torch.Tensor:
    """Per-batch tensors ``[rows, units_i]`` computed on their ranks, concatenated along
    the units in batch order on every rank (two ``all_reduce`` calls: the unit counts,
    then the values at their global columns)."""
    if world()[1] == 1:
        return torch.cat([parts[i] for i in range(n_batches)], 1)
    widths = torch.zeros(n_batches, dtype=torch.float64)
    for i, t in parts.items():
        widths[i] = t.shape[1]
    widths = _all_reduce(widths).long()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), widths.cumsum(0)])
    rows = next(iter(parts.values())).shape[0]
    full = torch.zeros(rows, int(starts[-1]), dtype=torch.float64)
    for i, t in parts.items():
        full[:, int(starts[i]) : int(starts[i + 1])] = t.double().cpu()
    return _all_reduce(full)


def shard(items: Sequence[Any]) -> list[Any]:
    """This rank's share of ``items`` (item ``i`` goes to rank ``i mod world``)."""
    rank, size = world()
    return list(items[rank::size])


def gather_rows(parts: dict[int, torch.Tensor], n_batches: int) -> torch.Tensor:
    """Per-batch tensors ``[units_i, ...]`` (the same trailing shape on every rank),
    concatenated along the units in batch order on every rank."""
    first = next(iter(parts.values()))
    tail = tuple(first.shape[1:])
    flat = {i: t.double().cpu().reshape(t.shape[0], -1).T for i, t in parts.items()}
    return gather_units(flat, n_batches).T.reshape(-1, *tail)
