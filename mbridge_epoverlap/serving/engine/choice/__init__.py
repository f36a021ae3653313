"""What the engine chooses when the user does not say: its layout and its compute dtype.

- `layout`: `choose_layout`, the layout `serve-bench` runs without layout flags, predicted from in-process probes of
  one decode layer.
- `offline`: `choose_offline_layout`, the layout `serve --prompts` runs without layout flags: a trial run of each
  candidate on the batch's own prompts, the batch's time predicted from its prefill and decode step, the choice
  cached per batch shape and machine.
- `online`: `choose_online_layout`, the layout `serve --http` runs without layout flags: short trial runs of the
  engine with requests joining at every step, the choice cached per model, dtype, batch, cores and CPU.
- `dtype`: `choose_serving_dtype`, what `--dtype auto` means: the checkpoint's dtype where this CPU computes it
  natively, else float32.

Nothing is imported here, so importing the package stays cheap.
"""
