//! `lockbroker elect KEY --owner NAME -- COMMAND [ARGS...]`: leader election on a lock. The
//! lock's holder is the leader; this node runs COMMAND while it leads and otherwise waits as a
//! candidate.
//!
//! A candidate acquires the lock with `--owner` and a long wait, asking again each time a wait
//! runs out, so that it is in the key's queue in the store whenever the lock is held: when the
//! leader releases, the lock is handed to the first candidate at once. While it leads, it runs
//! the command as `lockbroker run` does (its own process group, the lease in its environment,
//! renewed every third of the TTL, the whole group stopped — SIGTERM, then SIGKILL after
//! `--grace` — when the lease is lost), and when the lease is lost it becomes a candidate
//! again. SIGTERM or SIGINT while it leads stops the command the same way and then releases the
//! lock, so a successor starts within a handoff rather than a TTL; other signals go to the
//! command. The exit status is the command's (it ended by itself or was stopped), or 128+S for
//! a signal S received while waiting as a candidate. If `elect` itself dies while it leads, by
//! any signal, SIGKILL included, the command's whole group gets SIGKILL at once (on Linux; see
//! [`supervise`](super::supervise)), so a successor, which leads only once the dead leader's
//! lease has ended, never runs its command beside it.
//!
//! With `--session-ttl` it stands and leads under a session of its own, kept alive every third
//! of its TTL in place of the lease's renewals and closed on exit; a lost session is a lost
//! lead, and the next term stands under a new session.

use std::ffi::OsString;
use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use lockbroker_client::{Claim, Client, Error, Grant, Session};
use nix::sys::signal::Signal;
use tokio::time::Instant;

use super::holding::{
    Signals, acquire_params, bound_again, client_and_signals, close_session, default_owner,
    exit_code_of, hold, open_session, release, spawn, terminate,
};
use super::{BrokerArgs, exit, exit_code, parse_duration, parse_key, parse_owner, parse_ttl};

/// How long one candidate request waits for the lock before it asks again (at most; a
/// broker whose `max_wait_ms` is lower refuses it, and the candidate then asks with that).
const CAMPAIGN_WAIT: Duration = Duration::from_secs(30);

/// How soon a candidate asks again after the broker could not be reached or answered 5xx.
const RETRY: Duration = Duration::from_secs(1);

/// `lockbroker elect` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = ELECT_EXIT_CODES_HELP)]
pub(crate) struct ElectArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The election's lock: 1 to 200 characters from A-Z a-z 0-9 . _ - :
    #[arg(value_parser = parse_key)]
    pub key: String,
    /// This candidate's name, shown as the lock's owner while it leads (`status` and
    /// `status --watch` show who leads) [default: HOSTNAME pid PID].
    #[arg(long, value_parser = parse_owner)]
    pub owner: Option<String>,
    /// Lease length, renewed every third of it while leading [default: the broker's, 30s
    /// unless configured]. A leader that dies is succeeded within it.
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION")]
    pub ttl: Option<Duration>,
    /// Stand and lead under a session of this length (opened first, kept alive every third
    /// of it, closed on exit) instead of a lease renewed on its own; a lost session is a lost
    /// lead, and the next term stands under a new session. Not with --ttl.
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION", conflicts_with = "ttl")]
    pub session_ttl: Option<Duration>,
    /// How long to wait as a candidate before giving up (exit 3) [default: forever].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub wait: Option<Duration>,
    /// When the command must stop: how long it has between SIGTERM and SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    pub grace: Duration,
    /// The command and its arguments, after `--`, run while this node leads, in a process
    /// group of its own. If `elect` dies, by any signal (SIGKILL included), the whole group
    /// gets SIGKILL at once (on Linux).
    #[arg(last = true, required = true, num_args = 1.., value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

pub(crate) const ELECT_EXIT_CODES_HELP: &str = "\
Exit codes:
  N      the command ran and exited with status N (0 included), by itself or stopped by
         a SIGTERM or SIGINT sent to elect (then the leadership is released)
  128+S  the command died of signal S (143 for SIGTERM); or elect got signal S while
         waiting as a candidate (the command did not run)
  1      error: request refused (400, 403), unexpected answer
  2      usage error
  3      --wait ran out before this node led; the command did not run
  126    the command could not be started
  127    the command was not found
