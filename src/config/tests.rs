//! The configuration's layering, parsing and validation.

use super::*;
use crate::store::redis::Topology;

/// The configuration `flags` alone give.
fn resolve(flags: Settings) -> anyhow::Result<Config> {
    Config::resolve(flags, Settings::default())
}

/// The configuration with `url` as its Redis URL and every other setting at its default.
fn with_redis_url(url: &str) -> anyhow::Result<Config> {
    resolve(Settings {
        redis_url: Some(url.into()),
        ..Settings::default()
    })
}

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
    assert_eq!(config.serving.listen.port(), 9100);
    assert_eq!(config.limits.default_ttl_ms, 5000);
    assert_eq!(config.limits.max_wait_ms, 1000);
    assert_eq!(config.limits.max_ttl_ms, 3_600_000);
    assert!(config.store.redis_url().is_none());
}

#[test]
fn each_component_gets_its_settings() {
    let file: Settings = toml::from_str(
        "redis_url = \"redis://127.0.0.1:6379/2\"\nstore_timeout_ms = 700\nkey_prefix = \"k:\"\n\
         max_waiters = 7\nheader_timeout_ms = 900\nmax_connections = 3\nlog_level = \"debug\"\n\
         auth_file = \"/etc/auth.toml\"\n",
    )
    .unwrap();
    let config = Config::resolve(Settings::default(), file).unwrap();
    let StoreBackend::Redis(redis) = &config.store else {
        panic!("a Redis URL gives a Redis store: {config:?}");
    };
    assert_eq!(redis.timeout, Duration::from_millis(700));
    assert_eq!(redis.key_prefix, "k:");
    assert_eq!(redis.url.topology(), Topology::Single);
    assert_eq!(config.lock.store_timeout, Duration::from_millis(700));
    assert_eq!(config.lock.max_waiters, 7);
    // An auth file lets admin tokens force a release.
    assert!(config.lock.allow_force_release);
    assert_eq!(config.serving.header_timeout, Duration::from_millis(900));
    assert_eq!(config.serving.max_connections, 3);
    assert_eq!(config.log.level, "debug");
    assert!(!Config::default().lock.allow_force_release);
}

#[test]
fn unknown_file_keys_and_inconsistent_bounds_are_refused() {
    assert!(toml::from_str::<Settings>("default_ttl = 5").is_err());
    // `config` names the file; the file does not name another.
    assert!(toml::from_str::<Settings>("config = \"x.toml\"").is_err());
    let args = Settings {
        default_ttl_ms: Some(10),
        max_ttl_ms: Some(5),
        ..Settings::default()
    };
    assert!(resolve(args).is_err());
    let args = Settings {
        key_prefix: Some("a{b".into()),
        ..Settings::default()
    };
    assert!(resolve(args).is_err());
}

#[test]
fn redis_tls_files_need_each_other_and_a_tls_url() {
    let tls = |url: &str, cert: bool, key: bool| {
        resolve(Settings {
            redis_url: Some(url.into()),
            redis_tls_ca: Some("ca.pem".into()),
            redis_tls_cert: cert.then(|| "cert.pem".into()),
            redis_tls_key: key.then(|| "key.pem".into()),
            ..Settings::default()
        })
        .map_err(|e| e.to_string())
    };
    let config = tls("rediss://h:6380", true, true).unwrap();
    let StoreBackend::Redis(redis) = config.store else {
        panic!("a Redis store");
    };
    let client = redis.tls.client.expect("a client certificate");
    assert_eq!(client.cert, Path::new("cert.pem"));
    assert_eq!(client.key, Path::new("key.pem"));
    assert!(tls("REDISS+cluster://h:7000", false, false).is_ok());
    let half = tls("rediss://h:6380", true, false).unwrap_err();
    assert!(half.contains("go together"), "{half}");
    let plain = tls("redis://h:6379", false, false).unwrap_err();
    assert!(plain.contains("need a TLS Redis URL"), "{plain}");
}

#[test]
fn the_documented_config_file_parses_and_matches_the_defaults() {
    let text = include_str!("../../config/lockbroker.toml");
    let file: Settings = toml::from_str(text).unwrap();
    let config = Config::resolve(Settings::default(), file).unwrap();
    assert_eq!(format!("{config:?}"), format!("{:?}", Config::default()));
}

#[test]
fn passwords_are_masked_in_logged_urls() {
    let config = with_redis_url("redis://user:secret@10.0.0.1:6379/0").unwrap();
    assert_eq!(
        config.store.redis_url().unwrap().to_string(),
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
        let config = with_redis_url(url).unwrap_or_else(|e| panic!("{url}: {e:#}"));
        let printed = format!("{config:?} {config:#?}");
        assert!(!printed.contains("s3cr"), "{printed}");
        assert!(printed.contains("***@h"), "{printed}");
        let url_itself = config.store.redis_url().unwrap();
        assert_eq!(url_itself.expose(), url);
        assert_eq!(url_itself.parsed().password.as_deref(), Some("s3cr@t"));
    }
}

