#!/usr/bin/env bash
# Real components for the integration tests and CI (issue 4):
#   - dockerd from Debian's docker.io, on a private socket
#   - a second dockerd on its own socket (docker2.sock), standing in for a
#     second host in the launch gate's tests (issue 13)
#   - Debian's docker-registry (distribution) on 127.0.0.1
#   - a PEP 503 package index on 127.0.0.1 serving the default recipe's pinned
#     vllm and flashinfer wheels (python3 -m http.server over a directory)
#   - a local base image with Python, made with mmdebstrap + docker import
#
# Usage by hand:   bash .ci/services.sh start|stop|status|env
# From .ci/run:    . .ci/services.sh && vo_services_start
#                  (exports DOCKER_HOST, VLLM_OVERLAY_TEST_* into the caller)
#
# Every step is idempotent: what is installed, running, downloaded or built
# already is reused. Progress goes to stderr; `start` and `env` print
# `export NAME=VALUE` lines on stdout, so `eval "$(bash .ci/services.sh start)"`
# works too. The same NAME=VALUE lines are written to $VO_ENV_FILE for tests
# (tools/services.py reads it).
#
# This script keeps the daemon plumbing (packages, start/stop/wait, the env
# file, the base image); port picking, the index's wheels and pages, and JSON
# parsing are Python: `python3 -m tools.services pick-port|prepare-index|
# json-field`, run from the repository root (tools/services.py).
#
# Settings (environment, all optional):
#   VLLM_OVERLAY_CACHE        cache root (default ~/.cache/vllm-overlay);
#                             wheels in index/, the base rootfs tar in base/
#   VO_STATE_DIR              sockets, pid files, logs, env file
#                             (default /run/vllm-overlay)
#   VO_DATA_DIR               docker data roots (docker/, docker2/), registry
#                             storage (default /var/lib/vllm-overlay)
#   VO_REGISTRY_PORT          preferred registry port (default 5000)
#   VO_INDEX_PORT             preferred package index port (default 5001)
#   VO_STORAGE_DRIVER         force a docker storage driver (default: overlay2
#                             when an overlay mount works here, else vfs)
#   VO_DEBIAN_MIRROR          mirror for mmdebstrap (default: mmdebstrap's own)
#   VO_START_TIMEOUT          seconds to wait for each service (default 60)

