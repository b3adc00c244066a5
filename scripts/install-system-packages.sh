#!/usr/bin/env bash
# The Debian packages elasticps's tests use: iproute2 (network namespaces as test
# hosts), openssh-server (an sshd on each of them), Slurm (slurmctld, slurmd,
# slurm-client, munge: a test cluster on those hosts), and Chromium with its WebDriver
# (chromium, chromium-driver: the dashboard and report tests' headless browser).
# Training itself needs none of them. Installs only what is missing; needs root (or sudo) for
# that, and says so otherwise without failing.
set -euo pipefail

packages=(iproute2 openssh-server openssh-client slurmctld slurmd slurm-client munge chromium chromium-driver)
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get > /dev/null; then
  echo "install-system-packages: no apt-get; install ${missing[*]} to run the multi-host and browser tests" >&2
  exit 0
fi
run=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo > /dev/null && sudo -n true 2> /dev/null; then
    run=(sudo -n)
  else
    echo "install-system-packages: not root; install ${missing[*]} to run the multi-host and browser tests" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! "${run[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null; then
  "${run[@]}" apt-get update -q > /dev/null
  "${run[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null
fi
