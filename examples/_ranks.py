"""The examples' collectives on their own tensors, and leaving the process group.

torch releases before 2.8 destroy a gloo process group holding the GIL while they join gloo's
worker threads, and a worker that drops the last reference to a Python tensor it sent takes the
GIL: a group destroyed just after a collective can deadlock at exit (torch 2.8 releases the GIL
there, pytorch/pytorch#154976). So every tensor sent through here stays referenced until
``leave()`` has destroyed the group.
"""
import pickle

import torch
import torch.distributed as dist

_sent = []


def sent(tensor):
    """``tensor``, referenced until ``leave()``: wrap a tensor given to a collective with it."""
    _sent.append(tensor)
    return tensor


def everyone(value):
    """``value`` (any picklable object) from every rank, in rank order: ``all_gather_object``
    on tensors that outlive the group."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    world = dist.get_world_size()
    size = sent(torch.tensor([data.numel()], device=device))
    sizes = [sent(torch.empty_like(size)) for _ in range(world)]
    dist.all_gather(sizes, size)
    mine = sent(torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8, device=device))
    mine[: data.numel()] = data
    out = [sent(torch.empty_like(mine)) for _ in range(world)]
    dist.all_gather(out, mine)
    return [pickle.loads(o[: int(s)].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]


def leave():
    """Destroy the process group once every rank is done with it."""
    dist.barrier()  # no collective in flight when the group goes away
    dist.destroy_process_group()
    _sent.clear()
