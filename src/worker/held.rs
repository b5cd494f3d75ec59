//! Which input entries this worker holds, by stream, so that it can tell an entry pending under
//! its own consumer name that it holds (asleep, being written, waiting for a broken output)
//! from one it let go of while Redis kept it pending: a stranded entry (`claim`, `take_up`).
//!
//! How an entry is stranded: a failover wipes a write the worker saw succeed. During a
//! `SENTINEL FAILOVER` the old master takes writes for the few seconds before it is made a
//! replica, and a frozen cluster master runs what it was sent when it thaws; a dispatch and its
//! acknowledgement made there are lost together, and the new master still has the entry
//! pending on this worker, which has let it go. The claimer never takes from a live consumer,
//! so before, such an entry stayed pending until its worker restarted (a helper's attack left
//! 559-706 for the whole minute after each `SENTINEL FAILOVER`; now all are taken up within
//! about 9 s of the switch).
//!
//! An entry is registered as soon as its read or claim returns, before its permits are weighed
//! (which may wait), and let go when the worker drops it (`Hold`), acknowledged or not. One
//! held twice (read again after a failover wiped the read) takes two slots, and is held until
//! both are let go.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The entries held, per input stream (by its index in `Context::streams`).
pub(crate) struct Held {
    streams: Vec<Arc<Stream>>,
}

/// One stream's entries held, and the worker's permits they give back when let go.
pub(crate) struct Stream {
    permits: Arc<Semaphore>,
    slots: Mutex<Slots>,
}

/// Entry ids in slots (`key`: 8 bytes where a `String` takes 40 and more, and a worker may hold
/// a hundred thousand), each entry's `Hold` naming its slot: a hash set by id cost a worker
/// holding 100,000 sleeping events 8 MiB more, past the 64 MiB it is held to. In pages of
/// `PAGE`, so that growing never copies the lot. Searched only by `unheld`, on the rare ticks
/// that look for stranded entries.
#[derive(Default)]
struct Slots {
    pages: Vec<Box<[u64]>>,
    used: u32,
    free: Vec<u32>,
}

/// Slots per page (128 KiB).
const PAGE: usize = 16384;

/// A slot no entry is in, and the id of a free slot (Redis never gives `0-0`).
const NO_SLOT: u32 = u32::MAX;
const FREE: u64 = 0;

impl Slots {
    fn put(&mut self, id: u64) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = self.used;
                if slot as usize == self.pages.len() * PAGE {
                    self.pages.push(vec![FREE; PAGE].into_boxed_slice());
                }
                self.used += 1;
                slot
            }
        };
        self.pages[slot as usize / PAGE][slot as usize % PAGE] = id;
        slot
    }

    fn clear(&mut self, slot: u32) {
        if slot < self.used {
            self.pages[slot as usize / PAGE][slot as usize % PAGE] = FREE;
            self.free.push(slot);
        }
    }

    fn ids(&self) -> impl Iterator<Item = &u64> {
        self.pages
            .iter()
            .flat_map(|p| p.iter())
            .filter(|&&id| id != FREE)
    }

    fn count(&self) -> usize {
        self.used as usize - self.free.len()
    }
}

impl Stream {
    /// Clears `slot` (nothing for `NO_SLOT`).
    fn clear(&self, slot: u32) {
        if slot != NO_SLOT {
            self.slots.lock().expect("never poisoned").clear(slot);
        }
    }
}

impl Held {
    pub(crate) fn new(streams: usize, permits: Arc<Semaphore>) -> Self {
        Held {
            streams: (0..streams)
                .map(|_| {
                    Arc::new(Stream {
                        permits: permits.clone(),
                        slots: Mutex::default(),
                    })
                })
                .collect(),
        }
    }

    fn stream(&self, index: usize) -> &Arc<Stream> {
        &self.streams[index]
    }

