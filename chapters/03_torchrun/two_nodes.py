"""Two "nodes" meet: each torchrun agent starts its workers, and all of them form one group.

    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 --master-addr 127.0.0.1 --master-port 29400 chapters/03_torchrun/two_nodes.py

Launch test: custom (two torchrun commands at once; see two_nodes_on_one_machine.sh, which picks a
free port and runs both, in either form, and tests/test_chapter_03_torchrun.py, which runs it).

On two real machines, run the command above on the head node (with its address instead of
127.0.0.1) and the same command with ``--node_rank 1`` on the other. Without ``--master-addr`` and
``--master-port`` torchrun uses 127.0.0.1:29500, so node 1 would look for the head on itself and
the two would never meet. The c10d form needs no node rank but one shared rendezvous endpoint and
id on every node; it numbers the agents by sorting their (host name, agent pid), not by arrival
(``_DistributedRendezvousOpExecutor._mark_rendezvous_complete``), so on one machine the agent with
the smaller pid becomes node 0:

    torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d --rdzv-endpoint HEAD:29400 --rdzv-id job42 chapters/03_torchrun/two_nodes.py

Every worker prints where it runs and the pid of its agent (the torchrun process that started
it, its parent); then an all-reduce of the ranks checks that all of them are in
one group (0 + 1 + ... + (N-1) on every rank).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

from ddpcourse.dist_env import process_group


def main() -> int:
    with process_group(timeout_s=30) as ctx:
        print(f"node {os.environ['GROUP_RANK']} of {os.environ['GROUP_WORLD_SIZE']} "
              f"(host {socket.gethostname()}), local rank {ctx.local_rank} -> global rank "
              f"{ctx.rank} of {ctx.world_size}, store {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']}, agent pid {os.getppid()}\n", end="", flush=True)
        total = torch.tensor([float(ctx.rank)], device=ctx.device)
        dist.all_reduce(total)
        expected = ctx.world_size * (ctx.world_size - 1) / 2
        ok = total.item() == expected
        ctx.print0(f"all-reduce of the ranks: {total.item():g} (expected {expected:g}) -> "
                   f"{'one group of ' + str(ctx.world_size) if ok else 'MISMATCH'}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
