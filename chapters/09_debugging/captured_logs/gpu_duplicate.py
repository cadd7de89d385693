"""Two ranks on one GPU (gpu_duplicate_*.log); on a machine with one GPU, from the repository root:
    torchrun --nproc-per-node 2 chapters/09_debugging/captured_logs/gpu_duplicate.py set_device"""
import datetime, os, sys, torch, torch.distributed as dist  # noqa: E401 - lines 7 and 14 as logged
variant, rank = sys.argv[1], int(os.environ["RANK"])  # set_device or no_set_device
if variant == "set_device":
    torch.cuda.set_device(0)  # the bug: every rank picks GPU 0 instead of int(LOCAL_RANK)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=20), device_id=torch.device("cuda:0"))  # noqa: E501
else:  # the bug: no set_device at all, so every rank's "cuda" is GPU 0
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=20))
x = torch.ones(4, device="cuda") * (rank + 1)
# Both ranks' tensors are on one GPU, and NCCL refuses a communicator with two ranks on one
# device ("Duplicate GPU detected"): with device_id, at once, in init_process_group (line 7);
# without it, when the first collective creates the communicator:
dist.all_reduce(x)
torch.cuda.synchronize()
print(f"rank {rank}: {x.tolist()}", flush=True)
dist.destroy_process_group()
