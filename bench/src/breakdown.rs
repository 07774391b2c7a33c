//! `lockbroker-bench --breakdown`: where Redis's time goes in one uncontended lock cycle, and
//! what a released lock leaves in Redis's memory — for the broker, and for the floor proxy
//! beside it.
//!
//! *Per step and per command*: the clients acquire every one of their keys, then release every
//! one, again and again; `INFO commandstats` and `INFO cpu` are read between the two steps, so
//! each step's deltas are its own: the calls and Redis-timed µs of every command (Redis 7 counts
//! the commands a script calls besides the script's own `EVALSHA`, whose time includes
//! theirs), and Redis's CPU time. Each client cycles its own keys, as in the uncontended phase.
//!
//! *Memory left*: unique-key cycles (a new key every cycle) for `--leftover-duration`, then
//! Redis's `used_memory` and `DBSIZE` against before: the bytes and keys a released lock leaves.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use serde::Serialize;

use super::BenchArgs;
use super::http::drive;
use super::lean::{LeanClient, plain_authority};

/// Keys each client cycles in the per-command breakdown: several, so that a step is long
/// enough for the statistics read around it to be small beside it.
const KEYS_PER_CLIENT: usize = 4;

/// Commands that are the bench's own reads, never the lock cycle's.
const NOT_THE_CYCLE: &[&str] = &["info", "dbsize"];

/// Fewer calls per lock than this are not the cycle's: a broker's background calls (its epoch
/// check once a second, a connection's PING) that fell into a step.
const MIN_CALLS_PER_LOCK: f64 = 0.01;

/// One command's share of one step, per lock.
#[derive(Debug, Serialize)]
pub struct CommandCost {
    pub command: String,
    pub calls: f64,
    pub usec: f64,
}

/// One step (acquire or release) of the cycle, per lock.
#[derive(Debug, Serialize)]
pub struct StepCost {
    pub step: &'static str,
    /// Every command Redis counted in the step, by µs, scripts first.
    pub commands: Vec<CommandCost>,
    /// The scripts' µs less the µs of the commands they called: Lua's and the script call's own
    /// cost. `None` when the step ran no script.
    pub script_overhead_usec: Option<f64>,
    /// Redis's CPU time (user + system) over the step, per lock: the commands, and reading the
    /// requests and writing the answers.
    pub redis_cpu_us: f64,
}

/// The breakdown for one server.
#[derive(Debug, Serialize)]
pub struct Breakdown {
    pub server: &'static str,
    /// Locks taken and released.
    pub locks: u64,
    pub steps: Vec<StepCost>,
}

/// What unique-key cycles left in Redis.
#[derive(Debug, Serialize)]
pub struct Leftover {
    pub server: &'static str,
    pub seconds: f64,
    pub cycles: u64,
    pub used_memory_before: i64,
    pub used_memory_after: i64,
    pub keys_before: i64,
    pub keys_after: i64,
    pub bytes_per_lock: f64,
    pub keys_per_lock: f64,
}

type Stats = BTreeMap<String, (u64, u64)>;

/// `calls` and `usec` of every `cmdstat_<name>` line of an INFO commandstats reply.
fn commandstats(info: &str) -> Stats {
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |f: &str| -> Option<u64> {
                rest.split(',')
                    .find_map(|kv| kv.strip_prefix(f)?.strip_prefix('='))?
                    .parse()
                    .ok()
            };
            Some((name.to_owned(), (field("calls")?, field("usec")?)))
        })
        .collect()
}

/// `field:` of an INFO reply, as a number.
fn info_field(info: &str, field: &str) -> Option<f64> {
    info.lines().find_map(|l| {
        l.strip_prefix(field)?
            .strip_prefix(':')?
            .trim()
            .parse()
            .ok()
    })
}

