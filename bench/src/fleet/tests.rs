//! The fleet bench's bookkeeping: handoffs and spread.

use super::*;

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

#[test]
fn handoff_runs_from_a_release_to_the_grant_of_the_next_fence_whoever_logged_them() {
    let t = Instant::now();
    // Logged out of order, as clients merge their logs: fences 10, 20, 30, 40.
    let grants = vec![
        Grant {
            fence: 30,
            granted: at(t, 20),
            released: Some(at(t, 25)),
        },
        Grant {
            fence: 10,
            granted: at(t, 0),
            released: Some(at(t, 5)),
        },
        Grant {
            fence: 40,
            granted: at(t, 27),
            released: None,
        },
        Grant {
            fence: 20,
            granted: at(t, 7),
            released: Some(at(t, 12)),
        },
    ];
    assert_eq!(
        handoffs(grants),
        [
            Duration::from_millis(2),
            Duration::from_millis(8),
            Duration::from_millis(2)
        ]
    );
}

#[test]
fn a_failed_release_starts_no_handoff_and_a_grant_heard_before_the_release_counts_zero() {
    let t = Instant::now();
    let grants = vec![
        Grant {
            fence: 1,
            granted: at(t, 0),
            released: None,
        },
        Grant {
            fence: 2,
            granted: at(t, 10),
            // Its 204 arrived after the next holder's 201.
            released: Some(at(t, 15)),
        },
        Grant {
            fence: 3,
            granted: at(t, 14),
            released: Some(at(t, 20)),
        },
    ];
    assert_eq!(handoffs(grants), [Duration::ZERO]);
    assert!(handoffs(Vec::new()).is_empty());
}

#[test]
fn spread_is_most_over_fewest_and_undefined_when_a_client_starved() {
    assert_eq!(
        Spread::of(&[30, 20, 25]),
        Spread {
            most: 30,
            fewest: 20,
            most_over_fewest: Some(1.5)
        }
    );
    assert_eq!(
        Spread::of(&[7, 0]),
        Spread {
            most: 7,
            fewest: 0,
            most_over_fewest: None
        }
    );
    assert_eq!(Spread::of(&[]).most_over_fewest, None);
}
