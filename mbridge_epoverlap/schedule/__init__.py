"""Stage programs, schedules and the simulator that times them.

- `program`: the stage program of a MoE layer, the `Step` vocabulary, the forward pieces, `check_schedule`.
- `training_orders`: the 1F1B orders of training (plain and combined) and their backward pieces.
- `serving_orders`: decode orders (ping-pong between attention and expert workers, two-batch overlap).
- `resources`: which stream runs each step and which channel carries each collective.
- `costs`, `simulator`, `timeline`, `gantt`: stage costs -> timed events -> utilization, idle time, PNG.
- `presets`, `cli`: named schedules and `mbridge-epoverlap simulate`.

Nothing is imported here, so importing the package stays cheap.
"""
