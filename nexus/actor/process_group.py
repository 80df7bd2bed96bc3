"""The actor group's torch.distributed process group: one per actor-rank process, formed once.

* **World of 1** (the default, and every unit test): an in-memory ``HashStore``, so no TCP store listens
  anywhere; under torchrun or the deepspeed launcher (``WORLD_SIZE`` > 1 in the environment) their
  variables keep control.
* **N ranks** (``actor_ranks = N``): the control plane passes each rank its rank, the world size, its local
  rank (its device index on its host) and a :class:`~nexus.wire.messages.Rendezvous`: rank 0's TCP store,
  listening on a socket that rank 0's worker bound on its own address beforehand
  (``nexus.worker.plugin.open_rendezvous``), so nothing binds a wildcard address and no port is raced for.

Backend: gloo on CPU (its device bound to the interface of the rank's own address), nccl on CUDA. A
process belongs to one group for its lifetime: a group that lost a rank is rebuilt on restarted processes
(a surviving rank's group is broken), so :func:`ensure_distributed` refuses to join a second one.

Collectives of the tenant slots go through :func:`gather_objects`; every rank must issue them for the
same tenant in the same order (the control plane runs one actor-group call at a time).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from nexus.wire.messages import Rendezvous

if not torch.cuda.is_available():
    # Skip DeepSpeed's accelerator probing (and its "unable to detect a GPU" warning) on CPU machines.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402  (must see DS_ACCELERATOR)
from deepspeed.accelerator import get_accelerator  # noqa: E402

# How long a collective (and the rendezvous) waits for the other ranks: a rank that died is seen at once
# (its sockets close), this bounds a rank that hangs. The control plane rebuilds the group either way.
COLLECTIVE_TIMEOUT_S = 300.0

_lock = threading.Lock()
_joined: Rendezvous | None = None  # the group this process belongs to (None: a world of 1)
_store: Any = None  # rank 0's TCP store: kept alive with the process group


def _quiet_deepspeed() -> None:
    # DeepSpeed logs its whole config at INFO on every initialize(); one engine per tenant makes that loud.
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor, which DeepSpeed 0.19.8
    # calls on every step.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.",
                            category=FutureWarning)


def _interface_of(host: str) -> str | None:
    """The network interface holding ``host`` (gloo binds its device to one interface)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == host for a in addrs):
            return name
    return None


def ensure_distributed(host: str = "127.0.0.1", rank: int = 0, world_size: int = 1,
                       rendezvous: Rendezvous | None = None, local_rank: int = 0,
                       listen_fd: int | None = None) -> None:
    """Join this process to its actor group once (idempotent, thread-safe); ``host``: this rank's own address.

    ``rendezvous`` None: a world of 1 (or a launcher's). Otherwise rank ``rank`` of ``world_size``; rank 0
    passes ``listen_fd``, a socket listening on its own address
    (``nexus.worker.plugin.open_rendezvous``). ``LOCAL_RANK`` is set because DeepSpeed's
    engine reads it (the device of this rank on its host)."""
    global _joined, _store
    _quiet_deepspeed()
    with _lock:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if rendezvous is not None and rendezvous != _joined:
                raise RuntimeError(f"this process is already rank {torch.distributed.get_rank()} of a group of "
                                   f"{torch.distributed.get_world_size()} (epoch "
                                   f"{_joined.epoch if _joined else '-'}); a new group needs a fresh process")
            if deepspeed.comm.is_initialized():
                return
        accel = get_accelerator()
        backend = accel.communication_backend_name()
        if not torch.distributed.is_initialized():
            iface = _interface_of(host)
            if iface is not None:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
                os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
            if rendezvous is not None:
                _init_group(backend, rank, world_size, rendezvous, local_rank, listen_fd)
                _joined = rendezvous
            else:
                for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", host)):
                    os.environ.setdefault(key, value)
                if os.environ["WORLD_SIZE"] == "1":
                    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0,
                                                         world_size=1)
                elif "MASTER_PORT" not in os.environ:
                    os.environ["MASTER_PORT"] = str(_free_port(host))
        if accel.device_name() == "cpu":
            # The shm comm op would be JIT-compiled (minutes of g++); it only serves
            # inference_all_reduce, ZeRO's collectives go through gloo anyway.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        else:
            accel.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed(dist_backend=backend)


def _init_group(backend: str, rank: int, world_size: int, rv: Rendezvous, local_rank: int,
                listen_fd: int | None) -> None:
    global _store
    if world_size != rv.world_size or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size} does not fit the rendezvous for {rv.world_size} ranks")
    if rank == 0 and listen_fd is None:
        raise ValueError("rank 0 serves the rendezvous: it needs its listening socket (open_rendezvous)")
    os.environ["LOCAL_RANK"] = str(local_rank)
    if backend == "nccl":
        get_accelerator().set_device(local_rank)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    _store = torch.distributed.TCPStore(rv.host, rv.port, world_size, rank == 0, timeout,
                                        master_listen_fd=listen_fd if rank == 0 else None)
    torch.distributed.init_process_group(backend, store=_store, rank=rank, world_size=world_size, timeout=timeout)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def world() -> tuple[int, int]:
    """(rank, world size) of this process's group."""
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective; pickled), in rank order; ``[obj]`` in a world of 1."""
    if torch.distributed.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def portable(error: BaseException | None) -> BaseException | None:
    """An exception that survives pickling to the other ranks (else a RuntimeError with its text)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def agreed_error(own: BaseException | None, outcomes: Sequence[BaseException | None]) -> BaseException | None:
    """The error every rank raises after comparing outcomes: its own if it failed, else the first rank's."""
    return own if own is not None else next((e for e in outcomes if e is not None), None)


def weighted(parts: Sequence[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Per-rank means of a batch's shards combined into the batch's mean: ``sum(share * value)`` (a rank
    with share 0 computed a stand-in row and adds nothing)."""
    out: dict[str, float] = {}
    for stats, share in parts:
        if share <= 0:
            continue
        for k, v in stats.items():
            out[k] = out.get(k, 0.0) + share * float(v)
    return out
