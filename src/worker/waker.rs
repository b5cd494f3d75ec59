//! A sleep precise to a fraction of a millisecond, for the dispatcher.
//!
//! tokio's timer wheel ticks in whole milliseconds, so a task sleeping until a slot wakes up to
//! 1 ms late. On a route with burst 1 the gate (rightly) holds each event until one interval
//! after the previous *actual* dispatch, so those delays would add up along a busy route. One
//! OS thread sleeping on a futex with a timeout wakes within tens of microseconds instead, and
//! serves every deadline of the process.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::mpsc;
use std::time::Instant;
use tokio::sync::oneshot;

type Request = (Instant, oneshot::Sender<()>);

/// Handle to the timer thread; the thread ends when the handle is dropped.
pub(crate) struct Waker {
    tx: mpsc::Sender<Request>,
}

struct Due(Instant, u64, oneshot::Sender<()>);

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.0, self.1) == (other.0, other.1)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0, self.1).cmp(&(other.0, other.1))
    }
}

impl Waker {
    pub(crate) fn start() -> Self {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("pacer-waker".into())
            .spawn(move || {
                let mut heap: BinaryHeap<Reverse<Due>> = BinaryHeap::new();
                let mut seq = 0u64;
                loop {
                    let now = Instant::now();
                    while heap.peek().is_some_and(|Reverse(d)| d.0 <= now) {
                        let Reverse(Due(_, _, done)) = heap.pop().expect("peeked");
                        let _ = done.send(());
                    }
                    // Drop requests nobody waits for any more, so the heap stays small.
                    if heap.len() > 64 {
                        heap.retain(|Reverse(d)| !d.2.is_closed());
                    }
                    let request = match heap.peek() {
                        Some(Reverse(d)) => rx.recv_timeout(d.0.saturating_duration_since(now)),
                        None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                    };
                    match request {
                        Ok((at, done)) => {
                            heap.push(Reverse(Due(at, seq, done)));
                            seq += 1;
                        }
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
            })
            .expect("spawning the waker thread");
        Waker { tx }
    }

    /// Resolves at `at`, give or take tens of microseconds.
    pub(crate) fn sleep_until(&self, at: Instant) -> oneshot::Receiver<()> {
        let (done, wait) = oneshot::channel();
        if self.tx.send((at, done)).is_err() {
            // The thread is gone (only while shutting down): a receiver that resolves at once.
            let (done, wait) = oneshot::channel();
            let _ = done.send(());
            return wait;
        }
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn wakes_in_deadline_order_and_never_early() {
        let waker = Waker::start();
        let start = Instant::now();
        let late = waker.sleep_until(start + Duration::from_millis(30));
        let soon = waker.sleep_until(start + Duration::from_millis(10));
        soon.await.unwrap();
        assert!(start.elapsed() >= Duration::from_millis(10));
        late.await.unwrap();
        assert!(start.elapsed() >= Duration::from_millis(30));
    }
}
