//! What store losses cost this broker: the losses it caught up with, the leases it put back
//! (all at once, or one by one when a grant's answer raced the loss), the double claims it found
//! and the store-wide holds that followed.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

pub(super) struct Losses {
    losses: Counter,
    pub put_back: Counter,
    pub late_put_backs: Counter,
    double_claims: Counter,
    hold_seconds: Counter<f64, AtomicU64>,
}

impl Losses {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let losses = Counter::default();
        registry.register(
            "lockbroker_store_losses",
            "Times this broker found the store in a new epoch after it had lost or may have lost \
             writes (restart, flush, failover) and put its live leases back",
            losses.clone(),
        );
        let put_back = Counter::default();
        registry.register(
            "lockbroker_leases_put_back",
            "Live leases this broker wrote back into the store after a loss",
            put_back.clone(),
        );
        let late_put_backs = Counter::default();
        registry.register(
            "lockbroker_late_put_backs",
            "Leases granted or renewed here whose answer raced a store loss (written in an epoch \
             older than the newest this broker had seen), put back one by one",
            late_put_backs.clone(),
        );
        let double_claims = Counter::default();
        registry.register(
            "lockbroker_double_claims",
            "Keys found held by another lease while putting a lease back (a lock had two \
             holders; the higher fence was kept)",
            double_claims.clone(),
        );
        let hold_seconds = Counter::<f64, AtomicU64>::default();
        registry.register(
            "lockbroker_store_hold_seconds",
            "Length of the store-wide holds this broker found after detected losses",
            hold_seconds.clone(),
        );
        Self {
            losses,
            put_back,
            late_put_backs,
            double_claims,
            hold_seconds,
        }
    }

    /// A loss caught up with: `put_back` leases written back, `double_claims` found, a hold of
    /// `hold_ms` found.
    pub(super) fn caught_up(&self, put_back: usize, double_claims: usize, hold_ms: u64) {
        self.losses.inc();
        self.put_back.inc_by(put_back as u64);
        self.double_claims.inc_by(double_claims as u64);
        self.hold_seconds.inc_by(hold_ms as f64 / 1000.0);
    }
}
