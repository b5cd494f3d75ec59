//! The admission maths: `lua/admit.lua`, run for real against a redis-server on Redis's own
//! clock, gives the same decisions as the Rust engine (`src/admission`) replaying each call at
//! the `now_us` the script reports, and writes the rejected entries the worker would (once
//! each, with `rejected_fields`' fields) when it writes them itself; and the Rust algorithms
//! keep their promises against brute-force models of the rolling window (property tests, fake
//! time).
//!
//! Over 400 lines: one subject, the admission maths (Lua against Rust, Rust against brute force),
//! whose strategies read together.

use pacer::admission::{
    fixed_window, gcra, sliding_log, Algorithm, Ask, Check, Engine, EngineRule, Limit, Rule, State,
    SPACING,
};
use pacer::config::InboundRule;
use pacer::event::inbound::{forward_fields, rejected_fields, Decision, InboundEvent};
use pacer::event::{Entry, Fields};
use pacer::keys::InboundKeys;
use pacer::scripts::{
    spacing_label, AdmitItem, AdmitTargets, Admitted, DecideCheck, DecideRequest, Function,
    ScriptRules, Scripts, LOG_ENTRIES_PER_READ,
};
use pacer::testkit::{command_calls, RedisServer};
use proptest::prelude::*;
use std::cell::RefCell;
use std::time::Duration;

// ---------------------------------------------------------------- Lua against Rust, real Redis

fn limit() -> impl Strategy<Value = (u64, u64)> {
    // count, window in µs: a few ms, so that real time slides them within a test case.
    (1u64..5, 2_000u64..15_000)
}

fn rule_strategy() -> impl Strategy<Value = (Rule, bool, usize)> {
    (
        prop_oneof![
            Just(Algorithm::SlidingLog),
            Just(Algorithm::Gcra),
            Just(Algorithm::FixedWindow)
        ],
        proptest::collection::vec(limit(), 0..3),
        prop_oneof![Just(0i64), 500i64..6_000],
        any::<bool>(),
        proptest::option::of(1u64..4),
        any::<bool>(),
        1usize..3,
    )
        .prop_map(
            |(algorithm, limits, spacing, count_rejected, burst, shadow, fields)| {
                let spacing_us = if limits.is_empty() && spacing == 0 {
                    1_000
                } else {
                    spacing
                };
                let burst = if algorithm == Algorithm::Gcra {
                    burst
                } else {
                    None
                };
                let rule = Rule {
                    algorithm,
                    limits: limits
                        .iter()
                        .enumerate()
                        .map(|(i, &(n, w))| Limit::new(n, w, burst, &format!("L{i}")))
                        .collect(),
                    spacing_us,
                    count_rejected,
                };
                (rule, shadow, fields)
            },
        )
}

/// One event: for each rule and key field, which of 3 values it carries; and whether it is a
/// redelivery of an earlier event instead.
#[derive(Debug, Clone)]
struct Ev {
    values: Vec<u8>,
    redeliver: Option<usize>,
}

#[derive(Debug, Clone)]
struct Case {
    rules: Vec<(Rule, bool, usize)>,
    /// Whether the script writes rejections itself (to the stream "rej").
    rejects_here: bool,
    /// Whether it writes accepted events itself (to the stream "fwd"): decision `A`, else `a`.
    forwards_here: bool,
    /// Whether it reads sliding logs whole or entry by entry (the entries per read of its `ScriptRules`).
    whole_logs: bool,
    /// (sleep before it in µs, events)
    batches: Vec<(u64, Vec<Ev>)>,
}

