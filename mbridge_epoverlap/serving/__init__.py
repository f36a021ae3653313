"""Serving MoE models with disaggregated expert parallelism: one room (subpackage) per role.

- `model`: the model and its checkpoints: spec, Hugging Face layout and loading, the attention and expert
  parts, token batch, KV cache and prefix cache, tokenizer, the expert weight store.
- `decoding`: what happens to a row of logits: sampling, log-probabilities, penalties, grammars.
- `planning`: the offline deployment planner: GPU and model catalog, MegaScale-Infer's performance model,
  the search over deployments (Algorithm 1).
- `workers`: the worker processes' side: the worker protocol (typed messages), attention and expert workers,
  the colocated baseline, expert placement, request queue, stage timer.
- `elastic`: elastic EP: EPLB (pure functions), layouts and epochs, weight moves, epoch sync, reports, the
  elastic workers.
- `engine`: the engine plan, the run (processes, collect, merge), the worker entry point, the benchmark
  helpers and the replay through the simulator.
- `api`: the OpenAI API's fields beyond prompts and sampling (log-probabilities, choices, penalties, structured
  output, tool calls), checked and answered.
- `cli`: the `plan`, `serve`, `serve-bench` and `elastic-bench` commands and their shared flags.

Data flows down: a command builds an engine plan, the engine starts workers, workers decode with the model.
Nothing is imported here, so importing the package (and `mbridge-epoverlap --help`) stays cheap.
"""
