# Shared helpers for scripts/demo.sh, bench-overhead.sh and bench-hedge.sh.
# Source it; it needs bash. Nothing here needs tools beyond bash and
# coreutils: ports are probed through bash's /dev/tcp.

# Process ids (each the leader of its own process group) that cleanup stops.
_started_pids=()
_started_names=()

# log MESSAGE... prints a progress message on stderr.
log() { printf '%s: %s\n' "${SCRIPT_NAME:-script}" "$*" >&2; }

# die MESSAGE... prints an error and exits (the EXIT trap cleans up).
die() { log "error: $*"; exit 1; }

# port_in_use PORT reports whether something accepts connections on
# 127.0.0.1:PORT.
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# require_free_ports PORT... fails if any port is taken.
require_free_ports() {
	local p busy=()
	for p in "$@"; do
		if port_in_use "$p"; then busy+=("$p"); fi
	done
	if [ ${#busy[@]} -gt 0 ]; then
		die "port(s) ${busy[*]} on 127.0.0.1 already in use; stop what listens there (ss -ltnp) and retry"
	fi
}

# start_bg NAME LOGFILE CMD [ARGS...] starts CMD in the background in its
# own process group (so that cleanup can stop it with everything it spawns),
# with stdout and stderr to LOGFILE.
start_bg() {
	local name=$1 logfile=$2
	shift 2
	if command -v setsid >/dev/null 2>&1; then
		# The child of "&" is not a process group leader, so setsid does not
		# fork again: $! is the program, and the leader of its new group.
		setsid "$@" >"$logfile" 2>&1 </dev/null &
	else
		"$@" >"$logfile" 2>&1 </dev/null &
	fi
	_started_pids+=("$!")
	_started_names+=("$name")
	log "started $name (pid $!), log $logfile"
}

# alive PID reports whether the process still runs (and is not a zombie).
alive() {
	kill -0 "$1" 2>/dev/null || return 1
	local state=""
	if [ -r "/proc/$1/stat" ]; then
		state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)
	elif command -v ps >/dev/null 2>&1; then
		state=$(ps -o stat= -p "$1" 2>/dev/null || true)
	fi
	[ "${state#Z}" = "$state" ]
}

# wait_ports NAME PID LOGFILE TIMEOUT_SECONDS PORT... waits until every
# port accepts connections; fails early, showing the log, if PID exits.
wait_ports() {
	local name=$1 pid=$2 logfile=$3 timeout=$4
	shift 4
	local deadline=$((SECONDS + timeout)) p
	for p in "$@"; do
		until port_in_use "$p"; do
			if ! alive "$pid"; then
				log "$name exited before listening on port $p; last lines of $logfile:"
				tail -n 20 "$logfile" >&2 || true
				exit 1
			fi
			if [ "$SECONDS" -ge "$deadline" ]; then
				log "$name not listening on port $p after ${timeout}s; last lines of $logfile:"
				tail -n 20 "$logfile" >&2 || true
				exit 1
			fi
			sleep 0.1
		done
	done
	log "$name ready (ports $*)"
}

# run_fg CMD [ARGS...] runs CMD with the script's stdout and stderr and
# waits for it. It runs as a background job so that the script's traps run
# at once on TERM instead of after CMD ends; stop_all interrupts it first.
_fg_pid=""
run_fg() {
	"$@" &
	_fg_pid=$!
	local rc=0
	wait "$_fg_pid" || rc=$?
	_fg_pid=""
	return "$rc"
}

# stop_all interrupts the run_fg command (it prints its partial summary),
# then stops every started process group: TERM, up to 5 s of grace, then
# KILL. Safe to call more than once.
stop_all() {
	if [ -n "$_fg_pid" ]; then
		kill -INT "$_fg_pid" 2>/dev/null || true
		wait "$_fg_pid" 2>/dev/null || true
		_fg_pid=""
	fi
	local i pid n=${#_started_pids[@]}
	[ "$n" -eq 0 ] && return 0
	for ((i = n - 1; i >= 0; i--)); do
		pid=${_started_pids[$i]}
		kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
	done
	local deadline=$((SECONDS + 5)) left
	while :; do
		left=0
		for pid in "${_started_pids[@]}"; do
			if alive "$pid"; then left=1; fi
		done
		[ "$left" -eq 0 ] && break
		if [ "$SECONDS" -ge "$deadline" ]; then
			for pid in "${_started_pids[@]}"; do
				kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
			done
			break
		fi
		sleep 0.1
	done
	for ((i = 0; i < n; i++)); do
		wait "${_started_pids[$i]}" 2>/dev/null || true
	done
	log "stopped ${_started_names[*]}"
	_started_pids=()
	_started_names=()
}

# install_cleanup installs traps that stop everything on exit, Ctrl-C and
# TERM. An interrupted script exits with 130 (INT) or 143 (TERM).
install_cleanup() {
	trap 'stop_all' EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
}

# build_all LOGDIR builds ./caddy (cached by source hash) and bin/mockllm,
# bin/llmload, with the output of xcaddy in LOGDIR/build.log.
build_all() {
	log "building ./caddy (./xcaddy.sh: cached by source hash, a cold build takes minutes)"
	if ! ./xcaddy.sh >"$1/build.log" 2>&1; then
		tail -n 30 "$1/build.log" >&2
		die "./xcaddy.sh failed; full output in $1/build.log"
	fi
	log "building bin/mockllm and bin/llmload"
	mkdir -p bin
	go build -o bin/ ./cmd/mockllm ./cmd/llmload
}
