//! Fuzzing (proptest) of what pacer reads from outside: outbound and inbound event fields, config
//! files from operators, marker values and raw Redis replies. Nothing may panic or hang; a bad
//! event is refused with a reason and handed back whole (so it can be dead-lettered with every
//! field), a bad config is refused with at least one problem and its path.
//!
//! `cargo test --test fuzz` runs a short pass (part of the test command); for a longer one:
//! `PROPTEST_CASES=100000 cargo test --release --test fuzz`.

use pacer::config::{Config, Overrides};
use pacer::event::{self, dead_letter_fields, Entry, Fields};
use pacer::marker::Marker;
use proptest::prelude::*;
use redis::Value;
use std::sync::Arc;

const CONFIG: &str = include_str!("../config.yaml");

/// The short pass's case count, unless PROPTEST_CASES asks for more.
fn cases(short: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(short)
}

fn inbound() -> pacer::config::InboundConfig {
    Config::parse(CONFIG, &Overrides::default())
        .expect("config.yaml is valid")
        .inbound
        .expect("config.yaml has an inbound section")
}

fn outbound() -> pacer::config::OutboundConfig {
    Config::parse(CONFIG, &Overrides::default())
        .expect("config.yaml is valid")
        .outbound
}

/// Field names producers use, plus pacer's own and arbitrary bytes.
fn field_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"route".to_vec()),
        Just(b"id".to_vec()),
        Just(b"cost".to_vec()),
        Just(b"max_wait_ms".to_vec()),
        Just(b"source".to_vec()),
        Just(b"tenant".to_vec()),
        Just(b"pacer_reason".to_vec()),
        Just(b"pacer_route".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..12),
    ]
}

/// Values that are nearly right as often as wrong: route names, numbers at their edges, bytes.
fn field_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"carrier-a".to_vec()),
        Just(b"carrier-b".to_vec()),
        Just(b"carrier-c".to_vec()),
        any::<i64>().prop_map(|n| n.to_string().into_bytes()),
        any::<u64>().prop_map(|n| n.to_string().into_bytes()),
        "[0-9 +-.e]{0,24}".prop_map(String::into_bytes),
        "\\PC{0,40}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 0..300),
    ]
}

fn fields() -> impl Strategy<Value = Fields> {
    proptest::collection::vec((field_name(), field_value()), 0..8)
}

/// A raw Redis reply of any shape, nested a few levels.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<i64>().prop_map(Value::Int),
        proptest::collection::vec(any::<u8>(), 0..16).prop_map(Value::BulkString),
        "[a-z0-9-]{0,8}".prop_map(Value::SimpleString),
    ];
    leaf.prop_recursive(4, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((inner.clone(), inner), 0..4).prop_map(Value::Map),
        ]
    })
}

/// config.yaml with a few lines deleted, doubled or cut, or characters replaced.
fn mutated_config() -> impl Strategy<Value = String> {
    let lines: Vec<String> = CONFIG.lines().map(str::to_string).collect();
    let n = lines.len();
    proptest::collection::vec((0..n, 0..4u8, any::<char>(), 0..40usize), 1..6).prop_map(
        move |edits| {
            let mut lines = lines.clone();
            for (at, kind, c, col) in edits {
                let at = at % lines.len().max(1);
                if lines.is_empty() {
                    break;
                }
                match kind {
                    0 => {
                        lines.remove(at);
                    }
                    1 => {
                        let dup = lines[at].clone();
                        lines.insert(at, dup);
                    }
                    2 => {
                        let cut: String = lines[at].chars().take(col).collect();
                        lines[at] = cut;
                    }
                    _ => {
                        let mut chars: Vec<char> = lines[at].chars().collect();
                        if !chars.is_empty() {
                            let i = col % chars.len();
                            chars[i] = c;
                        }
                        lines[at] = chars.into_iter().collect();
                    }
                }
            }
            lines.join("\n")
        },
    )
}

