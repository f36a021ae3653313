#!/usr/bin/env bash
# Build the Python 3.12 environment in which Megatron-Bridge main's own config code (with Megatron-Core main
# under it) runs on a CPU: the differential test against main (tests/unit_tests/training/test_bridge_differential.py)
# and scripts/extract_bridge_recipe_facts.py for main's recipe facts.
#
# Usage: scripts/setup_bridge_main_venv.sh VENV_DIR BRIDGE_SOURCE CORE_SOURCE [BASE_VENV]
#   BRIDGE_SOURCE  a Megatron-Bridge checkout or git directory (e.g. the one `git clone` or a mirror gives)
#   CORE_SOURCE    a Megatron-LM checkout or git directory
#   BASE_VENV      the 0.6.2 environment scripts/setup_bridge_venv.sh built (default
#                  ~/.cache/mbridge-epoverlap/bridge-venv); its packages are reused
# then export MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON=VENV_DIR/bin/python.
#
# Main has no wheel, and its config code needs the same third-party packages as 0.6.2 (torch, transformers,
# omegaconf, ...), so instead of a second 5 GB environment this one holds the two source trees (copied from
# HEAD, their commits recorded in VENV_DIR/SOURCES) ahead of BASE_VENV's site-packages on sys.path: `megatron`
# is a namespace package in both projects, so megatron.core and megatron.bridge come from main and the rest
# (megatron.energon, torch, ...) from BASE_VENV. Small dist-info records give importlib.metadata main's
# versions (Megatron-Core 0.20.0, Megatron-Bridge 0.7.0 today) instead of BASE_VENV's. Rebuild this one after
# BASE_VENV is rebuilt.
set -euo pipefail
if [ "$#" -lt 3 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
venv="$1"
bridge_source="$2"
core_source="$3"
base="${4:-$HOME/.cache/mbridge-epoverlap/bridge-venv}"
base_site="$(ls -d "$base"/lib/python3.12/site-packages 2>/dev/null || true)"
if [ -z "$base_site" ]; then
  echo "error: $base has no lib/python3.12/site-packages; build it first with scripts/setup_bridge_venv.sh" >&2
  exit 2
fi
python="$(readlink -f "$base/bin/python")"
rm -rf "$venv"
"$python" -m venv "$venv"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$venv/src"

# Copy the Python package folder $3 of HEAD of a git directory (bare, mirror or checkout), or of a plain source
# tree, into $venv/src/$2. Only the package: a mirror may lack the large files elsewhere (images, data).
copy_source() {
  local source="$1" name="$2" folder="$3" commit
  mkdir -p "$venv/src/$name"
  if git --git-dir="$source" rev-parse --verify HEAD >/dev/null 2>&1; then
    commit="$(git --git-dir="$source" rev-parse HEAD)"
    git --git-dir="$source" archive HEAD -- "$folder" | tar -x -C "$venv/src/$name"
  elif git -C "$source" rev-parse --verify HEAD >/dev/null 2>&1; then
    commit="$(git -C "$source" rev-parse HEAD)"
    git -C "$source" archive HEAD -- "$folder" | tar -x -C "$venv/src/$name"
  else
    commit="unknown (not a git tree)"
    mkdir -p "$venv/src/$name/$(dirname "$folder")"
    cp -r "$source/$folder" "$venv/src/$name/$folder"
  fi
  echo "$name $commit" >> "$venv/SOURCES"
}
copy_source "$bridge_source" bridge src/megatron/bridge
copy_source "$core_source" core megatron/core

# The version a project's package_info.py declares (MAJOR.MINOR.PATCH + PRE_RELEASE).
version_of() {
  "$venv/bin/python" - "$1" <<'EOF'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
parts = {k: re.search(rf"^{k} = ['\"]?([^'\"\n]*)['\"]?$", text, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH")}
pre = re.search(r"^PRE_RELEASE = ['\"]([^'\"]*)['\"]", text, re.M)
print(f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{pre.group(1) if pre else ''}")
EOF
}
record() {  # a dist-info that importlib.metadata finds before BASE_VENV's
  local name="$1" version="$2" dir
  dir="$site/${name//-/_}-$version.dist-info"
  mkdir -p "$dir"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$version" > "$dir/METADATA"
  echo "mbridge-epoverlap" > "$dir/INSTALLER"
  : > "$dir/RECORD"
}
record megatron-core "$(version_of "$venv/src/core/megatron/core/package_info.py")"
record megatron-bridge "$(version_of "$venv/src/bridge/src/megatron/bridge/package_info.py")"
# .pth files are read in name order and append to sys.path: main's sources, then BASE_VENV's packages.
printf '%s\n%s\n' "$(cd "$venv/src/core" && pwd)" "$(cd "$venv/src/bridge/src" && pwd)" > "$site/00-megatron-main.pth"
echo "$base_site" > "$site/zz-base-venv.pth"
# Found, not imported: importing megatron.bridge needs the fake Transformer Engine (config/bridge_cpu.py).
"$venv/bin/python" - <<'EOF'
import importlib.util
from importlib import metadata
for dist, module in (("megatron-core", "megatron.core"), ("megatron-bridge", "megatron.bridge")):
    print(f"{dist} {metadata.version(dist)} from {importlib.util.find_spec(module).submodule_search_locations[0]}")
EOF
echo "export MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON=$(cd "$venv" && pwd)/bin/python"
