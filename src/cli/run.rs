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
//! If a renewal is answered `not_held` or `not_owner`, or no renewal gets through before the
//! lease would have ended, the lease is lost: the command's process group gets SIGTERM, then
//! SIGKILL after `--grace`, and `run` exits [`exit::LEASE_LOST`]. Signals sent to `run`
//! (TERM, INT, HUP, QUIT, USR1, USR2) go to the command's process group. If `run` itself dies,
//! by any signal, SIGKILL included, the whole group gets SIGKILL at once (on Linux; see
//! [`supervise`](super::supervise) for how, and what holds elsewhere).

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use clap::Args;
use lockbroker_client::{
    AcquireParams, Claim, Client, Error, Grant, Lease, LeaseOptions, REQUEST_TIMEOUT, Released,
    Trouble, new_request_id,
};
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal as listen_for};
use tokio::time::{Instant, sleep_until};

use super::supervise::{Supervised, cannot_run};
use super::{
    BrokerArgs, ClaimArgs, RUN_EXIT_CODES_HELP, exit, exit_code, format_ms, parse_duration,
    parse_owner, parse_ttl,
};
use lockbroker::domain::Owner;

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
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    // Listening first: from here on a signal is forwarded (or ends the wait for the lock)
    // instead of killing `run` and leaving its command and its lease behind.
    let mut signals = match Signals::listen() {
        Ok(signals) => signals,
        Err(e) => {
            say(format_args!("cannot listen for signals: {e}"));
            return ExitCode::from(exit::ERROR);
        }
    };
    let params = AcquireParams {
        ttl: args.ttl,
        wait: Some(args.wait),
        owner: Some(args.owner.clone().unwrap_or_else(default_owner)),
        request_id: Some(new_request_id()),
    };
    let claim = args.target.claim();
    let resource = claim.resource();
    let sent_at = Instant::now();
    let grant = tokio::select! {
        result = acquire(&client, &claim, &params) => match result {
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
    let (grant, sent_at) = match bound_again(&client, &claim, grant, sent_at).await {
        Ok(bounded) => bounded,
        Err(e) => {
            say(format_args!(
                "cannot renew the lease on {resource} just granted ({e}); the command did not run"
            ));
            return ExitCode::from(exit_code(&e));
        }
    };
    // From here the lease renews itself every third of its TTL, and says when it is lost.
    let mut options = LeaseOptions::new(Duration::from_millis(grant.ttl_ms.max(1)));
    let renewing = resource.clone();
    options.on_trouble = Some(std::sync::Arc::new(
        move |trouble: &Trouble| match trouble {
            Trouble::Failing { error, ends_in } => say(format_args!(
                "cannot renew the lease on {renewing} ({error}); retrying until it ends in {}",
                format_ms(u64::try_from(ends_in.as_millis()).unwrap_or(0))
            )),
            Trouble::Recovered => say(format_args!("renewed the lease on {renewing} again")),
        },
    ));
    let lease = Lease::hold(client.clone(), &claim, &grant, sent_at, options);

    let mut child = match spawn("run", &args.command, &lease, &client, claim.mode()).await {
        Ok(child) => child,
        Err(e) => {
            say(format_args!(
                "cannot run {:?}: {e}",
                args.command[0].to_string_lossy()
            ));
            release(&lease).await;
            return cannot_run(&e);
        }
    };
    let lost = loop {
        tokio::select! {
            biased;
            status = child.wait() => {
                release(&lease).await;
                return exit_code_of(status);
            }
            signal = signals.recv() => child.signal(signal),
            lost = lease.lost() => break lost,
        }
    };
    say(format_args!(
        "lost the lease on {resource}: {lost}; stopping the command (SIGTERM, SIGKILL after {})",
        humantime::format_duration(args.grace)
    ));
    let status = terminate(&mut child, args.grace, &mut signals).await;
    match status {
        Ok(status) => say(format_args!("the command stopped ({status})")),
        Err(e) => say(format_args!("cannot wait for the command: {e}")),
    }
    ExitCode::from(exit::LEASE_LOST)
}

/// Acquires, and on a transport error (the answer may have been lost after the broker granted)
/// asks once more with the same request id, which returns that same grant if there was one.
pub(super) async fn acquire(
    client: &Client,
    claim: &Claim,
    params: &AcquireParams,
) -> Result<Grant, Error> {
    match client.grant(claim, params).await {
        Err(e @ Error::Transport { .. }) => {
            say(format_args!(
                "acquiring {} failed ({e}); trying once more",
                claim.resource()
            ));
            client.grant(claim, params).await
        }
        other => other,
    }
}

/// For a grant that waited, renews it at once. The renewer judges a lease to end when the
/// request that produced it was sent plus its TTL (the earliest it can end), but a waiting
/// acquire may have been granted long after it was sent: judged by that, the lease would seem to
/// end early, or to have ended already. A renewal sent now bounds it again: the lease then ends
/// no sooner than now plus its TTL. A grant answered within a tenth of its TTL keeps its bound.
/// A renewal that fails leaves the lease to end by itself (a transport error), or finds it gone.
pub(super) async fn bound_again(
    client: &Client,
    claim: &Claim,
    grant: Grant,
    sent_at: Instant,
) -> Result<(Grant, Instant), Error> {
    let ttl = Duration::from_millis(grant.ttl_ms.max(1));
    if sent_at.elapsed() < ttl / 10 {
        return Ok((grant, sent_at));
    }
    let renew_sent = Instant::now();
    let renewed = client
        .renew(&claim.resource(), &grant.token, Some(ttl))
        .await?;
    Ok((renewed, renew_sent))
}

/// Releases after the command exited. A failure is reported, not fatal: the command's status
/// is what `run` exits with, and an unreleased lease ends by itself. Waits at most one TTL, by
/// which time the lease has ended anyway.
pub(super) async fn release(lease: &Lease) {
    let resource = lease.resource();
    match tokio::time::timeout(lease.ttl().min(REQUEST_TIMEOUT), lease.release()).await {
        Ok(Ok(Released::Now | Released::Before)) => {}
        Ok(Ok(Released::Gone(e))) => say(format_args!(
            "the lease on {resource} was no longer held when the command finished: {e}"
        )),
        Ok(Err(e)) => say(format_args!(
            "cannot release {resource} ({e}); the lease ends by itself within {}",
            humantime::format_duration(lease.ttl())
        )),
        Err(_) => say(format_args!(
            "the broker did not answer the release of {resource}; the lease has ended by itself"
        )),
    }
}

/// Starts the command for `who` (`run` or `elect`) in a process group of its own, guarded so
/// that it dies with `who` (see [`supervise`](super::supervise)), with the lease in its
/// environment: `LOCKBROKER_KEY` is the lock's key or the semaphore's name, and
/// `LOCKBROKER_MODE` says which (`exclusive`, `shared` or `semaphore`).
pub(super) async fn spawn(
    who: &'static str,
    command: &[OsString],
    lease: &Lease,
    client: &Client,
    mode: &str,
) -> io::Result<Supervised> {
    let fence = lease.fence().to_string();
    Supervised::start(
        who,
        command,
        &[
            ("LOCKBROKER_KEY", lease.key()),
            ("LOCKBROKER_MODE", mode),
            ("LOCKBROKER_FENCE", &fence),
            ("LOCKBROKER_TOKEN", lease.token().as_str()),
            ("LOCKBROKER_URL", client.url()),
        ],
    )
    .await
}

/// SIGTERM to the command's group; SIGKILL if it is still there after `grace`. Signals that
/// arrive meanwhile are still forwarded.
pub(super) async fn terminate(
    child: &mut Supervised,
    grace: Duration,
    signals: &mut Signals,
) -> io::Result<ExitStatus> {
    child.signal(Signal::SIGTERM);
    let kill_at = Instant::now() + grace;
    loop {
        tokio::select! {
            biased;
            status = child.wait() => return status,
            () = sleep_until(kill_at) => {
                say(format_args!(
                    "the command is still running {} after SIGTERM; sending SIGKILL",
                    humantime::format_duration(grace)
                ));
                child.signal(Signal::SIGKILL);
                return child.wait().await;
            }
            signal = signals.recv() => child.signal(signal),
        }
    }
}

/// The exit code that reports the command's end: its own status, or 128 + the signal that
/// killed it, as shells do.
pub(super) fn exit_code_of(status: io::Result<ExitStatus>) -> ExitCode {
    match status {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(exit::ERROR)),
            (None, Some(signal)) => {
                ExitCode::from(u8::try_from(128 + signal).unwrap_or(exit::ERROR))
            }
            (None, None) => ExitCode::from(exit::ERROR),
        },
        Err(e) => {
            say(format_args!("cannot wait for the command: {e}"));
            ExitCode::from(exit::ERROR)
        }
    }
}

