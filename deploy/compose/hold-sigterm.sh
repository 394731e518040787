#!/bin/sh
# hold-sigterm.sh SECONDS COMMAND [ARG...]: runs COMMAND, and passes it a SIGTERM (or SIGINT) only
# SECONDS after it came, then exits as COMMAND does. Compose has no preStop: an engine started through
# this outlives its shim's drain (docs/deployment.md), as deploy/k8s's engines do with theirs.
hold=$1
shift
stopping=0
trap 'stopping=1' TERM INT
"$@" &
child=$!
wait "$child"
status=$?
if [ "$stopping" = 1 ]; then
    sleep "$hold"
    kill -TERM "$child" 2>/dev/null
    wait "$child"
    status=$?
fi
exit "$status"
