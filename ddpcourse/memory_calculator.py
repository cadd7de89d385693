"""Bytes per rank and bytes on the wire per step for data, tensor and pipeline parallelism.

    from ddpcourse.memory_calculator import estimate
    estimate(parameters=7e9, batch=8, sequence=2048, layers=32, hidden=4096,
             dp=8, tp=1, pp=1, zero_stage=3)

A plain function of numbers in and numbers out, so that it can be re-implemented elsewhere (the
course's web page does, in JavaScript) and tested against the same cases. Every formula is in
:func:`estimate`'s docstring; chapter 11 checks each one against bytes counted tensor by tensor
in real process groups (``tests/test_chapter_11_beyond_ddp.py``).

The model is the usual first-order one (ZeRO paper, Rajbhandari et al. 2020, section 3;
Megatron-LM, Narayanan et al. 2021): parameters, gradients and optimizer state scale with the
parameter count; activations scale with tokens x hidden x layers. It leaves out what the run
adds on top (DDP's bucket copies, allocator caching, temporary buffers, padding of shards): the
chapter shows those beside the prediction.
"""

from __future__ import annotations

import math

ZERO_STAGES = (0, 1, 2, 3)  # 0 = plain data parallelism (DDP); 3 = ZeRO-3 / FSDP full sharding
SCHEDULES = ("gpipe", "1f1b")


def ring_factor(n: int) -> float:
    """(n - 1) / n: the share of a buffer each rank sends in a ring all-gather or reduce-scatter
    of n ranks (an all-reduce sends twice that). 0 for one rank: nothing is sent."""
    return (n - 1) / n if n > 1 else 0.0


def estimate(*, parameters: float, batch: int, sequence: int, layers: int, hidden: int,
             dp: int = 1, tp: int = 1, pp: int = 1, zero_stage: int = 0,
             microbatches: int = 1, schedule: str = "1f1b", bytes_per_value: int = 4,
             optimizer_values_per_parameter: int = 2, saved_values_per_layer: float = 1.0,
             tp_allreduces_per_layer: int = 2) -> dict[str, float]:
    """What one rank holds and sends in one training step.

    Args (all keyword-only):
        parameters: the model's parameter count (all of it, before any sharding).
        batch: samples per data-parallel rank per step (split into ``microbatches``).
        sequence: tokens per sample (1 for a plain MLP on vectors).
        layers: layers the activations are counted over (split over ``pp`` stages).
        hidden: width of the activations each layer saves.
        dp, tp, pp: data-, tensor- and pipeline-parallel degrees (ranks = dp x tp x pp).
        zero_stage: 0 (DDP: everything replicated), 1 (optimizer state sharded over dp),
            2 (+ gradients), 3 (+ parameters: ZeRO-3, FSDP's full sharding).
        microbatches: micro-batches per step for pipeline parallelism.
        schedule: "gpipe" (all forwards, then all backwards) or "1f1b".
        bytes_per_value: 4 for float32 (the same for parameters, gradients, state, activations).
        optimizer_values_per_parameter: 2 for Adam (exp_avg, exp_avg_sq), 1 for SGD with
            momentum, 0 for plain SGD.
        saved_values_per_layer: activations a layer saves for backward, per sample and token, in
            units of ``hidden`` values (1 for a stack of Linear + ReLU: the ReLU's output, which
            is also the next Linear's saved input, one storage; the model's own input adds one
            more; about 17 for a transformer layer in 16-bit, Korthikanti et al. 2022).
        tp_allreduces_per_layer: all-reduces of one layer's activations per micro-batch under
            tensor parallelism, forward and backward together (2 for a column-then-row parallel
            MLP; 4 for a Megatron transformer layer).

    Returns bytes per rank (floats; fractions where a count does not divide evenly):
        ``params``, ``grads``, ``optimizer``, ``activations``, ``total``, and
        ``wire_dp``, ``wire_tp``, ``wire_pp``, ``wire_total``: bytes this rank sends per step.

    Formulas (``P = parameters * bytes_per_value / (tp * pp)``, this rank's model slice):
        params = P / dp if zero_stage >= 3 else P
        grads = P / dp if zero_stage >= 2 else P
        optimizer = optimizer_values_per_parameter * P / dp if zero_stage >= 1 else ... * P
        activations = saved_values_per_layer * hidden * sequence * (batch / microbatches)
                      * (layers / pp) / tp * in_flight,
            in_flight = microbatches for "gpipe" (or with pp == 1), min(pp, microbatches) for
            "1f1b" (the first stage, which holds the most)
        wire_dp = 2 (n-1)/n P for zero_stage 0, 1, 2 (an all-reduce, or a reduce-scatter of the
            gradients plus an all-gather of the parameters), 3 (n-1)/n P for stage 3 (all-gather
            in forward and again in backward, reduce-scatter of the gradients); n = dp
        wire_tp = tp_allreduces_per_layer * (layers / pp) * microbatches * 2 (t-1)/t
                  * (batch / microbatches) * sequence * hidden * bytes_per_value; t = tp
        wire_pp = 2 * batch * sequence * hidden * bytes_per_value if pp > 1 (a middle stage
            sends every micro-batch's activations forward and its gradient back)
    """
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("microbatches", microbatches),
                        ("layers", layers), ("batch", batch), ("sequence", sequence),
                        ("hidden", hidden)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, not {zero_stage!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    if parameters < 0:
        raise ValueError(f"parameters must be >= 0, not {parameters!r}")

    slice_bytes = parameters * bytes_per_value / (tp * pp)
    params = slice_bytes / dp if zero_stage >= 3 else slice_bytes
    grads = slice_bytes / dp if zero_stage >= 2 else slice_bytes
    optimizer = optimizer_values_per_parameter * slice_bytes / (dp if zero_stage >= 1 else 1)

    micro = batch / microbatches
    in_flight = microbatches if (schedule == "gpipe" or pp == 1) else min(pp, microbatches)
    activations = (saved_values_per_layer * hidden * sequence * micro * (layers / pp) / tp
                   * in_flight * bytes_per_value)

    wire_dp = (3 if zero_stage == 3 else 2) * ring_factor(dp) * slice_bytes
    one_activation = micro * sequence * hidden * bytes_per_value
    wire_tp = (tp_allreduces_per_layer * (layers / pp) * microbatches * 2 * ring_factor(tp)
               * one_activation)
    wire_pp = 2 * microbatches * one_activation if pp > 1 else 0.0
    return {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "total": params + grads + optimizer + activations,
        "wire_dp": wire_dp, "wire_tp": wire_tp, "wire_pp": wire_pp,
        "wire_total": wire_dp + wire_tp + wire_pp,
    }


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe or 1F1B step with equal-cost stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    if n < 1024:
        return f"{n:.0f} B"
    exponent = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exponent:.2f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exponent]}"


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors' elements (a DTensor counts its local shard only): the measured side
    that chapters 02 and 11 hold :func:`estimate` against."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total
