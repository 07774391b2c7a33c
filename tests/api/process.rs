//! The real binary: start-up, configuration errors, layering of flags, environment and file, and
//! graceful shutdown on SIGTERM.

use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use lockbroker_test_support::broker::{BrokerCommand, BrokerProcess, serve_command};
use lockbroker_test_support::http::{Answer, http_client, until_waiting};
use lockbroker_test_support::redis_server::RedisServer;
use lockbroker_test_support::send_signal;
use lockbroker_test_support::temp::{temp_file, temp_log};
use reqwest::StatusCode;

use crate::outage::{log_field, wait_for_log_line};

/// The binary under test; Cargo builds it before this suite.
const BINARY: &str = env!("CARGO_BIN_EXE_lockbroker");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_waiting_requests_with_503_shutting_down_and_exits_0() {
    let mut broker = BrokerProcess::start(BrokerCommand::new(BINARY)).await;
    let client = http_client();
    let held = Answer::send(client.post(broker.url("/locks/job"))).await;
    held.expect_grant(StatusCode::CREATED);
    let waiter = {
        let request = client.post(broker.url("/locks/job?wait_ms=20000"));
        tokio::spawn(async move { Answer::send(request).await })
    };
    // The waiter finds the lock held and parks (the broker counts it).
    until_waiting(&broker.address(), 1).await;
    assert!(!waiter.is_finished(), "the waiter must be waiting");

    let signalled = Instant::now();
    send_signal(broker.pid(), "-TERM");
    let answer = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter must be answered when the broker stops")
        .expect("the waiter task");
    answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "shutting_down");
    assert!(
        signalled.elapsed() < Duration::from_secs(2),
        "the waiter was answered {:?} after SIGTERM",
        signalled.elapsed()
    );
    let status = broker.exit_status(Duration::from_secs(5)).await;
    assert!(
        status.success(),
        "exit status {status}:\n{}",
        broker.output()
    );
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "the broker took {:?} to exit",
        signalled.elapsed()
    );
    // It no longer accepts connections.
    assert!(client.get(broker.url("/healthz")).send().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_without_a_redis_url_says_loudly_that_locks_stay_in_its_memory() {
    let mut broker = BrokerProcess::start(BrokerCommand::new(BINARY)).await;
    let output = broker.output().to_lowercase();
    assert!(
        output.contains("memory") && output.contains("redis"),
        "the start-up log must say the locks are in memory, not in Redis:\n{output}"
    );
    assert!(broker.terminate(Duration::from_secs(5)).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_written_to_a_file_carry_no_colour_codes() {
    // Its stdout is a file, as under `docker logs` or a log collector; the warning about the
    // embedded store is a log line with a level, which a terminal would show in colour.
    let mut broker = BrokerProcess::start(BrokerCommand::new(BINARY)).await;
    let output = broker.output();
    assert!(output.contains("WARN"), "no log line to look at:\n{output}");
    assert!(
        !output.contains('\u{1b}'),
        "escape sequences in a log file:\n{output:?}"
    );
    send_signal(broker.pid(), "-TERM");
    assert!(broker.exit_status(Duration::from_secs(5)).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setting_that_gives_up_a_guarantee_is_warned_about_in_the_log() {
    let mut broker = BrokerProcess::start(BrokerCommand::configured(BINARY, |command, port| {
        command.args(["--listen", &format!("127.0.0.1:{port}")]);
        command.args([
            "--store-settle-ms",
            "100",
            "--redis-url",
            "redis://127.0.0.1:1/",
        ]);
    }))
    .await;
    let output = broker.output();
    assert!(
        output.contains("store_settle_ms (100) is shorter than 1000"),
        "the start-up log must carry the configuration's warning:\n{output}"
    );
    send_signal(broker.pid(), "-TERM");
    assert!(broker.exit_status(Duration::from_secs(5)).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listen_flag_beats_the_environment_which_beats_the_config_file() {
    let file = temp_file("config", "toml");
    // The file alone.
    listens_where_told(&file, listen, |command, file, _| {
        command.arg("--config").arg(file);
    })
    .await;
    // The environment over the file.
    listens_where_told(&file, unused, |command, file, port| {
        command
            .env("LOCKBROKER_CONFIG", file)
            .env("LOCKBROKER_LISTEN", listen(port));
    })
    .await;
    // The flag over both.
    listens_where_told(&file, unused, |command, file, port| {
        command
            .arg("--config")
            .arg(file)
            .env("LOCKBROKER_LISTEN", unused(port))
            .args(["--listen", &listen(port)]);
    })
    .await;
    let _ = std::fs::remove_file(&file);
}

/// The address the broker is started on.
fn listen(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// Another address than the broker's: a setting that must lose.
fn unused(port: u16) -> String {
    format!("127.0.0.1:{}", if port == 1 { 2 } else { port - 1 })
}

/// Starts the broker with the config `file` saying `listen = file_listen(port)` and
/// `configure`d on top: it must answer on its port (where the winning setting says) and stop
/// cleanly.
async fn listens_where_told(
    file: &Path,
    file_listen: fn(u16) -> String,
    configure: fn(&mut Command, &Path, u16),
) {
    let written = file.to_owned();
    let mut broker =
        BrokerProcess::start(BrokerCommand::configured(BINARY, move |command, port| {
            std::fs::write(&written, format!("listen = \"{}\"\n", file_listen(port))).unwrap();
            configure(command, &written, port);
        }))
        .await;
    assert!(broker.terminate(Duration::from_secs(5)).await.success());
}

/// Runs the command to its end, for at most 10 s, and returns its status and output.
fn run_to_exit(mut command: Command) -> (ExitStatus, String) {
    let log = temp_log("broker-run");
    let out = std::fs::File::create(&log).unwrap();
    command.stdout(out.try_clone().unwrap()).stderr(out);
    let mut child = command.spawn().expect("cannot start the lockbroker binary");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the broker kept running with an invalid configuration:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    (status, output)
}

#[test]
fn an_invalid_configuration_stops_the_binary_with_a_non_zero_status_and_a_message() {
    let bad_file = temp_file("bad-config", "toml");
    std::fs::write(&bad_file, "default_ttl = 5000\n").unwrap();
    let cases: [(&[&str], &str); 10] = [
        (&["--max-ttl-ms", "0"], "max_ttl_ms"),
        (
            &["--default-ttl-ms", "5000", "--max-ttl-ms", "1000"],
            "default_ttl_ms",
        ),
        (&["--listen", "not-an-address"], "listen"),
        (&["--redis-url", "http://example.com/"], "redis"),
        (
            &["--redis-url", "redis+sentinel://u:hunter2@127.0.0.1:1"],
            "master's name",
        ),
        (
            &["--redis-url", "redis+cluster://u:hunter2@127.0.0.1:1/2"],
            "database 0 only",
        ),
        (
            &[
                "--redis-url",
                "redis://127.0.0.1:1",
                "--redis-tls-ca",
                "/tmp/ca.pem",
            ],
            "tls redis url",
        ),
        (
            &["--redis-replica-acks", "1"],
            "redis_replica_acks needs a redis url",
        ),
        (&["--max-waiters", "0"], "max_waiters"),
        (&["--config", bad_file.to_str().unwrap()], "config"),
    ];
    for (args, mentions) in cases {
        let mut command = serve_command(BINARY);
        if !args.contains(&"--listen") {
            // Should the configuration be taken, no port of anyone else's is disturbed.
            command.args(["--listen", "127.0.0.1:0"]);
        }
        command.args(args);
        let (status, output) = run_to_exit(command);
        assert!(
            !status.success(),
            "lockbroker serve {args:?} must fail, it exited with {status}"
        );
        assert!(
            output.to_lowercase().contains(mentions),
            "lockbroker serve {args:?} must say what is wrong ({mentions}):\n{output}"
        );
        assert!(
            !output.contains("hunter2"),
            "a Redis password reached the output:\n{output}"
        );
    }
    let _ = std::fs::remove_file(&bad_file);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_trace_level_each_redis_script_call_is_logged_with_its_key_and_duration() {
    let redis = RedisServer::start().await;
    let url = redis.url();
    let broker = BrokerProcess::start(BrokerCommand::configured(BINARY, move |command, port| {
        command
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--redis-url",
                &url,
            ])
            // A new store's settle time aside: grants at once.
            .args(["--store-settle-ms", "0"])
            .env("LOCKBROKER_LOG_LEVEL", "trace");
    }))
    .await;
    let client = http_client();
    let grant = Answer::send(client.post(broker.url("/locks/traced?ttl_ms=30000")))
        .await
        .expect_grant(StatusCode::CREATED);
    let released = client
        .delete(broker.url("/locks/traced"))
        .header("Lock-Token", &grant.token)
        .send()
        .await
        .unwrap();
    assert_eq!(released.status(), StatusCode::NO_CONTENT);
    let limit = Duration::from_secs(5);
    for script in ["claim", "release"] {
        let line = wait_for_log_line(
            &broker,
            &format!("{script} script on lockbroker:{{traced}}:lock"),
            limit,
        )
        .await;
        assert!(line.contains(" TRACE "), "{line}");
        assert!(line.contains(&format!("script=\"{script}\"")), "{line}");
        assert!(line.contains("key=lockbroker:{traced}:lock"), "{line}");
        assert!(log_field(&line, "took_us") < 10_000_000, "{line}");
        assert!(
            !line.contains(&grant.token),
            "a lease token in the log: {line}"
        );
    }
}
