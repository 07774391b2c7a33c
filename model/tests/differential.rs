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
//! end passes among them. A run whose machine stalled longer than that cannot be compared past
//! the stall: it is reported, the steps before it count, and another seed continues until
//! `STEPS` steps were compared (the test fails if stalls keep happening).
//!
//! A store loss is a FLUSHALL right after a tick (so that the ends told between brokers have
//! reached their ledgers): both brokers catch up (`Store::ready`), and the model runs CHECK and
//! PUT_BACK for each, with the ledgers the test keeps for it, then ticks out the hold.

mod diff;

use diff::{Outcome, Tally, generate, run_steps, shrink};

/// Steps per run, and the steps the test compares in all.
const STEPS: usize = 3000;
/// Runs the machine may spoil (each still counts the steps it compared before the stall).
const MAX_SPOILED: usize = 20;

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
    let (mut compared, mut spoiled) = (0, 0);
    let mut claims = Tally::default();
    let mut seed = base;
    while compared < STEPS {
        // A seed's first steps are the same however many are generated: a run after a stall
        // compares what is left.
        let steps = generate(seed, STEPS - compared);
        match run_steps(&steps).await {
            Outcome::Agreed {
                ticks,
                flushes,
                claims: tally,
            } => {
                compared += steps.len();
                claims.add(&tally);
                eprintln!(
                    "seed {seed}: {} steps ({ticks} ticks, {flushes} flushes): the scripts answered as the model",
                    steps.len()
                );
            }
            Outcome::Spoiled(at) => {
                // The steps before the stall were compared; a short end may have passed since.
                compared += at;
                spoiled += 1;
                eprintln!(
                    "seed {seed}: the scripts answered as the model for {at} steps, then the machine \
                     stalled longer than a short lease; another seed"
                );
                assert!(
                    spoiled <= MAX_SPOILED,
                    "{spoiled} runs stalled: only {compared} steps could be compared"
                );
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
        seed += 1;
    }
    eprintln!(
        "CLAIM_ALL and BATCH operations and direct grants compared in agreeing runs: {:?}",
        claims.0
    );
}
