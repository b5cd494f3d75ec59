//! What the worker brings in and holds, counted in bytes as well as in entries: how many
//! entries the next read asks for (`ReadSize`), and how many of the `max_inflight` permits an
//! entry holds once read (`hold`).
//!
//! **Reads.** A read counted in entries alone is unbounded in bytes. Stream values may be as
//! large as Redis takes (512 MB each): a producer that attached a 1 MB file to each of 595
//! events made a worker at the default batch of 512 read 512 MB at once and peak at 780 MB
//! resident, three times the memory limit `deploy/kubernetes` sets. Killed for it, a worker
//! leaves those entries pending; whoever takes them next (its restart, or the claimer of
//! another worker) reads them the same way and is killed in turn, and the whole group stops on
//! a handful of entries.
//!
//! Redis says nothing of an entry's size before it is sent, so a reader learns it: each read
//! after one that brought entries asks for at most `read_bytes` over the largest entry it
//! brought, and at most twice as many as it brought (`batch` again within a few full reads
//! once entries are small). Where it has nothing to learn from, what it will take is counted in
//! Redis first (`lua/sizes.lua`), and it takes as many as fit in `read_bytes`, one at least:
//! what a claimer takes from a silent consumer, what a reader takes up that its consumer name
//! held before a restart (the entries a worker may have been killed for holding, so a crash of
//! that kind does not repeat itself, on the restart or on another worker), and a reader's first
//! new read (a worker started on a backlog). What it cannot bound: a read that waits for new
//! entries takes up to its count of whatever arrives, and a read right after small entries, up
//! to its count of a run of large ones; once (the worker learns from it, or dies of it and its
//! successor takes the entries up counted).
//!
//! **Holding.** Sleeping events keep their fields until dispatched, so `max_inflight` alone
//! let 10,000 events at the 64 KiB `max_event_bytes` default hold 640 MB. An entry holds one
//! permit per started `max_inflight_bytes / max_inflight` bytes of fields (one, for the usual
//! small event), so the fields held stay within `max_inflight_bytes` as the entries do within
//! `max_inflight`. A read whose weight is not free does not wait for it where the worker keeps
//! places for its readers: what does not fit is parked (`hold`), its fields let go, and weighed
//! again when its route takes it back.

use super::context::Context;
use crate::event::Entry;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

/// The entry count for new reads of one stream.
#[derive(Debug, Clone)]
pub(super) struct ReadSize {
    batch: usize,
    budget: usize,
    count: usize,
}

impl ReadSize {
    /// Starts at `batch`: nothing is known of the stream's entries yet.
    pub(super) fn new(batch: usize, budget: usize) -> Self {
        ReadSize {
            batch,
            budget,
            count: batch.max(1),
        }
    }

    /// How many entries the next read asks for.
    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// Learns from what a read brought: its entries' `sizes` (nothing, from a read that
    /// brought nothing).
    pub(super) fn read(&mut self, sizes: &[usize]) {
        if let Some(&largest) = sizes.iter().max() {
            self.count = next_count(sizes.len(), self.batch, self.budget, largest);
        }
    }
}