async fn snapshot(redis: &mut MultiplexedConnection) -> anyhow::Result<(Stats, f64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .arg("cpu")
        .query_async(redis)
        .await?;
    let cpu = info_field(&info, "used_cpu_sys").unwrap_or(0.0)
        + info_field(&info, "used_cpu_user").unwrap_or(0.0);
    Ok((commandstats(&info), cpu * 1e6))
}

/// Adds `after - before` of every command into `into`.
fn add_delta(into: &mut Stats, before: &Stats, after: &Stats) {
    for (name, &(calls, usec)) in after {
        let (c0, u0) = before.get(name).copied().unwrap_or((0, 0));
        let entry = into.entry(name.clone()).or_default();
        entry.0 += calls.saturating_sub(c0);
        entry.1 += usec.saturating_sub(u0);
    }
}

fn is_script(name: &str) -> bool {
    matches!(
        name,
        "evalsha" | "eval" | "evalsha_ro" | "eval_ro" | "fcall" | "fcall_ro"
    )
}

fn step_cost(step: &'static str, stats: &Stats, cpu_us: f64, locks: u64) -> StepCost {
    let per = |n: u64| n as f64 / locks as f64;
    let mut commands: Vec<CommandCost> = stats
        .iter()
        .filter(|(name, _)| !NOT_THE_CYCLE.contains(&name.as_str()))
        .map(|(name, &(calls, usec))| CommandCost {
            command: name.clone(),
            calls: per(calls),
            usec: per(usec),
        })
        .filter(|c| c.calls >= MIN_CALLS_PER_LOCK)
        .collect();
    commands.sort_by(|a, b| {
        is_script(&b.command)
            .cmp(&is_script(&a.command))
            .then(b.usec.total_cmp(&a.usec))
    });
    let scripts: f64 = commands
        .iter()
        .filter(|c| is_script(&c.command))
        .map(|c| c.usec)
        .sum();
    let inner: f64 = commands
        .iter()
        .filter(|c| !is_script(&c.command))
        .map(|c| c.usec)
        .sum();
    let ran_scripts = commands.iter().any(|c| is_script(&c.command));
    StepCost {
        step,
        commands,
        script_overhead_usec: ran_scripts.then_some(scripts - inner),
        redis_cpu_us: cpu_us / locks as f64,
    }
}

/// The per-step, per-command breakdown of about `locks` uncontended cycles on `base`.
pub(super) async fn per_command(
    server: &'static str,
    base: &str,
    redis: &MultiplexedConnection,
    args: &BenchArgs,
    run_id: &str,
    locks: u64,
) -> anyhow::Result<Breakdown> {
    let authority = plain_authority(base).context("--breakdown needs a plain http:// broker")?;
    let mut clients = Vec::with_capacity(args.clients);
    for _ in 0..args.clients {
        clients.push(LeanClient::connect(authority, args.connect.auth_token.as_deref()).await?);
    }
    let paths: Vec<Vec<String>> = (0..args.clients)
        .map(|i| {
            (0..KEYS_PER_CLIENT)
                .map(|k| format!("/locks/bench-{run_id}-b{i}-{k}"))
                .collect()
        })
        .collect();
    let mut redis = redis.clone();
    let (mut acquired, mut released) = (Stats::new(), Stats::new());
    let (mut acquire_cpu, mut release_cpu) = (0.0, 0.0);
    let per_round = (args.clients * KEYS_PER_CLIENT) as u64;
    let rounds = locks.div_ceil(per_round).max(1);
    // One round first, uncounted: each key's first cycle is not the steady state.
    for round in 0..=rounds {
        let (s0, c0) = snapshot(&mut redis).await?;
        let tokens = join_all(
            clients
                .iter_mut()
                .zip(&paths)
                .map(|(client, keys)| async move {
                    let mut tokens = Vec::with_capacity(keys.len());
                    for path in keys {
                        tokens.push(client.acquire(&format!("{path}?ttl_ms=10000")).await?);
                    }
                    Ok::<_, anyhow::Error>(tokens)
                }),
        )
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        let (s1, c1) = snapshot(&mut redis).await?;
        join_all(clients.iter_mut().zip(&paths).zip(&tokens).map(
            |((client, keys), tokens)| async move {
                for (path, token) in keys.iter().zip(tokens) {
                    client.release(path, token).await?;
                }
                Ok::<_, anyhow::Error>(())
            },
        ))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        let (s2, c2) = snapshot(&mut redis).await?;
        if round > 0 {
            add_delta(&mut acquired, &s0, &s1);
            add_delta(&mut released, &s1, &s2);
            acquire_cpu += c1 - c0;
            release_cpu += c2 - c1;
        }
    }
    let locks = rounds * per_round;
    Ok(Breakdown {
        server,
        locks,
        steps: vec![
            step_cost("acquire", &acquired, acquire_cpu, locks),
            step_cost("release", &released, release_cpu, locks),
        ],
    })
}