VO_STATE_DIR=${VO_STATE_DIR:-/run/vllm-overlay}
VO_DATA_DIR=${VO_DATA_DIR:-/var/lib/vllm-overlay}
VO_CACHE_DIR=${VLLM_OVERLAY_CACHE:-${HOME:-/root}/.cache/vllm-overlay}
# Absolute, so they mean the same in the repository root, where Python runs.
[[ $VO_STATE_DIR == /* ]] || VO_STATE_DIR=$PWD/$VO_STATE_DIR
[[ $VO_DATA_DIR == /* ]] || VO_DATA_DIR=$PWD/$VO_DATA_DIR
[[ $VO_CACHE_DIR == /* ]] || VO_CACHE_DIR=$PWD/$VO_CACHE_DIR
# The checkout this script is in: tools/services.py is imported from there.
VO_REPO=$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
VO_ENV_FILE=${VO_ENV_FILE:-$VO_STATE_DIR/env}
VO_DOCKER_SOCK=$VO_STATE_DIR/docker.sock
VO_DOCKER2_SOCK=$VO_STATE_DIR/docker2.sock
VO_BASE_IMAGE=${VO_BASE_IMAGE:-vllm-overlay-test/debian-python:bookworm-dev}
VO_START_TIMEOUT=${VO_START_TIMEOUT:-60}
# docker.io's client, not whatever `docker` comes first on PATH.
VO_DOCKER_CLI=${VO_DOCKER_CLI:-/usr/bin/docker}

vo_log() { printf 'services: %s\n' "$*" >&2; }
# One clear line, then leave the (sub)shell that runs the step.
vo_die() { printf 'services: error: %s\n' "$*" >&2; exit 1; }

# python3 -m tools.services ARGS... from the repository root (a subshell: the
# caller's directory stays). It prints its own `services: error:` line.
vo_py() { (cd "$VO_REPO" && python3 -m tools.services "$@"); }

# Seconds since an epoch, with a fraction, for the timings printed.
vo_now() { date +%s.%N; }
vo_since() { awk -v a="$1" -v b="$(vo_now)" 'BEGIN { printf "%.1f", b - a }'; }

# --- processes ---------------------------------------------------------------

# vo_pid_alive NAME EXE: the pid in $VO_STATE_DIR/NAME.pid runs EXE.
vo_pid_alive() {
  local pidfile=$VO_STATE_DIR/$1.pid pid
  [[ -s $pidfile ]] || return 1
  pid=$(<"$pidfile")
  [[ $pid =~ ^[0-9]+$ ]] && [[ -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$2"
}

# Does pid $1 exist and is it no zombie? (PID 1 here may not reap at once.)
vo_pid_exists() {
  local state
  state=$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n $state && $state != Z ]]
}

# vo_spawn NAME LOG CMD...: start CMD detached (own session, no stdin),
# record its pid in $VO_STATE_DIR/NAME.pid.
vo_spawn() {
  local name=$1 log=$2
  shift 2
  setsid "$@" </dev/null >>"$log" 2>&1 &
  echo $! >"$VO_STATE_DIR/$name.pid"
}

# vo_wait NAME EXE LOG CHECK...: wait until CHECK succeeds; fail early if the
# process died, naming the last line of its log. The pid was just spawned, so
# only its being alive is checked: right after the fork it is still a copy of
# this shell, not yet EXE (matching EXE here made a slow exec look like death).
vo_wait() {
  local name=$1 log=$3 deadline=$((SECONDS + VO_START_TIMEOUT)) pid
  shift 3
  pid=$(<"$VO_STATE_DIR/$name.pid")
  until "$@" >/dev/null 2>&1; do
    if ! vo_pid_exists "$pid"; then
      vo_die "$name exited while starting: $(tail -n 1 "$log" 2>/dev/null) (log: $log)"
    fi
    ((SECONDS < deadline)) || vo_die "$name did not answer within ${VO_START_TIMEOUT}s (log: $log)"
    sleep 0.2
  done
}

# vo_stop_one NAME EXE: SIGTERM the recorded pid, wait, SIGKILL if it hangs.
vo_stop_one() {
  local name=$1 exe=$2 pid i
  if ! vo_pid_alive "$name" "$exe"; then
    rm -f "$VO_STATE_DIR/$name.pid"
    vo_log "$name: not running"
    return 0
  fi
  pid=$(<"$VO_STATE_DIR/$name.pid")
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < 150; i++)); do
    vo_pid_exists "$pid" || break
    sleep 0.2
  done
  if vo_pid_exists "$pid"; then
    vo_log "$name: pid $pid did not stop in 30s, killing it"
    kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$VO_STATE_DIR/$name.pid"
  vo_log "$name: stopped (pid $pid)"
}

# vo_pick_port PREFERRED: PREFERRED if free on 127.0.0.1, else the next free
# one above it (bound as the servers bind: with SO_REUSEADDR).
vo_pick_port() { vo_py pick-port "$1"; }

# --- 1. Debian packages ------------------------------------------------------

vo_install_packages() {
  local want=(docker.io docker-registry mmdebstrap curl ca-certificates) missing=() p
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    vo_log "packages: ${want[*]} already installed"
    return 0
  fi
  [[ $(id -u) == 0 ]] || vo_die "packages ${missing[*]} are missing and installing them needs root"
  local t0 log=$VO_STATE_DIR/apt.log
  t0=$(vo_now)
  vo_log "packages: installing ${missing[*]} (log: $log)"
  # policy-rc.d keeps the packages' own services (docker, registry) from
  # starting system-wide: this script runs private instances instead.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
  fi
  local rc=0
  {
    DEBIAN_FRONTEND=noninteractive apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  } </dev/null >"$log" 2>&1 || rc=$?
  ((made_policy)) && rm -f "$policy"
  ((rc == 0)) || vo_die "apt-get could not install ${missing[*]}: $(grep -m 1 -E '^E:' "$log") (log: $log)"
  vo_log "packages: installed in $(vo_since "$t0")s"
}

# --- 2. dockerd ----------------------------------------------------------------

vo_docker() { DOCKER_HOST=unix://$VO_DOCKER_SOCK "$VO_DOCKER_CLI" "$@"; }
vo_docker_ping() { vo_engine_ping "$VO_DOCKER_SOCK"; }
vo_docker2_ping() { vo_engine_ping "$VO_DOCKER2_SOCK"; }

# Which storage driver to use, and why, on stdout as "DRIVER reason".
vo_storage_driver() {
  if [[ -n ${VO_STORAGE_DRIVER:-} ]]; then
    echo "$VO_STORAGE_DRIVER (VO_STORAGE_DRIVER)"
    return 0
  fi
  # overlay2 needs an overlay mount whose upper dir lives on the data root.
  local probe err
  probe=$(mktemp -d "$VO_DATA_DIR/overlay-probe.XXXXXX")
  mkdir -p "$probe"/{lower,upper,work,merged}
  if err=$(mount -t overlay overlay \
    -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" 2>&1); then
    umount "$probe/merged"
    echo "overlay2 (overlay mount on $VO_DATA_DIR works)"
  else
    echo "vfs (overlay mount on $VO_DATA_DIR failed: ${err//$'\n'/ })"
  fi
  rm -rf "$probe"
}

# vo_engine_ping SOCK: the engine on SOCK answers _ping.
vo_engine_ping() { curl -sf --max-time 2 --unix-socket "$1" http://docker/_ping | grep -qx OK; }

# vo_start_engine NAME MATCH SOCK DATA_ROOT EXEC_ROOT DRIVER REASON: start a
# private dockerd (pid in $VO_STATE_DIR/NAME.pid, its command line holding
# MATCH) on unix://SOCK, unless one answers there already.
vo_start_engine() {
  local name=$1 match=$2 sock=$3 data=$4 exec_root=$5 driver=$6 reason=$7
  local log=$VO_STATE_DIR/$name.log
  if vo_pid_alive "$name" "$match" && vo_engine_ping "$sock"; then
    vo_log "$name: already running (pid $(<"$VO_STATE_DIR/$name.pid"), $sock)"
    return 0
  fi
  vo_pid_alive "$name" "$match" && vo_die "$name (pid $(<"$VO_STATE_DIR/$name.pid")) runs but does not answer on $sock; run: bash .ci/services.sh stop"
  command -v dockerd >/dev/null || vo_die "dockerd not found (Debian package docker.io)"
  mkdir -p "$data" "$exec_root"
  vo_log "$name: storage driver $driver $reason"
  # Left behind by a dockerd that was killed: dockerd refuses to start while
  # its pid file names a live (or unreaped) process.
  rm -f "$sock" "$VO_STATE_DIR/$name.own.pid"
  local t0
  t0=$(vo_now)
  # Own exec root and containerd (dockerd starts its own under exec-root), so
  # nothing is shared with a system docker or the other engine. No iptables,
  # no bridge: builds and containers use host networking (or none), so two
  # engines on one host never clash over networks. Registries on 127.0.0.0/8
  # (the local one) are insecure by default: plain http, no flag needed.
  vo_spawn "$name" "$log" dockerd \
    --host "unix://$sock" \
    --data-root "$data" \
    --exec-root "$exec_root" \
    --pidfile "$VO_STATE_DIR/$name.own.pid" \
    --storage-driver "$driver" \
    --iptables=false --ip-masq=false --bridge=none
  vo_wait "$name" dockerd "$log" vo_engine_ping "$sock"
  local info got
  info=$(curl -sf --unix-socket "$sock" http://docker/info) ||
    vo_die "$name answers _ping but not /info (log: $log)"
  got=$(vo_py json-field Driver <<<"$info") || exit 1
  [[ $got == "$driver" ]] || vo_die "$name runs with storage driver $got, asked for $driver (log: $log)"
  vo_log "$name: up in $(vo_since "$t0")s (pid $(<"$VO_STATE_DIR/$name.pid"), unix://$sock, $got, log: $log)"
}

vo_start_dockerd() {
  if vo_pid_alive dockerd dockerd && vo_docker_ping; then
    vo_log "dockerd: already running (pid $(<"$VO_STATE_DIR/dockerd.pid"), $VO_DOCKER_SOCK)"
    return 0
  fi
  local driver reason
  read -r driver reason < <(vo_storage_driver)
  vo_start_engine dockerd dockerd "$VO_DOCKER_SOCK" "$VO_DATA_DIR/docker" "$VO_STATE_DIR/docker-exec" \
    "$driver" "$reason"
}

# The second engine stands in for a second host (the launch gate's tests): its
# own socket, data root, exec root and pid file, and the first engine's
# storage driver (read from the running first engine, so both choose alike).
vo_start_dockerd2() {
  local info driver
  info=$(curl -sf --unix-socket "$VO_DOCKER_SOCK" http://docker/info) ||
    vo_die "dockerd2: the first engine does not answer /info on $VO_DOCKER_SOCK"
  driver=$(vo_py json-field Driver <<<"$info") || exit 1
  vo_start_engine dockerd2 "unix://$VO_DOCKER2_SOCK" "$VO_DOCKER2_SOCK" "$VO_DATA_DIR/docker2" \
    "$VO_STATE_DIR/docker2-exec" "$driver" "(as the first engine)"
}

# --- 3. registry ---------------------------------------------------------------

vo_registry_addr() { cat "$VO_STATE_DIR/registry.addr" 2>/dev/null; }
vo_registry_ping() { curl -sf --max-time 2 -o /dev/null "http://$(vo_registry_addr)/v2/"; }

vo_start_registry() {
  local log=$VO_STATE_DIR/registry.log config=$VO_STATE_DIR/registry.yml port
  if vo_pid_alive registry docker-registry && vo_registry_ping; then
    vo_log "registry: already running (pid $(<"$VO_STATE_DIR/registry.pid"), $(vo_registry_addr))"
    return 0
  fi
  vo_stop_one registry docker-registry 2>/dev/null
  command -v docker-registry >/dev/null || vo_die "docker-registry not found (Debian package docker-registry)"
  port=$(vo_pick_port "${VO_REGISTRY_PORT:-5000}") || exit 1
  mkdir -p "$VO_DATA_DIR/registry"
  # No auth, plain http, loopback only; deletes allowed so tests can clean up.
  cat >"$config" <<EOF
version: 0.1
log:
  level: info
  fields:
    service: registry
storage:
  filesystem:
    rootdirectory: $VO_DATA_DIR/registry
  delete:
    enabled: true
  cache:
    blobdescriptor: inmemory
http:
  addr: 127.0.0.1:$port
  headers:
    X-Content-Type-Options: [nosniff]
EOF
  echo "127.0.0.1:$port" >"$VO_STATE_DIR/registry.addr"
  local t0
  t0=$(vo_now)
  REGISTRY_HTTP_SECRET=vllm-overlay-test vo_spawn registry "$log" docker-registry serve "$config"
  vo_wait registry docker-registry "$log" vo_registry_ping
  vo_log "registry: up in $(vo_since "$t0")s (pid $(<"$VO_STATE_DIR/registry.pid"), http://127.0.0.1:$port/v2/, storage $VO_DATA_DIR/registry)"
}

# --- 4. package index ----------------------------------------------------------

vo_index_root() { echo "$VO_CACHE_DIR/index"; }
vo_index_addr() { cat "$VO_STATE_DIR/index.addr" 2>/dev/null; }
# The root page lists the pinned projects; it is written only once every
# wheel is in place.
vo_index_ping() { curl -sf --max-time 2 "http://$(vo_index_addr)/simple/" | grep -q 'href='; }

# Download (once) and check the default recipe's vllm and flashinfer wheels;
# lay out a PEP 503 tree:
#   index/files/<wheel>, index/simple/index.html, index/simple/<name>/index.html
vo_prepare_index() {
  vo_py prepare-index --cache "$VO_CACHE_DIR" --root "$(vo_index_root)" \
    --pip-log "$VO_STATE_DIR/pip-download.log" || exit 1
}

vo_start_index() {
  local log=$VO_STATE_DIR/index.log port root
  vo_prepare_index
  root=$(vo_index_root)
  if vo_pid_alive index http.server && vo_index_ping &&
    [[ $(cat "$VO_STATE_DIR/index.root" 2>/dev/null) == "$root" ]]; then
    vo_log "index: already serving (pid $(<"$VO_STATE_DIR/index.pid"), http://$(vo_index_addr)/simple/)"
    return 0
  fi
  vo_stop_one index http.server 2>/dev/null
  port=$(vo_pick_port "${VO_INDEX_PORT:-5001}") || exit 1
  echo "127.0.0.1:$port" >"$VO_STATE_DIR/index.addr"
  echo "$root" >"$VO_STATE_DIR/index.root"
  vo_spawn index "$log" python3 -m http.server --bind 127.0.0.1 --directory "$root" "$port"
  vo_wait index http.server "$log" vo_index_ping
  vo_log "index: serving http://127.0.0.1:$port/simple/ from $root (pid $(<"$VO_STATE_DIR/index.pid"))"
}

# --- 5. base image -------------------------------------------------------------

vo_build_base_image() {
  if vo_docker image inspect "$VO_BASE_IMAGE" >/dev/null 2>&1; then
    vo_log "base image: $VO_BASE_IMAGE already present"
    return 0
  fi
  local dir=$VO_CACHE_DIR/base tar t0 log=$VO_STATE_DIR/mmdebstrap.log
  tar=$dir/debian-python-dev-bookworm.tar
  mkdir -p "$dir"
  if [[ -s $tar ]]; then
    vo_log "base image: using cached rootfs $tar"
  else
    command -v mmdebstrap >/dev/null || vo_die "mmdebstrap not found (Debian package mmdebstrap)"
    t0=$(vo_now)
    vo_log "base image: mmdebstrap bookworm (log: $log)"
    local mirror=()
    [[ -n ${VO_DEBIAN_MIRROR:-} ]] && mirror=("$VO_DEBIAN_MIRROR")
    mmdebstrap --variant=apt --format=tar --include=python3,python3-venv,python3-pip,python3-dev,ca-certificates \
      bookworm "$tar.part" "${mirror[@]}" </dev/null >"$log" 2>&1 ||
      { rm -rf "$tar.part"; vo_die "mmdebstrap failed: $(grep -m 1 -E '^E:' "$log") (log: $log)"; }
    mv -f "$tar.part" "$tar"
    vo_log "base image: rootfs made in $(vo_since "$t0")s ($(du -h "$tar" | cut -f1), $tar)"
  fi
  t0=$(vo_now)
  vo_docker import --change 'CMD ["/bin/bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$tar" "$VO_BASE_IMAGE" >/dev/null 2>"$VO_STATE_DIR/import.log" ||
    vo_die "docker import of $tar failed: $(tail -n 1 "$VO_STATE_DIR/import.log")"
  vo_log "base image: imported $VO_BASE_IMAGE in $(vo_since "$t0")s"
}

# --- environment ---------------------------------------------------------------

# NAME=VALUE lines (no quoting needed: no value has spaces).
vo_env_lines() {
  echo "DOCKER_HOST=unix://$VO_DOCKER_SOCK"
  echo "VLLM_OVERLAY_TEST_DOCKER_HOST2=unix://$VO_DOCKER2_SOCK"
  echo "VLLM_OVERLAY_TEST_REGISTRY=$(vo_registry_addr)"
  echo "VLLM_OVERLAY_TEST_INDEX=http://$(vo_index_addr)/simple/"
  echo "VLLM_OVERLAY_TEST_BASE_IMAGE=$VO_BASE_IMAGE"
}

vo_write_env() {
  vo_env_lines >"$VO_ENV_FILE.tmp" && mv -f "$VO_ENV_FILE.tmp" "$VO_ENV_FILE"
  vo_log "env: written to $VO_ENV_FILE"
}

# Export the env file's variables into the current shell.
vo_services_env() {
  [[ -s $VO_ENV_FILE ]] || { vo_log "error: $VO_ENV_FILE missing; run: bash .ci/services.sh start"; return 1; }
  local line
  while IFS= read -r line; do
    [[ $line == *=* ]] && export "${line?}"
  done <"$VO_ENV_FILE"
}

# --- commands ------------------------------------------------------------------

# Start everything. Runs in a subshell (so vo_die ends only the start, not a
# shell that sourced this file), then exports the result into the caller.
vo_services_start() {
  (
    set -uo pipefail
    mkdir -p "$VO_STATE_DIR" "$VO_DATA_DIR" "$VO_CACHE_DIR" || vo_die "cannot create $VO_STATE_DIR, $VO_DATA_DIR or $VO_CACHE_DIR"
    rm -f "$VO_ENV_FILE"
    vo_install_packages
    vo_start_dockerd
    vo_start_dockerd2
    vo_start_registry
    vo_start_index
    vo_build_base_image
    vo_write_env
  ) || return 1
  vo_services_env
}

vo_services_stop() {
  vo_stop_one index http.server
  vo_stop_one registry docker-registry
  vo_stop_one dockerd2 "unix://$VO_DOCKER2_SOCK"
  vo_stop_one dockerd dockerd
  # dockerd leaves these mounted on exit; unmount so the dirs can be removed.
  local m
  for m in "$VO_STATE_DIR/docker-exec/netns/default" "$VO_DATA_DIR/docker"; do
    if mountpoint -q "$m" 2>/dev/null && ! vo_pid_alive dockerd dockerd; then
      umount "$m" 2>/dev/null || vo_log "dockerd: could not unmount $m"
    fi
  done
  for m in "$VO_STATE_DIR/docker2-exec/netns/default" "$VO_DATA_DIR/docker2"; do
    if mountpoint -q "$m" 2>/dev/null && ! vo_pid_alive dockerd2 "unix://$VO_DOCKER2_SOCK"; then
      umount "$m" 2>/dev/null || vo_log "dockerd2: could not unmount $m"
    fi
  done
  rm -f "$VO_ENV_FILE" "$VO_STATE_DIR"/{registry,index}.addr "$VO_STATE_DIR/index.root"
}

vo_services_status() {
  local ok=0
  if vo_pid_alive dockerd dockerd && vo_docker_ping; then
    vo_log "dockerd: up (pid $(<"$VO_STATE_DIR/dockerd.pid"), unix://$VO_DOCKER_SOCK)"
  else
    vo_log "dockerd: down"; ok=1
  fi
  if vo_pid_alive dockerd2 "unix://$VO_DOCKER2_SOCK" && vo_docker2_ping; then
    vo_log "dockerd2: up (pid $(<"$VO_STATE_DIR/dockerd2.pid"), unix://$VO_DOCKER2_SOCK)"
  else
    vo_log "dockerd2: down"; ok=1
  fi
  if vo_pid_alive registry docker-registry && vo_registry_ping; then
    vo_log "registry: up (pid $(<"$VO_STATE_DIR/registry.pid"), $(vo_registry_addr))"
  else
    vo_log "registry: down"; ok=1
  fi
  if vo_pid_alive index http.server && vo_index_ping; then
    vo_log "index: up (pid $(<"$VO_STATE_DIR/index.pid"), http://$(vo_index_addr)/simple/)"
  else
    vo_log "index: down"; ok=1
  fi
  if ((ok == 0)) && vo_docker image inspect "$VO_BASE_IMAGE" >/dev/null 2>&1; then
    vo_log "base image: $VO_BASE_IMAGE present"
  else
    vo_log "base image: $VO_BASE_IMAGE not checked or absent"; ok=1
  fi
  return $ok
}

vo_main() {
  case ${1:-} in
    start) vo_services_start && vo_env_lines | sed 's/^/export /' ;;
    stop) vo_services_stop ;;
    status) vo_services_status ;;
    env) vo_services_env && sed 's/^/export /' "$VO_ENV_FILE" ;;
    *)
      echo "usage: bash .ci/services.sh start|stop|status|env" >&2
      return 2
      ;;
  esac
}

# Run as a script: act on the command; sourced: only define the functions.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  vo_main "$@"
  exit $?
fi
