//! What the `lockbroker` and `lockbroker-bench` command lines share, so that both take the same
//! flags and end the same way: how to reach a broker beyond its URL ([`ConnectArgs`]), the exit
//! codes ([`exit`]), stdout that a closed pipe ends quietly ([`out!`]), the semaphore-limit
//! parser ([`parse_limit`]) and the exit after an error ([`report`]). Neither binary's own
//! commands are here: `lockbroker`'s are in its `src/cli`, the bench's in `bench/`.
#![forbid(unsafe_code)]

use std::fmt;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU8, Ordering};

use clap::Args;
use lockbroker_client::{Client, MAX_SEMAPHORE_LIMIT};

/// `println!` for the commands' output, except that a reader gone (a closed pipe, as in
/// `lockbroker list | head -1`) ends the process quietly instead of panicking: with the status
/// the command said it ends with ([`closed_stdout_ends_with`]: 0 for a listing or a status,
/// whose reader took what it wanted), else [`exit::BROKEN_PIPE`], as a program killed by
/// SIGPIPE does (an acquire's token that nobody read).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_line(format_args!($($arg)*))
    };
}

/// The exit codes of the client commands (and the bench's 0, 1 and 2). `--help` of each client
/// command lists them.
pub mod exit {
    /// Done (the table's first row: `ExitCode::SUCCESS` says it in code).
    pub const OK: u8 = 0;
    /// An error: the broker could not be reached, refused the request (400, 403, a semaphore's
    /// `limit_mismatch`), answered 5xx, or answered something unexpected.
    pub const ERROR: u8 = 1;
    /// A usage error, from clap: unknown flag, missing argument, or a value that can never be
    /// valid (a bad key, duration, owner or request id). Said by clap itself.
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

/// How to reach a broker beyond its URL: a bearer token for a broker with an auth file, and the
/// TLS files for an `https://` one. Shared by every client command and the bench. `Debug` shows no
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

/// A semaphore's number of permits: 1 to [`MAX_SEMAPHORE_LIMIT`].
pub fn parse_limit(raw: &str) -> Result<u32, String> {
    raw.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| (1..=MAX_SEMAPHORE_LIMIT).contains(n))
        .ok_or_else(|| format!("a semaphore has 1 to {MAX_SEMAPHORE_LIMIT} permits"))
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

/// Exit 1 with the error and its causes, as `main` returning an `anyhow::Result` would.
pub fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}