fn case() -> impl Strategy<Value = Case> {
    proptest::collection::vec(rule_strategy(), 1..3).prop_flat_map(|rules| {
        let fields: usize = rules.iter().map(|r| r.2).sum();
        let ev = (
            proptest::collection::vec(0u8..3, fields),
            proptest::option::weighted(0.1, 0usize..1000),
        )
            .prop_map(|(values, redeliver)| Ev { values, redeliver });
        let batch = (0u64..5_000, proptest::collection::vec(ev, 1..7));
        (
            proptest::collection::vec(batch, 3..12),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(
                move |(batches, rejects_here, forwards_here, whole_logs)| Case {
                    rules: rules.clone(),
                    rejects_here,
                    forwards_here,
                    whole_logs,
                    batches,
                },
            )
    })
}

fn inbound_rules(case: &Case) -> Vec<InboundRule> {
    case.rules
        .iter()
        .enumerate()
        .map(|(i, (rule, shadow, fields))| InboundRule {
            name: format!("rule{i}"),
            key: (0..*fields).map(|f| format!("f{f}")).collect(),
            rule: rule.clone(),
            rates: Vec::new(),
            shadow: *shadow,
            default_identity: None,
            lease: None,
        })
        .collect()
}

/// The decision string the script writes, from the engine's verdict (`A` and `R` for what the
/// script writes itself, `a` and `r` for what it leaves to the worker).
fn expected_decision(
    rules: &[InboundRule],
    checks: &[(usize, String, String)],
    v: &pacer::admission::Verdict,
    case: &Case,
) -> String {
    match v.binding {
        None if case.forwards_here => "A".into(),
        None => "a".into(),
        Some((r, i, check)) => {
            let rule = &rules[r];
            let label = if check.limit == SPACING {
                spacing_label(rule.rule.spacing_us)
            } else {
                rule.rule.limits[check.limit].label.clone()
            };
            let kind = if case.rejects_here { 'R' } else { 'r' };
            format!(
                "{kind}{}|{}|{label}|{}",
                check.retry_us, rule.name, checks[i].1
            )
        }
    }
}

/// An event's identities: (rule index, key field, limiter key).
type Checks = Vec<(usize, String, String)>;

/// The inbound event of `owner` ("<id>@in"), carrying one field; only its entry and carried
/// fields matter here (they make its forward and rejected fields).
fn inbound_event(owner: &str) -> InboundEvent {
    let fields: Fields = vec![(b"x".to_vec(), owner.as_bytes().to_vec())];
    InboundEvent {
        entry: Entry {
            stream: "in".into(),
            id: owner.split('@').next().unwrap().to_string(),
            fields: fields.clone(),
            deliveries: 1,
        },
        identities: Vec::new(),
        partition: 0,
        carried: fields,
    }
}

fn run_case(
    case: &Case,
    con: &mut redis::aio::MultiplexedConnection,
    rt: &tokio::runtime::Runtime,
    sync: &mut redis::Connection,
) -> Result<(), TestCaseError> {
    let _: () = redis::cmd("FLUSHALL").query(sync).unwrap();
    let scripts = Scripts::default();
    let keys = InboundKeys::new("fwd", "rej");
    let rules = inbound_rules(case);
    let mut engine = Engine::new(
        rules
            .iter()
            .map(|r| EngineRule {
                rule: r.rule.clone(),
                shadow: r.shadow,
            })
            .collect(),
    );
    // Every event sent so far: (owner, checks, decision); the rejections the script should
    // have written, in order.
    let mut sent: Vec<(String, Checks, String)> = Vec::new();
    let mut rejections: Vec<Fields> = Vec::new();
    let mut next_id = 0;
    for (sleep_us, events) in &case.batches {
        std::thread::sleep(Duration::from_micros(*sleep_us));
        let mut batch: Vec<(String, Checks, Option<String>)> = Vec::new();
        for ev in events {
            if let Some(j) = ev.redeliver.filter(|_| !sent.is_empty()) {
                let (owner, checks, decision) = &sent[j % sent.len()];
                if batch.iter().all(|(o, _, _)| o != owner) {
                    batch.push((owner.clone(), checks.clone(), Some(decision.clone())));
                }
                continue;
            }
            next_id += 1;
            let owner = format!("{next_id}-0@in");
            let mut checks = Vec::new();
            let mut v = ev.values.iter();
            for (r, rule) in rules.iter().enumerate() {
                for field in &rule.key {
                    let value = [b'a' + v.next().unwrap()];
                    let key = keys.identity(&rule.name, &rule.rule.key_part(), field, &value);
                    checks.push((r, field.clone(), key));
                }
            }
            batch.push((owner, checks, None));
        }
        let hashes: Vec<String> = batch
            .iter()
            .map(|(o, _, _)| keys.decisions(o.split('@').next().unwrap()))
            .collect();
        let events: Vec<InboundEvent> = batch.iter().map(|(o, _, _)| inbound_event(o)).collect();
        let fields: Vec<Fields> = events.iter().map(forward_fields).collect();
        let items: Vec<AdmitItem<'_>> = batch
            .iter()
            .zip(&hashes)
            .zip(&fields)
            .map(|(((owner, checks, _), decisions), fields)| AdmitItem {
                owner,
                stream: "in",
                entry_ms: pacer::event::entry_ms(owner),
                decisions,
                identities: checks.iter().map(|(_, _, k)| k.as_str()).collect(),
                fields,
            })
            .collect();
        let no_acks = |_: &str| false;
        let to = AdmitTargets {
            keys: &keys,
            forward: case.forwards_here,
            rejected: case.rejects_here,
            decision_ttl_ms: 600_000,
            max_len: 10_000,
            group: "pacer",
            acks: &no_acks,
            stale_us: i64::MAX / 4,
        };
        // The drawn caps are small: read whole by default, by entry with 0.
        let entries_per_read = if case.whole_logs {
            LOG_ENTRIES_PER_READ
        } else {
            0
        };
        let script_rules = ScriptRules::new(&rules, entries_per_read);
        let reply = rt
            .block_on(scripts.admit(con, &to, &script_rules, &items))
            .expect("admit");
        for (((owner, checks, earlier), got), event) in batch.iter().zip(&reply.items).zip(&events)
        {
            match earlier {
                Some(decision) => {
                    prop_assert_eq!(got, &Admitted::Earlier(decision.clone()), "redelivery");
                }
                None => {
                    let identities: Vec<(usize, String)> =
                        checks.iter().map(|(r, _, k)| (*r, k.clone())).collect();
                    let v = engine.admit(reply.now_us, &identities);
                    let decision = expected_decision(&rules, checks, &v, case);
                    if decision.starts_with('R') {
                        let d = Decision::parse(&decision).expect("a readable decision");
                        rejections.push(rejected_fields(event, &d));
                    }
                    let want = Admitted::Now {
                        decision: decision.clone(),
                        verdicts: v.passed.clone(),
                    };
                    prop_assert_eq!(got, &want, "event {} at {}", owner, reply.now_us);
                    sent.push((owner.clone(), checks.clone(), decision));
                }
            }
        }
        // Bounded memory, after every call: logs never longer than their largest limit, and
        // every key expiring within its rule's horizon and within what the model says its state
        // is worth. A log holds what the model's holds.
        for (r, rule) in rules.iter().enumerate() {
            let pattern = format!("pacer:in:{{fwd}}:{}:*", rule.name);
            let found: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(sync).unwrap();
            for key in found {
                let pttl: i64 = redis::cmd("PTTL").arg(&key).query(sync).unwrap();
                let horizon_ms = (rule.rule.horizon_us() + 999) / 1000;
                // -1 would be a key without a TTL; -2 or 0, one that expired since KEYS listed it.
                prop_assert!(
                    pttl != -1 && pttl <= horizon_ms,
                    "{} ttl {} > {}",
                    key,
                    pttl,
                    horizon_ms
                );
                // And no longer than its state is worth keeping, as the model computes it (for
                // gcra and fixed_window, often well within the horizon). The key was written at
                // this call's `now` or earlier, so its time to live is at most the model's as of
                // now, give or take a millisecond each for the two roundings: the script's
                // time to live is rounded up to the ms from its `now`, and Redis counts it from
                // its own clock in whole ms. A key an earlier call wrote can show both (a script
                // that ran longer between its TIME and its PSETEX than this check comes after
                // this call's TIME: seen about once in 40 runs of 120 cases, 2 ms over).
                let Some(model) = engine.states.get(&(r, key.clone())) else {
                    return Err(TestCaseError::fail(format!("{key}: not in the model")));
                };
                let worth_ms = model.ttl_ms(reply.now_us, &rule.rule);
                prop_assert!(
                    pttl <= worth_ms + 2,
                    "{} ttl {} > {} ms",
                    key,
                    pttl,
                    worth_ms
                );
                if rule.rule.algorithm == Algorithm::SlidingLog {
                    let Some(bytes): Option<Vec<u8>> =
                        redis::cmd("GET").arg(&key).query(sync).unwrap()
                    else {
                        // Expired since KEYS listed it (a horizon can be a few ms): then every
                        // entry the model holds is older than the horizon by now.
                        let (s, us): (i64, i64) = redis::cmd("TIME").query(sync).unwrap();
                        let mut model = match engine.states.get(&(r, key.clone())) {
                            Some(State::Log(model)) => model.clone(),
                            _ => Vec::new(),
                        };
                        sliding_log::trim(&mut model, s * 1_000_000 + us, &rule.rule);
                        prop_assert!(model.is_empty(), "{} expired holding {:?}", key, model);
                        continue;
                    };
                    let mut stored = sliding_log::unpack(&bytes).expect("a packed log");
                    prop_assert!(
                        stored.len() as i64 <= rule.rule.log_cap(),
                        "{} holds {}",
                        key,
                        stored.len()
                    );
                    // The script trims when it writes, the model when it checks: compare both
                    // as of this call.
                    let Some(State::Log(model)) = engine.states.get(&(r, key.clone())) else {
                        return Err(TestCaseError::fail(format!("{key}: not in the model")));
                    };
                    let mut model = model.clone();
                    sliding_log::trim(&mut model, reply.now_us, &rule.rule);
                    sliding_log::trim(&mut stored, reply.now_us, &rule.rule);
                    prop_assert_eq!(&stored, &model, "{}", key);
                }
            }
        }
    }
    let forwarded: i64 = redis::cmd("XLEN").arg("fwd").query(sync).unwrap();
    let accepted = sent.iter().filter(|s| s.2 == "A").count() as i64;
    prop_assert_eq!(forwarded, accepted, "each accepted event forwarded once");
    // Each rejection the script wrote, once, with the fields the worker would have written.
    let written: Vec<Fields> = rt
        .block_on(pacer::report::read_all(con, "rej"))
        .unwrap()
        .into_iter()
        .map(|e| e.fields)
        .collect();
    prop_assert_eq!(written, rejections);
    Ok(())
}

/// Runs `cases` cases of `strategy` through `run` against `redis`.
fn on_redis<S: Strategy>(
    redis: &RedisServer,
    cases: u32,
    strategy: S,
    run: impl Fn(
        &S::Value,
        &mut redis::aio::MultiplexedConnection,
        &tokio::runtime::Runtime,
        &mut redis::Connection,
    ) -> Result<(), TestCaseError>,
) {
    let (rt, con) = redis.async_con();
    let con = RefCell::new(con);
    let sync = RefCell::new(redis.con());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(cases));
    runner
        .run(&strategy, |case| {
            run(&case, &mut con.borrow_mut(), &rt, &mut sync.borrow_mut())
        })
        .unwrap();
}

