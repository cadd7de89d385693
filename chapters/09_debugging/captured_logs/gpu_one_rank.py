"""A world of one on NCCL (gpu_one_rank_nccl_info.log): NCCL_DEBUG=INFO's report of the
communicator, and the flight recorder's record of the collectives. On a GPU machine:

    NCCL_DEBUG=INFO TORCH_NCCL_TRACE_BUFFER_SIZE=100 torchrun --nproc-per-node 1 chapters/09_debugging/captured_logs/gpu_one_rank.py

(torch 2.11 says TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated in favour of TORCH_FR_BUFFER_SIZE;
either switches the flight recorder on.) The dump goes through a private function,
``torch._C._distributed_c10d._dump_nccl_trace``, so it may change between torch versions.
"""

import datetime
import pickle

import torch
import torch.distributed as dist

torch.cuda.set_device(0)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=20),
                        device_id=torch.device("cuda:0"))
x = torch.ones(1 << 20, device="cuda")
for _ in range(3):
    dist.all_reduce(x)
dist.broadcast(x, 0)
torch.cuda.synchronize()
try:
    trace = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
    print("flight recorder keys:", sorted(trace))
    for entry in trace.get("entries", [])[:6]:
        print({key: entry.get(key) for key in ("record_id", "profiling_name", "state",
                                               "input_sizes", "collective_seq_id",
                                               "process_group")})
except Exception as exc:  # noqa: BLE001 - a private API: say what happened
    print("flight recorder dump failed:", type(exc).__name__, exc)
print("nccl version", torch.cuda.nccl.version())
dist.destroy_process_group()
