#!/usr/bin/env bash
# Installs the Debian packages the project uses when they are missing: the built-in Bible
# corpus (diatheke and the SWORD modules), Chromium, the browser that the serve page's
# end-to-end tests drive (Playwright cannot download its own browser here), and g++, with
# which torch.compile builds the quantized KV caches' decoding kernel (and --compile) and,
# with ninja, torch builds the continuous search's one-query attention kernel.
# Needs root and apt-get; without them it says what to install and exits 0, so that the
# test suite still runs (the tests that need them are then skipped with that reason).
set -u
packages="diatheke sword-text-sparv sword-text-kjv sword-text-web chromium g++ ninja-build"
missing=""
for package in $packages; do
    dpkg -s "$package" >/dev/null 2>&1 || missing="$missing $package"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: the Bible corpus needs:$missing (install them with apt-get as root)"
    exit 0
fi
echo "installing:$missing"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing; } >/dev/null; then
    echo "note: apt-get could not install:$missing"
fi
exit 0
