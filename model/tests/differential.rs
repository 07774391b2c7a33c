//! The real scripts held to the model: seeded random sequences of store operations run against
//! two `RedisStore`s (two brokers) on a real `redis-server` and against the model's step
//! functions (`lockbroker_model::store`), which must give the same answers — granted, queued,
//! refused, held, not held, not owner, the fences (up to one order-keeping renaming per key),
//! the holders of each key after each step, and the offers and requeues told to each broker.
//!
//! Time: the real store's clock is Redis's TIME, which a test cannot move. Every lease, offer
//! window and renewal is either long (10 minutes: it never ends in a run) or short (`SHORT`),
//! which the model counts as one tick. A tick is a real wait until every short end has passed;
//! between two ticks the steps must all run within `SHORT` of the first one, so that no short
//! end passes among them. A run whose machine stalled longer than that cannot be compared: it
//! is reported and replaced by another seed (and the test fails if that keeps happening).
//!
//! A store loss is a FLUSHALL right after a tick (so that the ends told between brokers have
//! reached their ledgers): both brokers catch up (`Store::ready`), and the model runs CHECK and
//! PUT_BACK for each, with the ledgers the test keeps for it, then ticks out the hold.

mod diff;

use diff::{Outcome, generate, run_steps, shrink};

/// Steps per run; runs (seeds) per test.
const STEPS: usize = 3000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripts_answer_as_the_model() {
    let base: u64 = std::env::var("MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
        });
    let mut spoiled = 0;
    let mut seed = base;
    loop {
        let steps = generate(seed, STEPS);
        match run_steps(&steps).await {
            Outcome::Agreed { ticks, flushes } => {
                eprintln!(
                    "seed {seed}: {} steps ({ticks} ticks, {flushes} flushes): the scripts answered as the model",
                    steps.len()
                );
                return;
            }
            Outcome::Spoiled(at) => {
                spoiled += 1;
                eprintln!(
                    "seed {seed}: the machine stalled longer than a short lease at step {at}; another seed"
                );
                assert!(
                    spoiled < 3,
                    "three runs in a row stalled: the comparison could not be made"
                );
                seed += 1;
            }
            Outcome::Disagreed { at, what } => {
                eprintln!("seed {seed}: disagreement at step {at}: {what}; shrinking");
                let (short, what) = shrink(steps[..=at].to_vec(), what).await;
                let listed: Vec<String> = short
                    .iter()
                    .enumerate()
                    .map(|(i, s)| format!("  {i:>3}: {s:?}"))
                    .collect();
                panic!(
                    "seed {seed} (MODEL_SEED={seed} replays it): the real scripts and the model disagree: \
                     {what}\nshortest sequence found ({} steps):\n{}",
                    short.len(),
                    listed.join("\n")
                );
            }
        }
    }
}
