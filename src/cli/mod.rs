//! The command line's client side, part of the binary and not of the server library: the
//! `acquire`, `release`, `renew` and `status` commands ([`commands`]), `list` ([`list`]),
//! `lockbroker run` ([`run`]), which holds a lock (or a shared lease, or a semaphore's permit)
//! for as long as a command runs, and `lockbroker elect` ([`elect`]). Their HTTP calls go
//! through the `lockbroker-client` crate. The benchmark is a program of its own
//! (`lockbroker-bench`, in `bench/`).
//!
//! This module owns what the commands share: how to reach the broker ([`BrokerArgs`]), the
//! exit-code tables of their `--help`, and errors as the API's JSON. The token and TLS flags
//! ([`ConnectArgs`]), the exit codes ([`exit`]) so that a shell script can branch on "held by
//! someone else" apart from "something went wrong", and stdout that a closed pipe ends quietly
//! (`out!`) come from `lockbroker-cli-support`, which lockbroker-bench shares.

mod args;
pub(crate) mod commands;
#[cfg(unix)]
pub(crate) mod elect;
pub(crate) mod follow;
mod holding;
pub(crate) mod list;
#[cfg(unix)]
pub(crate) mod run;
pub(crate) mod session;
#[cfg(unix)]
pub(crate) mod supervise;

use std::process::ExitCode;

use clap::Args;
pub(crate) use lockbroker_cli_support::{ConnectArgs, closed_stdout_ends_with, exit};
use lockbroker_client::{Client, Error};
use serde::Serialize;

pub(crate) use self::args::{
    ClaimArgs, TargetArgs, format_ms, parse_duration, parse_key, parse_owner, parse_prefix,
    parse_request_id, parse_token, parse_ttl,
};

/// The exit-code table shown at the end of each client command's `--help`.
pub(crate) const EXIT_CODES_HELP: &str = "\
Exit codes:
  0    done
  1    error: broker unreachable, request refused (400, 403, limit_mismatch), 5xx,
       unexpected answer
  2    usage error (bad flag, key, duration, owner, request id or limit)
  3    locked: someone else holds the lock (every permit of the semaphore is taken) and
       the wait ran out
  4    not held: the lock or semaphore is free, or this token no longer holds it
       (not_held, not_owner); or the session has ended (not_held, no_session)";

/// The exit-code table at the end of `lockbroker run --help`.
pub(crate) const RUN_EXIT_CODES_HELP: &str = "\
Exit codes:
  N      the command ran and exited with status N (0 included)
  128+S  the command died of signal S (143 for SIGTERM)
  1      error before the command started: broker unreachable, request refused (400,
         403, limit_mismatch: the semaphore's holders use another --limit), 5xx
  2      usage error (bad flag, key, duration, owner or limit; no command after --)
  3      locked: someone else holds the lock (every permit of the semaphore is taken) and
         the wait ran out; the command did not run
  5      the lease was lost while the command ran (a renewal, or with --session-ttl the
         session's keep-alive, answered not_held or not_owner, or the broker stayed
         unreachable until it ended); the command got SIGTERM, then SIGKILL after --grace
  126    the command could not be started
  127    the command was not found
A command's own statuses 1, 3 and 5 look the same as run's; a job that must tell them apart
should not exit with those.";

/// Where the broker is: shared by every client command.
#[derive(Debug, Clone, Args)]
pub(crate) struct BrokerArgs {
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
    pub(crate) fn client(&self) -> Result<Client, ExitCode> {
        self.connect.client(&self.url).map_err(|why| {
            eprintln!("lockbroker: {why}");
            ExitCode::from(exit::ERROR)
        })
    }
}

/// The exit code a command ends with after `e`.
pub(crate) fn exit_code(e: &Error) -> u8 {
    match e {
        Error::Locked { .. } => exit::LOCKED,
        Error::NotHeld { .. } | Error::NotOwner { .. } | Error::SessionEnded { .. } => {
            exit::NOT_HELD
        }
        _ => exit::ERROR,
    }
}

/// `e` as one JSON object in the API's format, for `--json`.
pub(crate) fn error_json(e: &Error) -> serde_json::Value {
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
pub(crate) fn fail(doing: &str, e: &Error, json: bool) -> ExitCode {
    eprintln!("lockbroker: {doing}: {e}");
    closed_stdout_ends_with(exit_code(e));
    if json {
        print_json(&error_json(e));
    }
    ExitCode::from(exit_code(e))
}

/// What `status` and `release --force` say of a lock or semaphore nobody holds.
pub(crate) fn not_held(resource: &lockbroker_client::Resource, json: bool) {
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
pub(crate) fn print_json(value: &impl Serialize) {
    out!(
        "{}",
        serde_json::to_string(value).expect("plain structs always serialize")
    );
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
                held: Vec::new(),
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
            held: Vec::new(),
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