/// Admits `n` events (each with one `size`-byte field) of distinct identities under
/// `hourly_rule`, forwarding them in the call: the call's `now_us` and each forward entry's id.
fn admit_forwarding(redis: &RedisServer, n: usize, size: usize) -> (i64, Vec<String>) {
    let (rt, mut con) = redis.async_con();
    let scripts = Scripts::default();
    let keys = InboundKeys::new("fwd", "rej");
    let rules = hourly_rule();
    let owners: Vec<String> = (1..=n).map(|i| format!("{i}-0@in")).collect();
    let identities: Vec<String> = (0..n)
        .map(|i| {
            keys.identity(
                "r",
                &rules[0].rule.key_part(),
                "k",
                i.to_string().as_bytes(),
            )
        })
        .collect();
    let hashes: Vec<String> = owners
        .iter()
        .map(|o| keys.decisions(o.split('@').next().unwrap()))
        .collect();
    let fields: Vec<Fields> = owners
        .iter()
        .map(|o| {
            let mut event = inbound_event(o);
            event.carried = vec![(b"x".to_vec(), vec![b'x'; size])];
            forward_fields(&event)
        })
        .collect();
    let items: Vec<AdmitItem<'_>> = (0..n)
        .map(|i| AdmitItem {
            owner: &owners[i],
            stream: "in",
            entry_ms: pacer::event::entry_ms(&owners[i]),
            decisions: &hashes[i],
            identities: vec![identities[i].as_str()],
            fields: &fields[i],
        })
        .collect();
    let no_acks = |_: &str| false;
    let to = AdmitTargets {
        keys: &keys,
        forward: true,
        rejected: true,
        decision_ttl_ms: 600_000,
        max_len: 100_000,
        group: "pacer",
        acks: &no_acks,
        stale_us: i64::MAX / 4,
    };
    let reply = rt
        .block_on(scripts.admit(&mut con, &to, &ScriptRules::new(&rules, 0), &items))
        .expect("admit");
    let accepted = reply
        .items
        .iter()
        .filter(|a| matches!(a, Admitted::Now { decision, .. } if decision == "A"))
        .count();
    assert_eq!(accepted, n, "{:?}", &reply.items[..3.min(n)]);
    let ids: Vec<String> = redis::cmd("XRANGE")
        .arg("fwd")
        .arg("-")
        .arg("+")
        .query::<Vec<(String, Vec<Vec<u8>>)>>(&mut redis.con())
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    (reply.now_us, ids)
}

