//! Decisions: what an outbound event's input entry has on record on one route, kept in the
//! route's decision hash under the entry's id. This is the one Rust codec for them; `lua/lib.lua`
//! (`decision`, `decision_kind`) is the one Lua codec, and `tests/scripts.rs` holds the two to
//! the same values.
//!
//! - `s<slot>:<deadline>`: a slot was reserved (µs of Redis time), and the latest the event may
//!   go (its first decision plus its wait): the event sleeps until the slot;
//! - `d<ms>`: dispatched, in the ready entry of that millisecond;
//! - `x<wait>`: passed over for a fallback (the wait it would have had, µs);
//! - `v0`: voided, the entry was delivered too often and is dead-lettered (`lua/void.lua`).

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    Slot { slot_us: i64, deadline_us: i64 },
    Dispatched(i64),
    Skipped(i64),
    Voided,
}

impl Marker {
    /// Reads a decision; `None` if it is not one (junk, or a format from elsewhere).
    pub fn parse(value: &str) -> Option<Self> {
        let (letter, rest) = value.split_at_checked(1)?;
        let number = |text: &str| -> Option<i64> { text.parse().ok() };
        Some(match letter {
            "s" => {
                let (slot, deadline) = rest.split_once(':')?;
                Marker::Slot {
                    slot_us: number(slot)?,
                    deadline_us: number(deadline)?,
                }
            }
            "d" => Marker::Dispatched(number(rest)?),
            "x" => Marker::Skipped(number(rest)?),
            "v" if rest == "0" => Marker::Voided,
            _ => return None,
        })
    }

    /// The value as the scripts write it.
    pub fn encode(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Marker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Marker::Slot {
                slot_us,
                deadline_us,
            } => write!(f, "s{slot_us}:{deadline_us}"),
            Marker::Dispatched(ms) => write!(f, "d{ms}"),
            Marker::Skipped(wait) => write!(f, "x{wait}"),
            Marker::Voided => write!(f, "v0"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_it_encodes() {
        for m in [
            Marker::Slot {
                slot_us: 1_790_000_000_123_456,
                deadline_us: 1_790_000_001_000_000,
            },
            Marker::Dispatched(1_790_000_000_123),
            Marker::Skipped(2_500_000),
            Marker::Voided,
        ] {
            assert_eq!(Marker::parse(&m.encode()), Some(m));
        }
    }

    #[test]
    fn refuses_what_is_not_a_decision() {
        for junk in ["", "junk", "q1", "s12", "s1:x", "d", "v1", "d12|1-0@in"] {
            assert_eq!(Marker::parse(junk), None, "{junk:?}");
        }
    }
}
