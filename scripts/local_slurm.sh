#!/usr/bin/env bash
# A real, throw-away Slurm cluster on this machine, for testing the usp Slurm launcher.
#
#   scripts/local_slurm.sh start [--nodes N] [--cpus C] [--gpus G]   (root)
#   scripts/local_slurm.sh stop                                      (root)
#   scripts/local_slurm.sh status
#
# munged + slurmctld + N slurmd daemons (node1..nodeN, all on 127.0.0.1), every file
# under $USP_SLURM_DIR (default /tmp/usp-slurm). Clients need SLURM_CONF: `start` prints
# the export line and writes it to $USP_SLURM_DIR/env. See docs/slurm_local.md ("Settings
# and why" says why each setting is what it is).
set -euo pipefail

DIR=${USP_SLURM_DIR:-/tmp/usp-slurm}
CTLD_PORT=${USP_SLURM_CTLD_PORT:-6817}
SLURMD_PORT_BASE=${USP_SLURM_SLURMD_PORT:-6820}   # node i listens on base + i
READY_TIMEOUT=${USP_SLURM_READY_TIMEOUT:-30}
STOP_TIMEOUT=15
ETC_CONF=/etc/slurm/slurm.conf
PKGS=(slurmctld slurmd slurm-client munge)
MUNGE_RUN=/run/munge

CONF=$DIR/slurm.conf
NODES=2 CPUS='' GPUS=4 REQ_CPUS=

log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------- processes

# Alive = /proc entry exists and is not a zombie: PID 1 here is no real init, so
# exited daemons linger as zombies for a while.
pid_alive() {
  local pid=$1 stat
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

# The pid in pid file $1, if that process is alive and its command line contains $2
# (a guard against a recycled pid; processes are found by pid file, never by name).
pidfile_pid() {
  local file=$1 want=$2 pid
  [[ -r $file ]] || return 1
  pid=$(tr -dc 0-9 <"$file")
  pid_alive "$pid" || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$want" || return 1
  echo "$pid"
}

# SIGTERM the process of pid file $1, wait until it is gone, SIGKILL after a timeout.
stop_pidfile() {
  local file=$1 want=$2 pid i
  if pid=$(pidfile_pid "$file" "$want"); then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
      pid_alive "$pid" || break
      sleep 0.1
    done
    if pid_alive "$pid"; then
      log "$want (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      for ((i = 0; i < 50; i++)); do pid_alive "$pid" || break; sleep 0.1; done
    fi
  fi
  rm -f "$file"
}

# Run a self-daemonizing program fully detached from the caller: its own session (it
# survives the calling shell), stdio to its log (so a caller capturing our output is not
# held open), and no inherited fds above 2 (e.g. a caller's flock fd or our own lock).
spawn() {
  local out=$1; shift
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
    exec setsid "$@" </dev/null >>"$out" 2>&1
  )
}

