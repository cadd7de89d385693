"""Hidden checks for chapter 09's wrong_numbers: 3 and 4 ranks, data sets one sample short of and
one sample past a multiple of the world size (DistributedSampler pads 1, or world_size - 1,
samples), other batch sizes and seeds, more epochs, accumulation_steps of 1 and of 3 with a
shorter last group, SGD with momentum. Every situation runs the visible module's Cases (passed as
data), so it runs only in the trusted grader, with the communication counted by its broker."""

from __future__ import annotations

from ddpcourse.grading.exercises.wrong_numbers import (ACCURACY, EPOCHS, accumulation_situation,
                                                       accuracy_situation, epochs_situation,
                                                       run_accumulation, run_lab)

ACCURACY_SITUATIONS = {  # world_size: [...]; sizes k * world_size - 1 and k * world_size + 1
    3: [accuracy_situation(8, 3, seed=2), accuracy_situation(10, 2, seed=3)],
    4: [accuracy_situation(11, 2, seed=4), accuracy_situation(13, 5, seed=5)],
}
EPOCH_SITUATIONS = {
    3: [epochs_situation(8, 2, 3, seed=6), epochs_situation(10, 4, 4, seed=7, lr=0.05)],
    4: [epochs_situation(11, 3, 3, seed=8), epochs_situation(13, 2, 2, seed=9)],
}
ACCUMULATION_SITUATIONS = {
    3: [accumulation_situation(7, 3, seed=10, momentum=0.9), accumulation_situation(4, 1, seed=11)],
    4: [accumulation_situation(5, 3, seed=12, rows=2), accumulation_situation(3, 1, seed=13)],
}


def check_accuracy(accuracy) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size, situations in ACCURACY_SITUATIONS.items():
        run_lab(ACCURACY, "accuracy", world_size, accuracy, situations, hide_internals=True)


def check_train_epochs(train_epochs) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, situations in EPOCH_SITUATIONS.items():
        run_lab(EPOCHS, "epochs", world_size, train_epochs, situations, hide_internals=True)


def check_train_accumulated(train_accumulated) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, situations in ACCUMULATION_SITUATIONS.items():
        run_accumulation(train_accumulated, world_size, situations, hide_internals=True)


def check_all(accuracy, train_epochs, train_accumulated) -> None:
    """The three labs' hidden situations, one after the other."""
    __tracebackhide__ = True  # noqa: F841
    check_accuracy(accuracy)
    check_train_epochs(train_epochs)
    check_train_accumulated(train_accumulated)
