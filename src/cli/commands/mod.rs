//! `lockbroker acquire`, `release`, `renew` and `status`: one API call each, on a lock (an
//! exclusive or shared lease) or a semaphore, the answer printed for people (`key: value` lines)
//! or, with `--json`, as one JSON object for scripts, and an exit code from [`super::exit`].

use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use clap::Args;
use lockbroker_client::{
    AcquireParams, Claim, Error, Grant, Holder, LockMode, LockStatus, SemaphoreStatus, Space,
};
use serde::Serialize;

use super::list::print_table;
use super::{
    BrokerArgs, ClaimArgs, EXIT_CODES_HELP, TargetArgs, error_json, exit, exit_code, fail,
    format_ms, not_held, parse_duration, parse_owner, parse_request_id, parse_token, parse_ttl,
    print_json,
};
use lockbroker_client::Token;

/// `lockbroker acquire` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub(crate) struct AcquireArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub target: ClaimArgs,
    /// Lease length (30s, 1500ms, 2m) [default: the broker's, 30s unless configured].
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION")]
    pub ttl: Option<Duration>,
    /// How long to wait while someone else holds the lock (or every permit is taken); 0s
    /// answers at once.
    #[arg(long, default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub wait: Duration,
    /// A label for people, shown by `status` (at most 128 characters).
    #[arg(long, value_parser = parse_owner)]
    pub owner: Option<String>,
    /// Makes the acquire safe to repeat: while the lease it produced is held, an acquire with
    /// the same id returns that same lease (1 to 64 characters from A-Z a-z 0-9 _ -; make it
    /// random, since whoever knows it gets the token).
    #[arg(long, value_parser = parse_request_id, value_name = "ID")]
    pub request_id: Option<String>,
    /// Take the lease under this session (the id `session open` printed): it lives as long as
    /// the session, kept by its keep-alives (`session renew`). Not with --ttl.
    #[arg(long, value_parser = parse_token, value_name = "ID", conflicts_with = "ttl")]
    pub session: Option<Token>,
    /// Print the grant (or the error) as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `lockbroker release` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub(crate) struct ReleaseArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub target: TargetArgs,
    /// The token the acquire gave. The environment keeps it out of `ps`; `lockbroker run`
    /// sets it for its command.
    #[arg(
        long,
        env = "LOCKBROKER_TOKEN",
        hide_env_values = true,
        value_parser = parse_token,
        required_unless_present = "force"
    )]
    pub token: Option<Token>,
    /// End every lease on the lock (every permit of the semaphore) without a token; a token
    /// given is not sent. The broker allows it to an admin --auth-token, or, without an auth
    /// file, only when it runs with --allow-force-release.
    #[arg(long)]
    pub force: bool,
    /// Print the outcome as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `lockbroker renew` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub(crate) struct RenewArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub target: TargetArgs,
    /// The token the acquire gave (see `release --help`).
    #[arg(long, env = "LOCKBROKER_TOKEN", hide_env_values = true, value_parser = parse_token)]
    pub token: Token,
    /// New lease length, counted from now [default: the broker's, 30s unless configured].
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION")]
    pub ttl: Option<Duration>,
    /// Print the grant (or the error) as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `lockbroker status` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub target: TargetArgs,
    /// Print the state (or the error) as one JSON object on stdout; with --watch, one per
    /// line, each with `held` and `seen_at_ms`.
    #[arg(long)]
    pub json: bool,
    /// Keep watching: print the state now, then every change (holder, fence, owner) as it
    /// happens, one line each, until interrupted.
    #[arg(long)]
    pub watch: bool,
}

/// `lockbroker acquire`: prints the token and the fence.
pub(crate) async fn acquire(args: AcquireArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    let claim = args.target.claim();
    let params = AcquireParams {
        ttl: args.ttl,
        wait: Some(args.wait),
        owner: args.owner,
        request_id: args.request_id,
        session: args.session,
    };
    match client.grant(&claim, &params).await {
        Ok(grant) => print_grant(&grant, Some(&claim), args.json),
        Err(e) => fail(
            &format!("cannot acquire {}", claim.resource()),
            &e,
            args.json,
        ),
    }
}

