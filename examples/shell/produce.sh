#!/usr/bin/env bash
# Pushes events to pacer with redis-cli: outbound events to pace, inbound events to admit.
#
#   PACER_REDIS_URL=redis://127.0.0.1:6379 ./produce.sh
#
# Stream and route names are those of the repo's config.yaml.
set -euo pipefail
url=${PACER_REDIS_URL:-redis://127.0.0.1:6379}

# Idempotency keys must be unique for as long as pacer remembers them (outbound.dedupe_ttl):
# a run tag keeps two runs of this script from colliding.
run="$$-$(date +%s)"

# redis-cli runs the commands it reads on stdin, one per line, over one connection: the events
# arrive together, as from a busy producer. It prints error replies like any other reply and
# still exits 0, so look for them.
send() {
  local out
  out=$(redis-cli -u "$url")
  if grep -E '^(\(error\) )?(ERR|WRONGTYPE|NOAUTH)' <<<"$out" >&2; then exit 1; fi
}

# Outbound: one XADD per event. `route` is required; everything else is optional. Fields pacer
# does not know (to, body) are carried untouched to the ready stream. max_wait_ms 1500: rather
# be rejected (and told when to retry) than wait more than 1.5 s for a slot. cost 2: a long
# message takes two of the route's slots. A retry with the same `id` can never send an event
# twice (see below).
for i in $(seq 0 29); do
  cost=""
  if ((i % 10 == 9)); then cost="cost 2"; fi
  echo "XADD pacer:out * route carrier-a id sms-$run-$i max_wait_ms 1500 $cost to +1555000$(printf %04d "$i") body \"your code is 1234\""
done | send

# A producer that cannot tell whether an XADD went through (it timed out, say) pushes the event
# again with the same id: pacer dead-letters the copy (pacer_reason=duplicate) instead of
# sending it twice.
echo "XADD pacer:out * route carrier-a id sms-$run-0 to +15550000000" | send

# Inbound: the fields the rules' `key` names (config.yaml limits per `source`, and watches per
# `tenant` in shadow mode); the rest is carried to the forward stream. Five calls per source at
# once: the per-source rule (min_spacing 100ms) lets the first through and rejects the others
# with pacer_retry_after_ms.
for source in +14440001 +14440002 +14440003; do
  for n in 0 1 2 3 4; do
    echo "XADD pacer:in * source $source tenant acme call $run-$source-$n"
  done
done | send

echo "pushed 31 outbound events to pacer:out and 15 inbound events to pacer:in"
