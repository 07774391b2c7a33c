//! The command line's client side, part of the binary and not of the server library: the
//! `acquire`, `release`, `renew` and `status` commands ([`commands`]), `list` ([`list`]),
//! `lockbroker run` ([`run`]), which holds a lock (or a shared lease, or a semaphore's permit)
//! for as long as a command runs, and `lockbroker bench` ([`bench`]), a load generator that
//! measures a running broker. Their HTTP calls go through the `lockbroker-client` crate; only
//! the bench's direct-Redis phases use the server library, through its public API.
//!
//! This module owns what the commands share: how to reach the broker ([`BrokerArgs`]), the exit
//! codes ([`exit`]) so that a shell script can branch on "held by someone else" apart from
//! "something went wrong", and stdout that a closed pipe ends quietly ([`out!`]).

/// `println!` for the commands' output, except that a reader gone (a closed pipe, as in
/// `lockbroker list | head -1`) ends the process quietly instead of panicking: with the status
/// the command said it ends with ([`closed_stdout_ends_with`]: 0 for a listing or a status,
/// whose reader took what it wanted), else [`exit::BROKEN_PIPE`], as a program killed by
/// SIGPIPE does (an acquire's token that nobody read).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_line(format_args!($($arg)*))
    };
}
pub(crate) use out;

mod args;
pub mod bench;
pub mod commands;
#[cfg(unix)]
pub mod elect;
pub mod follow;
pub mod list;
#[cfg(unix)]
pub mod run;
#[cfg(unix)]
pub mod supervise;

use std::fmt;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU8, Ordering};

use clap::Args;
use lockbroker_client::{Client, Error};
use serde::Serialize;

pub use self::args::{
    ClaimArgs, TargetArgs, format_ms, parse_duration, parse_key, parse_limit, parse_owner,
    parse_prefix, parse_request_id, parse_token, parse_ttl,
};

/// The exit codes of the client commands. `--help` of each command lists them (see
/// [`EXIT_CODES_HELP`]).
pub mod exit {
    /// Done.
    #[allow(dead_code)] // The table's first row: `ExitCode::SUCCESS` says it in code.
    pub const OK: u8 = 0;
    /// An error: the broker could not be reached, refused the request (400, 403, a semaphore's
    /// `limit_mismatch`), answered 5xx, or answered something unexpected.
    pub const ERROR: u8 = 1;
    /// A usage error, from clap: unknown flag, missing argument, or a value that can never be
    /// valid (a bad key, duration, owner or request id).
    #[allow(dead_code)] // Said by clap itself.
    pub const USAGE: u8 = 2;
    /// Someone else holds the lock, or every permit of the semaphore is taken, and the wait ran
    /// out (`acquire`, `run`).
    pub const LOCKED: u8 = 3;
    /// Nobody holds the lock with this token: `release` and `renew` of a lease that ended or
    /// was taken over (`not_held`, `not_owner`), `status` of a free lock or semaphore, and
    /// `release --force` of one.
    pub const NOT_HELD: u8 = 4;
    /// `run` only: the lease was lost while the command ran, and the command was stopped.
    pub const LEASE_LOST: u8 = 5;
    /// `run` only: the command was found but could not be started (as a shell does).
    pub const CANNOT_EXECUTE: u8 = 126;
    /// `run` only: the command was not found (as a shell does).
    pub const NOT_FOUND: u8 = 127;
    /// Stdout was closed before output that had to be read was written (the grant of
    /// `lockbroker acquire --json | …` whose reader left): 128 + SIGPIPE, what a shell reports
    /// for a program that SIGPIPE ended. A listing or a status whose reader leaves early
    /// (`lockbroker list --json | head -1`) ends with its own status instead.
    pub const BROKEN_PIPE: u8 = 141;
}

/// The exit-code table shown at the end of each client command's `--help`.
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0    done
  1    error: broker unreachable, request refused (400, 403, limit_mismatch), 5xx,
       unexpected answer
  2    usage error (bad flag, key, duration, owner, request id or limit)
  3    locked: someone else holds the lock (every permit of the semaphore is taken) and
       the wait ran out
  4    not held: the lock or semaphore is free, or this token no longer holds it
       (not_held, not_owner)";

