//! `lockbroker`: parses the command line and runs the chosen command. The broker (`serve`)
//! lives in the `lockbroker` library; the client commands live here, in [`cli`], on the
//! `lockbroker-client` crate, so the server library exports nothing for them.
#![forbid(unsafe_code)]

// `out!` (stdout that a closed pipe ends quietly) in every command's module, as when `cli`
// defined it.
#[macro_use]
extern crate lockbroker_cli_support;

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cli::commands::{self, AcquireArgs, ReleaseArgs, RenewArgs, StatusArgs};
#[cfg(unix)]
use cli::elect::{self, ElectArgs};
use cli::list::{self, ListArgs};
#[cfg(unix)]
use cli::run::{self, RunArgs};
use cli::session::{self, SessionArgs};
#[cfg(target_os = "linux")]
use cli::supervise;
use lockbroker::config::{Config, ServeArgs};
use lockbroker::{Application, shutdown_signal};
use lockbroker_cli_support::report;

/// jemalloc: a parked HTTP/1.1 waiter takes 14.8 KB with it against 23.1 KB with glibc's
/// allocator (hyper's per-connection buffers stay untouched, so not resident, until used), and
/// the broker spends less CPU per request (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// A distributed-lock broker: leases with fencing tokens over HTTP, kept in Redis.
#[derive(Parser)]
#[command(name = "lockbroker", version, about)]
#[command(
    after_help = "The client commands (acquire, release, renew, status, list, run, elect, \
                        session) talk to the broker at --url (LOCKBROKER_URL, default http://127.0.0.1:8080). \
                        Each takes a lock's KEY or --semaphore NAME. Exit codes: 0 done, \
                        1 error, 2 usage, 3 locked by someone else (or every permit taken), \
                        4 not held (or the session ended), 5 lease lost during `run`; see each \
                        command's --help."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the broker.
    // Boxed: the settings are many times larger than any other command's arguments.
    Serve(Box<ServeArgs>),
    /// Acquire a lock (exclusive, or --shared) or a semaphore's permit; print its token and
    /// fence.
    Acquire(AcquireArgs),
    /// Release a lock or permit held with --token, or with --force every lease on it.
    Release(ReleaseArgs),
    /// Extend the lease held with --token.
    Renew(RenewArgs),
    /// Show who holds a lock or a semaphore's permits (fences, owners and expiries; never a
    /// token).
    Status(StatusArgs),
    /// List the held locks (or --semaphores) whose key starts with a prefix.
    List(ListArgs),
    /// Run a command while holding a lock (or a shared lease, or a semaphore's permit):
    /// acquire, renew while it runs, release when it exits, and stop it if the lease is lost.
    #[cfg(unix)]
    Run(RunArgs),
    /// Leader election: run a command while this node holds the lock as its leader, wait as a
    /// candidate otherwise, and hand over on SIGTERM.
    #[cfg(unix)]
    Elect(ElectArgs),
    /// A session for scripts: open one (its id printed), renew it, close it (every lease
    /// under it released), show it. Take leases under it with `acquire --session ID`.
    Session(SessionArgs),
    /// Starts `run`'s or `elect`'s command so that it dies with them (cli::supervise).
    #[cfg(target_os = "linux")]
    #[command(name = "__exec", hide = true)]
    Exec(supervise::ExecArgs),
    /// Stands between `run` or `elect` and its command, which it kills when they die
    /// (cli::supervise).
    #[cfg(target_os = "linux")]
    #[command(name = "__supervise", hide = true)]
    Supervise(supervise::SuperviseArgs),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        // Before the async runtime: one thread, and no signal handlers for `exec` to pass on.
        #[cfg(target_os = "linux")]
        Command::Exec(args) => supervise::exec(args),
        #[cfg(target_os = "linux")]
        Command::Supervise(args) => supervise::supervise(args),
        // On this (the main) thread: `run` and `elect` start their command from it (see
        // cli::supervise).
        command => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("cannot start the async runtime")
            .block_on(execute(command)),
    }
}

async fn execute(command: Command) -> ExitCode {
    match command {
        Command::Serve(args) => report(serve(*args).await),
        Command::Acquire(args) => commands::acquire(args).await,
        Command::Release(args) => commands::release(args).await,
        Command::Renew(args) => commands::renew(args).await,
        Command::Status(args) if args.watch => cli::follow::follow(&args).await,
        Command::Status(args) => commands::status(args).await,
        Command::List(args) => list::list(args).await,
        #[cfg(unix)]
        Command::Run(args) => run::run(args).await,
        #[cfg(unix)]
        Command::Elect(args) => elect::elect(args).await,
        Command::Session(args) => session::session(args).await,
        #[cfg(target_os = "linux")]
        Command::Exec(_) | Command::Supervise(_) => unreachable!("run by main"),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = Config::load(args)?;
    lockbroker::init_logging(config.log.format, &config.log.level);
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    // Listening for the stop signals before the port is bound (see `shutdown_signal`).
    let stop = shutdown_signal();
    let app = Application::build(&config).await?;
    app.run_until_stopped(stop).await?;
    Ok(())
}
