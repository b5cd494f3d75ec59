//! Turns: how many calls a worker has out at once on one Redis node.
//!
//! Each route's task makes its own calls, and a call's timeout runs from when it is handed to
//! the node's multiplexed connection, so with no bound every call queues behind every other: a
//! backlog spread over 10,000 routes put 10,000 `schedule` calls on one connection at once,
//! those at the back timed out though Redis answered each in about 40 µs, and their retries
//! queued again (a worker took 20–56 s for 200,000 events, 40 s of it with no progress at all).
//! So a call first takes a turn on its node: at most `IN_FLIGHT` are out, the rest wait in the
//! worker, where no timeout runs. 64 calls keep a node busy (each is a batch), and the last of
//! them waits behind at most 63.
//!
//! On a cluster the turns are per master, so that a frozen master holds up only its own slots'
//! calls. redis-rs keeps its slot map to itself, so pacer reads one of its own (`CLUSTER NODES`,
//! in the background, again when it is older than `READ_EVERY`); until the first read, and for
//! a command whose key it cannot tell, a call takes no turn. A stale map only groups some slots
//! under the wrong master's turns for a while, which bounds them all the same.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Semaphore, SemaphorePermit};

/// Calls out at once on one node.
pub(super) const IN_FLIGHT: usize = 64;

/// How old the slot map may be before a call has it read again (in the background).
const READ_EVERY: Duration = Duration::from_secs(5);

const SLOTS: usize = 16384;

/// A node's turns.
pub(super) type Turns = Arc<Semaphore>;

pub(super) fn turns() -> Turns {
    Arc::new(Semaphore::new(IN_FLIGHT))
}

/// Waits for a call's turn on `turns`, if it has any; held until the call ends. A wait is
/// counted against the operation timing the call (`telemetry::timed`), so that its duration
/// says what Redis took.
pub(super) async fn take(turns: Option<&Turns>) -> Option<SemaphorePermit<'_>> {
    let turns = turns?;
    if let Ok(turn) = turns.try_acquire() {
        return Some(turn);
    }
    let start = Instant::now();
    let turn = turns.acquire().await.ok();
    crate::telemetry::turn_waited(start.elapsed());
    turn
}

/// Each slot's master's turns, as pacer last read the cluster's slots.
#[derive(Default)]
pub(super) struct SlotTurns {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Per slot: its master's node id and turns (empty until the first read).
    by_slot: Vec<Option<(Arc<str>, Turns)>>,
    /// Per master (by node id), kept across reads: a call out on a master keeps its turn
    /// there whatever a later read says.
    by_node: HashMap<String, Turns>,
    read_at: Option<Instant>,
    reading: bool,
}

impl SlotTurns {
    /// The turns of `slot`'s master, and whether the caller should read the slots again (then
    /// it must call `read` or `unread` once done: one read at a time).
    pub(super) fn of(&self, slot: u16) -> (Option<Turns>, bool) {
        let mut s = self.state.lock().expect("not poisoned");
        let stale = s.read_at.is_none_or(|at| at.elapsed() >= READ_EVERY);
        let read = stale && !s.reading;
        if read {
            s.reading = true;
        }
        let turns = s.by_slot.get(usize::from(slot)).cloned().flatten();
        (turns.map(|(_, t)| t), read)
    }

    /// Whether a map has been read (a read that failed leaves none).
    pub(super) fn is_read(&self) -> bool {
        !self.state.lock().expect("not poisoned").by_slot.is_empty()
    }

    /// The node id of `slot`'s master, as last read (None before the first read).
    pub(super) fn master(&self, slot: u16) -> Option<Arc<str>> {
        let s = self.state.lock().expect("not poisoned");
        s.by_slot
            .get(usize::from(slot))?
            .as_ref()
            .map(|(id, _)| id.clone())
    }

    /// Takes `CLUSTER NODES` text as the slot map.
    pub(super) fn read(&self, nodes: &str) {
        let masters = masters_slots(nodes);
        let mut s = self.state.lock().expect("not poisoned");
        let mut by_slot = vec![None; SLOTS];
        for (id, ranges) in masters {
            let t = s.by_node.entry(id.clone()).or_insert_with(turns).clone();
            let id: Arc<str> = id.into();
            for (first, last) in ranges {
                for slot in by_slot.iter_mut().take(last + 1).skip(first) {
                    *slot = Some((id.clone(), t.clone()));
                }
            }
        }
        s.by_slot = by_slot;
        s.read_at = Some(Instant::now());
        s.reading = false;
    }

    /// A read that failed (no master answered, or the answer was refused): the map stays as
    /// it was, and is read again `READ_EVERY` later, not on the next call (a user refused
    /// `CLUSTER NODES` would otherwise cost a read per call).
    pub(super) fn unread(&self) {
        let mut s = self.state.lock().expect("not poisoned");
        s.read_at = Some(Instant::now());
        s.reading = false;
    }
}

/// Each master's node id and slot ranges (inclusive) in `CLUSTER NODES` text; slots being
/// migrated or imported (`[slot->-id]`) are left out.
fn masters_slots(nodes: &str) -> Vec<(String, Vec<(usize, usize)>)> {
    nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            if !flags.split(',').any(|f| f == "master") {
                return None;
            }
            let ranges = fields
                .iter()
                .skip(8)
                .filter_map(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                    (a <= b && b < SLOTS).then_some((a, b))
                })
                .collect();
            Some((fields[0].to_string(), ranges))
        })
        .collect()
}