/// A forward entry's id is the millisecond the call decided it in, however long the call took to
/// write it: counted by entry id, the forward stream then holds the rules' limits on Redis's
/// clock. 400 events of 64 KB each keep the call writing for many milliseconds (Redis's own ids,
/// `*`, would spread over them). A forward stream whose newest entry is past the decision (the
/// clock stepped back) takes the entries with Redis's own ids instead, each written once.
#[test]
fn forward_entries_carry_the_decisions_millisecond_and_a_stream_ahead_of_it_takes_them_still() {
    let redis = RedisServer::start();
    let (now_us, ids) = admit_forwarding(&redis, 400, 64 * 1024);
    let now_ms = now_us.div_euclid(1000);
    assert_eq!(ids.len(), 400);
    let off: Vec<&String> = ids
        .iter()
        .filter(|id| pacer::event::entry_ms(id) != now_ms)
        .collect();
    assert!(
        off.is_empty(),
        "decided at {now_ms} ms: {} ids not: {:?}",
        off.len(),
        &off[..3.min(off.len())]
    );

    let _: () = redis::cmd("FLUSHALL").query(&mut redis.con()).unwrap();
    let ahead = format!("{}-0", now_ms + 3_600_000);
    let _: String = redis::cmd("XADD")
        .arg("fwd")
        .arg(&ahead)
        .arg("x")
        .arg("ahead")
        .query(&mut redis.con())
        .unwrap();
    let (_, ids) = admit_forwarding(&redis, 5, 10);
    assert_eq!(ids.len(), 6, "{ids:?}");
    assert_eq!(ids[0], ahead);
}

#[test]
fn lua_and_rust_decide_alike_on_redis_time() {
    on_redis(&RedisServer::start(), 120, case(), run_case);
}

// ------------------------------------------ synchronous decisions: decide.lua against Rust

/// One synchronous request: per check, which of 3 values and what is asked (0 decide, 1 covered
/// by a lease, n > 1 lease n - 1 tokens; only 0 at cost 0); its cost; the sleep before it (µs).
#[derive(Debug, Clone)]
struct Request {
    values: Vec<(u8, u8)>,
    cost: i64,
    sleep_us: u64,
}

/// Rules (rule, shadow, key fields), whether logs are read whole, and the requests.
type SyncCase = (Vec<(Rule, bool, usize)>, bool, Vec<Request>);

fn sync_case() -> impl Strategy<Value = SyncCase> {
    proptest::collection::vec(rule_strategy(), 1..3).prop_flat_map(|rules| {
        let fields: usize = rules.iter().map(|r| r.2).sum();
        let request = (
            proptest::collection::vec(
                (
                    0u8..3,
                    prop_oneof![3 => Just(0u8), 1 => Just(1u8), 2 => 2u8..6],
                ),
                fields,
            ),
            // 0: a check that charges nothing (an Envoy descriptor's hits_addend of 0).
            prop_oneof![3 => Just(1i64), 1 => 2i64..5, 1 => Just(0i64)],
            // Half join the batch before them (under 1 ms, see run_sync_case).
            prop_oneof![1 => 0u64..1_000, 1 => 1_000u64..4_000],
        )
            .prop_map(|(values, cost, sleep_us)| Request {
                values,
                cost,
                sleep_us,
            });
        (
            Just(rules),
            any::<bool>(),
            proptest::collection::vec(request, 5..30),
        )
    })
}

fn run_sync_case(
    (rules, whole_logs, requests): &SyncCase,
    con: &mut redis::aio::MultiplexedConnection,
    rt: &tokio::runtime::Runtime,
    sync: &mut redis::Connection,
) -> Result<(), TestCaseError> {
    let _: () = redis::cmd("FLUSHALL").query(sync).unwrap();
    let scripts = Scripts::default();
    let keys = InboundKeys::new("fwd", "rej");
    let case = Case {
        rules: rules.clone(),
        rejects_here: false,
        forwards_here: false,
        whole_logs: *whole_logs,
        batches: Vec::new(),
    };
    let rules = inbound_rules(&case);
    let per_read = if *whole_logs { LOG_ENTRIES_PER_READ } else { 0 };
    let decide_rules = ScriptRules::new(&rules, per_read);
    let mut engine = Engine::new(
        rules
            .iter()
            .map(|r| EngineRule {
                rule: r.rule.clone(),
                shadow: r.shadow,
            })
            .collect(),
    );
    // Requests go in batches: a request whose sleep is under 1 ms joins the batch before it
    // (the batch is decided at one instant, each request in turn).
    let mut batches: Vec<Vec<&Request>> = Vec::new();
    for req in requests {
        match batches.last_mut() {
            Some(b) if req.sleep_us < 1_000 => b.push(req),
            _ => batches.push(vec![req]),
        }
    }
    for (n, batch) in batches.iter().enumerate() {
        std::thread::sleep(Duration::from_micros(batch[0].sleep_us));
        let mut model: Vec<Vec<(usize, String, Ask)>> = Vec::new();
        let mut keys_of: Vec<Vec<(usize, usize, String, Ask)>> = Vec::new();
        for req in batch {
            let mut model_checks = Vec::new();
            let mut checks = Vec::new();
            let mut v = req.values.iter();
            for (r, rule) in rules.iter().enumerate() {
                for (f, field) in rule.key.iter().enumerate() {
                    let &(value, ask) = v.next().unwrap();
                    let key =
                        keys.identity(&rule.name, &rule.rule.key_part(), field, &[b'a' + value]);
                    // Only gcra and fixed_window lease. A lease asked for comes with some of
                    // the request's tokens paid from the caller's lease, or none, from
                    // leases that end long after the call or have ended before it.
                    // A check of cost 0 asks nothing else.
                    let ask = match ask {
                        _ if req.cost == 0 => Ask::Decide,
                        0 => Ask::Decide,
                        1 => Ask::Covered,
                        _ if rule.rule.algorithm == Algorithm::SlidingLog => Ask::Decide,
                        k => Ask::Lease {
                            more: k as i64 - 1,
                            paid: k as i64 % req.cost,
                            paid_until_us: if k % 2 == 1 { 1 << 60 } else { 1 },
                        },
                    };
                    checks.push((r, f, key.clone(), ask));
                    model_checks.push((r, key, ask));
                }
            }
            model.push(model_checks);
            keys_of.push(checks);
        }
        let calls: Vec<DecideRequest<'_>> = keys_of
            .iter()
            .zip(batch)
            .map(|(checks, req)| DecideRequest {
                checks: checks
                    .iter()
                    .map(|(r, f, key, ask)| DecideCheck {
                        rule: *r,
                        field: *f,
                        key,
                        ask: *ask,
                    })
                    .collect(),
                cost: req.cost,
            })
            .collect();
        let (now_us, mut got) = rt
            .block_on(scripts.decide(con, &decide_rules, &calls))
            .expect("decide");
        // Fetch turns are a pacing hint the function keeps, which the engine does not model
        // (`decide_books_fetch_turns_a_gap_apart` tests them).
        for c in got.iter_mut().flat_map(|v| v.checks.iter_mut()) {
            c.turn_in_us = 0;
        }
        for (i, (checks, req)) in model.iter().zip(batch).enumerate() {
            let want = engine.decide(now_us, checks, req.cost);
            prop_assert_eq!(&got[i], &want, "batch {} request {} at {}", n, i, now_us);
        }
    }
    Ok(())
}

