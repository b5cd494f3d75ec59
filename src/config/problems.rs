//! Config problems, each tied to its YAML path, and the readers that turn raw leaves into typed
//! values while collecting every problem instead of stopping at the first.

use serde::de::DeserializeOwned;
use serde_yaml::{Mapping, Value};
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// One thing wrong with the config, at `path` (like `outbound.routes.carrier-a.rate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem found in one config, in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        writeln!(
            f,
            "{n} problem{} in the config:",
            if n == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            writeln!(f, "  {p}")?;
        }
        Ok(())
    }
}

/// What [`Problems::string_list`] keeps in place of an item that is not a string: a config that
/// has one is refused, and no name a check compares it with can be this.
pub const NOT_A_STRING: &str = "\u{0}(not a string)";

/// The longest duration any setting may hold.
pub const DURATION_MAX: Duration = Duration::from_secs(365 * 24 * 3600);

/// Collects problems while a config is read: the first at each path. A value that could not
/// be read is one problem, not also the checks of what was put in its place (`redis.url: expected
/// a string` and then `needs at least one URL`, found by review).
#[derive(Debug, Default)]
pub struct Problems {
    list: Vec<Problem>,
    paths: HashSet<String>,
}

impl Problems {
    pub fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        let path = path.into();
        if self.paths.insert(path.clone()) {
            self.list.push(Problem {
                path,
                message: message.into(),
            });
        }
    }

    /// Whether a problem at `path` is listed already.
    pub fn said(&self, path: &str) -> bool {
        self.paths.contains(path)
    }

    /// Whether any of `paths` has a problem: a check across settings then says nothing, as it
    /// would judge the defaults put in place of the values refused (`dedupe_ttl must be more
    /// than ... (1year 2h)` computed from a default claim_idle, found by review).
    pub fn said_any(&self, paths: &[&str]) -> bool {
        paths.iter().any(|path| self.said(path))
    }

    pub fn into_result<T>(self, value: impl FnOnce() -> T) -> Result<T, ConfigError> {
        if self.list.is_empty() {
            Ok(value())
        } else {
            Err(ConfigError {
                problems: self.list,
            })
        }
    }

    /// Reads a section into its raw struct; a section that is not a map is one problem.
    pub fn section<T: DeserializeOwned + Default>(&mut self, path: &str, v: Option<Value>) -> T {
        match v {
            None | Some(Value::Null) => T::default(),
            Some(v @ Value::Mapping(_)) => match serde_yaml::from_value(v) {
                Ok(t) => t,
                Err(e) => {
                    self.push(path, e.to_string());
                    T::default()
                }
            },
            Some(other) => {
                self.push(path, format!("expected a map, got {}", kind(&other)));
                T::default()
            }
        }
    }

    /// Every key a section did not expect is an error: a typo must not silently fall back to a
    /// default.
    pub fn unknown_keys(&mut self, path: &str, unknown: &Mapping, known: &[&str]) {
        for key in unknown.keys() {
            let name = match key {
                Value::String(s) => shown_key(s),
                other => shown_key(&format!("{other:?}")),
            };
            self.push(
                join(path, &name),
                format!("unknown key (expected one of: {})", known.join(", ")),
            );
        }
    }

    pub fn string(&mut self, path: &str, v: &Option<Value>, default: Option<&str>) -> String {
        match v {
            None | Some(Value::Null) => match default {
                Some(d) => d.to_string(),
                None => {
                    self.push(path, "is required");
                    String::new()
                }
            },
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                self.push(path, format!("expected a string, got {}", kind(other)));
                String::new()
            }
        }
    }

    pub fn integer(
        &mut self,
        path: &str,
        v: &Option<Value>,
        default: u64,
        min: u64,
        max: u64,
    ) -> u64 {
        let n = match v {
            None | Some(Value::Null) => return default,
            Some(Value::Number(n)) => n.as_u64(),
            Some(_) => None,
        };
        match n {
            Some(n) if (min..=max).contains(&n) => n,
            _ => {
                self.push(
                    path,
                    format!(
                        "expected a whole number from {min} to {max}, got {}",
                        show(v)
                    ),
                );
                default
            }
        }
    }

    pub fn boolean(&mut self, path: &str, v: &Option<Value>, default: bool) -> bool {
        match v {
            None | Some(Value::Null) => default,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                self.push(
                    path,
                    format!("expected true or false, got {}", show(&Some(other.clone()))),
                );
                default
            }
        }
    }

    /// A duration like `250ms` or `2s`, at most [`DURATION_MAX`]: the daemon adds and multiplies
    /// durations (deadlines, claim_idle × max_deliveries), which a bound keeps from overflowing.
    pub fn duration(&mut self, path: &str, v: &Option<Value>, default: Duration) -> Duration {
        match v {
            None | Some(Value::Null) => default,
            // humantime says only "expected number at 0" of "-2s".
            Some(Value::String(s)) if s.trim_start().starts_with('-') => {
                self.push(path, format!("a duration cannot be negative, got {s:?}"));
                default
            }
            // humantime reads "M" as a month (30.44 days): "1M" meant as a minute was taken as
            // a month and passed every bound.
            Some(Value::String(s)) if has_month(s) => {
                self.push(
                    path,
                    format!("months are not taken (\"M\" is a month, not a minute: write 1m or 1min), got {s:?}"),
                );
                default
            }
            Some(Value::String(s)) => match humantime::parse_duration(s) {
                Ok(d) if d <= DURATION_MAX => d,
                Ok(_) => {
                    self.push(path, "must be at most 365 days");
                    default
                }
                Err(e) => {
                    self.push(path, format!("{e}: write a duration like 250ms, 2s or 1m"));
                    default
                }
            },
            Some(other) => {
                self.push(
                    path,
                    format!(
                        "expected a duration like 250ms or 2s, got {}",
                        show(&Some(other.clone()))
                    ),
                );
                default
            }
        }
    }

    /// A leaf written as a string and parsed by `FromStr` (rates, addresses).
    pub fn parsed<T: FromStr>(&mut self, path: &str, v: &Option<Value>, what: &str) -> Option<T>
    where
        T::Err: fmt::Display,
    {
        match v {
            None | Some(Value::Null) => {
                self.push(path, format!("is required ({what})"));
                None
            }
            Some(Value::String(s)) => s
                .parse()
                .map_err(|e: T::Err| self.push(path, e.to_string()))
                .ok(),
            Some(other) => {
                self.push(path, format!("expected {what}, got {}", kind(other)));
                None
            }
        }
    }

    /// A list of strings. An item that is not one is a problem, and is kept in the list as
    /// [`NOT_A_STRING`] so that the items after it keep their index in what later checks say
    /// of them (they said `streams[1]` of the third item after a number, found by review); a
    /// later check of its own index is not said, as its path has a problem already.
    pub fn string_list(&mut self, path: &str, v: &Option<Value>) -> Vec<String> {
        match v {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Sequence(items)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => s.clone(),
                    other => {
                        self.push(
                            format!("{path}[{i}]"),
                            format!("expected a string, got {}", kind(other)),
                        );
                        NOT_A_STRING.to_string()
                    }
                })
                .collect(),
            Some(other) => {
                self.push(path, format!("expected a list, got {}", kind(other)));
                Vec::new()
            }
        }
    }
}

/// Whether duration text `s` names months: a unit "M", "month" or "months".
fn has_month(s: &str) -> bool {
    s.split(|c: char| !c.is_ascii_alphabetic())
        .any(|unit| matches!(unit, "M" | "month" | "months"))
}

/// An unknown key as a message shows it: whole when it reads like a key (up to 64 letters,
/// digits, `_`, `-`, `.`), else by its first 8 characters and its length. A file that is no
/// config (`/etc/shadow` named by mistake) was echoed whole, a line a key, password hashes and
/// all.
fn shown_key(key: &str) -> String {
    let plain = key.len() <= 64
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if plain {
        return key.to_string();
    }
    let start: String = key.chars().take(8).collect();
    format!("{start:?}… ({} bytes)", key.len())
}

pub fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a map",
        Value::Tagged(_) => "a tagged value",
    }
}

fn show(v: &Option<Value>) -> String {
    match v {
        Some(Value::String(s)) => format!("{s:?}"),
        Some(Value::Number(n)) => n.to_string(),
        Some(other) => kind(other).to_string(),
        None => "nothing".into(),
    }
}
