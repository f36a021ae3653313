#!/usr/bin/env python3
"""Fuzz the EP-overlap validator against the real `TransformerConfig` of every Megatron-Core release.

For each release (0.15 ... 0.20) the script takes `megatron/core` from a Megatron-LM git checkout or bare
clone at the release tag (`git archive core_vX.Y.0`), imports its `transformer_config.py` in a fresh
process (the triton-only modules stubbed, so releases that need Python 3.12 to install still import on
3.11), draws random overlap configs and prints, per release:

    missed   Megatron-Core rejects the config for an overlap rule, the validator (checking for that release)
             finds no error among the rules that release enforces;
    false    the validator reports such an error, Megatron-Core accepts the config (read from the keyword
             arguments, and again from the accepted real object: "false on object").

The goal is 0 / 0 for every release. Not part of `make test` (it needs a Megatron-LM clone).

Usage:
    python benchmarks/mcore_release_fuzz.py --megatron-lm /path/to/Megatron-LM [--samples 400]
        [--releases 0.15,0.16,...] [--ref 0.20=main]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ("0.15", "0.16", "0.17", "0.18", "0.19", "0.20")
_TRITON = re.compile(r"^(import triton|from triton)", re.MULTILINE)


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    git_dir = repo / ".git" if (repo / ".git").exists() else repo
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, timeout=300)


def resolve_ref(repo: Path, release: str, overrides: dict[str, str]) -> str:
    """The git ref of a release: an explicit --ref, else the tag core_vX.Y.0."""
    ref = overrides.get(release, f"core_v{release}.0")
    if _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode != 0:
        raise SystemExit(f"error: {repo} has no ref {ref!r} for Megatron-Core {release}; fetch the tags, or pass "
                         f"--ref {release}=<commit or branch>")
    return ref


def extract(repo: Path, ref: str, dest: Path) -> str:
    """Write megatron/core at `ref` under `dest`; return the version its package_info.py declares."""
    archive = _git(repo, "archive", ref, "megatron/core")
    if archive.returncode != 0:
        raise SystemExit(f"error: git archive {ref} failed: {archive.stderr.decode(errors='replace')[-300:]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True, timeout=300)
    info = (dest / "megatron" / "core" / "package_info.py").read_text()
    major, minor, patch = (re.search(rf"^{name} = (\d+)", info, re.MULTILINE).group(1)
                           for name in ("MAJOR", "MINOR", "PATCH"))
    return f"{major}.{minor}.{patch}"


def worker(tree: Path, version: str, samples: int, seed: int) -> None:
    """In a fresh process: import the release's TransformerConfig from `tree` and print the tally as JSON."""
    import types
    from importlib.machinery import ModuleSpec

    class _Anything:
        def __call__(self, *args, **kwargs):
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything()

        def __getattr__(self, item):
            if item.startswith("__"):
                raise AttributeError(item)
            return _Anything()

    class _Stub(types.ModuleType):
        def __getattr__(self, item):
            if item.startswith("__"):
                raise AttributeError(item)
            return _Anything()

    for path in (tree / "megatron" / "core").rglob("*.py"):
        if path.name != "__init__.py" and _TRITON.search(path.read_text(errors="ignore")):
            name = ".".join(path.relative_to(tree).with_suffix("").parts)
            module = _Stub(name)
            module.__spec__ = ModuleSpec(name, None)
            sys.modules[name] = module
    sys.path.insert(0, str(tree))
    sys.path.insert(0, str(ROOT))
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import torch
    from megatron.core.transformer import transformer_config

    from mbridge_epoverlap.config import Environment
    from mbridge_epoverlap.config.fuzz import compare

    if not Path(transformer_config.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"error: imported {transformer_config.__file__}, not the tree {tree}")
    env = Environment(torch_version=torch.__version__.split("+")[0], te_version=None, mcore_version=version)
    examples: list[str] = []
    tally = compare(transformer_config.TransformerConfig, env, samples, seed, torch.bfloat16, examples)
    print(json.dumps({"version": version, "tally": vars(tally), "examples": examples}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", type=Path, help="Megatron-LM checkout or bare clone with the release tags")
    parser.add_argument("--releases", default=",".join(RELEASES), help="comma-separated major.minor releases")
    parser.add_argument("--ref", action="append", default=[], metavar="RELEASE=REF",
                        help="git ref of a release whose tag is missing (e.g. 0.20=main)")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--verbose", action="store_true", help="print up to 20 disagreeing samples per release")
    parser.add_argument("--worker", nargs=2, metavar=("TREE", "VERSION"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="60 samples per release")
    parser.add_argument("--json", action="store_true", help="the tallies per release as JSON on stdout (last line)")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples = 60
    if args.worker:
        worker(Path(args.worker[0]), args.worker[1], args.samples, args.seed)
        return 0
    if args.megatron_lm is None:
        parser.error("--megatron-lm PATH is required (a Megatron-LM clone with the core_vX.Y.0 tags)")
    overrides = dict(item.split("=", 1) for item in args.ref)
    print(f"{'release':<8} {'source':<16} {'accepted':>8} {'overlap rej':>11} {'other rej':>9} {'missed':>6} "
          f"{'false':>5} {'false on object':>15}")
    worst = 0
    tallies: dict[str, dict[str, int]] = {}
    for release in [r.strip() for r in args.releases.split(",") if r.strip()]:
        ref = resolve_ref(args.megatron_lm, release, overrides)
        with tempfile.TemporaryDirectory(prefix=f"mcore{release}-") as tmp:
            version = extract(args.megatron_lm, ref, Path(tmp))
            result = subprocess.run(
                [sys.executable, __file__, "--worker", tmp, version, "--samples", str(args.samples),
                 "--seed", str(args.seed)], capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            print(f"{release:<8} {ref:<16} worker failed:\n{result.stderr[-2000:]}")
            worst = max(worst, 1)
            continue
        report = json.loads(result.stdout.strip().splitlines()[-1])
        t = tallies[release] = report["tally"]
        print(f"{release:<8} {ref:<16} {t['accepted']:>8} {t['overlap_rejected']:>11} {t['other_rejected']:>9} "
              f"{t['missed']:>6} {t['false']:>5} {t['false_on_object']:>15}")
        if args.verbose:
            for line in report["examples"]:
                print(f"    {line[:400]}")
        worst = max(worst, int(bool(t["missed"] or t["false"] or t["false_on_object"])))
    if args.json:
        print(json.dumps({"samples": args.samples, "releases": tallies}))
    return worst


if __name__ == "__main__":
    sys.exit(main())
