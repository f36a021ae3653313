"""The serving workers: the third executor of the stage program, one attention side composed with a transport.

- `protocol`: the worker protocol: M2N message records with `encode`/`decode` (`Dispatch`, `Combine`, their
  controls `StepControl` and `ElasticControl`), tags, `ACTIVE`/`IDLE`/`CONTINUE`/`STOP`, `Worker` (what the
  worker process needs of any worker) and `Transport` (what an attention worker asks of its transport).
- `attention`: `AttentionSide` (sequences, KV cache, attention, sampling, step boundaries, progress line) and
  `MicroBatchHandle`, a decode micro-batch's state between its steps.
- `decode`: `AttentionWorker`, the attention side and a transport run through the order (streamed rounds or
  drained steps), and the handler and heartbeat helpers the expert worker shares.
- `m2n`: `M2NTransport`, dispatch to and combine from the expert workers over M2N by a fixed placement.
- `expert`: `ExpertWorker`, a subset of the experts serving every attention worker over M2N.
- `colocated`: every process both roles, the attention side with `AllToAllTransport` (EP all-to-all over M2N).
- `placement`: `Placement`, expert id -> expert worker.
- `requests`: requests, running sequences and continuous batching (`RequestQueue`).
- `online`: online serving's request source (`OnlineSource`, polled at step boundaries) and its ZeroMQ
  messages to and from the front end.
- `stage_timer`: `StageTimer`, per-stage durations and utilization.
- `step_cores`: `StepCores`, how a process with several cores spends them at each step (torch's threads at
  wide steps, the tiled expert GEMMs' threads at narrow ones).
"""
