#!/bin/sh
# hold-sigterm.sh SECONDS COMMAND [ARG...]: runs COMMAND, and passes it a SIGTERM (or SIGINT) only
# SECONDS after it came, then exits as COMMAND does. Compose has no preStop: an engine started through
# this outlives its shim's drain (docs/deployment.md), as deploy/k8s's engines do with theirs.
# Further signals change nothing: the engine's own shutdown (vLLM's --shutdown-timeout) runs whole,
# and the container's stop_grace_period, then SIGKILL, bounds it all.
hold=$1
shift
stopping=0
trap 'stopping=1' TERM INT
"$@" &
child=$!
# A signal ends `wait` early: wait again while the engine runs, and pass the first signal on once
# (checked before each wait, so one caught before the first wait starts is passed on too).
passed=0
while :; do
    if [ "$stopping" = 1 ] && [ "$passed" = 0 ]; then
        passed=1
        sleep "$hold"
        kill -TERM "$child" 2>/dev/null
    fi
    wait "$child"
    status=$?
    kill -0 "$child" 2>/dev/null || break
done
exit "$status"
