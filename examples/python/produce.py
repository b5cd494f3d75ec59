"""Pushes events to pacer with redis-py: outbound events to pace, inbound events to admit.

    PACER_REDIS_URL=redis://127.0.0.1:6379 python produce.py

Stream and route names are those of the repo's config.yaml.
"""

import os
import time

import redis

r = redis.Redis.from_url(os.environ.get("PACER_REDIS_URL", "redis://127.0.0.1:6379"))

# Idempotency keys must be unique for as long as pacer remembers them (outbound.dedupe_ttl):
# a run tag keeps two runs of this script from colliding.
run = f"{os.getpid()}-{int(time.time())}"

# Outbound: one XADD per event. `route` is required; everything else is optional. Fields pacer
# does not know (to, body) are carried untouched to the ready stream. A pipeline sends them in
# one round trip; each XADD is still its own event.
pipe = r.pipeline(transaction=False)
for i in range(30):
    event = {
        "route": "carrier-a",
        # Retrying with the same id can never send the event twice (see below).
        "id": f"sms-{run}-{i}",
        # Rather be rejected (and told when to retry) than wait more than 1.5 s for a slot.
        "max_wait_ms": 1500,
        "to": f"+1555000{i:04d}",
        "body": "your code is 1234",
    }
    if i % 10 == 9:
        event["cost"] = 2  # a long message takes two of the route's slots
    pipe.xadd("pacer:out", event)
pipe.execute()

# A producer that cannot tell whether an XADD went through (it timed out, say) pushes the event
# again with the same id: pacer dead-letters the copy (pacer_reason=duplicate) instead of
# sending it twice.
r.xadd("pacer:out", {"route": "carrier-a", "id": f"sms-{run}-0", "to": "+15550000000"})

# Inbound: the fields the rules' `key` names (config.yaml limits per `source`, and watches per
# `tenant` in shadow mode); the rest is carried to the forward stream. Five calls per source at
# once: the per-source rule (min_spacing 100ms) lets the first through and rejects the others
# with pacer_retry_after_ms.
pipe = r.pipeline(transaction=False)
for source in ("+14440001", "+14440002", "+14440003"):
    for n in range(5):
        pipe.xadd("pacer:in", {"source": source, "tenant": "acme", "call": f"{run}-{source}-{n}"})
pipe.execute()

print("pushed 31 outbound events to pacer:out and 15 inbound events to pacer:in")
