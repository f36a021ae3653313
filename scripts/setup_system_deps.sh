#!/usr/bin/env bash
# Installs the Debian packages the test suite uses: a one-node Slurm (slurm-wlm, munge), iproute2
# for the emulated-link tests, gcc (scripts/numerics_under_isas.py), and libibverbs1 (the Mooncake Transfer Engine loads it at import). Idempotent; does nothing when everything is present. Without root it
# only reports what is missing: the tests that need these packages skip with a reason, or fail where
# MBRIDGE_EPOVERLAP_REQUIRE names them (as .ci/run does; tests/unit_tests/requirements.py).
set -uo pipefail
need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || need+=(libibverbs1)
# A C compiler builds scripts/mkl_intel_path.c for the numerics runs under MKL's Intel kernels on other vendors.
command -v cc >/dev/null 2>&1 || need+=(gcc)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "setup_system_deps: not root; missing ${need[*]} (tests that need them will skip, or fail where MBRIDGE_EPOVERLAP_REQUIRE names them)" >&2
  exit 0
fi
echo "setup_system_deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null || echo "setup_system_deps: apt-get update failed" >&2
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
  || echo "setup_system_deps: apt-get install ${need[*]} failed (tests that need them will skip, or fail where MBRIDGE_EPOVERLAP_REQUIRE names them)" >&2
exit 0
