"""What ``train.py``'s DataLoader workers run: the noisy training set, and a watchdog for tests.

A module of its own, imported by its plain name: the workers start from a fork server
(``ddpcourse.dist_env.loader_workers_context``), so the dataset and ``worker_init_fn`` reach them
pickled, by module and name, and a worker can import ``_noisy_samples`` (its folder is on the
rank's ``sys.path``, which the workers get) where it could not import ``train.py`` under the
name another script gave it (``ch08_train``).
"""

from __future__ import annotations

import faulthandler

import torch
from torch.utils.data import Dataset, TensorDataset


class NoisySamples(Dataset):
    """The training samples with fresh Gaussian noise added at every fetch (an augmentation):
    drawn in whichever process fetches, a DataLoader worker or the rank itself."""

    def __init__(self, data: TensorDataset, noise: float):
        self.x, self.y = data.tensors
        self.noise = noise

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index] + self.noise * torch.randn(self.x.shape[1:]), self.y[index]


def report_if_stuck(seconds: float, worker_id: int) -> None:
    """A ``worker_init_fn`` for short runs (the tests, the lesson's table): a DataLoader worker
    still alive after ``seconds`` prints every thread's stack to stderr and exits, so the rank
    fails at once ("DataLoader worker ... exited unexpectedly") with the place it was stuck,
    instead of waiting for the process group's timeout. Off by default: in a long run a
    non-persistent worker lives for a whole epoch."""
    faulthandler.dump_traceback_later(seconds, exit=True)
