//! What the chaos tests share: the draws (a seeded generator, replayable), the workers they
//! kill, stop and restart, and the checks on what the faults left in the dead letters.

use super::{bin, event};
use pacer::report::OutputEntry;
use pacer::testkit::Pacer;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// An event's fields as pushed: names and raw values.
pub type RawEvent = Vec<(String, Vec<u8>)>;

/// xorshift64*: enough randomness for drawing faults, and a run replays its draws from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// One of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// `worker.max_inflight_bytes` for a chaos run, as a config line under `worker:` ("" for the
/// default budget) and its value (0 for the default): `env`'s value, else a byte a place when
/// `drawn` (`max_inflight`, 1 KiB at least: the least allowed). At a byte a place an event
/// weighs about a hundred places, a wide one the most a read may hold, so the places run short
/// and reads whose weight is not free park what they cannot weigh (`worker/budget.rs` `hold`;
/// with 150 places a read's weight is capped at a place an entry).
pub fn inflight_bytes(env: &str, drawn: bool, max_inflight: u64) -> (String, u64) {
    let bytes = env_u64(env).unwrap_or(if drawn { max_inflight.max(1024) } else { 0 });
    let line = if bytes > 0 {
        format!("\n  max_inflight_bytes: {bytes}")
    } else {
        String::new()
    };
    (line, bytes)
}

/// The seed in `name`, else one from the clock (odd: xorshift never leaves 0).
pub fn seed(name: &str) -> u64 {
    env_u64(name).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            | 1
    })
}

/// One tick's events: 15 outbound, each for `route(n)` (n counts them from the run's start),
/// with the hostile ones mixed in (about one in 15: no route, `wide` empty fields, a repeated
/// event id, a binary value), each with its n; and 5 inbound from ten sources.
pub fn tick_events(
    tick: u64,
    rng: &mut Rng,
    wide: usize,
    route: impl Fn(u64) -> String,
) -> (Vec<(u64, RawEvent)>, Vec<RawEvent>) {
    let mut out = Vec::new();
    for i in 0..15u64 {
        let n = tick * 15 + i;
        let mut e = event(&[("route", &route(n)), ("n", &n.to_string())]);
        match rng.below(60) {
            0 => e = event(&[("to", "nowhere")]),
            1 => e.extend((0..wide).map(|f| (format!("f{f}"), Vec::new()))),
            2 => e.push(("id".into(), format!("dup-{}", n % 7).into_bytes())),
            3 => e.push(("blob".into(), (0..2_000).map(|b| (b % 256) as u8).collect())),
            _ => {}
        }
        out.push((n, e));
    }
    let inb = (0..5u64)
        .map(|i| event(&[("source", &format!("s{}", (tick * 5 + i) % 10))]))
        .collect();
    (out, inb)
}

/// A worker the chaos kills, stops and restarts, under its wrapper (a skewed clock) each time.
pub struct Worker {
    pub pacer: Option<Pacer>,
    pub cfg: PathBuf,
    /// Its metrics port.
    pub port: u16,
    pub wrapper: Vec<String>,
    pub stopped_until: Option<Instant>,
}

impl Worker {
    pub fn pacer(&self) -> &Pacer {
        self.pacer.as_ref().expect("a running worker")
    }

    /// kill -9, restarted at once.
    pub fn kill_and_restart(&mut self) {
        if let Some(mut p) = self.pacer.take() {
            p.kill();
        }
        self.stopped_until = None;
        self.pacer = Some(Pacer::run_wrapped(&self.wrapper, bin(), &self.cfg, &[]));
    }

    /// SIGSTOP for 0.5–2 s (drawn), unless stopped already; whether it was stopped now.
    pub fn stop(&mut self, rng: &mut Rng) -> bool {
        if self.stopped_until.is_some() {
            return false;
        }
        self.pacer().signal("STOP");
        let pause = Duration::from_millis(500 + rng.below(1_500));
        self.stopped_until = Some(Instant::now() + pause);
        true
    }

    /// SIGCONT once its stop is over (or now, with `now`).
    pub fn cont(&mut self, now: bool) {
        if self
            .stopped_until
            .is_some_and(|t| now || Instant::now() >= t)
        {
            self.pacer().signal("CONT");
            self.stopped_until = None;
        }
    }
}

/// What the running workers have logged, one after the other.
pub fn logs(workers: &[Worker]) -> String {
    workers
        .iter()
        .map(|w| w.pacer().log_text())
        .collect::<Vec<_>>()
        .join("\n----\n")
}

/// Draws a fault on one of `workers` for `fault` 0–3 (kill -9 for 0 and 1, SIGSTOP for 2 and
/// 3), counting it in `faults`; false for any other `fault`, which the caller draws.
pub fn worker_fault(
    workers: &mut [Worker],
    fault: u64,
    rng: &mut Rng,
    faults: &mut BTreeMap<&'static str, u32>,
) -> bool {
    let w = rng.below(workers.len() as u64) as usize;
    match fault {
        0 | 1 => {
            workers[w].kill_and_restart();
            *faults.entry("kill -9 of a worker").or_default() += 1;
        }
        2 | 3 => {
            if workers[w].stop(rng) {
                *faults.entry("SIGSTOP of a worker").or_default() += 1;
            }
        }
        _ => return false,
    }
    true
}

/// The dead letters by reason.
pub fn reasons(dead: &[OutputEntry]) -> BTreeMap<String, usize> {
    dead.iter().fold(BTreeMap::new(), |mut m, d| {
        *m.entry(d.field("pacer_reason").unwrap_or("?").to_string())
            .or_default() += 1;
        m
    })
}

/// Faults redeliver entries (a killed worker's, a frozen one's past claim_idle), but an entry
/// delivered more than max_deliveries (5) times means workers keep failing to finish what they
/// hold: with a worker whose timers stalled, 5% of the outbound entries were. At most 1% of
/// `entries`, and the faults at least one per `every` seconds of the run.
pub fn assert_few_poisoned_and_enough_faults(
    seed: u64,
    reasons: &BTreeMap<String, usize>,
    entries: usize,
    faults: &BTreeMap<&str, u32>,
    seconds: u64,
    every: u64,
) {
    let poison = reasons.get("too_many_deliveries").copied().unwrap_or(0);
    assert!(
        poison * 100 <= entries,
        "seed {seed}: {poison} entries dead-lettered as delivered too often"
    );
    assert!(
        faults.values().sum::<u32>() >= (seconds / every) as u32,
        "too few faults: {faults:?}"
    );
}
