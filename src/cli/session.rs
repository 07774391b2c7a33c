//! `lockbroker session open|renew|close|show`: a session for scripts, one API call each. `open`
//! prints the session's id (a secret, like a lease token: whoever has it keeps the session, and
//! every lease taken under it with `acquire --session`), `renew` keeps it alive, `close` ends it
//! and releases every lease under it, `show` tells its owner, end and leases (never its id).
//! With `--json`, one JSON object on stdout, as the other commands print.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use lockbroker_client::{Error, SessionKept, SessionParams, SessionStatus, Token};
use serde::Serialize;

use super::commands::format_epoch_ms;
use super::list::print_table;
use super::{
    BrokerArgs, EXIT_CODES_HELP, closed_stdout_ends_with, error_json, exit, fail, format_ms,
    parse_duration, parse_owner, parse_request_id, parse_token, parse_ttl, print_json,
};

/// `lockbroker session`.
#[derive(Debug, Clone, Args)]
pub(crate) struct SessionArgs {
    #[command(subcommand)]
    pub command: SessionCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub(crate) enum SessionCommand {
    /// Open a session and print its id (a secret: keep it out of logs). Take leases under it
    /// with `acquire --session ID`, keep it alive with `session renew` more often than its
    /// TTL; with no keep-alive for its TTL it ends, and every lease under it with it.
    Open(OpenArgs),
    /// Keep a session alive: it then ends its TTL from now.
    Renew(KeepArgs),
    /// Close a session: it ends, and every lease under it is released at once.
    Close(IdArgs),
    /// Show a session: its owner, TTL, end, lock delay and leases (never its id).
    Show(IdArgs),
}

/// `lockbroker session open` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub(crate) struct OpenArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The session's length, counted from each keep-alive [default: the broker's lease TTL,
    /// 30s unless configured].
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION")]
    pub ttl: Option<Duration>,
    /// How long the keys of a session that ends by expiry stay held after its end, 0s to 60s;
    /// a close or a release has none.
    #[arg(long, default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub lock_delay: Duration,
    /// A label for people, shown for the session and its leases (at most 128 characters).
    #[arg(long, value_parser = parse_owner)]
    pub owner: Option<String>,
    /// Makes the open safe to repeat: while the session it opened lives, an open with the same
    /// id answers that same session (1 to 64 characters from A-Z a-z 0-9 _ -).
    #[arg(long, value_parser = parse_request_id, value_name = "ID")]
    pub request_id: Option<String>,
    /// Print the session (or the error) as one JSON object on stdout, its id as `session`.
    #[arg(long)]
    pub json: bool,
}

/// The session a command works on.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub(crate) struct IdArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The session's id, as `session open` printed it. The environment keeps it out of `ps`.
    #[arg(
        env = "LOCKBROKER_SESSION",
        hide_env_values = true,
        value_parser = parse_token,
        value_name = "ID"
    )]
    pub id: Token,
    /// Print the answer (or the error) as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `lockbroker session renew` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub(crate) struct KeepArgs {
    #[command(flatten)]
    pub session: IdArgs,
    /// A new length for the session, counted from now, which stays its length [default: its
    /// own].
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION")]
    pub ttl: Option<Duration>,
}

/// `lockbroker session ...`.
pub(crate) async fn session(args: SessionArgs) -> ExitCode {
    match args.command {
        SessionCommand::Open(args) => open(args).await,
        SessionCommand::Renew(args) => renew(args).await,
        SessionCommand::Close(args) => close(args).await,
        SessionCommand::Show(args) => show(args).await,
    }
}

/// `session open`: prints the id alone (for `S=$(lockbroker session open)`), or the whole
/// answer as JSON.
async fn open(args: OpenArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    let params = SessionParams {
        ttl: args.ttl,
        lock_delay: Some(args.lock_delay),
        owner: args.owner,
        request_id: args.request_id,
    };
    match client.create_session(&params).await {
        Ok(grant) => {
            if args.json {
                print_json(&grant);
            } else {
                out!("{}", grant.session.as_str());
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail("cannot open a session", &e, args.json),
    }
}

/// `session renew`: prints the session's new end.
async fn renew(args: KeepArgs) -> ExitCode {
    let KeepArgs { session, ttl } = args;
    let client = match session.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    match client.keep_alive(&session.id, ttl).await {
        Ok(kept) => {
            print_kept(&kept, session.json);
            ExitCode::SUCCESS
        }
        Err(e) => fail("cannot keep the session alive", &e, session.json),
    }
}

/// `session close`: exit 4 when the session had ended already (its leases are gone either way).
async fn close(args: IdArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    match client.close_session(&args.id).await {
        Ok(()) => {
            if args.json {
                #[derive(Serialize)]
                struct Closed {
                    closed: bool,
                }
                print_json(&Closed { closed: true });
            } else {
                out!("closed the session; every lease under it is released");
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail("cannot close the session", &e, args.json),
    }
}

/// `session show`: a session that has ended is an answer, as a free lock is for `status`: said
/// on stdout, told by exit 4.
async fn show(args: IdArgs) -> ExitCode {
    closed_stdout_ends_with(0);
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    match client.session(&args.id).await {
        Ok(status) => {
            print_status(&status, args.json);
            ExitCode::SUCCESS
        }
        Err(e @ Error::SessionEnded { .. }) => {
            closed_stdout_ends_with(exit::NOT_HELD);
            if args.json {
                print_json(&error_json(&e));
            } else {
                out!("the session has ended (or never existed)");
            }
            ExitCode::from(exit::NOT_HELD)
        }
        Err(e) => fail("cannot read the session", &e, args.json),
    }
}

fn print_kept(kept: &SessionKept, json: bool) {
    if json {
        return print_json(kept);
    }
    out!("ttl:        {}", format_ms(kept.ttl_ms));
    out!("expires:    {}", format_epoch_ms(kept.expires_at_ms));
}

fn print_status(status: &SessionStatus, json: bool) {
    if json {
        return print_json(status);
    }
    out!("owner:      {}", status.owner.as_deref().unwrap_or("-"));
    out!("ttl:        {}", format_ms(status.ttl_ms));
    out!("expires:    {}", format_epoch_ms(status.expires_at_ms));
    out!("remaining:  {}", format_ms(status.ttl_remaining_ms));
    out!("lock delay: {}", format_ms(status.lock_delay_ms));
    out!("leases:     {}", status.leases.len());
    let rows: Vec<[String; 3]> = status
        .leases
        .iter()
        .map(|lease| {
            let mode = lease
                .mode
                .map_or_else(|| "permit".to_owned(), |m| m.to_string());
            let key = lockbroker_client::Resource {
                space: lease.space,
                key: lease.key.clone(),
            };
            [key.to_string(), mode, lease.fence.to_string()]
        })
        .collect();
    print_table("  ", ["key", "mode", "fence"], &rows);
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        session: SessionArgs,
    }

    #[test]
    fn session_is_a_consistent_clap_definition() {
        Cli::command().debug_assert();
        let parsed = Cli::try_parse_from(["session", "renew", "abc", "--ttl", "2s"]).unwrap();
        let SessionCommand::Renew(renew) = parsed.session.command else {
            panic!("renew parsed as another command");
        };
        assert_eq!(renew.session.id.as_str(), "abc");
        assert_eq!(renew.ttl, Some(Duration::from_secs(2)));
        assert!(Cli::try_parse_from(["session", "show", "a b"]).is_err());
        assert!(Cli::try_parse_from(["session", "open", "--ttl", "0s"]).is_err());
    }
}