#[test]
fn synchronous_decisions_and_leases_agree_in_lua_and_rust() {
    // decide.lua as a Redis Function, the way pacer calls it wherever Redis lets it.
    let redis = RedisServer::start();
    on_redis(&redis, 150, sync_case(), run_sync_case);
    assert!(command_calls(&mut redis.con(), "fcall") > 0);
    assert_eq!(command_calls(&mut redis.con(), "evalsha"), 0);
}

#[test]
fn synchronous_decisions_agree_where_decide_cannot_be_a_function() {
    // A Redis that will not run it as a Function (FCALL renamed away, as a locked-down
    // deployment might): every call goes by EVALSHA, with the same answers.
    let redis = RedisServer::start_with(&["--rename-command", "FCALL", ""]);
    on_redis(&redis, 40, sync_case(), run_sync_case);
    assert!(command_calls(&mut redis.con(), "evalsha") > 0);
}

#[test]
fn decide_books_fetch_turns_a_gap_apart() {
    // Three workers' fetches at the limit of a leased gcra rule (100/s, burst 10, ttl 40 ms,
    // batches of up to 10: turns 30 ms apart), each asking more than is left: each gets the
    // turn after the one before, so together they fetch once a gap, whatever their number.
    let redis = RedisServer::start();
    let (rt, mut con) = redis.async_con();
    let scripts = Scripts::default();
    let mut rules = hourly_rule();
    rules[0].rule = make(Algorithm::Gcra, &[(100, 1_000_000)], 0, Some(10));
    let lease = pacer::config::Lease {
        ttl: Duration::from_millis(40),
        max: 10,
        bucket: Some((10, Duration::from_millis(100))),
    };
    let gap = lease.turn_gap().as_micros() as i64;
    assert_eq!(gap, 30_000);
    rules[0].lease = Some(lease);
    let rules = ScriptRules::new(&rules, 0);
    let fetch = |con: &mut redis::aio::MultiplexedConnection, ask: i64| {
        let request = DecideRequest {
            checks: vec![DecideCheck {
                rule: 0,
                field: 0,
                key: "pacer:in:{fwd}:r:gcra:k=a",
                ask: Ask::Lease {
                    more: ask,
                    paid: 0,
                    paid_until_us: 0,
                },
            }],
            cost: 1,
        };
        let (now_us, verdicts) = rt
            .block_on(scripts.decide(con, &rules, &[request]))
            .expect("decide");
        (now_us, verdicts[0].checks[0])
    };
    // The first takes the whole bucket (1 + 9 leased) and, leaving nothing, books a turn.
    let (t1, first) = fetch(&mut con, 10);
    assert_eq!(first.granted, 9);
    assert!((gap - 1_000..=gap).contains(&first.turn_in_us), "{first:?}");
    // The next two are refused (nothing left) and queue up behind it.
    let (t2, second) = fetch(&mut con, 10);
    let (t3, third) = fetch(&mut con, 10);
    assert!(!second.passed && !third.passed);
    assert_eq!(t2 + second.turn_in_us, t1 + first.turn_in_us + gap);
    assert_eq!(t3 + third.turn_in_us, t1 + first.turn_in_us + 2 * gap);
    // Once the bucket is full again, a fetch that leaves as much room as it asked books none.
    std::thread::sleep(Duration::from_millis(150));
    let (_, later) = fetch(&mut con, 3);
    assert_eq!((later.granted, later.turn_in_us), (3, 0), "{later:?}");
}

#[test]
fn decide_refuses_a_check_of_cost_0_that_asks_for_more_and_writes_nothing() {
    // A check that charges nothing leases nothing and spends no lease: a call that says
    // otherwise is a bug in its caller, refused whole (the request before it not charged).
    let redis = RedisServer::start();
    let (rt, mut con) = redis.async_con();
    let scripts = Scripts::default();
    let rules = ScriptRules::new(&hourly_rule(), 0);
    for ask in [
        Ask::Covered,
        Ask::Lease {
            more: 2,
            paid: 0,
            paid_until_us: 0,
        },
    ] {
        let mut peek = hourly_request();
        peek.cost = 0;
        peek.checks[0].ask = ask;
        let err = rt
            .block_on(scripts.decide(&mut con, &rules, &[hourly_request(), peek]))
            .expect_err("refused");
        assert!(
            err.to_string().contains("asks nothing more"),
            "{ask:?}: {err}"
        );
    }
    let mut peek = hourly_request();
    peek.cost = 0;
    let (_, v) = rt
        .block_on(scripts.decide(&mut con, &rules, &[peek]))
        .expect("decide");
    assert_eq!(v[0].checks[0].room.map(|r| r.remaining), Some(10), "{v:?}");
}

/// One rule of 10 an hour on `k`.
fn hourly_rule() -> Vec<InboundRule> {
    vec![InboundRule {
        name: "r".into(),
        key: vec!["k".into()],
        rule: make(Algorithm::Gcra, &[(10, 3_600_000_000)], 0, None),
        rates: Vec::new(),
        shadow: false,
        default_identity: None,
        lease: None,
    }]
}

/// One request of the identity `hourly_rule` is decided on.
fn hourly_request() -> DecideRequest<'static> {
    DecideRequest {
        checks: vec![DecideCheck {
            rule: 0,
            field: 0,
            key: "pacer:in:{fwd}:r:gcra:k=a",
            ask: Ask::Decide,
        }],
        cost: 1,
    }
}