/// The exit-code table at the end of `lockbroker run --help`.
pub const RUN_EXIT_CODES_HELP: &str = "\
Exit codes:
  N      the command ran and exited with status N (0 included)
  128+S  the command died of signal S (143 for SIGTERM)
  1      error before the command started: broker unreachable, request refused (400,
         403, limit_mismatch: the semaphore's holders use another --limit), 5xx
  2      usage error (bad flag, key, duration, owner or limit; no command after --)
  3      locked: someone else holds the lock (every permit of the semaphore is taken) and
         the wait ran out; the command did not run
  5      the lease was lost while the command ran (a renewal answered not_held or
         not_owner, or the broker stayed unreachable until the lease ended); the command
         got SIGTERM, then SIGKILL after --grace
  126    the command could not be started
  127    the command was not found
A command's own statuses 1, 3 and 5 look the same as run's; a job that must tell them apart
should not exit with those.";

/// How to reach a broker beyond its URL: a bearer token for a broker with an auth file, and the
/// TLS files for an `https://` one. Shared by every client command and `bench`. `Debug` shows no
/// token.
#[derive(Clone, Default, Args)]
pub struct ConnectArgs {
    /// Bearer token, for a broker with an auth file (sent as `Authorization: Bearer`). The
    /// environment keeps it out of `ps`. (`--token` is the lock's own token.)
    #[arg(
        long,
        env = lockbroker_client::AUTH_TOKEN_ENV,
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub auth_token: Option<String>,
    /// CA certificate (PEM) to trust for an https:// broker, besides the system's roots.
    #[arg(long, env = "LOCKBROKER_CACERT", value_name = "FILE")]
    pub cacert: Option<PathBuf>,
    /// Client certificate (PEM), for a broker that requires one (mutual TLS); with
    /// --client-key.
    #[arg(long, env = "LOCKBROKER_CLIENT_CERT", value_name = "FILE")]
    pub client_cert: Option<PathBuf>,
    /// The private key (PEM) of --client-cert.
    #[arg(long, env = "LOCKBROKER_CLIENT_KEY", value_name = "FILE")]
    pub client_key: Option<PathBuf>,
}

impl fmt::Debug for ConnectArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectArgs")
            .field("auth_token", &self.auth_token.as_ref().map(|_| "***"))
            .field("cacert", &self.cacert)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .finish()
    }
}

impl ConnectArgs {
    /// `builder` with the bearer token as a default header (marked sensitive) and the TLS
    /// files. Errors say which file or value is unusable.
    pub fn apply(&self, builder: reqwest::ClientBuilder) -> Result<reqwest::ClientBuilder, String> {
        let mut builder = builder;
        if let Some(token) = &self.auth_token {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| "--auth-token must be printable ASCII".to_owned())?;
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path).map_err(|e| format!("cannot read {what} {}: {e}", path.display()))
        };
        if let Some(path) = &self.cacert {
            let pem = read(path, "--cacert")?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("--cacert {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!(
                    "--cacert {}: no PEM certificate in it",
                    path.display()
                ));
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        match (&self.client_cert, &self.client_key) {
            (None, None) => {}
            (Some(cert), Some(key)) => {
                let mut pem = read(cert, "--client-cert")?;
                pem.push(b'\n');
                pem.extend(read(key, "--client-key")?);
                let identity = reqwest::Identity::from_pem(&pem)
                    .map_err(|e| format!("--client-cert and --client-key: {e}"))?;
                builder = builder.identity(identity);
            }
            _ => return Err("--client-cert and --client-key go together".to_owned()),
        }
        Ok(builder)
    }
}

impl ConnectArgs {
    /// A client for the broker at `url` with these settings; the reason it cannot be made
    /// otherwise (the URL, the token or a TLS file).
    pub fn client(&self, url: &str) -> Result<Client, String> {
        let builder = Client::builder(url).map_err(|e| e.0)?;
        let http = self.apply(reqwest::Client::builder())?;
        builder.http(http).build().map_err(|e| e.0)
    }
}

/// Where the broker is: shared by every client command.
#[derive(Debug, Clone, Args)]
pub struct BrokerArgs {
    /// The broker (or the load balancer in front of several).
    #[arg(
        long,
        env = lockbroker_client::URL_ENV,
        default_value = lockbroker_client::DEFAULT_URL,
        value_name = "URL"
    )]
    pub url: String,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

impl BrokerArgs {
    /// The client, or exit 1 with the reason the URL, the token or a TLS file is unusable.
    pub fn client(&self) -> Result<Client, ExitCode> {
        self.connect.client(&self.url).map_err(|why| {
            eprintln!("lockbroker: {why}");
            ExitCode::from(exit::ERROR)
        })
    }
}

/// The exit code a command ends with after `e`.
pub fn exit_code(e: &Error) -> u8 {
    match e {
        Error::Locked { .. } => exit::LOCKED,
        Error::NotHeld { .. } | Error::NotOwner { .. } => exit::NOT_HELD,
        _ => exit::ERROR,
    }
}