A leader whose lease is lost stops its command (SIGTERM, SIGKILL after --grace) and waits
as a candidate again.";

/// `lockbroker elect`.
pub(crate) async fn elect(args: ElectArgs) -> ExitCode {
    let (client, mut signals) = match client_and_signals(&args.broker, say) {
        Ok(started) => started,
        Err(code) => return code,
    };
    let mut session = None;
    let code = stand(&args, &client, &mut signals, &mut session).await;
    if let Some(session) = &session {
        close_session(say, session).await;
    }
    code
}

/// Stands, leads, and stands again after a lost lease, until elect is done. With
/// `--session-ttl`, under a session of its own in `session`, opened anew when it was lost.
async fn stand(
    args: &ElectArgs,
    client: &Client,
    signals: &mut Signals,
    session: &mut Option<Session>,
) -> ExitCode {
    let claim = Claim::Exclusive(args.key.clone());
    let owner = args.owner.clone().unwrap_or_else(default_owner);
    let deadline = args.wait.map(|wait| Instant::now() + wait);
    loop {
        if let Some(ttl) = args.session_ttl
            && session.as_ref().is_none_or(|s| !s.is_alive())
        {
            if let Some(lost) = session.take() {
                lost.close().await;
            }
            match open_session(say, client, ttl, &owner).await {
                Ok(opened) => *session = Some(opened),
                Err(e)
                    if e.is_transient() && deadline.is_none_or(|d| Instant::now() + RETRY < d) =>
                {
                    say(format_args!(
                        "cannot open a session ({e}); trying again in {}",
                        humantime::format_duration(RETRY)
                    ));
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
                Err(e) => {
                    say(format_args!(
                        "cannot open a session to stand for {}: {e}",
                        args.key
                    ));
                    return ExitCode::from(exit_code(&e));
                }
            }
        }
        let grant = tokio::select! {
            grant = campaign(client, &claim, (&owner, session.as_ref()), args.ttl, deadline) => match grant {
                Ok(grant) => grant,
                Err(e @ Error::Locked { .. }) => {
                    say(format_args!("--wait ran out while another node led {}: {e}; the command did not run", args.key));
                    return ExitCode::from(exit::LOCKED);
                }
                // The session ended while this node waited: stand again under a new one.
                Err(Error::SessionEnded { .. }) if session.is_some() => continue,
                Err(e) => {
                    say(format_args!("cannot stand for {}: {e}", args.key));
                    return ExitCode::from(exit_code(&e));
                }
            },
            signal = signals.recv() => {
                say(format_args!("got {signal} while waiting to lead {}; the command did not run", args.key));
                return ExitCode::from(128 + signal as u8);
            }
        };
        match lead(args, client, &claim, grant, signals, session.as_ref()).await {
            Led::Ended(code) => return code,
            Led::Lost => {}
        }
    }
}

/// Waits as a candidate until this node leads: acquires with a long wait, again and again,
/// until granted or `deadline`. A broker that cannot be reached, or answers 5xx, is asked again.
async fn campaign(
    client: &Client,
    claim: &Claim,
    (owner, session): (&str, Option<&Session>),
    ttl: Option<Duration>,
    deadline: Option<Instant>,
) -> Result<(Grant, Instant), Error> {
    let mut wait = CAMPAIGN_WAIT;
    let mut said_trouble = false;
    loop {
        let now = Instant::now();
        let this_wait = deadline.map_or(wait, |d| wait.min(d.saturating_duration_since(now)));
        let params = acquire_params(ttl, Some(this_wait), owner, session);
        let sent_at = Instant::now();
        let mut answer = client.grant(claim, &params).await;
        if matches!(answer, Err(Error::Transport { .. })) {
            answer = client.grant(claim, &params).await;
        }
        match answer {
            // Under a session, the session's keep-alive judges the lease's end.
            Ok(grant) if session.is_some() => return Ok((grant, sent_at)),
            // A grant that waited is renewed at once, so that the renewer judges its end right.
            Ok(grant) => match bound_again(client, claim, grant, sent_at).await {
                Ok(bounded) => return Ok(bounded),
                Err(e) => say(format_args!(
                    "cannot renew the lease on {} just granted ({e}); standing again",
                    claim.resource()
                )),
            },
            Err(Error::Locked { .. }) if deadline.is_none_or(|d| Instant::now() < d) => {}
            // A broker with a lower max_wait_ms: ask with a shorter wait.
            Err(Error::Api {
                status,
                ref message,
                ..
            }) if status.as_u16() == 400 && message.contains("wait_ms") && wait > RETRY => {
                wait /= 2;
            }
            Err(e) if e.is_transient() => {
                if !said_trouble {
                    say(format_args!(
                        "cannot stand for {} ({e}); trying again every {}",
                        claim.resource(),
                        humantime::format_duration(RETRY)
                    ));
                    said_trouble = true;
                }
                if deadline.is_some_and(|d| Instant::now() + RETRY >= d) {
                    return Err(e);
                }
                tokio::time::sleep(RETRY).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// How a term as leader ended.
enum Led {
    /// Elect is done: exit with this.
    Ended(ExitCode),
    /// The lease was lost and the command stopped: stand again.
    Lost,
}

/// Leads: runs the command while the lease holds, as `run` does.
async fn lead(
    args: &ElectArgs,
    client: &Client,
    claim: &Claim,
    grant: (Grant, Instant),
    signals: &mut Signals,
    session: Option<&Session>,
) -> Led {
    let resource = claim.resource();
    say(format_args!(
        "leading {resource} (fence {}); starting the command",
        grant.0.fence
    ));
    let lease = hold(say, client, claim, grant, session);
    let mut child = match spawn(("elect", say), &args.command, &lease, client, claim.mode()).await {
        Ok(child) => child,
        Err(code) => return Led::Ended(code),
    };
    let lost = loop {
        tokio::select! {
            biased;
            status = child.wait() => {
                say(format_args!("the command ended; handing {resource} over"));
                release(say, &lease).await;
                return Led::Ended(exit_code_of(say, status));
            }
            signal = signals.recv() => {
                if matches!(signal, Signal::SIGTERM | Signal::SIGINT) {
                    // Stop first, then hand over: never two leaders' commands at once.
                    say(format_args!("got {signal}: stopping the command, then handing {resource} over"));
                    let status = terminate(say, &mut child, args.grace, signals).await;
                    release(say, &lease).await;
                    return Led::Ended(exit_code_of(say, status));
                }
                child.signal(signal);
            }
            lost = lease.lost() => break lost,
        }
    };
    let with = if session.is_some() {
        " with its session"
    } else {
        ""
    };
    say(format_args!(
        "lost the lead on {resource}{with}: {lost}; stopping the command (SIGTERM, SIGKILL \
         after {})",
        humantime::format_duration(args.grace)
    ));
    match terminate(say, &mut child, args.grace, signals).await {
        Ok(status) => say(format_args!(
            "the command stopped ({status}); standing again"
        )),
        Err(e) => say(format_args!("cannot wait for the command: {e}")),
    }
    Led::Lost
}

/// One line on stderr, marked as elect's own among the command's output.
fn say(message: fmt::Arguments<'_>) {
    eprintln!("lockbroker elect: {message}");
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        elect: ElectArgs,
    }

    #[test]
    fn elect_is_a_consistent_clap_definition_that_needs_a_key_and_a_command() {
        Cli::command().debug_assert();
        let parsed = Cli::try_parse_from([
            "elect", "k", "--owner", "a", "--ttl", "2s", "--", "sh", "-c", "x",
        ])
        .unwrap()
        .elect;
        assert_eq!(parsed.key, "k");
        assert_eq!(parsed.owner.as_deref(), Some("a"));
        assert_eq!(parsed.ttl, Some(Duration::from_secs(2)));
        assert_eq!(parsed.command, ["sh", "-c", "x"]);
        assert!(Cli::try_parse_from(["elect", "k", "--owner", "a"]).is_err());
        assert!(Cli::try_parse_from(["elect", "--", "true"]).is_err());
    }
}
