#!/usr/bin/env bash
# The real external tools tracetop's tests run against, installed from Debian where apt is there:
#   prometheus-alertmanager  Alertmanager (binaries prometheus-alertmanager, amtool): the alert sink's tests
#   prometheus               for promtool (`promtool check metrics` lints /metrics)
#   tmux                     drives the TUI in a real terminal in the TUI's tests
#
# Idempotent: when every tool is on PATH it does nothing (no apt-get update) and returns at once.
# Never fatal: without apt, or without root (and no password-less sudo), or when an install fails,
# it says what to run and exits 0; the tests that need a missing tool then FAIL saying how to
# install it (tests/collector/export/tools.py), they never skip.
#
# Notes (measured on Debian 12, ../shared/notes/external-tools.md):
# - prometheus-alertmanager 0.25: 1 package, 43 MB; prometheus 2.42: 37 MB download, ~320 MB
#   installed without Recommends (it hard-depends on libjs-moment-timezone); tmux: 1 package.
# - --no-install-recommends keeps promtool and Alertmanager working and leaves out
#   prometheus-node-exporter and friends.
# - No service starts on install in a container (policy-rc.d, no systemd). On a real systemd host the
#   packages start their services: `systemctl disable --now prometheus prometheus-alertmanager`.
set -u

# tool on PATH -> the Debian package that ships it
TOOLS="prometheus-alertmanager:prometheus-alertmanager promtool:prometheus tmux:tmux"

missing_pkgs=""
missing_tools=""
for entry in $TOOLS; do
  tool=${entry%%:*}
  pkg=${entry#*:}
  if ! command -v "$tool" >/dev/null 2>&1; then
    missing_pkgs="$missing_pkgs $pkg"
    missing_tools="$missing_tools $tool"
  fi
done

if [ -z "$missing_pkgs" ]; then
  exit 0
fi

hint="apt-get update && apt-get install -y --no-install-recommends$missing_pkgs"

if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_external: missing$missing_tools and no apt-get here; install them with your package manager" \
       "(Debian/Ubuntu: $hint). The tests that need them will fail until then." >&2
  exit 0
fi

SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "setup_external: missing$missing_tools; not root, so not installing. Run as root: $hint." \
         "The tests that need them will fail until then." >&2
    exit 0
  fi
fi

echo "setup_external: installing$missing_pkgs (for$missing_tools)" >&2
# Several engineers may run setup at once on one machine: wait for apt's lock instead of failing.
APT_OPTS="-q -o DPkg::Lock::Timeout=600"
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get $APT_OPTS update >/dev/null; then
  echo "setup_external: apt-get update failed; run: $hint" >&2
  exit 0
fi
# shellcheck disable=SC2086  # word splitting of the package list is wanted
if ! $SUDO apt-get $APT_OPTS install -y --no-install-recommends $missing_pkgs >/dev/null; then
  echo "setup_external: apt-get install failed; run: $hint" >&2
  exit 0
fi
for tool in $missing_tools; do
  command -v "$tool" >/dev/null 2>&1 || echo "setup_external: $tool still not on PATH after installing" >&2
done
exit 0
