//! The configuration's layering, parsing and validation.

use super::*;

#[test]
fn flags_beat_the_file_which_beats_the_defaults() {
    let file: Settings =
        toml::from_str("listen = \"127.0.0.1:9000\"\ndefault_ttl_ms = 5000\nmax_wait_ms = 1000\n")
            .unwrap();
    let args = Settings {
        listen: Some("127.0.0.1:9100".into()),
        ..Settings::default()
    };
    let config = Config::resolve(args, file).unwrap();
    assert_eq!(config.listen.port(), 9100);
    assert_eq!(config.default_ttl_ms, 5000);
    assert_eq!(config.max_wait_ms, 1000);
    assert_eq!(config.max_ttl_ms, 3_600_000);
    assert!(config.redis_url.url().is_none());
}

#[test]
fn unknown_file_keys_and_inconsistent_bounds_are_refused() {
    assert!(toml::from_str::<Settings>("default_ttl = 5").is_err());
    let args = Settings {
        default_ttl_ms: Some(10),
        max_ttl_ms: Some(5),
        ..Settings::default()
    };
    assert!(Config::resolve(args, Settings::default()).is_err());
    let args = Settings {
        key_prefix: Some("a{b".into()),
        ..Settings::default()
    };
    assert!(Config::resolve(args, Settings::default()).is_err());
}

#[test]
fn the_documented_config_file_parses_and_matches_the_defaults() {
    let text = include_str!("../../config/lockbroker.toml");
    let file: Settings = toml::from_str(text).unwrap();
    let config = Config::resolve(Settings::default(), file).unwrap();
    let d = Config::default();
    assert_eq!(config.listen, d.listen);
    assert_eq!(config.default_ttl_ms, d.default_ttl_ms);
    assert_eq!(config.max_ttl_ms, d.max_ttl_ms);
    assert_eq!(config.max_wait_ms, d.max_wait_ms);
    assert_eq!(config.store_timeout_ms, d.store_timeout_ms);
    assert_eq!(config.max_waiters, d.max_waiters);
}

#[test]
fn passwords_are_masked_in_logged_urls() {
    let config = Config {
        redis_url: StoreBackend::parse("redis://user:secret@10.0.0.1:6379/0").unwrap(),
        ..Config::default()
    };
    assert_eq!(
        config.redis_url.url().unwrap().to_string(),
        "redis://***@10.0.0.1:6379/0"
    );
}

#[test]
fn a_printed_config_shows_no_password() {
    for url in [
        "redis://user:s3cr@t@h1:6379/0",
        "rediss+sentinel://:s3cr@t@h1:26379,h2:26379/mymaster",
        "redis+cluster://user:s3cr@t@h1:7000",
    ] {
        let config = Config {
            redis_url: StoreBackend::parse(url).unwrap_or_else(|e| panic!("{url}: {e:#}")),
            ..Config::default()
        };
        let printed = format!("{config:?} {config:#?}");
        assert!(!printed.contains("s3cr"), "{printed}");
        assert!(printed.contains("***@h"), "{printed}");
        let url_itself = config.redis_url.url().unwrap().expose();
        assert_eq!(url_itself, url);
    }
}

#[test]
fn the_scheme_picks_the_store_and_an_unknown_one_is_refused() {
    let kind = |url: &str| StoreBackend::parse(url).map(|b| format!("{b:?}"));
    assert_eq!(kind("").unwrap(), "Memory");
    assert_eq!(kind("  ").unwrap(), "Memory");
    assert!(
        kind("redis://127.0.0.1:6379/0")
            .unwrap()
            .starts_with("Redis(")
    );
    assert!(kind("REDIS://127.0.0.1").unwrap().starts_with("Redis("));
    assert!(
        kind("redis+sentinel://h:26379/m")
            .unwrap()
            .starts_with("Sentinel(")
    );
    assert!(
        kind("rediss+sentinel://h:26379/m")
            .unwrap()
            .starts_with("Sentinel(")
    );
    assert!(
        kind("redis+cluster://h:7000,h:7001")
            .unwrap()
            .starts_with("Cluster(")
    );
    assert!(
        kind("rediss+cluster://h:7000")
            .unwrap()
            .starts_with("Cluster(")
    );
    for url in [
        "http://example.com/",
        "unix:///tmp/redis.sock",
        "127.0.0.1:6379",
    ] {
        let error = format!("{:#}", kind(url).unwrap_err());
        assert!(error.contains("redis+sentinel://"), "{url}: {error}");
    }
    let error = format!("{:#}", kind("user:secret@host:6379").unwrap_err());
    assert!(!error.contains("secret"), "{error}");
    // Not a Redis URL: the scheme is right, the rest is not.
    assert!(kind("redis://h:notaport").is_err());
}

#[test]
fn settings_that_give_up_a_guarantee_come_back_as_warnings() {
    assert!(Config::default().warnings().is_empty());
    let args = Settings {
        store_settle_ms: Some(200),
        redis_url: Some("redis://127.0.0.1:6379".into()),
        ..Settings::default()
    };
    let warnings = Config::resolve(args, Settings::default())
        .unwrap()
        .warnings();
    assert_eq!(warnings.len(), 1);
    assert!(
        warnings[0].starts_with("store_settle_ms (200) is shorter than 1000"),
        "{warnings:?}"
    );
    // The embedded store never loses its data: nothing to warn about.
    let args = Settings {
        store_settle_ms: Some(0),
        ..Settings::default()
    };
    assert!(
        Config::resolve(args, Settings::default())
            .unwrap()
            .warnings()
            .is_empty()
    );
}