/// The permits for entries of `weights` (`weighed`), just read with `read` permits (one each):
/// each entry gets as many as it weighs, with whether it holds fewer (`underweight`).
///
/// When the weight is more than the read holds and the entries may be parked (`parkable`:
/// on their first delivery, in a worker that keeps places for its readers), those whose
/// weight is not free now get one place each and are marked underweight, to be parked as they
/// are handed over and weighed again when taken back: a read that waited for its weight waited
/// for whatever held the places, and a long queue of small events on a slow route held them for
/// as long as its sleepers slept (a fast route's 20 events of 60 KB, read behind a 50/s route's
/// queue on a worker of 2,000 places, went out 15 s late). Otherwise the read's permits are
/// given back and the whole weight asked for at once: waiting for more while holding some could
/// deadlock with the other readers and the claimer doing the same. None on shutdown meanwhile
/// (the entries stay pending in the group, taken up by this consumer's next start or a
/// claimer).
pub(super) async fn hold(
    ctx: &Context,
    mut weights: Vec<usize>,
    mut read: OwnedSemaphorePermit,
    parkable: bool,
    shutdown: &CancellationToken,
) -> Option<(Vec<OwnedSemaphorePermit>, Vec<bool>)> {
    let total: usize = weights.iter().sum();
    let mut underweight = vec![false; weights.len()];
    if total > read.num_permits() && parkable {
        // One place each from the read, and the weight beyond that to the first entries whose
        // weight is free now; the rest are underweight.
        let free =
            ctx.permits.available_permits() + read.num_permits().saturating_sub(weights.len());
        let (fitting, heavy) = fit(&weights, free);
        let extra = fitting.saturating_sub(read.num_permits());
        let more = if extra > 0 {
            ctx.permits
                .clone()
                .try_acquire_many_owned(extra as u32)
                .ok()
        } else {
            None
        };
        // The free permits counted may have been taken meanwhile: then none fits.
        let heavy = if extra > 0 && more.is_none() {
            0
        } else {
            heavy
        };
        if let Some(more) = more {
            read.merge(more);
        }
        for (w, under) in weights.iter_mut().zip(underweight.iter_mut()).skip(heavy) {
            *under = *w > 1;
            *w = 1;
        }
        return Some((split(read, &weights), underweight));
    }
    if total > read.num_permits() {
        drop(read);
        read = tokio::select! {
            _ = shutdown.cancelled() => return None,
            p = ctx.permits.clone().acquire_many_owned(total as u32) => p.expect("never closed"),
        };
    }
    Some((split(read, &weights), underweight))
}

/// How many of the first entries of `weights` may hold their weight in `free` permits beyond
/// one each for all of them: (the permits they and the rest, at one each, hold; how many).
fn fit(weights: &[usize], free: usize) -> (usize, usize) {
    let (mut used, mut n) = (0, 0);
    for w in weights {
        let more = w - 1;
        if used + more > free {
            break;
        }
        used += more;
        n += 1;
    }
    (weights.len() + used, n)
}

/// As `hold`, for entries that hold no permits yet, without waiting: the permits of as many of
/// them as fit in `room` permits, in order (one at least), if those are free now, else None.
/// (A route's placement task taking back what it parked must not wait: the permits it would
/// wait for may be held by the events queued for it.)
pub(super) fn try_hold(
    ctx: &Context,
    sizes: &[usize],
    room: usize,
) -> Option<Vec<OwnedSemaphorePermit>> {
    let weights = weighed(ctx, sizes);
    // Within what is free now, too: a read may have taken some since the room was counted.
    let room = room.min(ctx.permits.available_permits());
    let (mut total, mut kept) = (0, 0);
    for w in &weights {
        if kept > 0 && total + w > room {
            break;
        }
        total += w;
        kept += 1;
    }
    let permits = ctx
        .permits
        .clone()
        .try_acquire_many_owned(total as u32)
        .ok()?;
    Some(split(permits, &weights[..kept]))
}

/// The permits `entries` hold (`weighed`).
pub(super) fn weigh(ctx: &Context, entries: &[Entry]) -> Vec<usize> {
    let sizes: Vec<usize> = entries.iter().map(Entry::size).collect();
    weighed(ctx, &sizes)
}

/// The permits entries of `sizes` (bytes, `Entry::size`) hold (`weights`, with the worker's
/// settings): all of them together at most what the other reads leave.
pub(super) fn weighed(ctx: &Context, sizes: &[usize]) -> Vec<usize> {
    let worker = &ctx.cfg.worker;
    let slot = (worker.max_inflight_bytes / worker.max_inflight).max(1);
    // What the other reads may hold meanwhile (each reader's waiting read and the claimer's
    // page, `batch` each) is left to them: a read that weighed more would wait until they were
    // all idle (a claim waited 0.6 s a round for the readers' blocking reads to end).
    let others = (ctx.streams.len() + 1) * worker.batch;
    let most = worker.max_inflight.saturating_sub(others).max(sizes.len());
    weights(sizes, slot, most)
}

