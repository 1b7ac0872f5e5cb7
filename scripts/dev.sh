#!/usr/bin/env bash
# One entry point for a fresh machine with Python 3.11:
#   bash scripts/dev.sh quickstart   install everything, run recipes/quickstart.yaml end to end
#   bash scripts/dev.sh test         install everything, run the whole test suite
#   bash scripts/dev.sh test-fast    install everything, run the fast tier (about 1.5 minutes)
# The virtual environment lives in .venv (override with POSTTRAIN_VENV). Every package version is
# pinned by constraints.txt; torch==2.13.0 resolves to the CPU build where one is offered, so no
# multi-GB CUDA stack is pulled on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${POSTTRAIN_VENV:-.venv}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

install() {
  # $1: the extras to install (the tests also need the optional trackers, lm-eval, the
  # Kubernetes client and mkdocs, which builds the docs site).
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
  fi
  # Installing torch in the same command as everything else, under the constraints, keeps pip
  # from resolving a newer CUDA build first.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c constraints.txt -e ".[$1]"
}

# The Prefect UI test drives Debian's chromium (playwright never downloads a browser here).
install_browser() {
  command -v chromium >/dev/null 2>&1 && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the Prefect UI test" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null ||
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
  else
    echo "warning: chromium is missing and cannot be installed here (needs root and apt-get);" \
      "the Prefect UI test will fail: install Debian's chromium package" >&2
  fi
}

# Code rewards run model-written programs inside Debian's bubblewrap (posttrain/rewards/sandbox.py);
# tests/test_sandbox.py (fast tier) checks its security list, so it must run wherever bwrap can
# be installed: POSTTRAIN_REQUIRE_BWRAP=1 turns a sandbox that cannot start into a failure. The
# quickstart needs no sandbox (its rewards run no code), so only the test commands install it.
install_bwrap() {
  if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
      echo "warning: bubblewrap is missing and cannot be installed here (needs root and" \
        "apt-get): the sandbox tests will skip; install Debian's bubblewrap package" >&2
      return 0
    fi
    echo "installing Debian's bubblewrap for the code-execution sandbox tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null ||
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; }
  fi
  export POSTTRAIN_REQUIRE_BWRAP=1
}

# The Slurm launcher's tests start a real 2-node cluster (tests/slurm_cluster.py): Debian's
# slurm-wlm and munge, iproute2 for the nodes' network namespaces, and root. Where that is
# available the tests must run, never skip.
install_slurm() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "warning: the Slurm cluster tests need root: they will skip" >&2
    return 0
  fi
  if ! command -v slurmctld >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
      echo "warning: slurm-wlm/iproute2 missing and no apt-get: the Slurm tests will skip" >&2
      return 0
    fi
    echo "installing Debian's slurm-wlm, munge and iproute2 for the Slurm cluster tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2 >/dev/null ||
      { apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2 >/dev/null; }
  fi
  export POSTTRAIN_REQUIRE_SLURM=1
}

# The monitoring tests (fast tier) run promtool on the shipped alert rules and dashboard queries;
# the exporter's tests start a real Prometheus and Pushgateway: Debian's prometheus and
# prometheus-pushgateway. On a host with systemd, apt starts both as services (ports 9090, 9091).
install_prometheus() {
  command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 &&
    command -v prometheus-pushgateway >/dev/null 2>&1 && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's prometheus and prometheus-pushgateway for the monitoring tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-pushgateway >/dev/null ||
      { apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-pushgateway >/dev/null; }
  else
    echo "warning: prometheus/promtool is missing and cannot be installed here (needs root and" \
      "apt-get); the monitoring tests will fail: install Debian's prometheus and" \
      "prometheus-pushgateway packages" >&2
  fi
}

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
  quickstart)
    install dev
    "$venv/bin/posttrain" run recipes/quickstart.yaml "${@:2}"
    ;;
  test | test-fast)
    install dev,serving,mlflow,wandb,lm-eval,kubernetes,docs
    install_prometheus
    install_bwrap
    [ "$1" = test ] && install_browser
    [ "$1" = test ] && install_slurm
    # As root the fault tests mount small tmpfs disks: where they cannot, they fail, never skip.
    [ "$(id -u)" -eq 0 ] && export POSTTRAIN_REQUIRE_TMPFS=1
    marker=()
    [ "$1" = test-fast ] && marker=(-m "not slow")
    # Two workers (pytest-xdist), one per core of the CI machine (POSTTRAIN_TEST_WORKERS
    # overrides; 0 runs in this process): a file's tests stay in one worker (tests/conftest.py).
    workers=(-n "${POSTTRAIN_TEST_WORKERS:-2}")
    set +e
    # --durations=25: every log lists the slowest tests, so a test that grows is seen at once.
    "$venv/bin/python" -m pytest "${workers[@]}" --durations=25 "${marker[@]}" "${@:2}"
    rc=$?
    set -e
    # pytest exits 5 when it collected no test: that is a failure here, never a silent pass.
    if [ "$rc" -eq 5 ]; then
      echo "ERROR: pytest collected no tests" >&2
      exit 1
    fi
    exit "$rc"
    ;;
  *)
    echo "usage: bash scripts/dev.sh {quickstart|test|test-fast} [extra args]" >&2
    exit 2
    ;;
esac
