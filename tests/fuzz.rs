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