/// Decides `n` requests of one identity under `hourly_rule` in one call: how many were allowed.
fn decide_hourly(
    scripts: &Scripts,
    rt: &tokio::runtime::Runtime,
    con: &mut redis::aio::MultiplexedConnection,
    n: usize,
) -> usize {
    let requests: Vec<_> = (0..n).map(|_| hourly_request()).collect();
    let (_, verdicts) = rt
        .block_on(scripts.decide(con, &ScriptRules::new(&hourly_rule(), 0), &requests))
        .expect("decide");
    verdicts.iter().filter(|v| v.accepted).count()
}

#[test]
fn decide_runs_as_a_script_for_a_user_who_may_not_call_functions() {
    let redis = RedisServer::start();
    redis.add_acl_user("nofn", "pw");
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "nofn", "-fcall"])
        .query(&mut redis.con())
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = format!("redis://nofn:pw@127.0.0.1:{}", redis.port);
    let mut con = rt
        .block_on(
            redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection(),
        )
        .unwrap();
    let scripts = Scripts::default();
    rt.block_on(scripts.load(&mut con))
        .expect("the scripts load without the function");
    // The bucket's 10 go to the first 10 of 12 requests in three calls, each by EVALSHA: the
    // function loads but its FCALL is refused (NOPERM), twice in the first call (before and
    // after loading it again), then not tried within 10 s.
    let allowed: usize = (0..3)
        .map(|_| decide_hourly(&scripts, &rt, &mut con, 4))
        .sum();
    assert_eq!(allowed, 10);
    assert_eq!(command_calls(&mut redis.con(), "evalsha"), 3);
    assert_eq!(command_calls(&mut redis.con(), "fcall"), 0);
}

#[test]
fn decide_loads_its_function_again_when_redis_has_lost_it() {
    let redis = RedisServer::start();
    let (rt, mut con) = redis.async_con();
    let scripts = Scripts::default();
    let libraries = || -> String {
        let list: redis::Value = redis::cmd("FUNCTION")
            .arg("LIST")
            .query(&mut redis.con())
            .unwrap();
        format!("{list:?}")
    };
    // Loaded on first use (a worker loads it when it starts), then lost, then loaded again:
    // the bucket's 10 are spent across the three calls, each by FCALL. The library keeps the
    // rules it was sent: the first two calls find it without them (not found; then loaded,
    // asked for the rules and sent them: three FCALLs each), the third passes none (one).
    assert_eq!(decide_hourly(&scripts, &rt, &mut con, 4), 4);
    assert!(libraries().contains("pacer_decide_"), "{}", libraries());
    let _: () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query(&mut redis.con())
        .unwrap();
    assert!(!libraries().contains("pacer_decide_"));
    assert_eq!(decide_hourly(&scripts, &rt, &mut con, 4), 4);
    assert!(libraries().contains("pacer_decide_"), "{}", libraries());
    assert_eq!(decide_hourly(&scripts, &rt, &mut con, 4), 2);
    assert_eq!(command_calls(&mut redis.con(), "evalsha"), 0);
    assert_eq!(command_calls(&mut redis.con(), "fcall"), 7);
}

#[test]
fn decides_library_keeps_the_rules_of_every_config_in_use_and_forgets_the_rest() {
    let redis = RedisServer::start();
    let (rt, mut con) = redis.async_con();
    let scripts = Scripts::default();
    // Config i: one rule of i + 1 an hour (a digest of its own).
    let configs: Vec<ScriptRules> = (0..2100u64)
        .map(|i| {
            let mut rules = hourly_rule();
            rules[0].rule = make(Algorithm::Gcra, &[(i + 1, 3_600_000_000)], 0, None);
            ScriptRules::new(&rules, 0)
        })
        .collect();
    let mut decide = |config: &ScriptRules| {
        rt.block_on(scripts.decide(&mut con, config, &[hourly_request()]))
            .expect("decide");
    };
    let fcalls = || command_calls(&mut redis.con(), "fcall");
    // A hundred configs' workers in turn on one Redis: each sends its rules once (asked, then
    // again with them: two calls), then never again. Clearing all at 64 made nearly every
    // call past the 64th config's first send them again. (The function is loaded first.)
    decide(&configs[100]);
    for round in 0..3 {
        let before = fcalls();
        for config in &configs[..100] {
            decide(config);
        }
        let per_round = if round == 0 { 200 } else { 100 };
        assert_eq!(fcalls() - before, per_round, "round {round}");
    }
    // Bounded: past 1024 rules kept in the new generation, what is unused goes.
    for config in &configs[100..] {
        decide(config);
    }
    let before = fcalls();
    decide(&configs[2099]);
    assert_eq!(fcalls() - before, 1, "the last config's rules are kept");
    decide(&configs[0]);
    assert_eq!(fcalls() - before, 3, "the first config's rules were let go");
}

#[test]
fn loading_the_scripts_deletes_other_pacer_versions_libraries_and_no_one_elses() {
    let redis = RedisServer::start();
    let (rt, mut con) = redis.async_con();
    // The libraries' names, one line each.
    let names = || -> String {
        let list: Vec<Vec<redis::Value>> = redis::cmd("FUNCTION")
            .arg("LIST")
            .query(&mut redis.con())
            .unwrap();
        let mut names: Vec<String> = list
            .iter()
            .map(|library| redis::from_redis_value(library[1].clone()).unwrap())
            .collect();
        names.sort();
        names.join("\n")
    };
    // An older pacer's decide (another body, so another hash in its name), still called by a
    // worker of that version; and libraries that only look alike, or are a user's.
    // (`pacer_emit_` is no function of pacer's: `emit.lua` runs as a script.)
    const LOOKALIKES: [&str; 4] = [
        "pacer_decide_mine",
        "pacer_decide_0123456789abcdefff",
        "pacer_emit_0123456789abcdef",
        "mylib",
    ];
    // Another version's admit, loaded by hand as a worker of that version would.
    const OLDER_ADMIT: &str = "pacer_admit_0123456789abcdef";
    let older = Function::new("decide", "", "return 7");
    let call_older = |con: &mut redis::aio::MultiplexedConnection| -> redis::Value {
        rt.block_on(older.call(con, &[], |_| redis::Cmd::new()))
            .expect("the older version's call")
    };
    assert_eq!(call_older(&mut con), redis::Value::Int(7));
    for other in LOOKALIKES.into_iter().chain([OLDER_ADMIT]) {
        let _: () = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg(format!(
                "#!lua name={other}\nredis.register_function('{other}', function() return 1 end)"
            ))
            .query(&mut redis.con())
            .unwrap();
    }
    assert!(names().contains(older.name()), "{}", names());
    // A worker of this version starts: the older decide's and admit's libraries go, nothing
    // else does.
    let scripts = Scripts::default();
    rt.block_on(scripts.load(&mut con)).unwrap();
    let after = names();
    assert!(!after.contains(older.name()), "{after}");
    assert!(!after.contains(OLDER_ADMIT), "{after}");
    for kept in LOOKALIKES {
        assert!(after.contains(kept), "{kept}: {after}");
    }
    // The look-alikes, and this version's four: schedule, dispatch, admit and decide.
    assert_eq!(after.lines().count(), 8, "{after}");
    // This version's own library stays, loaded again or not.
    assert_eq!(decide_hourly(&scripts, &rt, &mut con, 4), 4);
    rt.block_on(scripts.load(&mut con)).unwrap();
    assert_eq!(names().lines().count(), 8, "{}", names());
    assert_eq!(command_calls(&mut redis.con(), "evalsha"), 0);
    // The older worker, still running, loads its library again and its call is answered.
    assert_eq!(call_older(&mut con), redis::Value::Int(7));
    assert!(names().contains(older.name()), "{}", names());
}

