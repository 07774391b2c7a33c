//! The keeper: the background task that keeps a lease (renewing it by its token) or a session
//! (its keep-alive) until it is released or lost, and says once when it is lost.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout_at};

use crate::error::Error;
use crate::lease::{LeaseState, Loss, MAX_RETRY, MIN_RETRY, Trouble, TroubleHook};

/// When and how often to renew.
pub(crate) struct Plan {
    /// When the request that produced the lease (or opened the session) was sent: it cannot
    /// end before `sent_at + ttl`, and is judged to end then.
    pub(crate) sent_at: Instant,
    pub(crate) ttl: Duration,
    pub(crate) every: Duration,
    pub(crate) on_trouble: Option<TroubleHook>,
}

/// Marks `state` released, unless it was lost first: the keeper sees it and stops.
pub(crate) fn mark_released(state: &watch::Sender<LeaseState>) {
    state.send_if_modified(|state| match state {
        LeaseState::Held => {
            *state = LeaseState::Released;
            true
        }
        _ => false,
    });
}

/// Resolves when `state` is lost (at once if it was already); never if it is released instead.
pub(crate) async fn lost(state: &watch::Sender<LeaseState>) -> Loss {
    let mut state = state.subscribe();
    let lost = state
        .wait_for(|s| matches!(s, LeaseState::Lost(_)))
        .await
        .map(|s| s.clone());
    match lost {
        Ok(LeaseState::Lost(loss)) => loss,
        // The sender outlives this borrow of it.
        _ => std::future::pending().await,
    }
}

/// What a dropped guard does: runs `end(keeper)` (which waits for the keeper, then tells the
/// broker) on the current tokio runtime; with none, stops the keeper, and what it kept ends by
/// its ttl.
pub(crate) fn end_in_background<F>(
    keeper: Option<JoinHandle<()>>,
    end: impl FnOnce(Option<JoinHandle<()>>) -> F,
) where
    F: Future<Output = ()> + Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(end(keeper));
        }
        Err(_) => {
            if let Some(keeper) = keeper {
                keeper.abort();
            }
        }
    }
}

/// Marks `state` lost, unless it was released first.
pub(crate) fn lose(state: &watch::Sender<LeaseState>, loss: Loss) {
    state.send_if_modified(|state| match state {
        LeaseState::Held => {
            *state = LeaseState::Lost(loss);
            true
        }
        _ => false,
    });
}

