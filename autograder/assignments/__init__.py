"""One module per exercise notebook; each defines ASSIGNMENT, NOTEBOOK, SETUP and cells().

An assignment (a folder of exercises/) may hold several notebooks: 05_allreduce has two.
"""

from autograder.assignments import (
    ch00_setup,
    ch01_why_ddp,
    ch02_dp_ddp_fsdp,
    ch03_torchrun,
    ch04_process_groups,
    ch05_allreduce,
    ch05_bucketed_ddp,
    ch06_data_loading,
)

ALL = [ch00_setup, ch01_why_ddp, ch02_dp_ddp_fsdp, ch03_torchrun, ch04_process_groups,
       ch05_allreduce, ch05_bucketed_ddp, ch06_data_loading]