// ---------------------------------------------------------------- Rust against brute force

/// Event times (µs, non-decreasing) from gaps.
fn times() -> impl Strategy<Value = Vec<i64>> {
    proptest::collection::vec(0i64..3_000, 1..300).prop_map(|gaps| {
        let mut t = 1_790_000_000_000_000i64;
        gaps.into_iter()
            .map(|g| {
                t += g;
                t
            })
            .collect()
    })
}

fn limits() -> impl Strategy<Value = Vec<(u64, u64)>> {
    proptest::collection::vec((1u64..8, 1_000u64..40_000), 1..4)
}

fn make(algorithm: Algorithm, limits: &[(u64, u64)], spacing_us: i64, burst: Option<u64>) -> Rule {
    Rule {
        algorithm,
        limits: limits
            .iter()
            .map(|&(n, w)| Limit::new(n, w, burst, "l"))
            .collect(),
        spacing_us,
        count_rejected: false,
    }
}

/// Feeds `times` through one identity's state; returns each check.
fn feed(rule: &Rule, times: &[i64]) -> Vec<Check> {
    let mut state = State::empty(rule);
    times
        .iter()
        .map(|&t| {
            state.trim(t, rule);
            let c = state.check(t, rule);
            if rule.charges(c.passed(), c.passed()) {
                state.charge(t, rule, c.passed());
            }
            c
        })
        .collect()
}

/// min_spacing by its definition: an event at `t` less than `spacing` after the last one
/// charged waits until it is.
fn brute_spacing(rule: &Rule, last: Option<i64>, t: i64) -> Check {
    match last {
        Some(last) if rule.spacing_us > 0 && t - last < rule.spacing_us => Check {
            retry_us: last + rule.spacing_us - t,
            limit: SPACING,
        },
        _ => Check::PASS,
    }
}

/// The rolling window by brute force over every charged event, kept forever: an event passes
/// when each window `(t − W, t]` holds fewer than `count` charged events and the last charged one
/// is `min_spacing` old; a rejected one could pass at the earliest time every condition clears.
fn brute_log(rule: &Rule, times: &[i64]) -> Vec<Check> {
    let mut charged: Vec<i64> = Vec::new();
    let mut out = Vec::new();
    for &t in times {
        let mut verdict = brute_spacing(rule, charged.last().copied(), t);
        for (i, l) in rule.limits.iter().enumerate() {
            let count = |at: i64| charged.iter().filter(|&&s| s > at - l.window_us).count() as i64;
            if count(t) >= l.count {
                // The first time, among the moments an entry leaves, that the window has room.
                let clear = charged
                    .iter()
                    .map(|&s| s + l.window_us)
                    .filter(|&at| at > t && count(at) < l.count)
                    .min()
                    .expect("the window clears once its entries leave");
                verdict = verdict.and(Check {
                    retry_us: clear - t,
                    limit: i,
                });
            }
        }
        if verdict.passed() || rule.count_rejected {
            charged.push(t);
        }
        out.push(verdict);
    }
    out
}

/// GCRA by its definition: accepted times `t_1..t_n` conform when for all i < j,
/// `t_j − t_i ≥ (j − i) × interval − tolerance`. An event passes when appending it conforms for
/// every limit; the earliest conforming time is the largest of those bounds.
fn brute_gcra(rule: &Rule, times: &[i64]) -> Vec<Check> {
    let mut accepted: Vec<i64> = Vec::new();
    let mut out = Vec::new();
    for &t in times {
        let mut verdict = brute_spacing(rule, accepted.last().copied(), t);
        let n = accepted.len() as i64;
        for (li, l) in rule.limits.iter().enumerate() {
            let earliest = accepted
                .iter()
                .enumerate()
                .map(|(i, &ti)| ti + (n - i as i64) * l.interval_us - l.tolerance_us)
                .max();
            if let Some(e) = earliest.filter(|&e| e > t) {
                verdict = verdict.and(Check {
                    retry_us: e - t,
                    limit: li,
                });
            }
        }
        if verdict.passed() {
            accepted.push(t);
        }
        out.push(verdict);
    }
    out
}

/// Fixed windows by counting every accepted event in the same calendar window.
fn brute_fixed(rule: &Rule, times: &[i64]) -> Vec<Check> {
    let mut accepted: Vec<i64> = Vec::new();
    let mut out = Vec::new();
    for &t in times {
        let mut verdict = brute_spacing(rule, accepted.last().copied(), t);
        for (i, l) in rule.limits.iter().enumerate() {
            let w = t / l.window_us;
            let count = accepted.iter().filter(|&&s| s / l.window_us == w).count() as i64;
            if count >= l.count {
                verdict = verdict.and(Check {
                    retry_us: (w + 1) * l.window_us - t,
                    limit: i,
                });
            }
        }
        if verdict.passed() {
            accepted.push(t);
        }
        out.push(verdict);
    }
    out
}