async fn memory(redis: &mut MultiplexedConnection) -> anyhow::Result<(i64, i64)> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(redis).await?;
    let used = info_field(&info, "used_memory").context("INFO memory has no used_memory")?;
    let keys: i64 = redis::cmd("DBSIZE").query_async(redis).await?;
    Ok((used as i64, keys))
}

/// Unique-key cycles on `base` for `duration`: what they leave in Redis.
pub(super) async fn leftover(
    server: &'static str,
    base: &str,
    redis: &MultiplexedConnection,
    args: &BenchArgs,
    duration: Duration,
    run_id: &str,
    progress: bool,
) -> anyhow::Result<Leftover> {
    let authority = plain_authority(base)
        .context("--breakdown needs a plain http:// broker")?
        .to_owned();
    let mut redis = redis.clone();
    let (used_before, keys_before) = memory(&mut redis).await?;
    let timed = BenchArgs {
        duration,
        ..args.clone()
    };
    let name = match server {
        "broker" => "unique keys (broker)",
        _ => "unique keys (proxy)",
    };
    let auth = args.connect.auth_token.clone();
    let phase = drive(name, args.clients, &timed, progress, |i, tally| {
        let (authority, auth) = (authority.clone(), auth.clone());
        let prefix = format!("/locks/bench-{run_id}-{server}-m{i}-");
        async move {
            let mut local = Vec::new();
            let Ok(mut client) = LeanClient::connect(&authority, auth.as_deref()).await else {
                tally.errors.fetch_add(1, Ordering::Relaxed);
                return;
            };
            let mut n = 0u64;
            while !tally.stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let path = format!("{prefix}{n}");
                n += 1;
                let ok = client
                    .cycle(&path, &format!("{path}?ttl_ms=10000"))
                    .await
                    .is_ok();
                tally.count(ok, started, &mut local);
                if !ok {
                    break;
                }
            }
            tally.record(local);
        }
    })
    .await;
    if phase.errors > 0 {
        bail!("{} cycles failed on the {server}", phase.errors);
    }
    let (used_after, keys_after) = memory(&mut redis).await?;
    let cycles = phase.cycles.max(1) as f64;
    Ok(Leftover {
        server,
        seconds: phase.seconds,
        cycles: phase.cycles,
        used_memory_before: used_before,
        used_memory_after: used_after,
        keys_before,
        keys_after,
        bytes_per_lock: (used_after - used_before) as f64 / cycles,
        keys_per_lock: (keys_after - keys_before) as f64 / cycles,
    })
}

