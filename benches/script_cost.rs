//! What `schedule.lua` costs Redis per event, counted in instructions rather than time: a
//! redis-server runs under valgrind's callgrind, and the same calls pacer's workers make (read
//! a batch, schedule it on one route whose rate does not bind, the input acknowledged in the
//! script) run against it. Time on this two-core virtual machine swings by a third between runs;
//! an instruction count repeats to about 0.5%, so it tells a 5% change in a script apart.
//!
//! Two phases on the same server, counted separately (`callgrind_control --dump` between them):
//! the producer's XADDs and the workers' XREADGROUPs alone, then the same with the schedule
//! calls. Their difference per event is what the script costs, its arguments included.
//!
//! Then the paced case: events on a route whose rate binds, each dispatched by `dispatch.lua`
//! in a call of its own at its slot (as at most rates a worker's timer sends them), counted
//! alone: there, what a call costs before its first event is most of what an event costs.
//!
//! Then the inbound case: events each admitted by `admit.lua` in a call of its own, on two
//! rules, counted alone.
//!
//! Then two floors, each with the same adds: the same reads with each event only copied to a
//! ready stream with pacer's five fields by a Lua function and acknowledged (nothing decided,
//! recorded or checked: what this design costs Redis before it decides anything), and the same
//! copy of events the function reads itself with no pending list (`XREADGROUP … NOACK`: the
//! floor of a design that reads where it decides, and keeps no pending entry per event).
//!
//! `cargo bench --bench script_cost -- [--calls 50] [--per 128] [--fields 2] [--listpack N]
//! [--paced 200] [--admit 200]` (`--paced 0`, `--admit 0` leave those cases out)
//!
//! `--per` events per call (a worker's call on one route holds up to 128), `--fields` fields per
//! event besides pacer's own, `--listpack` Redis's `hash-max-listpack-entries` (0: every
//! decision hash a hash table, as at the rates where Redis's CPU matters). With
//! `PACER_CALLGRIND_KEEP=<dir>` the counts of the phase with the schedule calls are kept there
//! for `callgrind_annotate`. Without valgrind it prints `skipped: valgrind is not installed`.

mod common;

use common::{arg, present};
use pacer::config::{Config, Overrides};
use pacer::event::inbound::{forward_fields, parse_inbound};
use pacer::event::Entry;
use pacer::scripts::{
    AdmitItem, AdmitTargets, DispatchItem, Dispatched, EventRef, RouteCall, RouteDispatch,
    ScheduleItem, Scheduled, ScriptRules, Scripts, Writing, LOG_ENTRIES_PER_READ,
};
use pacer::testkit::{free_port, wait_until, TempDir};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const GROUP: &str = "pacer";

/// redis-server under callgrind; killed on drop.
struct Counted {
    child: Child,
    port: u16,
    dir: TempDir,
}

