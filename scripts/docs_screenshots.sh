#!/usr/bin/env bash
# Build the documentation site and screenshot every page in headless Chromium, so that a person can look at it
# without a browser: bash scripts/docs_screenshots.sh [OUT_DIR [PAGE ...]]   (default OUT_DIR: docs-screenshots/,
# gitignored; PAGE: a page's path on the site, e.g. experiments/picaso/ or "" for the home page; default: every page).
# HEIGHT=4000 bash scripts/docs_screenshots.sh ... takes taller shots (default 1600 px; the width is 1280 px).
#
# Steps: install Chromium from Debian if it is missing (apt-get as root: these machines run as root, so no sudo;
# elsewhere install it yourself), build the site with `mkdocs build --strict` into a temporary folder (mkdocs comes
# with the `docs` extra), serve it with `python -m http.server` on a free local port, and screenshot every page
# (every index.html of the built site, or the PAGEs given) at 1280 x HEIGHT. The maths (MathJax) and fonts are
# served from the built site itself: no network is needed. Prints each PNG with its size, and the time taken.
set -euo pipefail

cd "$(dirname "$0")/.."
out="${1:-docs-screenshots}"
shift || true
height="${HEIGHT:-1600}"
start=$SECONDS

if ! command -v chromium >/dev/null 2>&1; then
    echo "chromium not found: installing the Debian package (needs root)"
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
if ! python -c "import mkdocs" 2>/dev/null; then
    echo "mkdocs is not installed: pip install -c constraints.txt -e \".[docs]\"" >&2
    exit 1
fi

tmp="$(mktemp -d)"
server=""
cleanup() {
    if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet --site-dir "$tmp/site"

port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
python -m http.server "$port" --bind 127.0.0.1 --directory "$tmp/site" >/dev/null 2>&1 &
server=$!
for _ in $(seq 50); do  # wait until the server answers (at most 5 s)
    python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
    sleep 0.1
done

rm -rf "$out"
mkdir -p "$out"
count=0
while IFS= read -r page; do
    rel="${page#"$tmp/site/"}"
    path="${rel%index.html}"
    name="${path%/}"
    name="${name//\//_}"
    name="${name:-index}"
    # --virtual-time-budget lets the page's scripts and fonts settle before the shot; no network is needed
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=3000 \
        --window-size="1280,$height" --screenshot="$out/$name.png" "http://127.0.0.1:$port/$path" >/dev/null 2>&1
    count=$((count + 1))
done < <(if [ "$#" -gt 0 ]; then for p in "$@"; do echo "$tmp/site/${p%/}${p:+/}index.html"; done; else
    find "$tmp/site" -name index.html | sort
fi)

for png in "$out"/*.png; do
    printf '%s  %s KB\n' "$png" "$(( $(stat -c %s "$png") / 1024 ))"
done
echo "$count pages screenshotted into $out/ in $((SECONDS - start)) s"
