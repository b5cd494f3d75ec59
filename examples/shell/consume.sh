#!/usr/bin/env bash
# Reads one of pacer's output streams with redis-cli and a consumer group: does the work,
# acknowledges it (XACK), then trims what every group is done with (../trim.lua).
#
#   ./consume.sh STREAM GROUP [CONSUMER]
#
#   ./consume.sh 'pacer:{carrier-a}:ready' senders   # events due now: send them
#   ./consume.sh pacer:accepted handlers             # inbound events admitted
#   ./consume.sh pacer:rejected producer             # rejected: retry later, or give up
#   ./consume.sh pacer:in-rejected producer          # inbound rejections
#   ./consume.sh pacer:dead ops                      # dead letters: a person looks
#
# Any number of consumers may share a group (each entry goes to one of them), and any number of
# groups may read a stream (each gets every entry). PACER_REDIS_URL says where Redis is;
# EXIT_WHEN_IDLE=3 stops after 3 s with nothing to read (whole seconds; default: run until
# interrupted).
set -euo pipefail
stream=$1 group=$2
# One name per process: two processes under one name would take each other's pending entries.
me=${3:-$(hostname)-$$}
url=${PACER_REDIS_URL:-redis://127.0.0.1:6379}
exit_when_idle=${EXIT_WHEN_IDLE:-0}
trim_lua="$(dirname "$0")/../trim.lua"

# redis-cli prints an error reply like any other and exits 0: fail on one, so that a wrong
# stream or group name does not loop quietly.
cli() {
  local out
  out=$(redis-cli -u "$url" --raw "$@")
  if [[ $out =~ ^(ERR|WRONGTYPE|NOGROUP|NOAUTH|NOSCRIPT)\  ]]; then
    echo "$out" >&2
    return 1
  fi
  printf '%s\n' "$out"
}

# From the stream's first entry ("0"), so that what pacer wrote before the group existed is not
# skipped. MKSTREAM: pacer may not have written anything yet. BUSYGROUP: another consumer made it.
created=$(redis-cli -u "$url" XGROUP CREATE "$stream" "$group" 0 MKSTREAM)
[[ $created == OK || $created == BUSYGROUP* ]] || { echo "$created" >&2; exit 1; }

# The work. Here it prints a line; a real consumer calls the carrier, schedules a retry...
# $@: the entry's field and value lines.
handle() {
  declare -A f=()
  local carried=()
  while (($#)); do
    f[$1]=$2
    [[ $1 == pacer_* ]] || carried+=("$1=$2")
    shift 2
  done
  local source_id=${f[pacer_source_id]:-} # the input entry this came from
  if [[ -v f[pacer_retry_after_ms] ]]; then
    # Rejected: no route had a slot within the event's wait (queue_full), or an inbound limit is
    # full (rate_limited, with pacer_rule and pacer_limit). Trying again before
    # pacer_retry_after_ms is pointless. A retry is a new event and needs a new `id`: pacer
    # remembers this one for dedupe_ttl and would dead-letter the retry as a duplicate.
    echo "rejected $source_id reason=${f[pacer_reason]} retry_after_ms=${f[pacer_retry_after_ms]}"
  elif [[ -v f[pacer_reason] ]]; then
    # Dead letter: pacer could not take the event (malformed, unknown_route, duplicate,
    # missing_key, too_many_deliveries). Sending it again unchanged will not help, but for
    # route_broken: once the route's key is fixed, it can be sent again.
    echo "dead $source_id reason=${f[pacer_reason]} detail=${f[pacer_detail]}"
  else
    # Ready (outbound, due now at the route's pace; pacer_route may be a fallback of the route
    # asked for) or accepted (inbound).
    local via=""
    if [[ -v f[pacer_route] ]]; then via="on=${f[pacer_route]} waited_ms=${f[pacer_wait_ms]} "; fi
    echo "sent $source_id $via${carried[*]}"
  fi
}

idle_since=$SECONDS
while true; do
  # Entries another consumer of the group read over a minute ago and never acknowledged (it
  # crashed, most likely) become ours. JUSTID: they are read below with our own pending ones.
  cli XAUTOCLAIM "$stream" "$group" "$me" 60000 0-0 COUNT 100 JUSTID >/dev/null
  # One entry per call: --raw prints nested replies flat, one element per line (the stream's
  # name, the entry id, then field and value lines), so with COUNT 1 the lines are one entry.
  # (A value holding a newline would break this: use a client library for such data.)
  # Our own pending entries first (claimed just now, or left by an earlier run under the same
  # name), then new ones, waiting up to 1 s for them.
  out=$(cli XREADGROUP GROUP "$group" "$me" COUNT 1 STREAMS "$stream" 0)
  mapfile -t reply <<<"$out"
  if [[ -z ${reply[1]:-} ]]; then
    out=$(cli XREADGROUP GROUP "$group" "$me" COUNT 1 BLOCK 1000 STREAMS "$stream" '>')
    mapfile -t reply <<<"$out"
  fi
  id=${reply[1]:-}
  if [[ -z $id ]]; then
    if ((exit_when_idle > 0 && SECONDS - idle_since >= exit_when_idle)); then break; fi
    continue
  fi
  # No field lines: the entry was deleted while pending (pacer's max_len trim): nothing to do.
  if ((${#reply[@]} > 3)); then handle "${reply[@]:2}"; fi
  # Acknowledge only once the work is done: if this process dies first, the entry stays pending
  # and another consumer claims it. So an entry may be worked twice, never lost; make the work
  # idempotent (the event's `id` is a good key).
  cli XACK "$stream" "$group" "$id" >/dev/null
  # EVAL sends the script each time; a client library would use EVALSHA.
  cli --eval "$trim_lua" "$stream" >/dev/null
  idle_since=$SECONDS
done
