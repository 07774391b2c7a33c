//! The metrics' unit tests: the exposition against the series the docs promise.

use super::*;

#[test]
fn the_exposition_names_every_series_the_docs_promise() {
    let m = Metrics::default();
    m.acquired(
        Kind::Exclusive,
        AcquireResult::Granted,
        Duration::from_millis(3),
    );
    m.acquired(
        Kind::Semaphore { limit: 3 },
        AcquireResult::LimitMismatch,
        Duration::ZERO,
    );
    m.released(
        Space::Locks,
        HolderResult::Done,
        Some(Duration::from_millis(40)),
    );
    m.force_released(Space::Semaphores, HolderResult::Done);
    m.store_call(StoreOp::claim, Duration::from_micros(200), true);
    m.handed_off(Space::Semaphores);
    m.offer_passed_on(PassedOn::Gone);
    m.granted_directly();
    let text = m.render(7, [5, 2], 3);
    for line in [
        "lockbroker_acquisitions_total{kind=\"exclusive\",result=\"granted\"} 1",
        "lockbroker_acquisitions_total{kind=\"exclusive\",result=\"locked\"} 0",
        "lockbroker_acquisitions_total{kind=\"shared\",result=\"granted\"} 0",
        "lockbroker_acquisitions_total{kind=\"semaphore\",result=\"limit_mismatch\"} 1",
        "lockbroker_releases_total{space=\"locks\",result=\"released\"} 1",
        "lockbroker_releases_total{space=\"semaphores\",result=\"released\"} 0",
        "lockbroker_renewals_total{space=\"locks\",result=\"not_owner\"} 0",
        "lockbroker_force_releases_total{space=\"semaphores\",result=\"released\"} 1",
        "lockbroker_force_releases_total{space=\"locks\",result=\"not_held\"} 0",
        "lockbroker_takeovers_total 0",
        "lockbroker_store_errors_total{op=\"claim\"} 1",
        "lockbroker_hold_seconds_count 1",
        "lockbroker_acquire_wait_seconds_count 1",
        "lockbroker_store_call_seconds_count{op=\"claim\"} 1",
        "lockbroker_waiters 7",
        "lockbroker_queued{space=\"locks\"} 5",
        "lockbroker_queued{space=\"semaphores\"} 2",
        "lockbroker_handoffs_total{space=\"semaphores\"} 1",
        "lockbroker_handoffs_total{space=\"locks\"} 0",
        "lockbroker_offers_passed_on_total{reason=\"gone\"} 1",
        "lockbroker_offers_passed_on_total{reason=\"lapsed\"} 0",
        "lockbroker_direct_grants_total 1",
        "lockbroker_ledger_leases 3",
        "lockbroker_store_losses_total 0",
        "lockbroker_leases_put_back_total 0",
        "lockbroker_late_put_backs_total 0",
        "lockbroker_double_claims_total 0",
        "lockbroker_store_hold_seconds_total 0.0",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

#[test]
fn store_ops_are_listed_in_their_declaration_order() {
    // `store_call` finds a primitive's series at `op as usize` in arrays built from `ALL`.
    for (i, op) in StoreOp::ALL.iter().enumerate() {
        assert_eq!(*op as usize, i, "{op:?}");
    }
}