#[test]
fn the_scheme_picks_the_store_and_an_unknown_one_is_refused() {
    let topology = |url: &str| redis_url(url).map(|url| url.map(|url| url.topology()));
    assert_eq!(topology("").unwrap(), None);
    assert_eq!(topology("  ").unwrap(), None);
    for (url, expected) in [
        ("redis://127.0.0.1:6379/0", Topology::Single),
        ("REDIS://127.0.0.1", Topology::Single),
        ("redis+sentinel://h:26379/m", Topology::Sentinel),
        ("rediss+sentinel://h:26379/m", Topology::Sentinel),
        ("redis+cluster://h:7000,h:7001", Topology::Cluster),
        ("rediss+cluster://h:7000", Topology::Cluster),
    ] {
        assert_eq!(topology(url).unwrap(), Some(expected), "{url}");
    }
    for url in [
        "http://example.com/",
        "unix:///tmp/redis.sock",
        "127.0.0.1:6379",
    ] {
        let error = format!("{:#}", topology(url).unwrap_err());
        assert!(error.contains("redis+sentinel://"), "{url}: {error}");
    }
    let error = format!("{:#}", topology("user:secret@host:6379").unwrap_err());
    assert!(!error.contains("secret"), "{error}");
    // Not a Redis URL: the scheme is right, the rest is not.
    assert!(topology("redis://h:notaport").is_err());
    // The embedded store is what an empty URL gives.
    assert!(matches!(
        with_redis_url("").unwrap().store,
        StoreBackend::Memory
    ));
}

#[test]
fn settings_that_give_up_a_guarantee_come_back_as_warnings() {
    assert!(Config::default().warnings().is_empty());
    let args = Settings {
        store_settle_ms: Some(200),
        redis_url: Some("redis://127.0.0.1:6379".into()),
        ..Settings::default()
    };
    let warnings = resolve(args).unwrap().warnings();
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
    assert!(resolve(args).unwrap().warnings().is_empty());
}

#[test]
fn every_setting_s_flag_and_environment_variable_follow_from_its_file_key() {
    use clap::Args;
    let command = ServeArgs::augment_args(clap::Command::new("serve"));
    let flags: Vec<&str> = command
        .get_arguments()
        .map(|arg| arg.get_id().as_str())
        .collect();
    for arg in command.get_arguments() {
        let key = arg.get_id().as_str();
        assert_eq!(
            arg.get_long(),
            Some(key.replace('_', "-").as_str()),
            "{key}"
        );
        let env = format!("LOCKBROKER_{}", key.to_ascii_uppercase());
        assert_eq!(arg.get_env(), Some(std::ffi::OsStr::new(&env)), "{key}");
    }
    // The file's keys are the flags' names, but for `config`, which names the file.
    let serde_json::Value::Object(keys) = serde_json::to_value(Settings::default()).unwrap() else {
        panic!("the settings serialize to an object");
    };
    let keys: Vec<&str> = keys.keys().map(String::as_str).collect();
    let mut without_config: Vec<&str> = flags.iter().copied().filter(|f| *f != "config").collect();
    let mut sorted_keys = keys.clone();
    without_config.sort_unstable();
    sorted_keys.sort_unstable();
    assert_eq!(sorted_keys, without_config);
    assert_eq!(flags.len(), 28, "{flags:?}");
}

#[test]
fn replica_acks_0_on_sentinel_or_cluster_is_a_warning_naming_the_setting() {
    let warnings = |url: &str, acks: Option<u32>| {
        let args = Settings {
            redis_url: Some(url.into()),
            redis_replica_acks: acks,
            ..Settings::default()
        };
        resolve(args).unwrap().warnings()
    };
    for url in [
        "redis+sentinel://127.0.0.1:26379/lockbroker",
        "redis+cluster://127.0.0.1:7000",
    ] {
        let given = warnings(url, None);
        assert_eq!(given.len(), 1, "{url}: {given:?}");
        assert!(given[0].contains("partition"), "{given:?}");
        assert!(given[0].contains("--redis-replica-acks 1"), "{given:?}");
        assert!(given[0].contains("min-replicas-to-write"), "{given:?}");
        assert!(warnings(url, Some(1)).is_empty(), "{url}");
    }
    // One server has no failover to lose a grant to.
    assert!(warnings("redis://127.0.0.1:6379", None).is_empty());
}