/// Renews (`renew()`) every `plan.every` until `state` is released or lost. A renewal that
/// fails transiently (no answer, a `503`) is asked again, with a pause that doubles up to a
/// quarter of the interval (at most [`MAX_RETRY`]), until the lease or session would have
/// ended, judged from when the last confirmed renewal was sent (the broker cannot have extended
/// it past that), less a tenth of the ttl. `renewing`: the URL renewed, for the error that says
/// the last renewal was still unanswered.
pub(crate) async fn keep<T, F, Fut>(
    state: &watch::Sender<LeaseState>,
    plan: Plan,
    mut renew: F,
    renewing: impl FnOnce() -> String,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let most = (plan.every / 4).clamp(MIN_RETRY, MAX_RETRY);
    let first_pause = most.min(MIN_RETRY * 5);
    let mut pause = first_pause;
    // Judged lost a tenth of the ttl before the earliest moment it can end at the broker, so
    // that the signal comes before the end even when this task's timer fires late.
    let lasts = plan.ttl - plan.ttl / 10;
    let mut ends_at = plan.sent_at + lasts;
    let mut next = plan.sent_at + plan.every;
    let mut last: Option<Error> = None;
    let mut watched = state.subscribe();
    loop {
        tokio::select! {
            () = sleep_until(next.min(ends_at)) => {}
            // Released (or dropped): no renewal starts after that.
            _ = watched.wait_for(|s| !matches!(s, LeaseState::Held)) => return,
        }
        let sent = Instant::now();
        if sent >= ends_at {
            return lose(state, Loss::Expired { last });
        }
        if !matches!(*watched.borrow(), LeaseState::Held) {
            return;
        }
        match timeout_at(ends_at, renew()).await {
            Ok(Ok(_)) => {
                if last.take().is_some()
                    && let Some(report) = &plan.on_trouble
                {
                    report(&Trouble::Recovered);
                }
                ends_at = sent + lasts;
                next = sent + plan.every;
                pause = first_pause;
            }
            // Gone, or a refusal that no later renewal would change (a revoked bearer token's
            // 401): lost now, with the answer as the reason, not at the end as if the broker
            // had been out of reach. Any 5xx is asked again until the end, as the Java and
            // Python clients do: nobody waits on a renewal, and a proxy's 500 says nothing of
            // the lease.
            Ok(Err(e)) if !e.is_transient() && !e.is_server_error() => {
                return lose(state, Loss::Refused(e));
            }
            Ok(Err(e)) => {
                if let (None, Some(report)) = (&last, &plan.on_trouble) {
                    report(&Trouble::Failing {
                        error: e.clone(),
                        ends_in: ends_at.saturating_duration_since(sent),
                    });
                }
                last = Some(e);
                next = Instant::now() + pause;
                pause = (pause * 2).min(most);
            }
            Err(_) => {
                let last = last.or_else(|| {
                    Some(Error::Transport {
                        url: renewing(),
                        reason: "the last renewal was still unanswered".into(),
                    })
                });
                return lose(state, Loss::Expired { last });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use reqwest::StatusCode;

    use super::*;
    use crate::types::Space;

    const TTL: Duration = Duration::from_secs(30);

    fn plan(sent_at: Instant) -> Plan {
        Plan {
            sent_at,
            ttl: TTL,
            every: TTL / 3,
            on_trouble: None,
        }
    }

    fn unavailable() -> Error {
        Error::Api {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "store_unavailable".into(),
            message: "down".into(),
            retry_after: None,
            url: "http://h:1/sessions/…/renew".into(),
        }
    }

    /// Runs a keeper whose every renewal answers `answer()`; when each was sent, from the start.
    async fn kept(
        state: &watch::Sender<LeaseState>,
        answer: fn() -> Result<(), Error>,
    ) -> Vec<Duration> {
        let start = Instant::now();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let log = sent.clone();
        let renew = move || {
            log.lock().unwrap().push(start.elapsed());
            std::future::ready(answer())
        };
        keep(state, plan(start), renew, || "http://h:1/renew".into()).await;
        sent.lock().unwrap().clone()
    }

    #[tokio::test(start_paused = true)]
    async fn failing_renewals_are_asked_again_with_growing_pauses_until_the_end() {
        let state = watch::Sender::new(LeaseState::Held);
        let sent = kept(&state, || Err(unavailable())).await;
        assert_eq!(sent[0], TTL / 3, "the first renewal at a third of the ttl");
        let pauses: Vec<u128> = sent.windows(2).map(|w| (w[1] - w[0]).as_millis()).collect();
        assert_eq!(pauses[..6], [50, 100, 200, 400, 800, 1000], "{pauses:?}");
        assert!(pauses[6..].iter().all(|&p| p == 1000), "{pauses:?}");
        // Lost a tenth of the ttl before its end, with the last failure as the reason.
        let last = *sent.last().unwrap();
        assert!(last < TTL - TTL / 10, "{last:?}");
        match &*state.borrow() {
            LeaseState::Lost(Loss::Expired { last: Some(e) }) => assert!(e.is_transient()),
            other => panic!("expected an expiry after failures, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_loses_at_once_and_a_release_stops_the_keeper() {
        let refused = watch::Sender::new(LeaseState::Held);
        let sent = kept(&refused, || {
            Err(Error::NotHeld {
                space: Space::Locks,
            })
        })
        .await;
        assert_eq!(sent, [TTL / 3], "one renewal, refused");
        assert!(matches!(
            *refused.borrow(),
            LeaseState::Lost(Loss::Refused(Error::NotHeld { .. }))
        ));

        let released = Arc::new(watch::Sender::new(LeaseState::Held));
        let keeper = tokio::spawn({
            let released = released.clone();
            async move { kept(&released, || Ok(())).await }
        });
        // Between the second renewal (at 20 s) and the third (due at 30 s).
        tokio::time::sleep(TTL * 5 / 6).await;
        mark_released(&released);
        let sent = keeper.await.unwrap();
        assert_eq!(
            sent,
            [TTL / 3, TTL * 2 / 3],
            "renewed until released, then no more"
        );
        assert!(matches!(*released.borrow(), LeaseState::Released));
    }
}
