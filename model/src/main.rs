//! The exhaustive check of the store protocol's model (docs/model.md).
//!
//! `lockbroker-model` checks every configuration of `configs.rs`; `--bug NAME` checks a
//! known-bad variant (which must fail); `--list-bugs` names them; `--threads N` (default 2).
//! Prints the states explored and each property's verdict; exits 1 with a counterexample trace
//! when a property fails.

use std::process::ExitCode;
use std::time::Instant;

use lockbroker_model::configs;
use lockbroker_model::model::{LockModel, Phase, State};
use lockbroker_model::store::Bug;
use stateright::{Checker, Expectation, HasDiscoveries, Model};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut bug = None;
    let mut threads = 2;
    let mut progress = false;
    let mut only: Option<String> = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--list-bugs" => {
                for b in Bug::ALL {
                    println!("{}", b.name());
                }
                return ExitCode::SUCCESS;
            }
            "--bug" => {
                let name = it.next().map(String::as_str).unwrap_or("");
                let Some(b) = Bug::parse(name) else {
                    eprintln!("unknown bug variant {name:?}; --list-bugs names them");
                    return ExitCode::from(2);
                };
                bug = Some(b);
            }
            "--progress" => progress = true,
            "--only" => only = it.next().cloned(),
            "--threads" => {
                let n = it.next().and_then(|n| n.parse().ok());
                let Some(n) = n.filter(|n: &usize| *n > 0) else {
                    eprintln!("--threads takes a positive number");
                    return ExitCode::from(2);
                };
                threads = n;
            }
            other => {
                eprintln!("unknown argument {other:?} (--list-bugs, --bug NAME, --threads N)");
                return ExitCode::from(2);
            }
        }
    }
    if let Some(b) = bug {
        println!("checking the known-bad variant {}", b.name());
    }
    let started = Instant::now();
    let (mut total, mut failed) = (0, false);
    for cfg in configs::all(bug) {
        if only.as_deref().is_some_and(|o| o != cfg.name) {
            continue;
        }
        let name = cfg.name;
        let model = LockModel { cfg };
        let properties: Vec<_> = model
            .properties()
            .into_iter()
            .map(|p| (p.name, p.expectation == Expectation::Sometimes))
            .collect();
        let t = Instant::now();
        let checker = model
            .clone()
            .checker()
            .threads(threads)
            .finish_when(HasDiscoveries::AnyFailures)
            .spawn_bfs();
        while !checker.is_done() {
            std::thread::sleep(std::time::Duration::from_secs(1));
            if progress {
                eprintln!(
                    "  [{name}] {} states so far, {:.0} s",
                    checker.unique_state_count(),
                    t.elapsed().as_secs_f64()
                );
            }
        }
        let checker = checker.join();
        let states = checker.unique_state_count();
        total += states;
        println!(
            "[{name}] {states} states, max depth {}, {:.1} s",
            checker.max_depth(),
            t.elapsed().as_secs_f64()
        );
        let discoveries = checker.discoveries();
        // A failure stops the check: what holds then holds in the states explored so far.
        let stopped = properties
            .iter()
            .any(|(p, example)| !example && discoveries.contains_key(p));
        for (p, example) in properties {
            let verdict = match (discoveries.get(p), example) {
                (None, false) if stopped => "holds so far",
                (None, false) => "holds",
                (Some(_), true) => "reached",
                (None, true) => "NEVER REACHED",
                (Some(_), false) => "FAILS",
            };

            println!("  {verdict:>13}: {p}");
            if example {
                // An example the checker could not reach is a gap in the bounds, not a failure.
                continue;
            }
            if let Some(path) = discoveries.get(p) {
                failed = true;
                println!(
                    "  counterexample ({} steps):",
                    path.clone().into_actions().len()
                );
                for (state, action) in path.clone().into_vec() {
                    println!("      {}", summary(&model, &state));
                    if let Some(action) = action {
                        println!("    -> {action:?}");
                    }
                }
            }
        }
    }
    println!("{total} states in {:.1} s", started.elapsed().as_secs_f64());
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// One line per state: the store's keys, the clients, the brokers.
fn summary(model: &LockModel, s: &State) -> String {
    let mut out = String::new();
    match s.store.marker {
        Some(m) => out.push_str(&format!("epoch {} hold {} | ", m.id, m.hold)),
        None => out.push_str("no epoch | "),
    }
    for (k, ks) in s.store.keys.iter().enumerate() {
        out.push_str(&format!("key{k}:"));
        for l in ks.lock.iter().chain(ks.pool.iter()) {
            out.push_str(&format!(
                " {}c{}.{} f{} left{}",
                if l.offered { "offer " } else { "" },
                l.token.client,
                l.token.attempt,
                l.fence,
                l.left
            ));
        }
        let q: Vec<String> = ks
            .queue
            .iter()
            .map(|b| format!("c{}", b.token.client))
            .collect();
        out.push_str(&format!(
            " queue[{}] counter {:?} | ",
            q.join(","),
            ks.counter
        ));
    }
    for (j, c) in s.clients.iter().enumerate() {
        let (b, k, _) = model.cfg.clients[j];
        let phase = match &c.phase {
            Phase::Idle => format!("idle#{}", c.attempt),
            Phase::Waiting { timer, due, .. } => {
                format!("waits(t{timer}{})", if *due { " due" } else { "" })
            }
            Phase::Seen { fence, .. } => format!("saw f{fence}"),
            Phase::Holding {
                fence, left, ended, ..
            } => {
                format!(
                    "holds f{fence} left{left}{}",
                    if *ended { " ended" } else { "" }
                )
            }
        };
        let slow = if c.slow.is_some() { " slow" } else { "" };
        out.push_str(&format!("c{j}@b{b}/key{k} {phase}{slow}; "));
    }
    for (m, sv) in s.several.iter().enumerate() {
        let took: Vec<String> = sv
            .took
            .iter()
            .map(|t| {
                format!(
                    "key{} f{} left{}{}",
                    t.key,
                    t.fence,
                    t.left,
                    if t.ended { " ended" } else { "" }
                )
            })
            .collect();
        out.push_str(&format!(
            "several{m}@b{} {:?} took[{}]; ",
            model.cfg.several[m].broker,
            sv.step,
            took.join(", ")
        ));
    }
    for (b, br) in s.brokers.iter().enumerate() {
        out.push_str(&format!(
            "b{b}{} epoch {:?} ledger {} inbox {:?}{}{}; ",
            if br.alive { "" } else { " dead" },
            br.known,
            br.ledger.len(),
            br.inbox,
            if br.batch.is_empty() {
                String::new()
            } else {
                format!(" batch {:?}", br.batch)
            },
            if br.handed.is_empty() {
                String::new()
            } else {
                let handed: Vec<String> = br
                    .handed
                    .iter()
                    .map(|h| {
                        let forced = if h.forced { " forced" } else { "" };
                        format!(
                            "key{} c{} f{} left{}{forced}",
                            h.key, h.token.client, h.fence, h.left
                        )
                    })
                    .collect();
                format!(" handed [{}]", handed.join(", "))
            }
        ));
    }
    out
}