/// `HOSTNAME pid PID`: which node's run holds the lock, for `status`.
pub(super) fn default_owner() -> String {
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown-host".to_owned());
    let label: String = format!("{host} pid {}", std::process::id())
        .chars()
        .filter(|c| !c.is_control())
        .take(Owner::MAX_LEN)
        .collect();
    Owner::parse(&label)
        .expect("a short label without control characters")
        .as_str()
        .to_owned()
}

/// The signals `run` passes on to its command.
pub(super) struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
}

impl Signals {
    pub(super) fn listen() -> io::Result<Self> {
        Ok(Self {
            term: listen_for(SignalKind::terminate())?,
            int: listen_for(SignalKind::interrupt())?,
            hup: listen_for(SignalKind::hangup())?,
            quit: listen_for(SignalKind::quit())?,
            usr1: listen_for(SignalKind::user_defined1())?,
            usr2: listen_for(SignalKind::user_defined2())?,
        })
    }

    /// The next signal received.
    pub(super) async fn recv(&mut self) -> Signal {
        tokio::select! {
            Some(()) = self.term.recv() => Signal::SIGTERM,
            Some(()) = self.int.recv() => Signal::SIGINT,
            Some(()) = self.hup.recv() => Signal::SIGHUP,
            Some(()) = self.quit.recv() => Signal::SIGQUIT,
            Some(()) = self.usr1.recv() => Signal::SIGUSR1,
            Some(()) = self.usr2.recv() => Signal::SIGUSR2,
            else => std::future::pending().await,
        }
    }
}

/// One line on stderr, marked as `run`'s own among the command's output.
fn say(message: fmt::Arguments<'_>) {
    eprintln!("lockbroker run: {message}");
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::{CommandFactory, Parser};

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
