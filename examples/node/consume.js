// Reads one of pacer's output streams with ioredis and a consumer group: does the work,
// acknowledges it (XACK), then trims what every group is done with (../trim.lua).
//
//   node consume.js STREAM GROUP [CONSUMER]
//
//   node consume.js 'pacer:{carrier-a}:ready' senders   # events due now: send them
//   node consume.js pacer:accepted handlers             # inbound events admitted
//   node consume.js pacer:rejected producer             # rejected: retry later, or give up
//   node consume.js pacer:in-rejected producer          # inbound rejections
//   node consume.js pacer:dead ops                      # dead letters: a person looks
//
// Any number of consumers may share a group (each entry goes to one of them), and any number of
// groups may read a stream (each gets every entry). PACER_REDIS_URL says where Redis is;
// EXIT_WHEN_IDLE=3 stops after 3 s with nothing to read (default: run until interrupted).
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');
const Redis = require('ioredis');

const [stream, group] = process.argv.slice(2, 4);
// One name per process: two processes under one name would take each other's pending entries.
const me = process.argv[4] || `${os.hostname()}-${process.pid}`;
const exitWhenIdleMs = Number(process.env.EXIT_WHEN_IDLE || 0) * 1000;

const redis = new Redis(process.env.PACER_REDIS_URL || 'redis://127.0.0.1:6379');
// redis.trimAcked(stream): EVALSHA, falling back to EVAL when Redis does not know the script yet.
redis.defineCommand('trimAcked', {
  numberOfKeys: 1,
  lua: fs.readFileSync(path.join(__dirname, '..', 'trim.lua'), 'utf8'),
});

// The work. Here it prints a line; a real consumer calls the carrier, schedules a retry...
function handle(fields) {
  const sourceId = fields.pacer_source_id; // the input entry this came from
  if ('pacer_retry_after_ms' in fields) {
    // Rejected: no route had a slot within the event's wait (queue_full), or an inbound limit is
    // full (rate_limited, with pacer_rule and pacer_limit). Trying again before
    // pacer_retry_after_ms is pointless. A retry is a new event and needs a new `id`: pacer
    // remembers this one for dedupe_ttl and would dead-letter the retry as a duplicate.
    console.log(`rejected ${sourceId} reason=${fields.pacer_reason} retry_after_ms=${fields.pacer_retry_after_ms}`);
  } else if ('pacer_reason' in fields) {
    // Dead letter: pacer could not take the event (malformed, unknown_route, duplicate,
    // missing_key, too_many_deliveries). Sending it again unchanged will not help, but for
    // route_broken: once the route's key is fixed, it can be sent again.
    console.log(`dead ${sourceId} reason=${fields.pacer_reason} detail=${fields.pacer_detail}`);
  } else {
    // Ready (outbound, due now at the route's pace; pacer_route may be a fallback of the route
    // asked for) or accepted (inbound).
    const via = 'pacer_route' in fields ? `on=${fields.pacer_route} waited_ms=${fields.pacer_wait_ms} ` : '';
    const carried = Object.entries(fields)
      .filter(([k]) => !k.startsWith('pacer_'))
      .map(([k, v]) => `${k}=${v}`)
      .join(' ');
    console.log(`sent ${sourceId} ${via}${carried}`);
  }
}

// XREADGROUP's reply, [[stream, [[id, [field, value, ...]], ...]]] or null, as [id, {field: value}].
function entriesOf(reply) {
  if (!reply) return [];
  return reply[0][1].map(([id, flat]) => {
    if (!flat) return [id, null]; // deleted while pending (pacer's max_len trim)
    const fields = {};
    for (let i = 0; i < flat.length; i += 2) fields[flat[i]] = flat[i + 1];
    return [id, fields];
  });
}

async function main() {
  // From the stream's first entry ("0"), so that what pacer wrote before the group existed is
  // not skipped. MKSTREAM: pacer may not have written anything yet. BUSYGROUP: another consumer
  // made it.
  try {
    await redis.xgroup('CREATE', stream, group, '0', 'MKSTREAM');
  } catch (err) {
    if (!String(err.message).includes('BUSYGROUP')) throw err;
  }

  let idleSince = Date.now();
  for (;;) {
    // Entries another consumer of the group read over a minute ago and never acknowledged (it
    // crashed, most likely) become ours. JUSTID: they are read below with our own pending ones.
    await redis.xautoclaim(stream, group, me, 60000, '0-0', 'COUNT', 100, 'JUSTID');
    // Our own pending entries first (claimed just now, or left by an earlier run under the same
    // name), then new ones, waiting up to 1 s for them.
    let entries = entriesOf(await redis.xreadgroup('GROUP', group, me, 'COUNT', 100, 'STREAMS', stream, '0'));
    if (entries.length === 0) {
      entries = entriesOf(
        await redis.xreadgroup('GROUP', group, me, 'COUNT', 100, 'BLOCK', 1000, 'STREAMS', stream, '>'),
      );
    }
    if (entries.length === 0) {
      if (exitWhenIdleMs && Date.now() - idleSince >= exitWhenIdleMs) break;
      continue;
    }
    for (const [, fields] of entries) {
      if (fields) handle(fields);
    }
    // Acknowledge only once the work is done: if this process dies first, the entries stay
    // pending and another consumer claims them. So an entry may be worked twice, never lost;
    // make the work idempotent (the event's `id` is a good key). Here the work is the printing:
    // where stdout is a pipe Node may queue it in memory, so wait until it is written out (an
    // empty write's callback comes once everything before it is).
    await new Promise((resolve) => process.stdout.write('', resolve));
    await redis.xack(stream, group, ...entries.map(([id]) => id));
    await redis.trimAcked(stream);
    idleSince = Date.now();
  }
  await redis.quit();
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