    /// Registers the entries `ids` of the stream at `stream`, one guard each, in order.
    pub(crate) fn register<'a>(
        &self,
        stream: usize,
        ids: impl Iterator<Item = &'a str>,
    ) -> Vec<Registered> {
        let stream = self.stream(stream);
        let mut slots = stream.slots.lock().expect("never poisoned");
        ids.map(|id| Registered {
            stream: stream.clone(),
            slot: match parse_id(id) {
                Some(id) if id != FREE => slots.put(id),
                _ => NO_SLOT,
            },
        })
        .collect()
    }

    /// Of `items`, those whose id (`id`) this worker does not hold on the stream at `stream`.
    pub(crate) fn unheld<T>(
        &self,
        stream: usize,
        items: Vec<T>,
        id: impl Fn(&T) -> &str,
    ) -> Vec<T> {
        if items.is_empty() {
            return items;
        }
        let asked: HashSet<u64> = items.iter().filter_map(|i| parse_id(id(i))).collect();
        let found: HashSet<u64> = {
            let slots = self.stream(stream).slots.lock().expect("never poisoned");
            slots.ids().filter(|i| asked.contains(i)).copied().collect()
        };
        items
            .into_iter()
            .filter(|i| parse_id(id(i)).is_none_or(|k| !found.contains(&k)))
            .collect()
    }

    /// How many entries of the stream at `stream` this worker holds (one held twice, twice).
    pub(crate) fn count(&self, stream: usize) -> usize {
        (self.stream(stream).slots.lock().expect("never poisoned")).count()
    }
}

/// A stream entry id (`ms-seq`) as one number (`key`), None for anything else.
fn parse_id(id: &str) -> Option<u64> {
    let (ms, seq) = id.split_once('-')?;
    Some(key(ms.parse().ok()?, seq.parse().ok()?))
}

/// An id as one number: exact (`ms << 22 | seq`) for every id Redis gives until the year 2109
/// with fewer than four million entries in its millisecond, a hash (`FxHash`'s multiply) for
/// the rest. Two ids alike only make the second look held, and stay pending until its worker
/// restarts, as every stranded entry did before.
fn key(ms: u64, seq: u64) -> u64 {
    if ms < 1 << 42 && seq < 1 << 22 {
        (ms << 22) | seq
    } else {
        ((ms.rotate_left(5) ^ seq).wrapping_mul(0x517c_c1b7_2722_0a95)) | 1 << 63
    }
}

/// One entry's registration until its permits are weighed (`holds`); let go if dropped first.
pub(crate) struct Registered {
    stream: Arc<Stream>,
    slot: u32,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.stream.clear(self.slot);
    }
}

/// What one entry holds while the worker has it: its share of the `max_inflight` permits
/// (`budget`) and its registration, in 16 bytes (a permit alone took as many). Dropped when the
/// worker is done with the entry, whatever became of it: the permits go back, the slot is
/// cleared.
pub(crate) struct Hold {
    stream: Arc<Stream>,
    /// Its places, and in the top bit whether it holds fewer than its entry weighs
    /// (`UNDERWEIGHT`): a flag of its own would make every sleeping event's hold 8 bytes larger.
    permits: u32,
    slot: u32,
}

/// The bit of `Hold::permits` that says it holds fewer places than its entry weighs (a read
/// that could not have its weight soon: `budget::hold`). Never a place count: `max_inflight` is
/// at most 10,000,000 (`config`).
const UNDERWEIGHT: u32 = 1 << 31;

impl Hold {
    /// How many of the worker's places it holds.
    pub(crate) fn places(&self) -> u32 {
        self.permits & !UNDERWEIGHT
    }

    /// Whether it holds fewer places than its entry weighs: the entry must be parked (its
    /// fields let go) as it is handed over, and weighed again when taken back.
    pub(crate) fn underweight(&self) -> bool {
        self.permits & UNDERWEIGHT != 0
    }

    /// Marks it as holding fewer places than its entry weighs.
    pub(crate) fn mark_underweight(&mut self) {
        self.permits |= UNDERWEIGHT;
    }

