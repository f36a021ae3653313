"""The perf harness behind `scripts/performance/run_script.py`: matched A/B runs of EP overlap.

- `flags`: the command line (Megatron-Bridge-compatible flags); `main`: resolve -> validate -> launch -> report.
- `resolve`, `cases`, `launch_env`: the run config of each case and the environment it is launched with.
- `executors.local` (reference runtime here) and `executors.slurm` (sbatch): run the cases.
- `results`, `stats`, `report`, `chart`: results JSON, stable-window statistics, markdown table, PNG.
- `mbridge_logs`: Megatron-Bridge training logs -> the same results; `mbridge_job`: GPU job entry point;
  `collect`: builds the results at the end of a cluster job.
- `bridge_recipes`, `upstream_recipe`, `recipe_facts` (with `data/bridge_recipe_facts.json`): the
  Megatron-Bridge recipe a GPU job builds and its values, where the validated config starts;
  `bridge_check` and `hf_configs`: `--check_with_bridge`, the job built by the real Megatron-Bridge.

Importing this package imports nothing heavy; torch and matplotlib load only where runs and charts happen.
"""
