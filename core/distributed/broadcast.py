"""Broadcasting a picklable Python object from rank 0 over a gloo (host) group."""

from __future__ import annotations

import pickle
from typing import Any

import torch


def broadcast_object(obj: Any, rank: int, group: Any, src: int = 0) -> Any:
    """Rank `src` sends `obj`; every other rank returns the object it received.

    Two broadcasts: the pickled size ([1] int64), then the bytes ([size] uint8). The group must be
    a gloo group (the tensors stay on the host).
    """
    import torch.distributed as dist

    if rank == src:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=src, group=group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src, group=group)
        return obj
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return pickle.loads(buffer.numpy().tobytes())
