#!/usr/bin/env bash
# The built-in chat page in a real browser: headless Debian Chromium driven by Playwright
# against a live afm on SmolLM2 (tests/webui/chat.test.js). Installs what is missing
# (chromium from apt, playwright-core from npm), builds afm, fetches the model, runs the test.
# Screenshots and the server log land in tests/webui/artifacts/. Exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ! -x /usr/bin/chromium ]]; then
  echo "== installing chromium (apt)"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y chromium
fi

echo "== node packages (tests/webui)"
if [[ -f tests/webui/package-lock.json ]]; then
  (cd tests/webui && npm ci --no-audit --no-fund)
else
  (cd tests/webui && npm install --no-audit --no-fund)
fi

echo "== afm and the test model"
bash scripts/fetch_models.sh smollm2
if [[ -z "${AFM_BIN:-}" ]]; then
  cargo build --release -p afm
fi

echo "== webui test (headless chromium)"
(cd tests/webui && node chat.test.js)
