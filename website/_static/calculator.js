// The chapter 11 calculator: ddpcourse/memory_calculator.py's estimate(), the same formulas in
// JavaScript (tests/test_site.py holds the two to each other on a grid of inputs).
"use strict";

function ringFactor(n) {
  // (n - 1) / n: the share of a buffer each rank sends in a ring all-gather or reduce-scatter
  return n > 1 ? (n - 1) / n : 0.0;
}

function estimate(a) {
  const sliceBytes = a.parameters * a.bytes_per_value / (a.tp * a.pp);
  const params = a.zero_stage >= 3 ? sliceBytes / a.dp : sliceBytes;
  const grads = a.zero_stage >= 2 ? sliceBytes / a.dp : sliceBytes;
  const optimizer = a.optimizer_values_per_parameter * sliceBytes / (a.zero_stage >= 1 ? a.dp : 1);
  const micro = a.batch / a.microbatches;
  const inFlight = (a.schedule === "gpipe" || a.pp === 1) ? a.microbatches
    : Math.min(a.pp, a.microbatches);
  const activations = (a.saved_values_per_layer * a.hidden * a.sequence * micro * (a.layers / a.pp)
    / a.tp * inFlight * a.bytes_per_value);
  const wireDp = (a.zero_stage === 3 ? 3 : 2) * ringFactor(a.dp) * sliceBytes;
  const oneActivation = micro * a.sequence * a.hidden * a.bytes_per_value;
  const wireTp = (a.tp_allreduces_per_layer * (a.layers / a.pp) * a.microbatches * 2
    * ringFactor(a.tp) * oneActivation);
  const wirePp = a.pp > 1 ? 2 * a.microbatches * oneActivation : 0.0;
  return {
    params, grads, optimizer, activations, total: params + grads + optimizer + activations,
    wire_dp: wireDp, wire_tp: wireTp, wire_pp: wirePp, wire_total: wireDp + wireTp + wirePp,
  };
}

function formatBytes(n) {
  // as memory_calculator.format_bytes: 1536 -> "1.50 KiB"
  if (n < 1024) return `${n.toFixed(0)} B`;
  const exponent = Math.min(Math.floor(Math.log(n) / Math.log(1024)), 4);
  return `${(n / 1024 ** exponent).toFixed(2)} ${["B", "KiB", "MiB", "GiB", "TiB"][exponent]}`;
}

function readInputs() {
  const number = id => Number(document.getElementById(id).value);
  return {
    parameters: Math.round(10 ** number("log_parameters")),
    batch: number("batch"), sequence: number("sequence"), layers: number("layers"),
    hidden: number("hidden"), dp: number("dp"), tp: number("tp"), pp: number("pp"),
    zero_stage: number("zero_stage"), microbatches: number("microbatches"),
    schedule: document.getElementById("schedule").value,
    bytes_per_value: number("bytes_per_value"),
    optimizer_values_per_parameter: number("optimizer_values_per_parameter"),
    saved_values_per_layer: number("saved_values_per_layer"),
    tp_allreduces_per_layer: number("tp_allreduces_per_layer"),
  };
}

function update() {
  const inputs = readInputs();
  const root = document.getElementById("calculator");
  root.dataset.inputs = JSON.stringify(inputs);
  for (const output of root.querySelectorAll("output[for]")) {
    output.textContent = document.getElementById(output.htmlFor).value;
  }
  document.getElementById("parameters-shown").textContent =
    inputs.parameters.toLocaleString("en-US");
  const result = estimate(inputs);
  root.dataset.result = JSON.stringify(result);
  for (const cell of root.querySelectorAll("[data-key]")) {
    cell.textContent = formatBytes(result[cell.dataset.key]);
  }
  for (const cell of root.querySelectorAll("[data-exact]")) {
    cell.textContent = Math.round(result[cell.dataset.exact]).toLocaleString("en-US") + " B";
  }
  const ranks = inputs.dp * inputs.tp * inputs.pp;
  const bubble = (inputs.pp - 1) / (inputs.microbatches + inputs.pp - 1);
  document.getElementById("calculator-ranks").textContent =
    `${ranks} ranks (DP ${inputs.dp} × TP ${inputs.tp} × PP ${inputs.pp}); ` +
    `pipeline bubble ${(100 * bubble).toFixed(1)} % of the step with equal stages.`;
}

document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("calculator-inputs");
  if (!form) return;
  form.addEventListener("input", update);
  update();
});