pub(super) fn print_breakdown(b: &Breakdown) {
    lockbroker_cli_support::out!(
        "Redis per lock, {} ({} locks taken and released; µs: Redis's timing of each command, \
         a script's including the commands it calls)",
        b.server,
        b.locks
    );
    lockbroker_cli_support::out!("{:<8} {:<28} {:>7} {:>8}", "step", "command", "calls", "µs");
    let mut cpu_total = 0.0;
    let mut top_total = 0.0;
    for step in &b.steps {
        let scripts = step.commands.iter().any(|c| is_script(&c.command));
        for c in &step.commands {
            // With a script in the step, the other commands are the ones it called (the
            // broker sends nothing else per lock).
            let inner = scripts && !is_script(&c.command);
            if !inner {
                top_total += c.usec;
            }
            let name = if inner {
                format!("  {}", c.command)
            } else {
                c.command.clone()
            };
            lockbroker_cli_support::out!(
                "{:<8} {:<28} {:>7.2} {:>8.2}",
                step.step,
                name,
                c.calls,
                c.usec
            );
        }
        if let Some(overhead) = step.script_overhead_usec {
            lockbroker_cli_support::out!(
                "{:<8} {:<28} {:>7} {:>8.2}",
                step.step,
                "script overhead",
                "",
                overhead
            );
        }
        lockbroker_cli_support::out!(
            "{:<8} {:<28} {:>7} {:>8.2}",
            step.step,
            "Redis CPU (INFO cpu)",
            "",
            step.redis_cpu_us
        );
        cpu_total += step.redis_cpu_us;
    }
    lockbroker_cli_support::out!(
        "{:<8} {:<28} {:>7} {:>8.2}",
        "cycle",
        "commands (top level)",
        "",
        top_total
    );
    lockbroker_cli_support::out!(
        "{:<8} {:<28} {:>7} {:>8.2}",
        "cycle",
        "Redis CPU (INFO cpu)",
        "",
        cpu_total
    );
}

pub(super) fn print_leftover(l: &Leftover) {
    lockbroker_cli_support::out!(
        "left in Redis by {} unique-key cycles in {:.1} s on the {}: used_memory {} -> {} bytes, \
         keys {} -> {}; {:.1} bytes and {:.3} keys per released lock",
        l.cycles,
        l.seconds,
        l.server,
        l.used_memory_before,
        l.used_memory_after,
        l.keys_before,
        l.keys_after,
        l.bytes_per_lock,
        l.keys_per_lock
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "# Commandstats\r\n\
        cmdstat_evalsha:calls=10,usec=100,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\
        cmdstat_hmget:calls=20,usec=30,usec_per_call=1.50,rejected_calls=0,failed_calls=0\r\n\
        cmdstat_info:calls=3,usec=90,usec_per_call=30.00,rejected_calls=0,failed_calls=0\r\n\
        cmdstat_client|setname:calls=1,usec=2,usec_per_call=2.00,rejected_calls=0,failed_calls=0\r\n\
        \r\n# CPU\r\nused_cpu_sys:1.500000\r\nused_cpu_user:2.250000\r\n";

    #[test]
    fn commandstats_are_read_with_calls_and_usec() {
        let stats = commandstats(INFO);
        assert_eq!(stats["evalsha"], (10, 100));
        assert_eq!(stats["hmget"], (20, 30));
        assert_eq!(stats["client|setname"], (1, 2));
        assert_eq!(info_field(INFO, "used_cpu_user"), Some(2.25));
        assert_eq!(info_field(INFO, "used_cpu"), None);
    }

    #[test]
    fn a_step_splits_scripts_from_the_commands_they_call() {
        let before = commandstats(INFO);
        let mut after = before.clone();
        after.insert("evalsha".into(), (20, 200));
        after.insert("hmget".into(), (40, 60));
        after.insert("info".into(), (5, 150));
        let mut delta = Stats::new();
        add_delta(&mut delta, &before, &after);
        let step = step_cost("acquire", &delta, 50.0, 10);
        let names: Vec<&str> = step.commands.iter().map(|c| c.command.as_str()).collect();
        assert_eq!(names, ["evalsha", "hmget"]);
        assert_eq!(step.commands[0].usec, 10.0);
        assert_eq!(step.commands[1].calls, 2.0);
        assert_eq!(step.script_overhead_usec, Some(7.0));
        assert_eq!(step.redis_cpu_us, 5.0);
    }
}
