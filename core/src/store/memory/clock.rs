//! Wall clocks for the embedded store. (The Redis store reads Redis's `TIME` instead, the one
//! clock all brokers sharing it agree on.)

#[cfg(test)]
use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of Unix epoch time.
pub trait Clock: Send + Sync + 'static {
    fn now_us(&self) -> u64;

    fn now_ms(&self) -> u64 {
        self.now_us() / 1000
    }
}

/// The host's clock as the embedded store reads it: the wall clock once, at start, then the
/// monotonic clock, so an NTP step while the broker runs can neither end leases early (a step
/// forward) nor stretch them (a step back). Correct for the embedded store, which one broker
/// uses.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    wall_at_start_us: u64,
    start: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        Self {
            wall_at_start_us: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
                .unwrap_or(0),
            start: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        let elapsed = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.wall_at_start_us.saturating_add(elapsed)
    }
}

/// A clock that moves only when told to: lets tests put a lease past its expiry without
/// sleeping.
#[cfg(test)]
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicU64>);

#[cfg(test)]
impl ManualClock {
    /// A clock standing at `start_ms`.
    pub fn starting_at_ms(start_ms: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_ms * 1000)))
    }

    pub fn advance_ms(&self, ms: u64) {
        self.0.fetch_add(ms * 1000, Ordering::SeqCst);
    }

    /// Moves the clock backwards, as an NTP step on a host would.
    pub fn rewind_ms(&self, ms: u64) {
        self.0.fetch_sub(ms * 1000, Ordering::SeqCst);
    }
}

#[cfg(test)]
impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}
