//! `lockbroker run KEY -- COMMAND [ARGS...]`: runs a command while holding a lock, for jobs that
//! many nodes schedule but only one may run at a time (cron on every node, one run a night).
//! With `--shared` it holds a shared lease instead (any number of shared runs at once, never
//! with an exclusive one), and with `--semaphore NAME --limit N` one of N permits (at most N runs
//! at once).
//!
//! It acquires the lease (with a random request id, and once more with the same id if the
//! answer was lost, so a lost answer does not strand a lease), starts the command in a process
//! group of its own with `LOCKBROKER_KEY`, `LOCKBROKER_MODE`, `LOCKBROKER_FENCE`,
//! `LOCKBROKER_TOKEN` and `LOCKBROKER_URL` in its environment, renews the lease every third of
//! its TTL, and releases it when the command exits, exiting with the command's status.
//!
//! With `--session-ttl` the lease is taken under a session of `run`'s own instead, opened before
//! the acquire and closed when the command exits: the session's keep-alive keeps it, and a lost
//! session is a lost lease.
//!
//! If a renewal (or the session's keep-alive) is answered `not_held` or `not_owner`, or none
//! gets through before the lease would have ended, the lease is lost: the command's process group gets SIGTERM, then
//! SIGKILL after `--grace`, and `run` exits [`exit::LEASE_LOST`]. Signals sent to `run`
//! (TERM, INT, HUP, QUIT, USR1, USR2) go to the command's process group. If `run` itself dies,
//! by any signal, SIGKILL included, the whole group gets SIGKILL at once (on Linux; see
//! [`supervise`](super::supervise) for how, and what holds elsewhere).

use std::ffi::OsString;
use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use lockbroker_client::{Client, Error, Session};
use tokio::time::Instant;

use super::holding::{
    Signals, acquire, acquire_params, bound_again, client_and_signals, close_session,
    default_owner, exit_code_of, hold, open_session, release, spawn, terminate,
};
use super::{
    BrokerArgs, ClaimArgs, RUN_EXIT_CODES_HELP, exit, exit_code, parse_duration, parse_owner,
    parse_ttl,
};

/// `lockbroker run` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = RUN_EXIT_CODES_HELP)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub target: ClaimArgs,
    /// Lease length, renewed every third of it while the command runs [default: the
    /// broker's, 30s unless configured]. A lost lease is noticed within a third of it.
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION")]
    pub ttl: Option<Duration>,
    /// Hold the lock under a session of this length (opened first, kept alive every third of
    /// it, closed when the command exits) instead of a lease renewed on its own; a lost session
    /// is a lost lease. Not with --ttl.
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION", conflicts_with = "ttl")]
    pub session_ttl: Option<Duration>,
    /// How long to wait while someone else holds the lock (or every permit is taken). With 0s,
    /// a lock held elsewhere exits 3 at once and the command does not run.
    #[arg(long, default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub wait: Duration,
    /// A label for people, shown by `status` [default: HOSTNAME pid PID].
    #[arg(long, value_parser = parse_owner)]
    pub owner: Option<String>,
    /// When the lease is lost: how long the command has between SIGTERM and SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    pub grace: Duration,
    /// Print nothing when the lock is held elsewhere or every permit is taken (exit 3 says
    /// it); cron mails whatever a job prints. Errors are still printed.
    #[arg(short, long)]
    pub quiet: bool,
    /// The command and its arguments, after `--`. It runs in a process group of its own, so
    /// that a stop reaches everything it started; it can write to a terminal, not read from it.
    /// If `run` dies, by any signal (SIGKILL included), the whole group gets SIGKILL at once
    /// (on Linux).
    #[arg(last = true, required = true, num_args = 1.., value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// `lockbroker run`.
pub(crate) async fn run(args: RunArgs) -> ExitCode {
    let (client, mut signals) = match client_and_signals(&args.broker, say) {
        Ok(started) => started,
        Err(code) => return code,
    };
    let owner = args.owner.clone().unwrap_or_else(default_owner);
    let Some(ttl) = args.session_ttl else {
        return hold_and_run(&args, &client, &mut signals, &owner, None).await;
    };
    let session = match open_session(say, &client, ttl, &owner).await {
        Ok(session) => session,
        Err(e) => {
            say(format_args!(
                "cannot open a session: {e}; the command did not run"
            ));
            return ExitCode::from(exit_code(&e));
        }
    };
    let code = hold_and_run(&args, &client, &mut signals, &owner, Some(&session)).await;
    close_session(say, &session).await;
    code
}

