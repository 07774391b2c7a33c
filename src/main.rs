//! `lockbroker`: parses the command line and runs the chosen command. Everything else lives in
//! the library, where the tests drive it.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use lockbroker::bench::BenchArgs;
use lockbroker::config::{Config, ServeArgs};
use lockbroker::startup::{Application, shutdown_signal};

/// A distributed-lock broker: leases with fencing tokens over HTTP, kept in Redis.
#[derive(Parser)]
#[command(name = "lockbroker", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the broker.
    Serve(ServeArgs),
    /// Load a running broker and print throughput and latency (and, with --redis-url, the
    /// same lock cycle done directly on Redis, for comparison).
    Bench(BenchArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => {
            let config = Config::load(args)?;
            lockbroker::telemetry::init(config.log_format, &config.log_level);
            let app = Application::build(&config).await?;
            app.run_until_stopped(shutdown_signal()).await?;
        }
        Command::Bench(args) => {
            lockbroker::bench::run(args).await?;
        }
    }
    Ok(())
}
