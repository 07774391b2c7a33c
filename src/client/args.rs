//! The client commands' argument parsers (keys, tokens, owners, request ids, durations, TTLs) and
//! the millisecond formatter their output uses.

use std::time::Duration;

use crate::domain::{LockKey, Owner, RequestId, Token};

/// A duration in milliseconds, the way people write them: `30s`, `1m 30s`, `1s 500ms`.
pub fn format_ms(ms: u64) -> String {
    humantime::format_duration(Duration::from_millis(ms)).to_string()
}

/// Parses a human duration (`30s`, `1500ms`, `2m`, `1h 30m`) that is a whole number of
/// milliseconds, the API's unit.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(raw.trim())
        .map_err(|e| format!("{e} (write a duration such as 30s, 1500ms or 2m)"))?;
    if d.subsec_nanos() % 1_000_000 != 0 {
        return Err("durations are whole milliseconds".into());
    }
    Ok(d)
}

/// A lease length: a duration of at least 1 ms.
pub fn parse_ttl(raw: &str) -> Result<Duration, String> {
    let d = parse_duration(raw)?;
    if d.is_zero() {
        return Err("a lease lasts at least 1ms".into());
    }
    Ok(d)
}

/// A lock key, checked here as the broker would, so a typo is a usage error.
pub fn parse_key(raw: &str) -> Result<LockKey, String> {
    LockKey::parse(raw).map_err(|e| e.0)
}

pub fn parse_token(raw: &str) -> Result<Token, String> {
    Token::parse(raw).map_err(|e| e.0)
}

pub fn parse_owner(raw: &str) -> Result<Owner, String> {
    Owner::parse(raw).map_err(|e| e.0)
}

pub fn parse_request_id(raw: &str) -> Result<RequestId, String> {
    RequestId::parse(raw).map_err(|e| e.0)
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
    fn durations_print_the_way_they_are_written() {
        assert_eq!(format_ms(30_000), "30s");
        assert_eq!(format_ms(1_500), "1s 500ms");
    }
}
