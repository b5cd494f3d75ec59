// BullMQ's side of `cargo bench --bench vs_bullmq`: the same work as pacer's throughput run,
// done the BullMQ way. benches/vs_bullmq.rs runs it; it is not meant to be run by hand.
//
//   node worker.js preload <redis-url> <routes> <events>
//     One Queue per route (r0, r1, ...). Job i goes to queue r<i % routes> with the fields pacer's
//     event i carries ({route, to}), added with addBulk a thousand at a time, before the
//     measured window, like pacer's preloaded input stream.
//   node worker.js work <redis-url> <routes> <concurrency>
//     One Worker per queue in this process. Each has a rate limiter that never binds, as pacer's
//     routes have a rate, and a processor that does nothing: completing the job is BullMQ's
//     counterpart of pacer writing the event to the route's ready stream. Jobs are removed on
//     completion, so Redis memory stays flat. Prints `ready` once its Workers are connected,
//     starts them when it reads `go` on stdin (so node's own start stays out of the measured
//     window), then prints `completed <n> <ms>` (this process's total, and the `Date.now()` of
//     its last completion) whenever it changes: the benchmark sums the totals to see the end,
//     and closes its window at the latest time. It needs no Redis command of its own.
//
// package.json pins bullmq and ioredis (BullMQ's own development version of it), and holds
// msgpackr-extract (an optional native helper of BullMQ's msgpackr) at 3.0.4: the registry the
// lock file was made from had 3.0.7's prebuilt packages for Linux only, which left the lock
// without the other platforms' entries, and `npm ci` refuses a lock file like that.
'use strict';
const { Queue, Worker } = require('bullmq');

const [mode, url, routesArg, nArg] = process.argv.slice(2);
const routes = Number(routesArg);
const { hostname: host, port } = new URL(url);
// maxRetriesPerRequest null: BullMQ's requirement for a Worker's connection (it blocks).
const connection = { host, port: Number(port), maxRetriesPerRequest: null };
const names = Array.from({ length: routes }, (_, r) => `r${r}`);

async function preload(events) {
  const queues = names.map((name) => new Queue(name, { connection }));
  for (let start = 0; start < events; start += 1000) {
    const batches = names.map(() => []);
    for (let i = start; i < Math.min(start + 1000, events); i++) {
      const r = i % routes;
      batches[r].push({ name: 'event', data: { route: names[r], to: String(i) }, opts: { removeOnComplete: true } });
    }
    await Promise.all(batches.map((jobs, r) => (jobs.length ? queues[r].addBulk(jobs) : null)));
  }
  await Promise.all(queues.map((q) => q.close()));
  console.log(`preloaded ${events}`);
}

async function work(concurrency) {
  let completed = 0;
  let lastAt = 0;
  let reported = -1;
  const workers = names.map((name) => {
    const w = new Worker(name, async () => {}, {
      connection,
      concurrency,
      limiter: { max: 1000000, duration: 1000 },
      autorun: false,
    });
    w.on('completed', () => {
      completed += 1;
      lastAt = Date.now();
    });
    w.on('error', (err) => console.error(`worker ${name}: ${err.message}`));
    return w;
  });
  await Promise.all(workers.map((w) => w.waitUntilReady()));
  process.stdout.write('ready\n');
  process.stdin.once('data', () => {
    for (const w of workers) {
      w.run().catch((err) => console.error(`worker ${w.name}: ${err.message}`));
    }
  });
  const timer = setInterval(() => {
    if (completed !== reported) {
      reported = completed;
      process.stdout.write(`completed ${completed} ${lastAt}\n`);
    }
  }, 10);
  process.on('SIGTERM', async () => {
    clearInterval(timer);
    await Promise.all(workers.map((w) => w.close()));
    process.exit(0);
  });
}

if (mode === 'preload') {
  preload(Number(nArg)).catch((err) => {
    console.error(err);
    process.exit(1);
  });
} else if (mode === 'work') {
  work(Number(nArg)).catch((err) => {
    console.error(err);
    process.exit(1);
  });
} else {
  console.error('usage: node worker.js preload|work <redis-url> <routes> <events|concurrency>');
  process.exit(2);
}