impl Drop for Counted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Counted {
    fn start() -> Self {
        let dir = TempDir::new("script-cost");
        let port = free_port();
        let child = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!(
                "--callgrind-out-file={}",
                dir.path().join("cg.out").display()
            ))
            .args(["redis-server", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting valgrind");
        let counted = Counted { child, port, dir };
        let client = redis::Client::open(counted.url()).unwrap();
        assert!(
            wait_until(Duration::from_secs(60), || client.get_connection().is_ok()),
            "redis-server under valgrind did not start"
        );
        counted
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Writes the instructions counted since the last dump (or the start) and returns them.
    fn dump(&self, n: usize) -> u64 {
        let ok = Command::new("callgrind_control")
            .arg("--dump")
            .arg(self.child.id().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "callgrind_control --dump failed");
        let file = self.dir.path().join(format!("cg.out.{n}"));
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        text.lines()
            .find_map(|l| l.strip_prefix("summary: ").or(l.strip_prefix("totals: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no instruction count in {file:?}"))
    }
}

/// One round: `per` events added and read; scheduled when `schedule`. Returns the events read.
fn round(
    rt: &tokio::runtime::Runtime,
    con: &mut redis::aio::MultiplexedConnection,
    scripts: &Scripts,
    route: &pacer::config::Route,
    (per, fields, schedule): (usize, usize, bool),
) -> usize {
    let values: Vec<Vec<(Vec<u8>, Vec<u8>)>> = (0..per).map(|i| event_fields(i, fields)).collect();
    rt.block_on(async {
        let ids = add_and_read(con, &values).await;
        if !schedule {
            return ids.len();
        }
        let pairs: Vec<Vec<(&[u8], &[u8])>> = values.iter().map(|v| as_pairs(v)).collect();
        let items: Vec<ScheduleItem<'_>> = ids
            .iter()
            .zip(&pairs)
            .map(|(id, fields)| ScheduleItem {
                event: EventRef {
                    stream: "in",
                    entry_id: id,
                    entry_ms: pacer::event::entry_ms(id),
                    cost: 1,
                    fields,
                },
                claim: None,
                expect: None,
                max_wait_us: 1_000_000,
                deadline_us: 0,
                since_us: 0,
            })
            .collect();
        let call = route_call(route);
        let reply = scripts
            .schedule(con, &call, (600_000_000, 0, 1_000_000), &items)
            .await
            .unwrap();
        assert!(
            reply
                .items
                .iter()
                .all(|s| matches!(s, Scheduled::Dispatched { .. })),
            "every event dispatched at once: {:?}",
            reply.items.first()
        );
        ids.len()
    })
}

/// A call on `route` as a worker makes it where every input stream is in reach: its records
/// live 10 minutes, its ready stream is trimmed to about a million entries, and it
/// acknowledges what it finishes.
fn route_call(route: &pacer::config::Route) -> RouteCall<'_> {
    RouteCall {
        name: &route.name,
        keys: &route.keys,
        bucket: &route.bucket,
        out: Writing {
            ttl_ms: 600_000,
            max_len: 1_000_000,
            group: GROUP,
            acks: &|_: &str| true,
        },
    }
}

/// The paced phase: `n` events of `fields` fields read and scheduled in one call on `route`,
/// whose rate binds (each gets a slot of its own), then each dispatched in a call of its own once
/// its slot has come, as a worker's timer sends it. Returns the instructions counted over the
/// dispatch calls alone (between dumps `dumps` and `dumps + 1`) per event.
fn paced(
    rt: &tokio::runtime::Runtime,
    con: &mut redis::aio::MultiplexedConnection,
    scripts: &Scripts,
    route: &pacer::config::Route,
    (n, fields): (usize, usize),
    (server, dumps): (&Counted, usize),
) -> f64 {
    let values: Vec<Vec<(Vec<u8>, Vec<u8>)>> = (0..n).map(|i| event_fields(i, fields)).collect();
    let pairs: Vec<Vec<(&[u8], &[u8])>> = values.iter().map(|v| as_pairs(v)).collect();
    let ids = rt.block_on(add_and_read(con, &values));
    let call = || route_call(route);
    let event = |i: usize| EventRef {
        stream: "in",
        entry_id: &ids[i],
        entry_ms: pacer::event::entry_ms(&ids[i]),
        cost: 1,
        fields: &pairs[i],
    };
    let max_wait_us = 600_000_000;
    let items: Vec<ScheduleItem<'_>> = (0..ids.len())
        .map(|i| ScheduleItem {
            event: event(i),
            claim: None,
            expect: None,
            max_wait_us,
            deadline_us: 0,
            since_us: 0,
        })
        .collect();
    let reply = rt
        .block_on(scripts.schedule(con, &call(), (600_000_000, 0, max_wait_us), &items))
        .unwrap();
    server.dump(dumps);
    let mut dispatched = 0;
    for (i, outcome) in reply.items.iter().enumerate() {
        let Scheduled::Sleep { slot_us } = *outcome else {
            continue;
        };
        // Its slot, by this machine's clock (Redis's, on the same machine).
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64;
        std::thread::sleep(Duration::from_micros((slot_us - now_us).max(0) as u64));
        let item = [DispatchItem {
            event: event(i),
            slot_us,
            deadline_us: reply.now_us + max_wait_us + pacer::pacing::LATE_US,
            decided_us: reply.now_us,
        }];
        let routes = [RouteDispatch {
            call: call(),
            items: &item,
        }];
        let done = rt.block_on(scripts.dispatch(con, &routes)).unwrap();
        assert!(
            matches!(done.items[0], Dispatched::Done { .. }),
            "dispatched at its slot: {:?}",
            done.items[0]
        );
        dispatched += 1;
    }
    assert!(
        dispatched > n / 2,
        "{dispatched} of {n} slept and were dispatched"
    );
    server.dump(dumps + 1) as f64 / dispatched as f64
}

/// The inbound case: `n` events on two rules (a gcra and a sliding log), each admitted by
/// `admit.lua` in a call of its own, as a worker reads them at low rates. Returns the
/// instructions counted over the admit calls alone (between dumps `dumps` and `dumps + 1`) per
/// event.
fn admitted_alone(
    rt: &tokio::runtime::Runtime,
    con: &mut redis::aio::MultiplexedConnection,
    scripts: &Scripts,
    n: usize,
    (server, dumps): (&Counted, usize),
) -> f64 {
    let yaml = "inbound:\n  streams: [inb]\n  forward_stream: fwd\n  rules:\n    - {name: per-key, key: [k], algorithm: gcra, limits: [1000/s], burst: 10}\n    - {name: per-src, key: [src], algorithm: sliding_log, limits: [500/s, 10000/min]}\n";
    let cfg = Config::parse(yaml, &Overrides::default())
        .unwrap()
        .inbound
        .unwrap();
    let rules = ScriptRules::new(&cfg.rules, LOG_ENTRIES_PER_READ);
    let keys = &cfg.keys[0];
    let no_acks = |_: &str| false;
    let to = AdmitTargets {
        keys,
        forward: true,
        rejected: true,
        decision_ttl_ms: 600_000,
        max_len: 1_000_000,
        group: GROUP,
        acks: &no_acks,
        stale_us: i64::MAX / 4,
    };
    let mut admit = |i: usize| {
        let (k, src) = (format!("key{}", i % 50), format!("s{}", i % 7));
        let pairs: [(&str, &str); 3] = [
            ("k", &k),
            ("src", &src),
            ("payload", "forty bytes of payload, give or take a few"),
        ];
        let entry = Entry {
            stream: "inb".into(),
            id: format!("{}-0", 1_000_000 + i),
            fields: pairs
                .iter()
                .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
                .collect(),
            deliveries: 1,
        };
        let event = parse_inbound(entry, &cfg).expect("a well-formed event");
        let (owner, hash) = (event.entry.owner(), keys.decisions(&event.entry.id));
        let fields = forward_fields(&event);
        let item = AdmitItem {
            owner: &owner,
            stream: &event.entry.stream,
            entry_ms: event.entry.ms(),
            decisions: &hash,
            identities: event.identities.iter().map(String::as_str).collect(),
            fields: &fields,
        };
        rt.block_on(scripts.admit(con, &to, &rules, &[item]))
            .expect("admit")
    };
    // The first call, which sends the rules the function then keeps, is not counted.
    admit(0);
    server.dump(dumps);
    for i in 1..=n {
        admit(i);
    }
    server.dump(dumps + 1) as f64 / n as f64
}

/// The floor function: about the least a design that reads through a consumer group and writes
/// each event's ready entry in a script, with pacer's fields, can cost Redis per event (the
/// benchmark's phases each include the producer's XADD and the worker's XREADGROUP).
///
/// KEYS[1]  the ready stream; KEYS[2] the input stream
/// ARGV[1]  the consumer group; then per event its entry id, its field count and its fields
/// Returns the number of events copied. (`floor_noack` beside it: the same copy of events read
/// in the script with no pending list, the floor of a design that reads where it decides.)
const FLOOR: &str = r#"#!lua name=floor
-- KEYS[1] the ready stream, KEYS[2] the input stream. ARGV[1] the group, ARGV[2] a consumer,
-- ARGV[3] how many to read. Reads them in the script, with no pending list (NOACK), and copies
-- each as 'floor' does. Returns the number copied.
redis.register_function('floor_noack', function(keys, args)
  local read = redis.call('XREADGROUP', 'GROUP', args[1], args[2], 'COUNT', args[3], 'NOACK',
    'STREAMS', keys[2], '>')
  local entries = read and read[1][2] or {}
  for i = 1, #entries do
    local e = entries[i]
    redis.call('XADD', keys[1], '*', 'pacer_route', 'r', 'pacer_source_stream', 'in',
      'pacer_source_id', e[1], 'pacer_slot_us', '1700000000000000', 'pacer_wait_ms', '0',
      unpack(e[2]))
  end
  return #entries
end)
redis.register_function('floor', function(keys, args)
  local at, acks, n = 2, {}, 0
  while at <= #args do
    local entry, nf = args[at], tonumber(args[at + 1])
    redis.call('XADD', keys[1], '*', 'pacer_route', 'r', 'pacer_source_stream', 'in',
      'pacer_source_id', entry, 'pacer_slot_us', '1700000000000000', 'pacer_wait_ms', '0',
      unpack(args, at + 2, at + 1 + 2 * nf))
    n = n + 1
    acks[n] = entry
    at = at + 2 + 2 * nf
  end
  redis.call('XACK', keys[2], args[1], unpack(acks))
  return n
end)
"#;

/// The floor phase: `calls` rounds of `per` events of `fields` fields added and read as
/// `round` does, each round's events passed to the floor function, counted between dumps
/// `dumps` and `dumps + 1`: instructions per event, the producer's XADD and the read included.
/// What `schedule.lua` costs above it is all that deciding, recording and checking costs.
fn floor(
    rt: &tokio::runtime::Runtime,
    con: &mut redis::aio::MultiplexedConnection,
    sync: &mut redis::Connection,
    (calls, per, fields, noack): (usize, usize, usize, bool),
    (server, dumps): (&Counted, usize),
) -> f64 {
    let _: () = redis::cmd("FUNCTION")
        .arg(&["LOAD", "REPLACE", FLOOR])
        .query(sync)
        .unwrap();
    let copy = |con: &mut redis::aio::MultiplexedConnection| {
        let values: Vec<Vec<(Vec<u8>, Vec<u8>)>> =
            (0..per).map(|i| event_fields(i, fields)).collect();
        if noack {
            return rt.block_on(async {
                let mut pipe = redis::pipe();
                for v in &values {
                    let cmd = pipe.cmd("XADD").arg("in").arg("*");
                    for (name, value) in v {
                        cmd.arg(name).arg(value);
                    }
                    cmd.ignore();
                }
                let _: () = pipe.query_async(con).await.unwrap();
                let n: usize = redis::cmd("FCALL")
                    .arg(&["floor_noack", "2", "floor:ready", "in", GROUP, "c"])
                    .arg(per)
                    .query_async(con)
                    .await
                    .unwrap();
                assert_eq!(n, per, "every event copied");
                n
            });
        }
        rt.block_on(async {
            let ids = add_and_read(con, &values).await;
            let mut cmd = redis::cmd("FCALL");
            cmd.arg(&["floor", "2", "floor:ready", "in", GROUP]);
            for (id, v) in ids.iter().zip(&values) {
                cmd.arg(id).arg(v.len());
                for (name, value) in v {
                    cmd.arg(name).arg(value);
                }
            }
            let n: usize = cmd.query_async(con).await.unwrap();
            assert_eq!(n, ids.len(), "every event copied");
            n
        })
    };
    for _ in 0..10 {
        copy(con);
    }
    server.dump(dumps);
    let copied: usize = (0..calls).map(|_| copy(con)).sum();
    server.dump(dumps + 1) as f64 / copied as f64
}

/// Event `i`'s fields: `fields` of them, about forty bytes each.
fn event_fields(i: usize, fields: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..fields)
        .map(|f| {
            let value = format!("value {f} of event {i}, some forty bytes long");
            (format!("field{f}").into_bytes(), value.into_bytes())
        })
        .collect()
}

fn as_pairs(v: &[(Vec<u8>, Vec<u8>)]) -> Vec<(&[u8], &[u8])> {
    v.iter()
        .map(|(a, b)| (a.as_slice(), b.as_slice()))
        .collect()
}

/// Adds the events to `in` and reads them as consumer `c`: their entry ids.
async fn add_and_read(
    con: &mut redis::aio::MultiplexedConnection,
    values: &[Vec<(Vec<u8>, Vec<u8>)>],
) -> Vec<String> {
    let mut pipe = redis::pipe();
    for v in values {
        let cmd = pipe.cmd("XADD").arg("in").arg("*");
        for (name, value) in v {
            cmd.arg(name).arg(value);
        }
        cmd.ignore();
    }
    let _: () = pipe.query_async(con).await.unwrap();
    let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg(&["GROUP", GROUP, "c", "COUNT"])
        .arg(values.len())
        .arg(&["STREAMS", "in", ">"])
        .query_async(con)
        .await
        .unwrap();
    read.keys[0].ids.iter().map(|e| e.id.clone()).collect()
}

fn main() {
    let calls = arg("--calls", 50) as usize;
    let per = arg("--per", 128) as usize;
    let fields = arg("--fields", 2) as usize;
    let paced_events = arg("--paced", 200) as usize;
    let admit_events = arg("--admit", 200) as usize;
    let listpack = std::env::args()
        .any(|a| a == "--listpack")
        .then(|| arg("--listpack", 128));
    if !present("valgrind") {
        println!("skipped: valgrind is not installed");
        return;
    }
    pacer::testkit::ensure_redis_installed();
    let yaml = "outbound:\n  streams: [in]\n  routes:\n    r: {rate: 1000/ms, burst: 1000000}\n    p: {rate: 1000/s, burst: 1}\n";
    let routes = Config::parse(yaml, &Overrides::default())
        .unwrap()
        .outbound
        .routes;
    let (route, paced_route) = (routes["r"].clone(), routes["p"].clone());
    let server = Counted::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut con = rt
        .block_on(client.get_multiplexed_async_connection())
        .unwrap();
    let mut sync = client.get_connection().unwrap();
    if let Some(n) = listpack {
        // A decision hash holds the records of a 100 ms span: at a few thousand events a
        // second it is a hash table, here (slow rounds under valgrind) a listpack of about a
        // call's events, where each HSET scans what the hash holds.
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("hash-max-listpack-entries")
            .arg(n)
            .query(&mut sync)
            .unwrap();
    }
    pacer::testkit::create_group(&mut sync, "in", GROUP);
    let scripts = Scripts::default();
    // Loaded before anything is counted, as a worker loads them before it is ready (a function
    // loaded on its first call would count its compiling in that phase).
    rt.block_on(scripts.load(&mut con))
        .expect("loading the scripts");
    // Warm up (the script loaded, the streams and hashes past their first allocations), then
    // the two phases, each between two dumps (a dump resets the count).
    for _ in 0..10 {
        round(&rt, &mut con, &scripts, &route, (per, fields, true));
    }
    server.dump(1);
    let mut read = 0;
    for _ in 0..calls {
        read += round(&rt, &mut con, &scripts, &route, (per, fields, false));
    }
    let base = server.dump(2) as f64 / read as f64;
    // The first phase's entries stay pending: a new group, so that the second starts as clean.
    let _: () = redis::cmd("XGROUP")
        .arg(&["DESTROY", "in", GROUP])
        .query(&mut sync)
        .unwrap();
    let _: () = redis::cmd("XGROUP")
        .arg(&["CREATE", "in", GROUP, "$"])
        .query(&mut sync)
        .unwrap();
    server.dump(3);
    let mut scheduled = 0;
    for _ in 0..calls {
        scheduled += round(&rt, &mut con, &scripts, &route, (per, fields, true));
    }
    let with = server.dump(4) as f64 / scheduled as f64;
    println!(
        "schedule.lua under callgrind: {calls} calls of {per} events with {fields} fields each, one route whose rate does not bind"
    );
    println!("  redis-server instructions per event");
    println!("    producer's XADD and the worker's XREADGROUP   {base:>8.0}");
    println!("    the same with the schedule call              {with:>8.0}");
    println!(
        "    schedule.lua (the difference)                {:>8.0}",
        with - base
    );
    let dispatch = (paced_events > 0).then(|| {
        paced(
            &rt,
            &mut con,
            &scripts,
            &paced_route,
            (paced_events, fields),
            (&server, 5),
        )
    });
    if let Some(per_event) = dispatch {
        println!(
            "dispatch.lua under callgrind: {paced_events} events on a route of 1000/s (burst 1), each in a call of its own at its slot"
        );
        println!("  redis-server instructions per event             {per_event:>8.0}");
    }
    // Dumps are numbered in order: the paced phase's took 5 and 6 if it ran.
    let admit_dump = if dispatch.is_some() { 7 } else { 5 };
    let admitted = (admit_events > 0)
        .then(|| admitted_alone(&rt, &mut con, &scripts, admit_events, (&server, admit_dump)));
    if let Some(per_event) = admitted {
        println!(
            "admit.lua under callgrind: {admit_events} events on two rules (gcra, sliding log), each in a call of its own"
        );
        println!("  redis-server instructions per event             {per_event:>8.0}");
    }
    // Dumps are numbered in order: the admit phase's took the next two if it ran.
    let floor_dump = admit_dump + if admitted.is_some() { 2 } else { 0 };
    let lowest = floor(
        &rt,
        &mut con,
        &mut sync,
        (calls, per, fields, false),
        (&server, floor_dump),
    );
    println!(
        "the floor: the same adds and reads, each event copied by a Lua function to a ready stream with pacer's five fields, and acknowledged; nothing decided or recorded"
    );
    println!("  redis-server instructions per event             {lowest:>8.0}");
    println!(
        "  pacer above the floor                           {:>8.0} (the floor is {:.0}% of pacer's count)",
        with - lowest,
        100.0 * lowest / with
    );
    let noack = floor(
        &rt,
        &mut con,
        &mut sync,
        (calls, per, fields, true),
        (&server, floor_dump + 2),
    );
    println!(
        "a floor without a pending list: the same adds, read in the function itself (XREADGROUP NOACK) and copied"
    );
    println!(
        "  redis-server instructions per event             {noack:>8.0} ({:.0}% of pacer's count)",
        100.0 * noack / with
    );
    // `PACER_CALLGRIND_KEEP=<dir>`: keep the counts of the phases with the schedule, dispatch
    // and admit calls, per function, for `callgrind_annotate`.
    if let Some(keep) = std::env::var_os("PACER_CALLGRIND_KEEP") {
        let keep = std::path::Path::new(&keep);
        let mut kept = vec![("cg.out.4".to_string(), "schedule.cg.out")];
        if dispatch.is_some() {
            kept.push(("cg.out.6".to_string(), "dispatch.cg.out"));
        }
        if admitted.is_some() {
            kept.push((format!("cg.out.{}", admit_dump + 1), "admit.cg.out"));
        }
        for (from, to) in kept {
            let to = keep.join(to);
            std::fs::copy(server.dir.path().join(from), &to).expect("keeping the counts");
            println!("  counts kept in {}", to.display());
        }
    }
}
