//! A TCP proxy on loopback that can black-hole the connections open at a moment: they stay open
//! and nothing more passes either way, while connections opened later pass. So does a network
//! that drops a NAT or conntrack entry without a reset, or a proxy that holds a dead peer's
//! connection.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct BlackHoleProxy {
    port: u16,
    shared: Arc<Shared>,
}

struct Shared {
    stop: AtomicBool,
    /// Connections numbered below this pass nothing any more.
    holed_below: AtomicU64,
    next: AtomicU64,
}

impl BlackHoleProxy {
    /// Listens on a free loopback port and passes each connection on to `127.0.0.1:target`.
    pub fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let port = listener.local_addr().expect("bound").port();
        listener.set_nonblocking(true).expect("nonblocking");
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            holed_below: AtomicU64::new(0),
            next: AtomicU64::new(0),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            while !s.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                            continue;
                        };
                        let n = s.next.fetch_add(1, Ordering::Relaxed);
                        for (from, to) in [
                            (client.try_clone(), server.try_clone()),
                            (server.try_clone(), client.try_clone()),
                        ] {
                            if let (Ok(from), Ok(to)) = (from, to) {
                                let s = s.clone();
                                std::thread::spawn(move || pump(from, to, n, &s));
                            }
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        BlackHoleProxy { port, shared }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on the connections open now pass nothing, and are never closed.
    pub fn black_hole(&self) {
        let open = self.shared.next.load(Ordering::Relaxed);
        self.shared.holed_below.store(open, Ordering::Relaxed);
    }
}

impl Drop for BlackHoleProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

/// Copies `from` to `to` until either closes or the proxy stops; once connection `n` is
/// black-holed, what it reads is dropped.
fn pump(mut from: TcpStream, mut to: TcpStream, n: u64, s: &Shared) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = [0u8; 16 * 1024];
    while !s.stop.load(Ordering::Relaxed) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(len) => {
                if n >= s.holed_below.load(Ordering::Relaxed) && to.write_all(&buf[..len]).is_err()
                {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Both);
}
