"""The serving commands and their shared flags; `register` functions only touch argparse (fast `--help`).

- `args`: the flags `serve`, `serve-bench` and `elastic-bench` share, and how they are read.
- `serve`: `mbridge-epoverlap serve` and `serve-bench`.
- `elastic`: `mbridge-epoverlap elastic-bench`.
- `plan`: `mbridge-epoverlap plan`, the deployment planner's command.
- `output`: how the commands print a result (JSON or a two-column table).

Nothing is imported here, so importing the package stays cheap.
"""