fn check_config(text: &str) {
    if let Err(e) = Config::parse(text, &Overrides::default()) {
        let shown = e.to_string();
        assert!(!shown.trim().is_empty(), "a refusal must say why");
        for line in shown.lines().filter(|l| !l.trim().is_empty()) {
            assert!(line.contains(':'), "a problem without its path: {line:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(10_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_event_is_parsed_or_refused_whole(fields in fields(), deliveries in 0u64..10) {
        let cfg = outbound();
        let entry = Entry {
            stream: Arc::from("pacer:out"),
            id: "1700000000000-0".into(),
            fields: fields.clone(),
            deliveries,
        };
        match event::parse_outbound(entry, &cfg) {
            Ok(ev) => {
                prop_assert!(ev.route < cfg.routes.len());
                prop_assert!(ev.cost >= 1);
                // Everything but pacer's own fields is carried, byte for byte and in order.
                let carried: Vec<(Vec<u8>, Vec<u8>)> = fields
                    .iter()
                    .filter(|(k, _)| !k.starts_with(b"pacer_"))
                    .cloned()
                    .collect();
                prop_assert_eq!(&ev.entry().fields, &carried);
                // What a parsed event becomes: its ready and rejected entries.
                let route = &cfg.route_at(ev.route).name;
                event::rejected_fields(&ev, route, event::Reason::QueueFull, "full", 1);
            }
            Err((entry, refused)) => {
                // Handed back whole, with a reason and a detail for the dead letter.
                prop_assert_eq!(&entry.fields, &fields);
                prop_assert!(!refused.detail.is_empty());
                let dead = dead_letter_fields(&entry, &refused);
                let reason = dead
                    .iter()
                    .find(|(k, _)| k.as_slice() == b"pacer_reason")
                    .map(|(_, v)| v.clone());
                prop_assert_eq!(reason, Some(refused.reason.as_str().as_bytes().to_vec()));
            }
        }
    }

    #[test]
    fn any_inbound_event_is_parsed_or_refused_whole(fields in fields(), deliveries in 0u64..10) {
        let cfg = inbound();
        let entry = Entry {
            stream: Arc::from("pacer:in"),
            id: "1700000000000-0".into(),
            fields: fields.clone(),
            deliveries,
        };
        match event::inbound::parse_inbound(entry, &cfg) {
            Ok(ev) => {
                prop_assert_eq!(&ev.entry.fields, &fields);
                prop_assert!(!ev.identities.is_empty());
                event::inbound::forward_fields(&ev);
            }
            Err((entry, refused)) => {
                prop_assert_eq!(&entry.fields, &fields);
                prop_assert!(!refused.detail.is_empty());
                dead_letter_fields(&entry, &refused);
            }
        }
    }

    #[test]
    fn any_marker_value_parses_or_is_refused(text in "\\PC{0,30}|[sdxvAr][0-9:-]{0,30}(\\|\\PC{0,6}){0,3}") {
        Marker::parse(&text);
        event::inbound::Decision::parse(&text);
    }

    #[test]
    fn any_reply_shape_is_read_or_refused(v in value()) {
        let stream: Arc<str> = Arc::from("in");
        let mut out = Vec::new();
        let _ = pacer::streams::parse_entries(v, &stream, 1, &mut out);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(3000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_text_as_config_is_loaded_or_refused_with_paths(text in "\\PC{0,200}") {
        check_config(&text);
    }

    #[test]
    fn a_damaged_config_is_loaded_or_refused_with_paths(text in mutated_config()) {
        check_config(&text);
    }

    #[test]
    fn any_yaml_shape_as_config_is_loaded_or_refused(
        text in "(redis|worker|metrics|outbound|routes|streams|rate|burst|x):( \\[|\\{| [0-9a-z/{}:,\\]\\[-]{0,12}|\\n  )"
            .prop_map(|s| s.repeat(3))
    ) {
        check_config(&text);
    }
}

/// Whole numbers at and beyond every edge a setting could have: 0, 1, the caps (3000, 10,000,
/// 1,000,000, 16 MiB, u32::MAX...), i64/u64 limits and past them, floats, text.
fn number() -> impl Strategy<Value = String> {
    let edges = [
        "0",
        "1",
        "-1",
        "2",
        "100",
        "3000",
        "3001",
        "10000",
        "10001",
        "1000000",
        "1000001",
        "16777216",
        "16777217",
        "4294967295",
        "4294967296",
        "9007199254740993",
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551615",
        "18446744073709551616",
        "1e30",
        "1.5",
        "-0",
        ".inf",
        ".nan",
        "null",
        "\"12\"",
        "[]",
    ];
    prop_oneof![
        proptest::sample::select(edges.to_vec()).prop_map(str::to_string),
        any::<u64>().prop_map(|n| n.to_string()),
        (0..2_000_000u64).prop_map(|n| n.to_string()),
    ]
}

/// Durations at the edges (0, 1 ns, the 365-day cap and past it, past u64 seconds) and at random.
fn duration() -> impl Strategy<Value = String> {
    let edges = [
        "0s",
        "0ms",
        "1ns",
        "1us",
        "1ms",
        "99ms",
        "100ms",
        "1s",
        "2s",
        "30s",
        "1h",
        "8760h",
        "365d",
        "366d",
        "8761h",
        "18446744073709551615s",
        "18446744073709551616s",
        "1e30s",
        "-1s",
        "5",
        "\"\"",
        "10 years",
    ];
    let units = ["ns", "us", "ms", "s", "m", "h", "d"];
    prop_oneof![
        proptest::sample::select(edges.to_vec()).prop_map(str::to_string),
        (any::<u64>(), proptest::sample::select(units.to_vec()))
            .prop_map(|(n, u)| format!("{n}{u}")),
        (0..100_000u64, proptest::sample::select(units.to_vec()))
            .prop_map(|(n, u)| format!("{n}{u}")),
    ]
}

/// Rates: counts at their edges per every unit, and units that do not exist.
fn rate() -> impl Strategy<Value = String> {
    let units = ["ms", "s", "min", "h", "us", "d", ""];
    (number(), proptest::sample::select(units.to_vec())).prop_map(|(n, u)| format!("{n}/{u}"))
}

/// One setting's value: mostly one of `valid` (its bounds and a usual value, so that whole
/// configs load and their extremes reach `loaded_numbers_stay_in_range`), sometimes anything
/// `wild` draws.
fn slot(valid: &[&'static str], wild: BoxedStrategy<String>) -> BoxedStrategy<String> {
    prop_oneof![
        24 => proptest::sample::select(valid.to_vec()).prop_map(str::to_string),
        1 => wild,
    ]
    .boxed()
}

/// A config with every numeric setting of every section drawn by `slot`.
fn numeric_config() -> impl Strategy<Value = String> {
    let n = |valid: &[&'static str]| slot(valid, number().boxed());
    let d = |valid: &[&'static str]| slot(valid, duration().boxed());
    let r = || {
        slot(
            &["1/h", "1000/ms", "10/s", "3600000000/h", "7/min"],
            rate().boxed(),
        )
    };
    let redis = (
        d(&["10ms", "1s", "365d"]),
        // Its least (WAIT counts whole milliseconds), under every valid timeout.
        d(&["1ms"]),
        n(&["0", "3", "100"]),
    );
    let worker = (
        n(&["1", "512", "10000"]),
        n(&["10000", "20000", "10000000"]),
        d(&["3s", "30s", "8h"]),
        n(&["1", "5", "1000"]),
        d(&["0s", "1ms", "5s", "365d"]),
    );
    let outbound = (
        n(&["100", "1000000", "4294967295"]),
        d(&["1s", "365d"]),
        n(&["64", "65536", "16777216"]),
        n(&["1", "1000", "3000"]),
        d(&["1ms", "60s", "365d"]),
    );
    let routes = (
        r(),
        n(&["1", "2", "1000000"]),
        d(&["0s", "1ms", "2s"]),
        d(&["1ms", "365d"]),
        r(),
    );
    let inbound = (
        n(&["100", "4294967295"]),
        d(&["365d"]),
        n(&["64", "16777216"]),
        n(&["1", "3000"]),
        n(&["1", "3", "20"]),
    );
    let rules = (r(), n(&["1", "1000000"]), r(), d(&["1us", "100ms", "365d"]));
    (redis, worker, outbound, routes, inbound, rules).prop_map(
        |(
            (t, wt, wr),
            (b, mi, ci, md, dr),
            (ol, od, ob, of, oa),
            (ra, rb, rw, rg, rb2),
            (il, id, ib, ifs, la),
            (g, gb, l, ls),
        )| {
            [
                "redis:".to_string(),
                "  url: redis://127.0.0.1:6379".into(),
                format!("  timeout: {t}"),
                format!("  wait_timeout: {wt}"),
                format!("  wait_replicas: {wr}"),
                "worker:".into(),
                format!("  batch: {b}"),
                format!("  max_inflight: {mi}"),
                format!("  claim_idle: {ci}"),
                format!("  max_deliveries: {md}"),
                format!("  drain: {dr}"),
                "outbound:".into(),
                "  streams: [o]".into(),
                format!("  max_len: {ol}"),
                format!("  dedupe_ttl: {od}"),
                format!("  max_event_bytes: {ob}"),
                format!("  max_event_fields: {of}"),
                format!("  max_age: {oa}"),
                "  routes:".into(),
                format!("    a: {{rate: {ra}, burst: {rb}, max_wait: {rw}, max_age: {rg}, fallbacks: [b]}}"),
                format!("    b: {{rate: {rb2}}}"),
                "inbound:".into(),
                "  streams: [i]".into(),
                "  forward_stream: f".into(),
                format!("  max_len: {il}"),
                format!("  dedupe_ttl: {id}"),
                format!("  max_event_bytes: {ib}"),
                format!("  max_event_fields: {ifs}"),
                format!("  limiter_attempts: {la}"),
                "  rules:".into(),
                format!("    - {{name: g, key: [s], algorithm: gcra, limits: [{g}], burst: {gb}}}"),
                format!("    - {{name: l, key: [s], algorithm: sliding_log, limits: [{l}], min_spacing: {ls}}}"),
            ]
            .join("\n")
        },
    )
}

/// No numeric value panics the config reader (issue 12: claim_idle × max_deliveries and
/// Instant + drain used to overflow): each is loaded, or refused with its path, and what loads
/// is held to what the daemon computes from it. A good share of cases must load, or the check
/// on loaded configs would check nothing.
#[test]
fn any_numeric_setting_is_loaded_or_refused_with_its_path() {
    let total = cases(5000);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: total,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let loaded = std::cell::Cell::new(0u32);
    runner
        .run(&numeric_config(), |text| {
            check_config(&text);
            if let Ok(cfg) = Config::parse(&text, &Overrides::default()) {
                loaded.set(loaded.get() + 1);
                loaded_numbers_stay_in_range(&cfg);
            }
            Ok(())
        })
        .unwrap();
    println!("{} of {total} configs loaded", loaded.get());
    assert!(
        loaded.get() >= total / 10,
        "only {} of {total} configs loaded",
        loaded.get()
    );
}

/// What the daemon derives from a loaded config must not overflow: microseconds as i64 (the
/// scripts' unit), deadlines from now, the bucket's tolerance in Lua's exact-integer range.
fn loaded_numbers_stay_in_range(cfg: &Config) {
    const LUA_EXACT: u128 = 1 << 53;
    let now_us: u128 = 1_800_000_000_000_000; // 2027, µs since the epoch
    let w = &cfg.worker;
    assert!(std::time::Instant::now().checked_add(w.drain).is_some());
    assert!(std::time::Instant::now()
        .checked_add(w.claim_idle * 2)
        .is_some());
    for route in cfg.outbound.routes.values() {
        let interval = route.rate.interval_us() as u128;
        let tolerance = interval * route.burst.get() as u128;
        assert!(
            now_us + tolerance + route.max_wait.as_micros() < LUA_EXACT,
            "route {} overflows Lua's integers",
            route.name
        );
        assert!(route.max_wait.as_micros() < i64::MAX as u128);
    }
    assert!(cfg.outbound.flow.dedupe_ttl.as_millis() < i64::MAX as u128);
}
