//! `lockbroker acquire`, `release`, `renew` and `status`: one API call each, the answer printed
//! for people (`key: value` lines) or, with `--json`, as one JSON object for scripts, and an
//! exit code from [`super::exit`].

use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use clap::Args;
use serde::Serialize;

use super::{
    AcquireParams, BrokerClient, ClientError, ConnectArgs, EXIT_CODES_HELP, Grant, LockStatus,
    exit, format_ms, parse_duration, parse_key, parse_owner, parse_request_id, parse_token,
    parse_ttl,
};
use crate::domain::{LockKey, Owner, RequestId, Token};

/// Where the broker is: shared by every client command.
#[derive(Debug, Clone, Args)]
pub struct BrokerArgs {
    /// The broker (or the load balancer in front of several).
    #[arg(
        long,
        env = "LOCKBROKER_URL",
        default_value = "http://127.0.0.1:8080",
        value_name = "URL"
    )]
    pub url: String,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

impl BrokerArgs {
    /// The client, or exit 1 with the reason the URL, the token or a TLS file is unusable.
    pub fn client(&self) -> Result<BrokerClient, ExitCode> {
        BrokerClient::connect(&self.url, &self.connect).map_err(|why| {
            eprintln!("lockbroker: {why}");
            ExitCode::from(exit::ERROR)
        })
    }
}

/// `lockbroker acquire` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub struct AcquireArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The lock: 1 to 200 characters from A-Z a-z 0-9 . _ - :
    #[arg(value_parser = parse_key)]
    pub key: LockKey,
    /// Lease length (30s, 1500ms, 2m) [default: the broker's, 30s unless configured].
    #[arg(long, value_parser = parse_ttl, value_name = "DURATION")]
    pub ttl: Option<Duration>,
    /// How long to wait while someone else holds the lock; 0s answers at once.
    #[arg(long, default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub wait: Duration,
    /// A label for people, shown by `status` (at most 128 characters).
    #[arg(long, value_parser = parse_owner)]
    pub owner: Option<Owner>,
    /// Makes the acquire safe to repeat: while the lease it produced is held, an acquire with
    /// the same id returns that same lease (1 to 64 characters from A-Z a-z 0-9 _ -; make it
    /// random, since whoever knows it gets the token).
    #[arg(long, value_parser = parse_request_id, value_name = "ID")]
    pub request_id: Option<RequestId>,
    /// Print the grant (or the error) as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `lockbroker release` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The lock.
    #[arg(value_parser = parse_key)]
    pub key: LockKey,
    /// The token the acquire gave. The environment keeps it out of `ps`; `lockbroker run`
    /// sets it for its command.
    #[arg(long, env = "LOCKBROKER_TOKEN", hide_env_values = true, value_parser = parse_token)]
    pub token: Token,
    /// Print the outcome as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `lockbroker renew` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = EXIT_CODES_HELP)]
pub struct RenewArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The lock.
    #[arg(value_parser = parse_key)]
    pub key: LockKey,
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
pub struct StatusArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The lock.
    #[arg(value_parser = parse_key)]
    pub key: LockKey,
    /// Print the state (or the error) as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `lockbroker acquire`: prints the token and the fence.
pub async fn acquire(args: AcquireArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    let params = AcquireParams {
        ttl: args.ttl,
        wait: Some(args.wait),
        owner: args.owner,
        request_id: args.request_id,
    };
    match client.acquire(&args.key, &params).await {
        Ok(grant) => print_grant(&grant, args.json),
        Err(e) => fail(&format!("cannot acquire {}", args.key), &e, args.json),
    }
}

/// `lockbroker release`.
pub async fn release(args: ReleaseArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    match client.release(&args.key, &args.token).await {
        Ok(()) => {
            if args.json {
                #[derive(Serialize)]
                struct Released<'a> {
                    key: &'a str,
                    released: bool,
                }
                print_json(&Released {
                    key: args.key.as_str(),
                    released: true,
                });
            } else {
                println!("released {}", args.key);
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("cannot release {}", args.key), &e, args.json),
    }
}

/// `lockbroker renew`: prints the grant again, with its new expiry.
pub async fn renew(args: RenewArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    match client.renew(&args.key, &args.token, args.ttl).await {
        Ok(grant) => print_grant(&grant, args.json),
        Err(e) => fail(&format!("cannot renew {}", args.key), &e, args.json),
    }
}

/// `lockbroker status`: who holds the lock and until when; exit 4 when nobody does.
pub async fn status(args: StatusArgs) -> ExitCode {
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    match client.status(&args.key).await {
        Ok(status) => {
            print_status(&status, args.json);
            ExitCode::SUCCESS
        }
        // A free lock is an answer, not a failure: said on stdout, told by the exit code.
        Err(ClientError::NotHeld) => {
            if args.json {
                print_json(&ClientError::NotHeld.to_json());
            } else {
                println!("{} is not held", args.key);
            }
            ExitCode::from(exit::NOT_HELD)
        }
        Err(e) => fail(&format!("cannot read {}", args.key), &e, args.json),
    }
}

fn print_grant(grant: &Grant, json: bool) -> ExitCode {
    if json {
        print_json(grant);
    } else {
        println!("key:     {}", grant.key);
        println!("token:   {}", grant.token);
        println!("fence:   {}", grant.fence);
        println!("ttl:     {}", format_ms(grant.ttl_ms));
        println!("expires: {}", format_epoch_ms(grant.expires_at_ms));
    }
    ExitCode::SUCCESS
}

fn print_status(status: &LockStatus, json: bool) {
    if json {
        print_json(status);
    } else {
        println!("key:       {}", status.key);
        println!("fence:     {}", status.fence);
        println!("owner:     {}", status.owner.as_deref().unwrap_or("-"));
        println!("expires:   {}", format_epoch_ms(status.expires_at_ms));
        println!("remaining: {}", format_ms(status.ttl_remaining_ms));
    }
}

/// Reports an error on stderr (and as JSON on stdout with `--json`); returns its exit code.
fn fail(doing: &str, e: &ClientError, json: bool) -> ExitCode {
    eprintln!("lockbroker: {doing}: {e}");
    if json {
        print_json(&e.to_json());
    }
    ExitCode::from(e.exit_code())
}

fn print_json(value: &impl Serialize) {
    println!(
        "{}",
        serde_json::to_string(value).expect("plain structs always serialize")
    );
}

/// An epoch-milliseconds time as RFC 3339 UTC (`2026-01-31T12:00:00.000Z`).
fn format_epoch_ms(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}