/// `e` as one JSON object in the API's format, for `--json`.
pub fn error_json(e: &Error) -> serde_json::Value {
    let mut body = serde_json::json!({ "error": e.code(), "message": e.to_string() });
    match e {
        Error::Locked {
            retry_after_ms: Some(ms),
            ..
        } => body["retry_after_ms"] = (*ms).into(),
        Error::LimitMismatch {
            limit: Some(limit), ..
        } => body["limit"] = (*limit).into(),
        _ => {}
    }
    body
}

/// Reports an error on stderr (and as JSON on stdout with `--json`); returns its exit code.
pub fn fail(doing: &str, e: &Error, json: bool) -> ExitCode {
    eprintln!("lockbroker: {doing}: {e}");
    closed_stdout_ends_with(exit_code(e));
    if json {
        print_json(&error_json(e));
    }
    ExitCode::from(exit_code(e))
}

/// What `status` and `release --force` say of a lock or semaphore nobody holds.
pub fn not_held(resource: &lockbroker_client::Resource, json: bool) {
    closed_stdout_ends_with(exit::NOT_HELD);
    if json {
        print_json(&error_json(&Error::NotHeld {
            space: resource.space,
        }));
    } else {
        out!("{resource} is not held");
    }
}

/// One JSON object on a line of stdout.
pub fn print_json(value: &impl Serialize) {
    out!(
        "{}",
        serde_json::to_string(value).expect("plain structs always serialize")
    );
}

/// The status a closed stdout ends the process with; see [`closed_stdout_ends_with`].
static CLOSED_STDOUT_EXIT: AtomicU8 = AtomicU8::new(exit::BROKEN_PIPE);

/// Says the status the command ends with, for a reader that closes stdout before the command
/// has written all it prints: a listing or a status is an answer that its reader may cut short
/// (`lockbroker list --json | head -1` ends with 0, as the table form does when the pipe took
/// all of it), and a failure ends with its own exit code. Until a command says, a closed stdout
/// ends it with [`exit::BROKEN_PIPE`].
pub fn closed_stdout_ends_with(code: u8) {
    CLOSED_STDOUT_EXIT.store(code, Ordering::Relaxed);
}

/// One line on stdout; see [`out!`].
pub fn write_line(line: fmt::Arguments<'_>) {
    let mut stdout = io::stdout().lock();
    let written = stdout
        .write_fmt(line)
        .and_then(|()| stdout.write_all(b"\n"));
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
            std::process::exit(CLOSED_STDOUT_EXIT.load(Ordering::Relaxed).into())
        }
        Err(e) => {
            eprintln!("lockbroker: cannot write to stdout: {e}");
            std::process::exit(exit::ERROR.into());
        }
    }
}

#[cfg(test)]
mod tests {
    use lockbroker_client::Space;
    use reqwest::StatusCode;

    use super::*;

    #[test]
    fn each_outcome_has_its_exit_code() {
        for space in [Space::Locks, Space::Semaphores] {
            let locked = Error::Locked {
                space,
                retry_after_ms: None,
            };
            assert_eq!(exit_code(&locked), exit::LOCKED);
            assert_eq!(exit_code(&Error::NotHeld { space }), exit::NOT_HELD);
            assert_eq!(exit_code(&Error::NotOwner { space }), exit::NOT_HELD);
        }
        let mismatch = Error::LimitMismatch {
            limit: Some(3),
            message: "limit 3 in use".into(),
        };
        assert_eq!(exit_code(&mismatch), exit::ERROR);
        let unavailable = Error::Api {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "store_unavailable".into(),
            message: "down".into(),
            retry_after: None,
            url: "http://h:1/locks/k".into(),
        };
        assert_eq!(exit_code(&unavailable), exit::ERROR);
    }

    #[test]
    fn errors_print_as_the_apis_json_with_their_extra_fields() {
        let locked = Error::Locked {
            space: Space::Semaphores,
            retry_after_ms: Some(1500),
        };
        assert_eq!(error_json(&locked)["retry_after_ms"], 1500);
        assert_eq!(error_json(&locked)["error"], "locked");
        let told = Error::LimitMismatch {
            limit: Some(3),
            message: "The semaphore is held with limit 3.".into(),
        };
        assert_eq!(
            error_json(&told),
            serde_json::json!({"error": "limit_mismatch", "message": told.to_string(), "limit": 3})
        );
        let untold = Error::LimitMismatch {
            limit: None,
            message: "Another limit is in use.".into(),
        };
        assert!(error_json(&untold).get("limit").is_none());
    }
}