/// Acquires (under `session` if there is one), runs the command while the lease holds, and
/// releases.
async fn hold_and_run(
    args: &RunArgs,
    client: &Client,
    signals: &mut Signals,
    owner: &str,
    session: Option<&Session>,
) -> ExitCode {
    let params = acquire_params(args.ttl, Some(args.wait), owner, session);
    let claim = args.target.claim();
    let resource = claim.resource();
    let sent_at = Instant::now();
    let grant = tokio::select! {
        result = acquire(say, client, &claim, &params) => match result {
            Ok(grant) => grant,
            Err(e @ Error::Locked { .. }) => {
                if !args.quiet {
                    say(format_args!("cannot acquire {resource}: {e}; the command did not run"));
                }
                return ExitCode::from(exit::LOCKED);
            }
            Err(e) => {
                say(format_args!("cannot acquire {resource}: {e}"));
                return ExitCode::from(exit_code(&e));
            }
        },
        signal = signals.recv() => {
            say(format_args!("got {signal} while acquiring {resource}; the command did not run"));
            return ExitCode::from(128 + signal as u8);
        }
    };
    // A lease under a session is kept by the session's keep-alive, which judges its end itself.
    let bounded = match session {
        Some(_) => Ok((grant, sent_at)),
        None => bound_again(client, &claim, grant, sent_at).await,
    };
    let bounded = match bounded {
        Ok(bounded) => bounded,
        Err(e) => {
            say(format_args!(
                "cannot renew the lease on {resource} just granted ({e}); the command did not run"
            ));
            return ExitCode::from(exit_code(&e));
        }
    };
    // From here the lease is kept (renewed every third of its TTL, or by the session), and says
    // when it is lost.
    let lease = hold(say, client, &claim, bounded, session);

    let mut child = match spawn(("run", say), &args.command, &lease, client, claim.mode()).await {
        Ok(child) => child,
        Err(code) => return code,
    };
    let lost = loop {
        tokio::select! {
            biased;
            status = child.wait() => {
                release(say, &lease).await;
                return exit_code_of(say, status);
            }
            signal = signals.recv() => child.signal(signal),
            lost = lease.lost() => break lost,
        }
    };
    let with = if session.is_some() {
        " with its session"
    } else {
        ""
    };
    say(format_args!(
        "lost the lease on {resource}{with}: {lost}; stopping the command (SIGTERM, SIGKILL \
         after {})",
        humantime::format_duration(args.grace)
    ));
    let status = terminate(say, &mut child, args.grace, signals).await;
    match status {
        Ok(status) => say(format_args!("the command stopped ({status})")),
        Err(e) => say(format_args!("cannot wait for the command: {e}")),
    }
    ExitCode::from(exit::LEASE_LOST)
}

/// One line on stderr, marked as `run`'s own among the command's output.
fn say(message: fmt::Arguments<'_>) {
    eprintln!("lockbroker run: {message}");
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::{CommandFactory, Parser};
    use lockbroker_client::Claim;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn parse(args: &[&str]) -> Result<RunArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("run").chain(args.iter().copied())).map(|c| c.run)
    }

    #[test]
    fn run_is_a_consistent_clap_definition() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_holds_a_lock_a_shared_lease_or_a_permit_for_the_command_after_dashes() {
        let key = |raw: &str| raw.to_owned();
        let run = parse(&["k", "--", "true"]).unwrap();
        assert_eq!(run.target.claim(), Claim::Exclusive(key("k")));
        let run = parse(&["--shared", "k", "--", "true"]).unwrap();
        assert_eq!(run.target.claim(), Claim::Shared(key("k")));
        let run = parse(&["--semaphore", "s", "--limit", "2", "--", "sh", "-c", "x"]).unwrap();
        assert_eq!(
            run.target.claim(),
            Claim::Permit {
                semaphore: key("s"),
                limit: 2
            }
        );
        assert_eq!(run.command, ["sh", "-c", "x"]);
    }

    #[test]
    fn run_refuses_a_key_with_a_semaphore_a_limit_alone_and_a_shared_permit() {
        for (args, kind) in [
            (&["--", "true"][..], ErrorKind::MissingRequiredArgument),
            (
                &["k", "--semaphore", "s", "--limit", "2", "--", "true"],
                ErrorKind::ArgumentConflict,
            ),
            (
                &["--semaphore", "s", "--", "true"],
                ErrorKind::MissingRequiredArgument,
            ),
            (
                &["k", "--limit", "2", "--", "true"],
                ErrorKind::ArgumentConflict,
            ),
            (
                &["--semaphore", "s", "--limit", "2", "--shared", "--", "true"],
                ErrorKind::ArgumentConflict,
            ),
            (
                &["--semaphore", "s", "--limit", "2"],
                ErrorKind::MissingRequiredArgument,
            ),
        ] {
            match parse(args) {
                Ok(_) => panic!("{args:?} was accepted"),
                Err(e) => assert_eq!(e.kind(), kind, "{args:?}"),
            }
        }
    }
}
