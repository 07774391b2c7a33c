//! The client commands' argument parsers (keys, prefixes, tokens, owners, request ids,
//! durations, TTLs, semaphore limits), the arguments that name what a command works on (a lock or
//! a semaphore: [`TargetArgs`], and for an acquire the kind of lease too: [`ClaimArgs`]), and the
//! millisecond formatter their output uses.

use std::time::Duration;

use clap::{ArgGroup, Args};

pub(super) use lockbroker_cli_support::parse_limit;
use lockbroker_client::{Claim, Resource, Token};

use lockbroker::domain::{LockKey, Owner, RequestId};

/// What `release`, `renew` and `status` work on: a lock by its KEY, or `--semaphore NAME`;
/// exactly one of the two.
#[derive(Debug, Clone, Args)]
#[group(skip)]
#[command(group(ArgGroup::new("target").args(["key", "semaphore"]).required(true)))]
pub(crate) struct TargetArgs {
    /// The lock: 1 to 200 characters from A-Z a-z 0-9 . _ - :
    #[arg(value_parser = parse_key)]
    pub key: Option<String>,
    /// A semaphore instead of a lock (semaphores and locks are separate names).
    #[arg(long, value_name = "NAME", value_parser = parse_key)]
    pub semaphore: Option<String>,
}

impl TargetArgs {
    /// The lock or semaphore named.
    pub(crate) fn resource(&self) -> Resource {
        match (&self.key, &self.semaphore) {
            (Some(key), None) => Resource::lock(key.clone()),
            (None, Some(name)) => Resource::semaphore(name.clone()),
            _ => unreachable!("clap requires exactly one of KEY and --semaphore"),
        }
    }
}

/// What `acquire` and `run` take: an exclusive lease on a lock by its KEY, a shared one with
/// `--shared`, or one permit of `--semaphore NAME --limit N`.
#[derive(Debug, Clone, Args)]
#[group(skip)]
#[command(group(ArgGroup::new("target").args(["key", "semaphore"]).required(true)))]
pub(crate) struct ClaimArgs {
    /// The lock: 1 to 200 characters from A-Z a-z 0-9 . _ - :
    #[arg(value_parser = parse_key)]
    pub key: Option<String>,
    /// Take a shared (read) lease: held together with other shared leases, never with an
    /// exclusive one.
    #[arg(long, conflicts_with = "semaphore")]
    pub shared: bool,
    /// Take one permit of this semaphore instead of a lock (with --limit).
    #[arg(long, value_name = "NAME", value_parser = parse_key, requires = "limit")]
    pub semaphore: Option<String>,
    /// How many permits the semaphore has, 1 to 10000; every holder must give the same.
    // `conflicts_with` as well as `requires`: clap lets a required argument go missing when
    // it conflicts with one given, and --semaphore conflicts with KEY.
    #[arg(
        long,
        value_name = "N",
        value_parser = parse_limit,
        requires = "semaphore",
        conflicts_with = "key"
    )]
    pub limit: Option<u32>,
}

impl ClaimArgs {
    /// The lease asked for.
    pub(crate) fn claim(&self) -> Claim {
        match (&self.key, &self.semaphore, self.limit) {
            (Some(key), None, None) if self.shared => Claim::Shared(key.clone()),
            (Some(key), None, None) => Claim::Exclusive(key.clone()),
            (None, Some(name), Some(limit)) => Claim::Permit {
                semaphore: name.clone(),
                limit,
            },
            _ => unreachable!("clap requires KEY, or --semaphore with --limit"),
        }
    }
}

pub(crate) use lockbroker_client::format_ms;

/// Parses a human duration (`30s`, `1500ms`, `2m`, `1h 30m`) that is a whole number of
/// milliseconds, the API's unit.
pub(crate) fn parse_duration(raw: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(raw.trim())
        .map_err(|e| format!("{e} (write a duration such as 30s, 1500ms or 2m)"))?;
    if d.subsec_nanos() % 1_000_000 != 0 {
        return Err("durations are whole milliseconds".into());
    }
    Ok(d)
}

/// A lease length: a duration of at least 1 ms.
pub(crate) fn parse_ttl(raw: &str) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    if d.is_zero() {
        return Err("a lease lasts at least 1ms".into());
    }
    Ok(d)
}

/// A lock key, checked here as the broker would, so a typo is a usage error.
pub(crate) fn parse_key(raw: &str) -> Result<String, String> {
    LockKey::parse(raw)
        .map(|key| key.as_str().to_owned())
        .map_err(|e| e.0)
}

/// The start of a key, for `list`: empty, or what could begin a key.
pub(crate) fn parse_prefix(raw: &str) -> Result<String, String> {
    if raw.is_empty() {
        return Ok(String::new());
    }
    LockKey::parse(raw)
        .map(|key| key.as_str().to_owned())
        .map_err(|e| format!("a prefix is the start of a key: {}", e.0))
}

/// A lease's token, checked as the broker would.
pub(crate) fn parse_token(raw: &str) -> Result<Token, String> {
    lockbroker::domain::Token::parse(raw)
        .map(|token| Token::new(token.as_str()))
        .map_err(|e| e.0)
}

/// An owner label: at most 128 characters, no control characters.
pub(crate) fn parse_owner(raw: &str) -> Result<String, String> {
    Owner::parse(raw)
        .map(|owner| owner.as_str().to_owned())
        .map_err(|e| e.0)
}

/// A request id: 1 to 64 characters from A-Z a-z 0-9 _ -.
pub(crate) fn parse_request_id(raw: &str) -> Result<String, String> {
    RequestId::parse(raw)
        .map(|id| id.as_str().to_owned())
        .map_err(|e| e.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_read_the_way_people_write_them() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1m 30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn durations_without_a_unit_or_finer_than_a_millisecond_are_refused() {
        assert!(
            parse_duration("30")
                .unwrap_err()
                .contains("30s, 1500ms or 2m")
        );
        assert!(parse_duration("1500us").is_err());
        assert!(parse_duration("soon").is_err());
        assert!(parse_ttl("0s").is_err());
        assert_eq!(parse_ttl("1ms"), Ok(Duration::from_millis(1)));
    }

    #[test]
    fn limits_are_1_to_10000_and_prefixes_the_start_of_a_key() {
        assert_eq!(parse_limit("1"), Ok(1));
        assert_eq!(parse_limit("10000"), Ok(10_000));
        for bad in ["0", "10001", "-1", "four", ""] {
            assert!(
                parse_limit(bad).unwrap_err().contains("1 to 10000"),
                "{bad}"
            );
        }
        assert_eq!(parse_prefix(""), Ok(String::new()));
        assert_eq!(parse_prefix("orders:"), Ok("orders:".to_owned()));
        assert!(parse_prefix("a b").unwrap_err().contains("start of a key"));
    }

    #[test]
    fn durations_print_the_way_they_are_written() {
        assert_eq!(format_ms(30_000), "30s");
        assert_eq!(format_ms(1_500), "1s 500ms");
    }
}
