#!/usr/bin/env bash
# The installed distribution shares no import name with other packages (make install-test; .ci/run runs it):
# build the wheel and sdist, install python-daemon and proto-plus (top-level `daemon` and `proto`) and then our
# wheel into a fresh venv, import theirs and ours, and run the console scripts. Packages come from pip's own
# configuration (index, find-links); torch from the local build if one is cached (TORCH_VERSION as in the Makefile).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m build -q --no-isolation --sdist --wheel -o "$work/dist" . >/dev/null
wheel=$(ls "$work"/dist/dilocox-*.whl)
sdist=$(ls "$work"/dist/dilocox-*.tar.gz)
echo "install-test: built $(basename "$wheel") and $(basename "$sdist")"
tar -tzf "$sdist" > "$work/sdist.txt"
grep -q "/daemon/cli.py$" "$work/sdist.txt" || { echo "install-test: FAIL: the sdist lacks daemon/cli.py"; exit 1; }
"$PY" -c "import sys, zipfile; print('\n'.join(sorted({n.split('/')[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()
                                                   if not n.split('/')[0].endswith('.dist-info')})))" "$wheel" > "$work/top"
if [ "$(cat "$work/top")" != "dilocox" ]; then echo "install-test: FAIL: top-level names $(tr '\n' ' ' < "$work/top")"; exit 1; fi
python3 -m venv "$work/venv"
V="$work/venv/bin"
"$V/pip" install -q --upgrade pip >/dev/null
"$V/pip" install -q python-daemon proto-plus 2>&1 | grep -v "^WARNING: Location" || true
"$V/pip" install -q "torch==$TORCH_VERSION"
"$V/pip" install -q "$wheel"
cd "$work"  # away from the checkout, whose folders would be importable from the current directory
"$V/python" - <<'PY'
import daemon, proto                      # python-daemon, proto-plus: still theirs
assert hasattr(daemon, "DaemonContext"), daemon.__file__
assert hasattr(proto, "Message"), proto.__file__
import dilocox, dilocox.daemon.cli, dilocox.peers.swarm, dilocox.proto.dilocox.v1.node_pb2  # ours
print("install-test: python-daemon", daemon.__file__, "| proto-plus", proto.__file__, "| dilocox", dilocox.__version__)
PY
"$V/dilocox-node" --help >/dev/null
"$V/dilocox-ctl" --help >/dev/null
"$V/dilocox-node" --version
"$V/python" -m dilocox --version
echo "install-test: ok"