    /// Gives its places back and keeps its registration: the entry is still held (parked).
    pub(crate) fn into_registered(mut self) -> Registered {
        let permits = std::mem::take(&mut self.permits) & !UNDERWEIGHT;
        self.stream.permits.add_permits(permits as usize);
        Registered {
            stream: self.stream.clone(),
            slot: std::mem::replace(&mut self.slot, NO_SLOT),
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.stream.clear(self.slot);
        self.stream.permits.add_permits(self.places() as usize);
    }
}

/// Pairs each entry's permits with its registration, in order.
pub(crate) fn holds(permits: Vec<OwnedSemaphorePermit>, registered: Vec<Registered>) -> Vec<Hold> {
    permits
        .into_iter()
        .zip(registered)
        .map(|(permit, mut registered)| {
            let permits = permit.num_permits() as u32;
            // Given back by the Hold's drop, to the same semaphore (`Held::new`).
            permit.forget();
            let slot = std::mem::replace(&mut registered.slot, NO_SLOT);
            Hold {
                stream: registered.stream.clone(),
                permits,
                slot,
            }
        })
        .collect()
}

#[cfg(test)]
pub(crate) fn hold_for_test() -> Hold {
    let permits = Arc::new(Semaphore::new(1));
    let held = Held::new(1, permits.clone());
    let permit = permits.try_acquire_owned().expect("one");
    holds(vec![permit], held.register(0, ["1-0"].into_iter()))
        .pop()
        .expect("one")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unheld(held: &Held, stream: usize, ids: &[&'static str]) -> Vec<&'static str> {
        held.unheld(stream, ids.to_vec(), |id| id)
    }

    #[test]
    fn an_entry_is_held_until_its_last_hold_is_let_go() {
        let permits = Arc::new(Semaphore::new(10));
        let held = Held::new(2, permits.clone());
        let take = |n| permits.clone().try_acquire_many_owned(n).unwrap();
        let first = holds(
            vec![take(1), take(3)],
            held.register(1, ["5-1", "5-2"].into_iter()),
        );
        let again = holds(vec![take(1)], held.register(1, ["5-1"].into_iter()));
        assert_eq!(permits.available_permits(), 5);
        assert_eq!(unheld(&held, 1, &["5-1", "5-2", "5-3"]), ["5-3"]);
        assert_eq!(
            unheld(&held, 0, &["5-1"]),
            ["5-1"],
            "held on another stream"
        );
        assert_eq!(held.count(1), 3);
        drop(first);
        assert_eq!(permits.available_permits(), 9, "the permits go back");
        assert_eq!(
            unheld(&held, 1, &["5-1", "5-2"]),
            ["5-2"],
            "5-1 is held again"
        );
        drop(again);
        assert_eq!(held.count(1), 0);
        assert_eq!(permits.available_permits(), 10);
        // Slots are used again.
        let r = held.register(1, ["6-0"].into_iter());
        assert_eq!(held.count(1), 1);
        drop(r);
        assert_eq!(held.count(1), 0);
    }

    #[test]
    fn ids_that_differ_only_in_their_sequence_are_told_apart() {
        assert_ne!(parse_id("1-2"), parse_id("2-1"));
        assert_eq!(parse_id("1795653634308-3"), Some((1795653634308 << 22) | 3));
        let far = [
            parse_id("18446744073709551615-18446744073709551615"),
            parse_id("18446744073709551615-18446744073709551614"),
            parse_id("1-4194304"),
            parse_id("1-4194305"),
        ];
        for (i, a) in far.iter().enumerate() {
            assert!(
                a.is_some_and(|k| k >= 1 << 63),
                "hashed apart from the exact ones"
            );
            assert!(far[i + 1..].iter().all(|b| b != a), "{far:?}");
        }
        assert_eq!(parse_id("nope"), None);
        let held = Held::new(1, Arc::new(Semaphore::new(1)));
        let r = held.register(0, ["nope", "7-0", "0-0"].into_iter());
        assert_eq!(held.count(0), 1);
        assert_eq!(unheld(&held, 0, &["nope", "7-0"]), ["nope"]);
        drop(r);
        assert_eq!(held.count(0), 0);
    }

    #[test]
    fn a_hold_takes_no_more_room_than_a_permit() {
        assert_eq!(
            std::mem::size_of::<Hold>(),
            std::mem::size_of::<OwnedSemaphorePermit>()
        );
    }
}
