//! `lockbroker-bench delay-link`: a TCP link that delays every byte by a fixed time each way, to
//! put a replica "another zone away" from its master on one machine
//! (`scripts/measure-replica-acks.sh`). Each chunk read from one side is written to the other
//! `--delay-ms` after it arrived, in order; a side that closes closes the other's write half once
//! what came before has gone.
//!
//! A process of its own beside the broker and Redis, on the bench's runtime: it costs the shared
//! cores little per chunk, where an interpreted proxy on the same two cores was a suspect for
//! what bounded the measurement. It is never part of `serve`.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

/// `lockbroker-bench delay-link` flags.
#[derive(Debug, Clone, Args)]
pub struct DelayLinkArgs {
    /// Where to listen; port 0 picks a free one. The address is printed on stdout once bound.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Where each accepted connection is carried to.
    #[arg(long)]
    pub upstream: SocketAddr,
    /// How long each byte is held, each way.
    #[arg(long, default_value = "1ms", value_parser = humantime::parse_duration)]
    pub delay: Duration,
}

/// Serves the link until the process is stopped. Plain threads and blocking sockets, four per
/// connection (a replica has one): the async runtime's timers tick in whole milliseconds and
/// round a deadline up, which made a 1 ms delay about 2 ms; a thread's sleep is within tens of
/// microseconds.
pub(crate) fn serve(args: &DelayLinkArgs) -> anyhow::Result<()> {
    let listener = TcpListener::bind(args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    // The caller reads this line to learn the port.
    lockbroker_cli_support::out!("{}", listener.local_addr()?);
    loop {
        let (near, _) = listener.accept()?;
        // A connection that breaks ends alone; the link goes on.
        let Ok(far) = TcpStream::connect(args.upstream) else {
            continue;
        };
        for (from, to) in [(&near, &far), (&far, &near)] {
            let _ = from.set_nodelay(true);
            if let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) {
                let delay = args.delay;
                thread::spawn(move || carry(from, to, delay));
            }
        }
    }
}

/// A side of the link that can be closed for writing once everything has gone.
pub(crate) trait WriteHalf: Write {
    fn close(&mut self);
}

impl WriteHalf for TcpStream {
    fn close(&mut self) {
        let _ = self.shutdown(Shutdown::Write);
    }
}

/// Carries one direction: what `from` gives reaches `to` `delay` after it was read, in order;
/// then `to` is closed for writing.
pub(crate) fn carry(mut from: impl Read, mut to: impl WriteHalf + Send + 'static, delay: Duration) {
    let (chunks, due) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = thread::spawn(move || {
        for (at, chunk) in due {
            let wait = at.saturating_duration_since(Instant::now());
            if !wait.is_zero() {
                thread::sleep(wait);
            }
            if to.write_all(&chunk).is_err() {
                return;
            }
        }
        to.close();
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if chunks
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }
    }
    drop(chunks);
    let _ = writer.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the far side received: when each part arrived and how long it was, the bytes, and
    /// whether it was closed.
    type Received = (Vec<(Instant, usize)>, Vec<u8>, bool);

    #[derive(Clone, Default)]
    struct Far(std::sync::Arc<std::sync::Mutex<Received>>);

    impl Write for Far {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut far = self.0.lock().unwrap();
            far.0.push((Instant::now(), buf.len()));
            far.1.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl WriteHalf for Far {
        fn close(&mut self) {
            self.0.lock().unwrap().2 = true;
        }
    }

    /// A reader that gives its parts one per read, a few milliseconds apart.
    struct Near(Vec<&'static [u8]>, Vec<Instant>);

    impl Read for Near {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0.is_empty() {
                return Ok(0);
            }
            if !self.1.is_empty() {
                thread::sleep(Duration::from_millis(3));
            }
            let part = self.0.remove(0);
            buf[..part.len()].copy_from_slice(part);
            self.1.push(Instant::now());
            Ok(part.len())
        }
    }

    /// Each part crosses in order, no sooner than the delay after it was read, and the far side
    /// is closed after the last.
    #[test]
    fn carries_in_order_no_sooner_than_the_delay() {
        let delay = Duration::from_millis(20);
        let far = Far::default();
        let mut near = Near(vec![b"first ", b"second ", b"third"], Vec::new());
        let (tx, rx) = mpsc::channel();
        let out = far.clone();
        thread::spawn(move || {
            carry(&mut near, out, delay);
            tx.send(near.1).unwrap();
        });
        let read_at = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let far = far.0.lock().unwrap();
        assert_eq!(far.1, b"first second third");
        assert!(far.2, "the far side was not closed");
        assert_eq!(far.0.len(), read_at.len());
        for ((arrived, _), read) in far.0.iter().zip(&read_at) {
            assert!(
                arrived.duration_since(*read) >= delay,
                "a part crossed early"
            );
        }
    }
}