# Wait up to $2 seconds for file $1 to hold a live pid.
wait_pidfile() {
  local file=$1 want=$2 secs=$3 i
  for ((i = 0; i < secs * 10; i++)); do
    pidfile_pid "$file" "$want" >/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# ---------------------------------------------------------------- setup pieces

require_root() { [[ $(id -u) == 0 ]] || die "'$1' must run as root"; }

# Our directory: refuse to take over a non-empty directory we did not create.
claim_dir() {
  [[ $DIR == /* && $DIR != / ]] || die "USP_SLURM_DIR must be an absolute path other than /: $DIR"
  if [[ -d $DIR && ! -e $DIR/.usp-local-slurm ]] && [[ -n $(ls -A "$DIR") ]]; then
    die "$DIR exists and was not made by this script; set USP_SLURM_DIR elsewhere"
  fi
  mkdir -p "$DIR"
  chmod 0755 "$DIR"   # jobs of non-root users must reach the spool dirs
  touch "$DIR/.usp-local-slurm"
}

# Serialise start/stop (e.g. parallel test workers); fd 9 is closed in the daemons.
take_lock() {
  exec 9>"$DIR/.lock"
  flock -w 120 9 || die "another local_slurm.sh holds $DIR/.lock"
}

ensure_packages() {
  local b missing=0
  for b in slurmctld slurmd sbatch munged; do
    command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || missing=1
  done
  ((missing)) || return 0
  log "installing ${PKGS[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null
}

# munge authenticates every Slurm RPC. Reuse a munged that already works (and leave it
# running on stop); otherwise start one and record its pid as ours.
start_munge() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  if pidfile_pid "$DIR/run/munged.pid" munged >/dev/null; then return 0; fi
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "using the munged that is already running"
    return 0
  fi
  # No systemd: make the runtime dir ourselves; drop leftovers of an unclean stop.
  mkdir -p "$MUNGE_RUN" /var/lib/munge /var/log/munge
  chown munge:munge "$MUNGE_RUN" /var/lib/munge /var/log/munge
  chmod 0755 "$MUNGE_RUN"
  if ! pidfile_pid "$MUNGE_RUN/munged.pid" munged >/dev/null; then
    rm -f "$MUNGE_RUN"/munge.socket.2 "$MUNGE_RUN"/munge.socket.2.lock "$MUNGE_RUN"/munged.pid
  fi
  spawn "$DIR/log/munged.out" runuser -u munge -- /usr/sbin/munged
  wait_pidfile "$MUNGE_RUN/munged.pid" munged 10 || { tail_logs; die "munged did not start"; }
  cp "$MUNGE_RUN/munged.pid" "$DIR/run/munged.pid"
  munge -n | unmunge >/dev/null || die "munge -n | unmunge fails"
}

# Fake GPUs: gres.conf needs character devices; clones of /dev/null (1,3) will do.
make_fake_gpus() {
  local i
  mkdir -p "$DIR/dev"
  for ((i = 0; i < GPUS; i++)); do
    [[ -c $DIR/dev/gpu$i ]] || { rm -f "$DIR/dev/gpu$i"; mknod -m 0666 "$DIR/dev/gpu$i" c 1 3; }
  done
}

write_conf() {
  local real_cpus real_mem i overrides=''
  # What slurmd sees; declaring more than this marks a node INVALID unless overridden.
  read -r real_cpus real_mem < <(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*RealMemory=\([0-9]*\).*/\1 \2/p')
  [[ -n $real_cpus && -n $real_mem ]] || die "cannot parse 'slurmd -C'"
  CPUS=${CPUS:-$real_cpus}
  if ((CPUS > real_cpus)); then overrides='SlurmdParameters=config_overrides'; fi

  cat >"$CONF" <<EOF
# Written by scripts/local_slurm.sh: a local test cluster. Regenerated on every start.
ClusterName=usp-local
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Requeued jobs wait cred_expire before rerunning (default 120 s).
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# Cores only: with memory as a resource each job would take a whole node.
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
JobRequeue=1
# Finished jobs stay visible to 'scontrol show job' for 10 minutes.
MinJobAge=600
KillWait=5
# Reject impossible requests at submit instead of pending forever.
EnforcePartLimits=ALL
GresTypes=gpu
MailProg=/bin/true
$overrides
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
EOF
  for ((i = 1; i <= NODES; i++)); do
    echo "NodeName=node$i NodeAddr=127.0.0.1 NodeHostname=node$i Port=$((SLURMD_PORT_BASE + i)) CPUs=$CPUS RealMemory=$real_mem Gres=gpu:$GPUS State=UNKNOWN" >>"$CONF"
  done
  # OverSubscribe=FORCE:4: up to 4 jobs share a core, so several small test jobs run at once.
  echo "PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >>"$CONF"

  # slurmd 22.05 always loads a cgroup plugin; v1 without automount is inert here.
  printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' >"$DIR/cgroup.conf"
  local files=$DIR/dev/gpu0
  if ((GPUS > 1)); then files="$DIR/dev/gpu[0-$((GPUS - 1))]"; fi
  printf 'AutoDetect=off\nNodeName=node[1-%d] Name=gpu File=%s\n' "$NODES" "$files" >"$DIR/gres.conf"
  chmod 0644 "$CONF" "$DIR/cgroup.conf" "$DIR/gres.conf"
}

# /etc/hosts is rewritten in place (it may be a bind mount, so no rename over it).
remove_hosts_line() {
  local tmp
  has_hosts_line || return 0
  tmp=$(awk -v m=" $HOSTS_MARK" 'substr($0, length($0) - length(m) + 1) != m' /etc/hosts)
  printf '%s\n' "$tmp" >/etc/hosts
}

has_hosts_line() {
  awk -v m=" $HOSTS_MARK" 'substr($0, length($0) - length(m) + 1) == m {found = 1} END {exit !found}' /etc/hosts
}

# Node names must resolve: torchrun rendezvous uses `scontrol show hostnames | head -1`.
add_hosts_line() {
  local i names=''
  for ((i = 1; i <= NODES; i++)); do names+=" node$i"; done
  remove_hosts_line
  echo "127.0.0.1$names $HOSTS_MARK" >>/etc/hosts
}

# Plain `sbatch` (no SLURM_CONF) reads /etc/slurm/slurm.conf: link it to ours, but never
# replace a real one.
link_etc_conf() {
  if [[ ! -e $ETC_CONF && ! -L $ETC_CONF ]]; then
    mkdir -p "${ETC_CONF%/*}"
    ln -s "$CONF" "$ETC_CONF"
  elif [[ $(readlink "$ETC_CONF" 2>/dev/null) != "$CONF" ]]; then
    log "$ETC_CONF exists and is not ours: clients need SLURM_CONF=$CONF"
  fi
}

unlink_etc_conf() {
  if [[ -L $ETC_CONF && $(readlink "$ETC_CONF") == "$CONF" ]]; then rm -f "$ETC_CONF"; fi
}

tail_logs() {
  local f
  for f in "$DIR"/log/*; do
    [[ -s $f ]] || continue
    echo "----- $f (last 20 lines)" >&2
    tail -n 20 "$f" >&2
  done
}

# Poll sinfo until every node is up: idle on a fresh start; mix/alloc too when `start`
# finds a running cluster with jobs on it. A flag suffix (*, ~, #...) means not ready.
wait_ready() {
  local i up
  for ((i = 0; i < READY_TIMEOUT * 10; i++)); do
    up=$(SLURM_CONF=$CONF sinfo -h -N -p debug -o '%N %t' 2>/dev/null \
      | awk '$2 == "idle" || $2 == "mix" || $2 == "alloc" {print $1}' | sort -u | wc -l) || up=0
    ((up == NODES)) && return 0
    sleep 0.1
  done
  SLURM_CONF=$CONF sinfo -N -l >&2 || true
  tail_logs
  die "the nodes did not all come up within ${READY_TIMEOUT}s (logs above, under $DIR/log)"
}

# ---------------------------------------------------------------- state

# What a running cluster was started with; `start` with other arguments restarts it.
signature() { echo "nodes=$NODES cpus=${REQ_CPUS:-auto} gpus=$GPUS dir=$DIR port=$CTLD_PORT"; }

# True when slurmctld and every slurmd recorded in $DIR/started are alive.
is_running() {
  local n i
  [[ -r $DIR/started ]] || return 1
  n=$(sed -n 's/^nodes=\([0-9]*\).*/\1/p' "$DIR/started")
  [[ -n $n ]] || return 1
  pidfile_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null || return 1
  for ((i = 1; i <= n; i++)); do
    pidfile_pid "$DIR/run/slurmd-node$i.pid" slurmd >/dev/null || return 1
  done
}

env_line() { echo "export SLURM_CONF=$CONF"; }

# ---------------------------------------------------------------- commands

cmd_start() {
  local i t0=$SECONDS
  require_root start
  claim_dir
  take_lock
  ensure_packages

  if is_running && [[ $(cat "$DIR/started") == "$(signature)" ]]; then
    SLURM_CONF=$CONF wait_ready
    log "already running ($(signature))"
    env_line
    return 0
  fi
  stop_all   # partial, stale or differently-sized cluster: start from nothing
  if (exec 3<>"/dev/tcp/127.0.0.1/$CTLD_PORT") 2>/dev/null; then
    die "port $CTLD_PORT is in use (another cluster? stop it, or set USP_SLURM_CTLD_PORT/USP_SLURM_SLURMD_PORT)"
  fi
  # A failed start takes down what it started (logs stay in $DIR/log).
  trap 'if (($? != 0)); then log "start failed: stopping what was started"; stop_all; fi' EXIT

  # Clean start: fresh state (job ids restart at 1) and spool; logs of this run only.
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
  mkdir -p "$DIR/state" "$DIR/log" "$DIR/run"
  for ((i = 1; i <= NODES; i++)); do mkdir -p "$DIR/spool/node$i"; done
  chmod 0755 "$DIR/state" "$DIR/spool" "$DIR"/spool/* "$DIR/log" "$DIR/run"

  start_munge
  make_fake_gpus
  write_conf
  add_hosts_line
  link_etc_conf

  export SLURM_CONF=$CONF
  spawn "$DIR/log/slurmctld.out" slurmctld -f "$CONF" -c
  wait_pidfile "$DIR/run/slurmctld.pid" slurmctld 10 || { tail_logs; die "slurmctld did not start"; }
  for ((i = 1; i <= NODES; i++)); do
    spawn "$DIR/log/slurmd-node$i.out" slurmd -f "$CONF" -N "node$i"
  done
  for ((i = 1; i <= NODES; i++)); do
    wait_pidfile "$DIR/run/slurmd-node$i.pid" slurmd 10 || { tail_logs; die "slurmd node$i did not start"; }
  done
  signature >"$DIR/started"
  wait_ready

  env_line >"$DIR/env"
  trap - EXIT
  log "ready in $((SECONDS - t0))s: $NODES node(s) node[1-$NODES], partition debug; source $DIR/env"
  env_line
}

# Stop everything we started, in reverse order. Safe to call when nothing runs.
stop_all() {
  local f i ids
  if pidfile_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
    # Cancel jobs first, so no training processes outlive the cluster.
    ids=$(SLURM_CONF=$CONF squeue -h -r -o %A 2>/dev/null | sort -u) || ids=''
    # shellcheck disable=SC2086  # one argument per job id
    [[ -z $ids ]] || SLURM_CONF=$CONF scancel --full $ids 2>/dev/null || true
    for ((i = 0; i < 200; i++)); do
      [[ -z $(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null) ]] && break
      sleep 0.1
    done
    [[ -z $(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null) ]] || log "warning: jobs still listed after scancel"
  fi
  for f in "$DIR"/run/slurmd-*.pid; do
    if [[ -e $f ]]; then stop_pidfile "$f" slurmd; fi
  done
  stop_pidfile "$DIR/run/slurmctld.pid" slurmctld
  if [[ -e $DIR/run/munged.pid ]]; then
    stop_pidfile "$DIR/run/munged.pid" munged
    rm -f "$MUNGE_RUN"/munge.socket.2 "$MUNGE_RUN"/munge.socket.2.lock "$MUNGE_RUN"/munged.pid
  fi
  remove_hosts_line
  unlink_etc_conf
  rm -f "$DIR/started" "$DIR/env"
}

cmd_stop() {
  require_root stop
  [[ -e $DIR/.usp-local-slurm ]] || { log "not running (no $DIR)"; return 0; }
  take_lock
  stop_all
  log "stopped"
}

cmd_status() {
  if is_running; then
    echo "running: $(cat "$DIR/started")"
    SLURM_CONF=$CONF sinfo -N -o '%N %P %t %c %G' || true
    env_line
  else
    echo "not running (USP_SLURM_DIR=$DIR)"
    return 1
  fi
}

usage() {
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
}

main() {
  local cmd=${1:-}
  [[ $# -gt 0 ]] && shift
  while [[ $# -gt 0 ]]; do
    case $1 in
      --nodes) NODES=${2:?}; shift 2 ;;
      --cpus) CPUS=${2:?}; shift 2 ;;
      --gpus) GPUS=${2:?}; shift 2 ;;
      -h | --help) usage; exit 0 ;;
      *) usage >&2; die "unknown argument: $1" ;;
    esac
  done
  [[ $NODES =~ ^[1-9][0-9]*$ ]] || die "--nodes wants a positive integer"
  [[ -z $CPUS || $CPUS =~ ^[1-9][0-9]*$ ]] || die "--cpus wants a positive integer"
  [[ $GPUS =~ ^[1-9][0-9]*$ ]] || die "--gpus wants a positive integer"
  CONF=$DIR/slurm.conf
  HOSTS_MARK="# usp-local-slurm $DIR"   # marks our /etc/hosts line
  REQ_CPUS=$CPUS
  case $cmd in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
