//! What `run` and `elect` share: the start (the client, and the signals listened for before
//! anything else), the acquire that survives a lost answer, the lease held with its renewal, the
//! command started under it (guarded so that it dies with them, see
//! [`supervise`](super::supervise)), the signals passed on to it, its stop, its exit code, and the
//! release.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use lockbroker_client::{
    AcquireParams, Claim, Client, Error, Grant, Lease, LeaseOptions, REQUEST_TIMEOUT, Released,
    Resource, Session, SessionOptions, Trouble, TroubleHook,
};
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal as listen_for};
use tokio::time::{Instant, sleep_until};

use super::supervise::{Supervised, cannot_run};
use super::{BrokerArgs, exit, format_ms};
use lockbroker::domain::Owner;

/// How `run` or `elect` says a line on stderr, marked as its own among the command's output.
pub(super) type Say = fn(fmt::Arguments<'_>);

/// Acquires, and on a transport error (the answer may have been lost after the broker granted)
/// asks once more with the same request id, which returns that same grant if there was one.
pub(super) async fn acquire(
    say: Say,
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
pub(super) async fn release(say: Say, lease: &Lease) {
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
/// `LOCKBROKER_MODE` says which (`exclusive`, `shared` or `semaphore`). A command that cannot
/// start is said, the lease released, and the exit code returned.
pub(super) async fn spawn(
    (who, say): (&'static str, Say),
    command: &[OsString],
    lease: &Lease,
    client: &Client,
    mode: &str,
) -> Result<Supervised, ExitCode> {
    let fence = lease.fence().to_string();
    let started = Supervised::start(
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
    .await;
    match started {
        Ok(child) => Ok(child),
        Err(e) => {
            say(format_args!(
                "cannot run {:?}: {e}",
                command[0].to_string_lossy()
            ));
            release(say, lease).await;
            Err(cannot_run(&e))
        }
    }
}

/// SIGTERM to the command's group; SIGKILL if it is still there after `grace`. Signals that
/// arrive meanwhile are still forwarded.
pub(super) async fn terminate(
    say: Say,
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
pub(super) fn exit_code_of(say: Say, status: io::Result<ExitStatus>) -> ExitCode {
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

/// What `run` and `elect` start with: the client, and the signals listened for before anything
/// else, so that from then on a signal is forwarded (or ends the wait for the lock) instead of
/// killing the process and leaving its command and its lease behind. A failure is said with
/// `say` and is the exit code.
pub(super) fn client_and_signals(
    broker: &BrokerArgs,
    say: Say,
) -> Result<(Client, Signals), ExitCode> {
    let client = broker.client()?;
    match Signals::listen() {
        Ok(signals) => Ok((client, signals)),
        Err(e) => {
            say(format_args!("cannot listen for signals: {e}"));
            Err(ExitCode::from(exit::ERROR))
        }
    }
}

/// How `run` and `elect` keep a lease: renewed every third of the granted TTL, each renewal in
/// trouble and each recovery said on stderr with `say`.
pub(super) fn renewal_options(grant: &Grant, resource: &Resource, say: Say) -> LeaseOptions {
    let mut options = LeaseOptions::new(Duration::from_millis(grant.ttl_ms.max(1)));
    options.on_trouble = Some(trouble_said(say, format!("the lease on {resource}")));
    options
}

/// Says each renewal of `kept` in trouble, and each recovery, on stderr with `say`.
fn trouble_said(say: Say, kept: String) -> TroubleHook {
    std::sync::Arc::new(move |trouble: &Trouble| match trouble {
        Trouble::Failing { error, ends_in } => say(format_args!(
            "cannot renew {kept} ({error}); retrying until it ends in {}",
            format_ms(u64::try_from(ends_in.as_millis()).unwrap_or(0))
        )),
        Trouble::Recovered => say(format_args!("renewed {kept} again")),
    })
}

/// `--session-ttl` for `run` and `elect`: their lock is then taken under a session of their
/// own, opened before the acquire and kept alive every third of `ttl` (trouble said as for a
/// lease), in place of the lease's own renewals.
pub(super) async fn open_session(
    say: Say,
    client: &Client,
    ttl: Duration,
    owner: &str,
) -> Result<Session, Error> {
    let mut options = SessionOptions::new(ttl).owner(owner);
    options.on_trouble = Some(trouble_said(say, "the session".to_owned()));
    client.open_session_with(options).await
}

/// The acquire's parameters: the lease's `ttl`, or, under `session`, none (the session's).
pub(super) fn acquire_params(
    ttl: Option<Duration>,
    wait: Option<Duration>,
    owner: &str,
    session: Option<&Session>,
) -> AcquireParams {
    AcquireParams {
        ttl: ttl.filter(|_| session.is_none()),
        wait,
        owner: Some(owner.to_owned()),
        // The same id for a retry after a lost answer: the broker answers that same grant.
        request_id: Some(lockbroker_client::new_request_id()),
        session: session.map(|s| s.id().clone()),
    }
}

/// The lease granted, kept by `session` if there is one (no renewals of its own), else renewed
/// every third of its TTL from `sent_at`.
pub(super) fn hold(
    say: Say,
    client: &Client,
    claim: &Claim,
    (grant, sent_at): (Grant, Instant),
    session: Option<&Session>,
) -> Lease {
    match session {
        Some(session) => session.hold(claim, &grant),
        None => {
            let options = renewal_options(&grant, &claim.resource(), say);
            Lease::hold(client.clone(), claim, &grant, sent_at, options)
        }
    }
}

/// Closes `run`'s or `elect`'s session on the way out, which releases its lease. A failure is
/// reported, not fatal: the session then ends by its TTL.
pub(super) async fn close_session(say: Say, session: &Session) {
    match tokio::time::timeout(session.ttl().min(REQUEST_TIMEOUT), session.try_close()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => say(format_args!(
            "cannot close the session ({e}); it ends by itself within {}",
            humantime::format_duration(session.ttl())
        )),
        Err(_) => say(format_args!(
            "the broker did not answer the session's close; it has ended by itself"
        )),
    }
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
