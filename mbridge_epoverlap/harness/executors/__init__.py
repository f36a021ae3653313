"""Executors: run an experiment's cases somewhere and return its results.

`local` runs the reference runtime in processes on this machine; `slurm` writes an sbatch script,
submits it and follows the job. Only the slurm executor knows about Slurm.
"""