/// The key a command is routed by, for the commands pacer sends: the first key of a script
/// or function call, else its first argument (XACK, XADD, HSET...). None for a call with no
/// key (`SCRIPT LOAD`, a script given no keys).
pub(super) fn routing_key<'a>(args: &[&'a [u8]]) -> Option<&'a [u8]> {
    let name = args.first()?.to_ascii_uppercase();
    match name.as_slice() {
        b"EVALSHA" | b"EVAL" | b"FCALL" | b"FCALL_RO" => {
            let keys: usize = std::str::from_utf8(args.get(2)?).ok()?.parse().ok()?;
            (keys > 0).then(|| args.get(3).copied()).flatten()
        }
        b"SCRIPT" | b"FUNCTION" | b"CLUSTER" | b"INFO" | b"PING" | b"TIME" | b"WAIT" => None,
        _ => args.get(1).copied(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODES: &str = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922 [10923->-c3]
c3 127.0.0.1:7002@17002 master,fail - 0 0 3 connected 10923-16383
d4 127.0.0.1:7003@17003 slave c3 0 0 3 connected
";
    /// The same after d4 took over c3's slots.
    const PROMOTED: &str = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7002@17002 master,fail - 0 0 3 connected
d4 127.0.0.1:7003@17003 master - 0 0 4 connected 10923-16383
";

    #[tokio::test]
    async fn a_calls_wait_for_its_turn_is_told_apart_from_its_time_out() {
        let turns: Turns = Arc::new(Semaphore::new(1));
        let held = turns.clone().try_acquire_owned().unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            drop(held);
        });
        // A call that waits 150 ms for the one turn, then is out for 20 ms.
        let ((), took, waited) = crate::telemetry::measure(async {
            let _turn = take(Some(&turns)).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        })
        .await;
        assert!(waited >= Duration::from_millis(140), "waited {waited:?}");
        let out = took - waited;
        assert!(
            out >= Duration::from_millis(20) && out < Duration::from_millis(120),
            "out {out:?} of {took:?}"
        );
        // A turn free at once, and a call with no turns (a cluster's before its slots are
        // read), wait for nothing.
        let ((), _, waited) = crate::telemetry::measure(async {
            let _turn = take(Some(&turns)).await;
            let _none = take(None).await;
        })
        .await;
        assert_eq!(waited, Duration::ZERO);
    }

    #[test]
    fn each_slot_takes_its_masters_turns_and_a_read_keeps_the_turns_out() {
        let slots = SlotTurns::default();
        // Nothing read yet: no turns, and the first caller reads.
        assert!(matches!(slots.of(0), (None, true)));
        assert!(matches!(slots.of(0), (None, false)), "one read at a time");
        // A failed read is not tried again at once.
        slots.unread();
        assert!(matches!(slots.of(0), (None, false)));
        slots.read(NODES);
        let (a, read) = slots.of(0);
        assert!(!read);
        let a = a.unwrap();
        assert!(Arc::ptr_eq(&a, &slots.of(5460).0.unwrap()));
        let b = slots.of(5461).0.unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        // A failed master still serves its slots until they move: its calls share its turns.
        let c = slots.of(16383).0.unwrap();
        assert!(!Arc::ptr_eq(&b, &c) && Arc::ptr_eq(&c, &slots.of(10923).0.unwrap()));
        // Read again after the failover: c3's slots are d4's now; a1 keeps its turns, and the
        // one taken before the read.
        let held = a.clone().try_acquire_owned().unwrap();
        slots.read(PROMOTED);
        let a_again = slots.of(0).0.unwrap();
        assert!(Arc::ptr_eq(&a, &a_again));
        assert_eq!(a_again.available_permits(), IN_FLIGHT - 1);
        drop(held);
        let d = slots.of(16383).0.unwrap();
        assert!(!Arc::ptr_eq(&d, &c) && !Arc::ptr_eq(&d, &a));
        // Each slot's master by id, for the pipelines that go to one master (`super::keyed`).
        assert_eq!(slots.master(0).as_deref(), Some("a1"));
        assert_eq!(slots.master(10923).as_deref(), Some("d4"));
        assert!(slots.is_read() && !SlotTurns::default().is_read());
        assert_eq!(SlotTurns::default().master(0), None);
    }

    #[test]
    fn calls_are_routed_by_their_first_key() {
        let args =
            |s: &'static str| -> Vec<&'static [u8]> { s.split(' ').map(str::as_bytes).collect() };
        let key = |s| routing_key(&args(s)).map(|k| String::from_utf8_lossy(k).into_owned());
        assert_eq!(key("FCALL f 2 {r}:b {r}:ready 1").as_deref(), Some("{r}:b"));
        assert_eq!(key("evalsha abc 1 {r}:b x").as_deref(), Some("{r}:b"));
        assert_eq!(key("EVALSHA abc 0 x"), None);
        assert_eq!(key("XACK in g 1-1").as_deref(), Some("in"));
        assert_eq!(key("SCRIPT LOAD x"), None);
        assert_eq!(key("TIME"), None);
    }
}