/// `lockbroker release`, and with `--force` the release of every lease without a token.
pub(crate) async fn release(args: ReleaseArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    let resource = args.target.resource();
    let released = if args.force {
        client.force_release(&resource).await
    } else {
        let token = args
            .token
            .as_ref()
            .expect("clap requires --token without --force");
        client.release(&resource, token).await
    };
    match released {
        Ok(()) => {
            if args.json {
                #[derive(Serialize)]
                struct Released<'a> {
                    key: &'a str,
                    released: bool,
                    #[serde(skip_serializing_if = "std::ops::Not::not")]
                    forced: bool,
                }
                print_json(&Released {
                    key: resource.key.as_str(),
                    released: true,
                    forced: args.force,
                });
            } else if args.force {
                out!("released {resource} (forced: every lease on it ended)");
            } else {
                out!("released {resource}");
            }
            ExitCode::SUCCESS
        }
        // Nothing to end: an answer, as for `status`.
        Err(Error::NotHeld { .. }) if args.force => {
            not_held(&resource, args.json);
            ExitCode::from(exit::NOT_HELD)
        }
        Err(e) if args.force && e.code() == "forbidden" => {
            eprintln!(
                "lockbroker: cannot force the release of {resource}: {e}\n\
                 lockbroker: a force release needs an --auth-token with the admin permission, or, \
                 on a broker without an auth file, a broker started with --allow-force-release"
            );
            if args.json {
                print_json(&error_json(&e));
            }
            ExitCode::from(exit_code(&e))
        }
        Err(e) => fail(&format!("cannot release {resource}"), &e, args.json),
    }
}

/// `lockbroker renew`: prints the grant again, with its new expiry.
pub(crate) async fn renew(args: RenewArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    let resource = args.target.resource();
    match client.renew(&resource, &args.token, args.ttl).await {
        Ok(grant) => print_grant(&grant, None, args.json),
        Err(e) => fail(&format!("cannot renew {resource}"), &e, args.json),
    }
}

/// `lockbroker status`: who holds the lock (or the semaphore's permits) and until when; exit 4
/// when nobody does. (`status --watch` is `follow::follow`.)
pub(crate) async fn status(args: StatusArgs) -> ExitCode {
    // A reader that stops reading (`| head -1`) took what it wanted.
    super::closed_stdout_ends_with(0);
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    let resource = args.target.resource();
    let shown = match resource.space {
        Space::Locks => client
            .status(&resource.key)
            .await
            .map(|status| print_status(&status, args.json)),
        Space::Semaphores => client
            .semaphore_status(&resource.key)
            .await
            .map(|status| print_semaphore_status(&status, args.json)),
    };
    match shown {
        Ok(()) => ExitCode::SUCCESS,
        // A free lock is an answer, not a failure: said on stdout, told by the exit code.
        Err(Error::NotHeld { .. }) => {
            not_held(&resource, args.json);
            ExitCode::from(exit::NOT_HELD)
        }
        Err(e) => fail(&format!("cannot read {resource}"), &e, args.json),
    }
}

/// The grant as `key: value` lines, or one JSON object. On an acquire, `claim` adds a line for
/// a shared lease (the grant itself does not say); a semaphore's grant shows its limit.
fn print_grant(grant: &Grant, claim: Option<&Claim>, json: bool) -> ExitCode {
    if json {
        print_json(grant);
    } else {
        out!("key:     {}", grant.key);
        if let Some(Claim::Shared(_)) = claim {
            out!("mode:    shared");
        }
        if let Some(limit) = grant.limit {
            out!("limit:   {limit}");
        }
        out!("token:   {}", grant.token.as_str());
        out!("fence:   {}", grant.fence);
        out!("ttl:     {}", format_ms(grant.ttl_ms));
        out!("expires: {}", format_epoch_ms(grant.expires_at_ms));
    }
    ExitCode::SUCCESS
}

fn print_status(status: &LockStatus, json: bool) {
    if json {
        print_json(status);
        return;
    }
    out!("key:       {}", status.key);
    out!("mode:      {}", status.mode);
    out!("fence:     {}", status.fence);
    // A shared lock's owners are its holders', listed below.
    if status.mode == LockMode::Exclusive {
        out!("owner:     {}", status.owner.as_deref().unwrap_or("-"));
    }
    if status.session {
        out!("session:   yes (the lease lives as long as its session)");
    }
    out!("expires:   {}", format_epoch_ms(status.expires_at_ms));
    out!("remaining: {}", format_ms(status.ttl_remaining_ms));
    if let Some(holders) = &status.holders {
        print_holders(holders);
    }
}

fn print_semaphore_status(status: &SemaphoreStatus, json: bool) {
    if json {
        print_json(status);
        return;
    }
    out!("semaphore: {}", status.key);
    out!("limit:     {}", status.limit);
    print_holders(&status.holders);
}

/// `holders: N`, then one line each: fence, expiry, time left and owner.
fn print_holders(holders: &[Holder]) {
    out!("holders:   {}", holders.len());
    let rows: Vec<[String; 4]> = holders
        .iter()
        .map(|h| {
            [
                h.fence.to_string(),
                format_epoch_ms(h.expires_at_ms),
                format_ms(h.ttl_remaining_ms),
                h.owner.clone().unwrap_or_else(|| "-".to_owned()),
            ]
        })
        .collect();
    print_table("  ", ["fence", "expires", "remaining", "owner"], &rows);
}

/// An epoch-milliseconds time as RFC 3339 UTC (`2026-01-31T12:00:00.000Z`).
pub(crate) fn format_epoch_ms(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

#[cfg(test)]
mod tests;
