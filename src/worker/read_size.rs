//! How many entries the next read asks for: `batch` while entries are small, fewer once they
//! are large, so that what one read brings into the worker stays near `worker.read_bytes`.
//!
//! A read counted in entries alone is unbounded in bytes. Stream values may be as large as
//! Redis takes (512 MB each): a producer that attached a 1 MB file to each of 595 events made a
//! worker at the default batch of 512 read 512 MB at once and peak at 780 MB resident, four
//! times the Kubernetes limit `deploy/` sets. Killed for it, a worker leaves those entries
//! pending; whoever takes them next (its restart, or the claimer of another worker) reads them
//! the same way and is killed in turn, and the whole group stops on a handful of entries.
//!
//! Redis says nothing of an entry's size before it is read, so the count learns it, as TCP's
//! slow start learns a path: the first read asks for one entry, and each read after one that
//! brought entries asks for at most twice as many as that one did and at most `read_bytes`
//! over the largest entry it brought. Small entries reach `batch` within ten reads (a few
//! milliseconds at start); one large entry shrinks the next read at once. A worker started, or
//! a claimer turned, on a stream of huge entries takes them one read of about `read_bytes` at a
//! time, so a crash of that kind does not repeat itself. What it cannot bound is a read right
//! after small entries, of a run of large ones: up to the last count, times their size.

use crate::event::Entry;

/// The entry count for reads of one stream (by a reader, or a claimer's pages).
#[derive(Debug, Clone)]
pub(super) struct ReadSize {
    batch: usize,
    budget: usize,
    count: usize,
}

impl ReadSize {
    /// Starts at one entry: nothing is known of the stream's entries yet.
    pub(super) fn new(batch: usize, budget: usize) -> Self {
        ReadSize {
            batch,
            budget,
            count: 1,
        }
    }

    /// How many entries the next read asks for.
    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// Learns from what a read brought (nothing, from a read that brought nothing).
    pub(super) fn read(&mut self, entries: &[Entry]) {
        if let Some(largest) = entries.iter().map(Entry::size).max() {
            self.count = next_count(self.count, self.batch, self.budget, largest);
        }
    }
}

/// The count after a read of `count` entries whose largest took `largest` bytes: twice the
/// count at most, `budget / largest` at most, and between 1 and `batch`.
pub fn next_count(count: usize, batch: usize, budget: usize, largest: usize) -> usize {
    (budget / largest.max(1))
        .min(count.saturating_mul(2))
        .clamp(1, batch.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_entries_reach_the_batch_by_doubling() {
        let mut count = 1;
        let mut reads = 0;
        while count < 512 {
            count = next_count(count, 512, 16 << 20, 200);
            reads += 1;
        }
        assert_eq!((count, reads), (512, 9));
        assert_eq!(next_count(512, 512, 16 << 20, 200), 512);
    }

    #[test]
    fn a_large_entry_bounds_the_next_read_by_bytes() {
        // 1 MB entries under a 16 MiB budget: 16 a read, from any count.
        assert_eq!(next_count(512, 512, 16 << 20, 1 << 20), 16);
        assert_eq!(next_count(16, 512, 16 << 20, 1 << 20), 16);
        // Larger than the whole budget: one at a time, never none.
        assert_eq!(next_count(512, 512, 16 << 20, 100 << 20), 1);
        assert_eq!(next_count(1, 512, 16 << 20, usize::MAX), 1);
    }

    #[test]
    fn the_count_stays_within_one_and_the_batch() {
        assert_eq!(next_count(usize::MAX, 512, usize::MAX, 0), 512);
        assert_eq!(next_count(0, 0, 0, 0), 1);
        assert_eq!(next_count(3, 4, 1 << 20, 1), 4);
    }
}