fn split(mut permits: OwnedSemaphorePermit, weights: &[usize]) -> Vec<OwnedSemaphorePermit> {
    weights
        .iter()
        .map(|&w| permits.split(w).expect("the permits weighed"))
        .collect()
}

/// How many permits each entry of `sizes` (bytes) holds: one per started `slot` bytes, at
/// least one; at most `most` in all (an entry is never refused for its weight: the first
/// entries take what is left above one each for the rest).
pub fn weights(sizes: &[usize], slot: usize, most: usize) -> Vec<usize> {
    let mut extra = most.saturating_sub(sizes.len());
    sizes
        .iter()
        .map(|&size| {
            let more = (size.div_ceil(slot.max(1))).saturating_sub(1).min(extra);
            extra -= more;
            1 + more
        })
        .collect()
}

/// The count after a read that brought `brought` entries, the largest of `largest` bytes:
/// twice what it brought at most (not twice what it asked for: a trickle of small entries, one
/// a read, would otherwise take a count learned on large ones back to `batch` in a few reads),
/// `budget / largest` at most, and between 1 and `batch`.
pub fn next_count(brought: usize, batch: usize, budget: usize, largest: usize) -> usize {
    (budget / largest.max(1))
        .min(brought.saturating_mul(2))
        .clamp(1, batch.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_entries_bring_the_count_back_to_the_batch_by_doubling() {
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
    fn a_trickle_of_small_entries_grows_the_count_by_what_it_brings() {
        // Learned on 1 MB entries: 16. Then reads of one small entry each keep it at 2.
        let mut count = next_count(512, 512, 16 << 20, 1 << 20);
        assert_eq!(count, 16);
        for _ in 0..10 {
            count = next_count(1, 512, 16 << 20, 100);
        }
        assert_eq!(count, 2);
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
    fn an_entry_weighs_a_permit_per_started_slot_of_bytes() {
        assert_eq!(
            weights(&[0, 1, 100, 101, 200, 201], 100, 1000),
            [1, 1, 1, 2, 2, 3]
        );
        // The fields held stay within the permits' bytes: weight x slot covers each size.
        let sizes = [5, 64 << 10, 999, 1 << 20, 3];
        for (size, w) in sizes.iter().zip(weights(&sizes, 6710, 10_000)) {
            assert!(w * 6710 >= *size && (w == 1 || (w - 1) * 6710 < *size));
        }
    }

    #[test]
    fn a_read_never_weighs_more_than_all_the_permits() {
        // The first entries take what is left above one each for the rest.
        assert_eq!(weights(&[1000, 1000, 1000], 100, 12), [10, 1, 1]);
        assert_eq!(weights(&[1000, 10, 1000], 1, 3), [1, 1, 1]);
        assert_eq!(weights(&[], 100, 12), Vec::<usize>::new());
    }

    /// A read that cannot have its whole weight gives it to its first entries while it is
    /// free beyond a place each for all, in order (an entry after one that did not fit does
    /// not take the rest: the route takes its events in order).
    #[test]
    fn the_first_entries_take_the_free_weight_the_rest_one_place_each() {
        // 3 entries of 5 places: 4 beyond one each fits once in 6, twice in 8.
        assert_eq!(fit(&[5, 5, 5], 6), (7, 1));
        assert_eq!(fit(&[5, 5, 5], 8), (11, 2));
        assert_eq!(fit(&[5, 5, 5], 12), (15, 3));
        // Nothing free: one place each, none weighed.
        assert_eq!(fit(&[5, 5, 5], 0), (3, 0));
        // Light entries fit in nothing; a heavy one stops the rest.
        assert_eq!(fit(&[1, 1, 9, 1], 3), (4, 2));
        assert_eq!(fit(&[], 3), (0, 0));
    }

    #[test]
    fn the_count_stays_within_one_and_the_batch() {
        assert_eq!(next_count(usize::MAX, 512, usize::MAX, 0), 512);
        assert_eq!(next_count(0, 0, 0, 0), 1);
        assert_eq!(next_count(3, 4, 1 << 20, 1), 4);
    }
}
