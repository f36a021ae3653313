"""The engine room: the plan every worker is told, running it on processes, and replaying it in the simulator.

The engine is the third executor of the stage program (beside the training runtime and the simulator);
it knows processes, the workers below it do not.

- `plan`: `EnginePlan`, what every worker process is told (layout, requests, model settings); derived
  values are methods (`mode`, `load_spec`, `role_of`, `arrival_order`), and `deal_requests`.
- `elastic_plan`: `make_elastic`, an engine plan in elastic mode (redundant slots, kills, epochs).
- `hosts`: `emulate_hosts`, a plan on two emulated hosts (attention and expert workers in network
  namespaces joined by a shaped link), and the host of each rank.
- `run`: `make_plan` and `run_engine`: start the workers, gather their reports, merge one result.
- `replay`: the measured stage times fed to the simulator with the order the engine ran.
- `worker_main`: the entry point of one worker process.
- `heap`: `keep_freed_memory`, a worker's freed memory kept by malloc for its next step (no page faults on
  a warm prefill's large tensors).
- `bench`: `serve-bench` pieces (synthetic requests, balanced sizing, the reference check) and
  `finish_bench_result`, the one place a bench result is finished.
- `breakdown`: `step_breakdown`, where a prefill and a decode step's time goes (attention, router, dispatch,
  experts, combine, sampling, overhead), timed in one process.
- `choice`: what the engine chooses when the user does not say: the batch `serve`'s layout (`choice.offline`,
  trial runs on its prompts), `serve-bench`'s (`choice.layout`, probes), `serve --http`'s (`choice.online`, trial
  runs) and the compute dtype of `--dtype auto`
  (`choice.dtype`).
- `collect`: merges a cluster job's worker reports into the `serve-bench` result.

Nothing is imported here, so importing the package stays cheap.
"""
