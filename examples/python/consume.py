"""Reads one of pacer's output streams with redis-py and a consumer group: does the work,
acknowledges it (XACK), then trims what every group is done with (../trim.lua).

    python consume.py STREAM GROUP [CONSUMER]

    python consume.py 'pacer:{carrier-a}:ready' senders   # events due now: send them
    python consume.py pacer:accepted handlers             # inbound events admitted
    python consume.py pacer:rejected producer             # rejected: retry later, or give up
    python consume.py pacer:in-rejected producer          # inbound rejections
    python consume.py pacer:dead ops                      # dead letters: a person looks

Any number of consumers may share a group (each entry goes to one of them), and any number of
groups may read a stream (each gets every entry). PACER_REDIS_URL says where Redis is;
EXIT_WHEN_IDLE=3 stops after 3 s with nothing to read (default: run until interrupted).
"""

import os
import socket
import sys
import time
from pathlib import Path

import redis

stream, group = sys.argv[1], sys.argv[2]
# One name per process: two processes under one name would take each other's pending entries.
me = sys.argv[3] if len(sys.argv) > 3 else f"{socket.gethostname()}-{os.getpid()}"
exit_when_idle = float(os.environ.get("EXIT_WHEN_IDLE", "0"))

r = redis.Redis.from_url(
    os.environ.get("PACER_REDIS_URL", "redis://127.0.0.1:6379"), decode_responses=True
)
trim = r.register_script((Path(__file__).parent.parent / "trim.lua").read_text())

# From the stream's first entry ("0"), so that what pacer wrote before the group existed is not
# skipped. MKSTREAM: pacer may not have written anything yet. BUSYGROUP: another consumer made it.
try:
    r.xgroup_create(stream, group, id="0", mkstream=True)
except redis.ResponseError as e:
    if "BUSYGROUP" not in str(e):
        raise


def handle(fields):
    """The work. Here it prints a line; a real consumer calls the carrier, schedules a retry..."""
    source_id = fields.get("pacer_source_id")  # the input entry this came from
    if "pacer_retry_after_ms" in fields:
        # Rejected: no route had a slot within the event's wait (queue_full), or an inbound limit
        # is full (rate_limited, with pacer_rule and pacer_limit). Trying again before
        # pacer_retry_after_ms is pointless. A retry is a new event and needs a new `id`: pacer
        # remembers this one for dedupe_ttl and would dead-letter the retry as a duplicate.
        print(
            f"rejected {source_id} reason={fields['pacer_reason']}"
            f" retry_after_ms={fields['pacer_retry_after_ms']}"
        )
    elif "pacer_reason" in fields:
        # Dead letter: pacer could not take the event (malformed, unknown_route, duplicate,
        # missing_key, too_many_deliveries). Sending it again unchanged will not help, but for
        # route_broken: once the route's key is fixed, it can be sent again.
        print(f"dead {source_id} reason={fields['pacer_reason']} detail={fields['pacer_detail']}")
    else:
        # Ready (outbound, due now at the route's pace; pacer_route may be a fallback of the
        # route asked for) or accepted (inbound).
        via = ""
        if "pacer_route" in fields:
            via = f"on={fields['pacer_route']} waited_ms={fields['pacer_wait_ms']} "
        carried = " ".join(f"{k}={v}" for k, v in fields.items() if not k.startswith("pacer_"))
        print(f"sent {source_id} {via}{carried}")


idle_since = time.monotonic()
while True:
    # Entries another consumer of the group read over a minute ago and never acknowledged (it
    # crashed, most likely) become ours. JUSTID: they are read below with our own pending ones.
    r.xautoclaim(stream, group, me, min_idle_time=60_000, count=100, justid=True)
    # Our own pending entries first (claimed just now, or left by an earlier run under the same
    # name), then new ones, waiting up to 1 s for them.
    reply = r.xreadgroup(group, me, {stream: "0"}, count=100)
    if not reply or not reply[0][1]:
        reply = r.xreadgroup(group, me, {stream: ">"}, count=100, block=1000)
    entries = reply[0][1] if reply else []
    if not entries:
        if exit_when_idle and time.monotonic() - idle_since >= exit_when_idle:
            break
        continue
    for entry_id, fields in entries:
        if fields:  # None: the entry was deleted while pending (pacer's max_len trim): nothing to do
            handle(fields)
    # Acknowledge only once the work is done: if this process dies first, the entries stay
    # pending and another consumer claims them. So an entry may be worked twice, never lost;
    # make the work idempotent (the event's `id` is a good key). Here the work is the printing:
    # to a pipe or a file, print() only fills Python's buffer, so flush it first.
    sys.stdout.flush()
    r.xack(stream, group, *[entry_id for entry_id, _ in entries])
    trim(keys=[stream])
    idle_since = time.monotonic()
