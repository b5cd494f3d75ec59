//! The config's text made a YAML tree, with two bounds serde_yaml leaves out, each found by
//! review:
//!
//! - **Nesting.** libyaml's scanner takes time quadratic in how deep flow collections nest, and
//!   serde_yaml refuses past 128 levels only once it has scanned the whole text: 200 KB of `[`
//!   took 29 s to be refused, 300 KB more than 90. The depth is counted first, in one pass.
//! - **Integers past 64 bits.** serde_yaml's own tree refuses one (`invalid type: integer
//!   as u128`), and that one error hid every other problem of the file. Here it becomes a
//!   float, which every whole-number setting refuses with its path and range, like `1e400`.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_yaml::value::{Tag, TaggedValue};
use serde_yaml::{Mapping, Value};
use std::fmt;

/// How deep collections may nest: serde_yaml's own limit.
pub const DEPTH_MAX: usize = 128;

/// The YAML tree of `text`, or why it is not one.
pub fn parse(text: &str) -> Result<Value, String> {
    if let Some((line, column)) = too_deep(text) {
        return Err(format!(
            "collections nested more than {DEPTH_MAX} deep at line {line} column {column}"
        ));
    }
    serde_yaml::from_str::<Tree>(text)
        .map(|t| t.0)
        .map_err(|e| e.to_string())
}

/// Where flow collections (`[`, `{`) first nest deeper than [`DEPTH_MAX`], as 1-based line and
/// column. An estimate on the safe side: brackets in quoted strings and comments are skipped,
/// but one inside a plain scalar (`a[b`) counts, so a config would need over a hundred of those
/// left open to be refused by it, where libyaml would refuse the deep ones anyway.
fn too_deep(text: &str) -> Option<(usize, usize)> {
    let mut depth = 0usize;
    for (l, line) in text.lines().enumerate() {
        let mut quote: Option<char> = None;
        let mut prev = ' ';
        let mut chars = line.chars().enumerate().peekable();
        while let Some((c, ch)) = chars.next() {
            match quote {
                Some('"') if ch == '\\' => {
                    chars.next();
                }
                Some(q) if ch == q => quote = None,
                Some(_) => {}
                None => match ch {
                    '#' if prev.is_whitespace() => break,
                    '\'' | '"' if prev.is_whitespace() || "[{,:".contains(prev) => quote = Some(ch),
                    '[' | '{' => {
                        depth += 1;
                        if depth > DEPTH_MAX {
                            return Some((l + 1, c + 1));
                        }
                    }
                    ']' | '}' => depth = depth.saturating_sub(1),
                    _ => {}
                },
            }
            prev = ch;
        }
        // A quoted string may run on over lines; this estimate lets it end with its line.
    }
    None
}

/// serde_yaml's `Value`, read by a visitor that also takes 128-bit integers.
struct Tree(Value);

impl<'de> Deserialize<'de> for Tree {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TreeVisitor).map(Tree)
    }
}

struct TreeVisitor;

impl<'de> Visitor<'de> for TreeVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_i128<E>(self, n: i128) -> Result<Value, E> {
        Ok(Value::Number((n as f64).into()))
    }

    fn visit_u128<E>(self, n: u128) -> Result<Value, E> {
        Ok(Value::Number((n as f64).into()))
    }

    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Tree::deserialize(d).map(|t| t.0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Tree(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Sequence(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut m = Mapping::new();
        while let Some(Tree(key)) = map.next_key()? {
            if m.contains_key(&key) {
                let shown = match &key {
                    Value::String(s) => format!("{s:?}"),
                    other => serde_yaml::to_string(other)
                        .map(|s| s.trim_end().to_owned())
                        .unwrap_or_default(),
                };
                return Err(de::Error::custom(format_args!(
                    "duplicate entry with key {shown}"
                )));
            }
            let Tree(value) = map.next_value()?;
            m.insert(key, value);
        }
        Ok(Value::Mapping(m))
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Value, A::Error> {
        use serde::de::VariantAccess;
        let (tag, contents) = data.variant::<String>()?;
        let Tree(value) = contents.newtype_variant()?;
        Ok(Value::Tagged(Box::new(TaggedValue {
            tag: Tag::new(tag),
            value,
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_flow_collections_are_refused_before_libyaml_scans_them() {
        let deep = format!("outbound: {}{}", "[".repeat(200_000), "]".repeat(200_000));
        assert_eq!(
            parse(&deep).unwrap_err(),
            "collections nested more than 128 deep at line 1 column 139"
        );
        // Brackets in quotes and comments are not collections; 127 levels in a map are 128.
        let quoted = format!(
            "a: '{}'\nb: \"{}\\\"[\" # {}\nc: {}{}\n",
            "[".repeat(500),
            "{".repeat(500),
            "[".repeat(500),
            "[".repeat(DEPTH_MAX - 1),
            "]".repeat(DEPTH_MAX - 1)
        );
        assert_eq!(too_deep(&quoted), None);
        let v = parse(&quoted).unwrap();
        assert_eq!(v["a"], Value::String("[".repeat(500)));
        assert_eq!(
            too_deep(&format!("c: {}", "{a: ".repeat(129))),
            Some((1, 4 + 128 * 4))
        );
    }

    #[test]
    fn integers_past_64_bits_are_numbers_and_the_rest_of_yaml_reads_as_serde_yaml_does() {
        let text = "a: 18446744073709551616\nb: -170141183460469231731687303715884105728\nc: !t {d: [1, -2, 2.5, x, ~, true]}\n";
        let v = parse(text).unwrap();
        assert_eq!(v["a"].as_f64(), Some(18446744073709551616.0));
        assert_eq!(v["a"].as_u64(), None);
        assert!(v["b"].as_f64().unwrap() < -1e38);
        let plain: Value = serde_yaml::from_str("c: !t {d: [1, -2, 2.5, x, ~, true]}").unwrap();
        assert_eq!(v["c"], plain["c"]);
        let dup = parse("a: 1\nb: {c: 1, c: 2}\n").unwrap_err();
        assert!(dup.contains("duplicate entry with key \"c\""), "{dup}");
    }
}
