//! The cost of the lease ledger, measured in this process: its memory per lease and the time of
//! a sweep and of a put-back's snapshot. `lockbroker-bench --ledger N` prints it; the ledger
//! itself stays private to the store. Built only with the library's `bench` feature, which
//! lockbroker-bench alone enables: the broker's own build neither carries nor exports it.

use std::time::{Duration, Instant};

use serde::Serialize;

use lockbroker_core::domain::{LockKey, Token};

/// What `--ledger` measured.
#[derive(Debug, Serialize)]
pub struct LedgerCost {
    pub leases: usize,
    /// Growth of this process's resident memory while the ledger was filled, per lease: what the
    /// allocator really handed out, map slack and string headers included.
    pub bytes_per_lease: f64,
    /// One pass of the once-a-second sweep over the full ledger (nothing ended).
    pub sweep_ms: f64,
    /// Copying out every live lease, as a put-back does first.
    pub snapshot_ms: f64,
}

/// Fills a ledger with `leases` leases shaped like real ones (a 20-character key, a generated
/// token, an owner label) and measures it.
pub fn ledger_cost(leases: usize) -> LedgerCost {
    use crate::ledger::Ledger;
    use lockbroker_core::domain::Kind;
    use lockbroker_core::domain::{Lease, Owner};
    let ledger = Ledger::default();
    let owner = Owner::parse("web-7 pid 4242").expect("a valid owner");
    let now = tokio::time::Instant::now();
    // Keys and tokens made before the measurement would be counted with it; made inside it, as
    // a broker makes them, only what stays allocated is.
    let before = lockbroker_core::metrics::resident_memory_bytes();
    for i in 0..leases {
        let key = LockKey::parse(&format!("orders:invoice-{i:06}")).expect("a valid key");
        let lease = Lease {
            token: Token::generate(),
            fence: 1_795_000_000_000_000 + i as u64,
            expires_at_ms: 0,
            ttl_ms: 30_000,
            owner: Some(owner.clone()),
            request_id: None,
            limit: None,
        };
        ledger.record(
            &key,
            Kind::Exclusive,
            &lease,
            now + Duration::from_millis(lease.ttl_ms),
        );
    }
    let after = lockbroker_core::metrics::resident_memory_bytes();
    let started = Instant::now();
    ledger.sweep(now);
    let sweep_ms = started.elapsed().as_secs_f64() * 1000.0;
    let started = Instant::now();
    let live = ledger.live(now).len();
    let snapshot_ms = started.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(live, leases, "every lease is live");
    LedgerCost {
        leases,
        bytes_per_lease: after.saturating_sub(before) as f64 / leases.max(1) as f64,
        sweep_ms,
        snapshot_ms,
    }
}