/// The most events whose times fall in any window `(a − W, a]`.
fn max_in_rolling_window(sorted: &[i64], window_us: i64) -> usize {
    let mut best = 0;
    let mut start = 0;
    for end in 0..sorted.len() {
        while sorted[end] - sorted[start] >= window_us {
            start += 1;
        }
        best = best.max(end - start + 1);
    }
    best
}

fn accepted_times(checks: &[Check], times: &[i64]) -> Vec<i64> {
    checks
        .iter()
        .zip(times)
        .filter(|(c, _)| c.passed())
        .map(|(_, &t)| t)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The sliding log, kept short (trimmed, capped at its largest limit), decides exactly like
    /// the unbounded log, retry times included; and never holds more than its largest limit.
    #[test]
    fn sliding_log_is_the_exact_rolling_window(
        l in limits(), spacing in prop_oneof![Just(0i64), 1i64..5_000],
        count_rejected in any::<bool>(), t in times(),
    ) {
        let mut rule = make(Algorithm::SlidingLog, &l, spacing, None);
        rule.count_rejected = count_rejected;
        prop_assert_eq!(feed(&rule, &t), brute_log(&rule, &t));
        let mut log = Vec::new();
        for &now in &t {
            sliding_log::trim(&mut log, now, &rule);
            if rule.charges(sliding_log::check(&log, now, &rule).passed(), true) {
                sliding_log::charge(&mut log, now, &rule);
            }
            prop_assert!(log.len() as i64 <= rule.log_cap());
        }
        // And what it accepted holds every limit in every rolling window.
        if !count_rejected {
            let acc = accepted_times(&feed(&rule, &t), &t);
            for lim in &rule.limits {
                prop_assert!(max_in_rolling_window(&acc, lim.window_us) as i64 <= lim.count);
            }
        }
    }

    /// GCRA accepts exactly the events that keep `rate × W + burst` in every window (its
    /// conformance definition), with the retry time to the microsecond.
    #[test]
    fn gcra_is_exact_rate_and_burst(
        l in limits(), burst in proptest::option::of(1u64..6),
        spacing in prop_oneof![Just(0i64), 1i64..5_000], t in times(),
    ) {
        let rule = make(Algorithm::Gcra, &l, spacing, burst);
        let checks = feed(&rule, &t);
        prop_assert_eq!(&checks, &brute_gcra(&rule, &t));
        let acc = accepted_times(&checks, &t);
        for lim in &rule.limits {
            let b = lim.tolerance_us / lim.interval_us + 1;
            for w in [1_000i64, 5_000, 20_000, 100_000] {
                // Events less than w apart: at most (w − 1) / interval + burst.
                let most = (w - 1) / lim.interval_us + b;
                prop_assert!((max_in_rolling_window(&acc, w) as i64) <= most);
            }
        }
        // O(1): one number per limit, whatever the traffic.
        let mut s = gcra::State::empty(&rule);
        for &now in &t {
            if gcra::check(&s, now, &rule).passed() {
                gcra::charge(&mut s, now, &rule, true);
            }
        }
        prop_assert_eq!(s.tats.len(), rule.limits.len());
    }

    /// Fixed windows count exactly per calendar window; a rolling window may see up to twice
    /// the limit (the boundary burst), never more.
    #[test]
    fn fixed_window_counts_calendar_windows(
        l in limits(), spacing in prop_oneof![Just(0i64), 1i64..5_000], t in times(),
    ) {
        let rule = make(Algorithm::FixedWindow, &l, spacing, None);
        let checks = feed(&rule, &t);
        prop_assert_eq!(&checks, &brute_fixed(&rule, &t));
        let acc = accepted_times(&checks, &t);
        for lim in &rule.limits {
            prop_assert!(max_in_rolling_window(&acc, lim.window_us) as i64 <= 2 * lim.count);
        }
        let mut s = fixed_window::State::empty(&rule);
        for &now in &t {
            if fixed_window::check(&s, now, &rule).passed() {
                fixed_window::charge(&mut s, now, &rule);
            }
        }
        prop_assert_eq!(s.windows.len(), rule.limits.len());
    }

    /// Several identities: an event is accepted only if every identity has room, and a rejected
    /// event leaves every identity's state as it was.
    #[test]
    fn a_rejected_event_charges_no_identity(
        l in limits(), alg in prop_oneof![Just(Algorithm::SlidingLog), Just(Algorithm::Gcra), Just(Algorithm::FixedWindow)],
        events in proptest::collection::vec((0i64..2_000, 0u8..3, 0u8..3), 1..200),
    ) {
        let rule = make(alg, &l, 0, None);
        let mut engine = Engine::new(vec![EngineRule { rule: rule.clone(), shadow: false }]);
        let mut t = 1_790_000_000_000_000i64;
        for (gap, ip, user) in events {
            t += gap;
            let checks = vec![(0, format!("ip={ip}")), (0, format!("user={user}"))];
            let mut before = engine.states.clone();
            let v = engine.admit(t, &checks);
            // Each identity alone, from the state before.
            let alone: Vec<bool> = checks.iter().map(|(r, id)| {
                let s = before.entry((*r, id.clone())).or_insert_with(|| State::empty(&rule));
                s.trim(t, &rule);
                s.check(t, &rule).passed()
            }).collect();
            prop_assert_eq!(v.accepted, alone.iter().all(|&a| a));
            if !v.accepted {
                for (key, s) in &engine.states {
                    let mut b = before.get(key).cloned().unwrap_or_else(|| State::empty(&rule));
                    b.trim(t, &rule);
                    let mut s = s.clone();
                    s.trim(t, &rule);
                    prop_assert_eq!(s, b, "rejected event charged {:?}", key);
                }
            }
        }
    }
}

#[test]
fn the_models_agree_on_a_hand_case() {
    let rule = make(Algorithm::SlidingLog, &[(10, 1_000_000)], 0, None);
    let t: Vec<i64> = (0..50).map(|i| 1_000_000 + i).collect();
    assert_eq!(feed(&rule, &t), brute_log(&rule, &t));
    assert_eq!(feed(&rule, &t).iter().filter(|c| c.passed()).count(), 10);
}
