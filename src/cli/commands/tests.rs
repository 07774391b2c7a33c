//! The client commands' unit tests: their arguments as clap parses and refuses them.

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};

use super::*;
use crate::cli::list::ListArgs;

/// The client commands as `main` wires them.
#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Acquire(AcquireArgs),
    Release(ReleaseArgs),
    Renew(RenewArgs),
    Status(StatusArgs),
    List(ListArgs),
}

fn parse(args: &[&str]) -> Result<Command, clap::Error> {
    Cli::try_parse_from(std::iter::once("lockbroker").chain(args.iter().copied()))
        .map(|cli| cli.command)
}

fn refused(args: &[&str]) -> ErrorKind {
    match parse(args) {
        Ok(_) => panic!("{args:?} was accepted"),
        Err(e) => e.kind(),
    }
}

fn key(raw: &str) -> String {
    raw.to_owned()
}

const TOKEN: &str = "000000000000000000000000000000000000000000000000";

#[test]
fn the_commands_are_consistent_clap_definitions() {
    Cli::command().debug_assert();
}

#[test]
fn acquire_takes_a_key_a_shared_lease_or_a_semaphores_permit() {
    let claim = |args: &[&str]| match parse(args).unwrap() {
        Command::Acquire(a) => a.target.claim(),
        _ => unreachable!(),
    };
    assert_eq!(claim(&["acquire", "k"]), Claim::Exclusive(key("k")));
    assert_eq!(
        claim(&["acquire", "k", "--shared"]),
        Claim::Shared(key("k"))
    );
    assert_eq!(
        claim(&["acquire", "--semaphore", "s", "--limit", "4"]),
        Claim::Permit {
            semaphore: key("s"),
            limit: 4
        }
    );
}

#[test]
fn acquire_refuses_both_or_neither_a_limit_without_a_semaphore_and_shared_permits() {
    use ErrorKind::*;
    // Neither KEY nor --semaphore, or both.
    assert_eq!(refused(&["acquire"]), MissingRequiredArgument);
    assert_eq!(
        refused(&["acquire", "k", "--semaphore", "s", "--limit", "2"]),
        ArgumentConflict
    );
    // --limit goes with --semaphore, both ways.
    assert_eq!(
        refused(&["acquire", "--semaphore", "s"]),
        MissingRequiredArgument
    );
    assert_eq!(refused(&["acquire", "k", "--limit", "2"]), ArgumentConflict);
    assert_eq!(
        refused(&["acquire", "--limit", "2"]),
        MissingRequiredArgument
    );
    // A shared permit means nothing.
    assert_eq!(
        refused(&["acquire", "--semaphore", "s", "--limit", "2", "--shared"]),
        ArgumentConflict
    );
    for bad in ["0", "10001", "x"] {
        assert_eq!(
            refused(&["acquire", "--semaphore", "s", "--limit", bad]),
            ValueValidation,
            "--limit {bad}"
        );
    }
}

#[test]
fn release_renew_and_status_name_a_lock_or_a_semaphore_without_a_limit() {
    let resource = |args: &[&str]| match parse(args).unwrap() {
        Command::Release(a) => a.target.resource(),
        Command::Renew(a) => a.target.resource(),
        Command::Status(a) => a.target.resource(),
        _ => unreachable!(),
    };
    let semaphore = resource(&["renew", "--semaphore", "s", "--token", TOKEN]);
    assert_eq!(semaphore.space, Space::Semaphores);
    assert_eq!(semaphore.key, key("s"));
    assert_eq!(resource(&["status", "k"]).space, Space::Locks);
    assert_eq!(
        resource(&["release", "--semaphore", "s", "--token", TOKEN]).space,
        Space::Semaphores
    );
    assert_eq!(refused(&["status"]), ErrorKind::MissingRequiredArgument);
    assert_eq!(
        refused(&["status", "k", "--semaphore", "s"]),
        ErrorKind::ArgumentConflict
    );
    for command in ["release", "renew", "status"] {
        assert_eq!(
            refused(&[
                command,
                "--semaphore",
                "s",
                "--limit",
                "2",
                "--token",
                TOKEN
            ]),
            ErrorKind::UnknownArgument,
            "{command} takes no --limit"
        );
        assert_eq!(
            refused(&[command, "k", "--shared", "--token", TOKEN]),
            ErrorKind::UnknownArgument,
            "{command} takes no --shared"
        );
    }
}

#[test]
fn release_force_needs_no_token() {
    let Command::Release(args) = parse(&["release", "--force", "k"]).unwrap() else {
        unreachable!()
    };
    assert!(args.force);
    let Command::Release(args) =
        parse(&["release", "--semaphore", "s", "--force", "--json"]).unwrap()
    else {
        unreachable!()
    };
    assert_eq!(args.target.resource().space, Space::Semaphores);
}

#[test]
fn list_takes_an_optional_prefix_a_limit_and_a_page_size() {
    let Command::List(all) = parse(&["list"]).unwrap() else {
        unreachable!()
    };
    assert_eq!(
        (all.prefix.as_str(), all.limit, all.page_size),
        ("", None, 100)
    );
    let Command::List(some) = parse(&[
        "list",
        "orders:",
        "--semaphores",
        "--limit",
        "5",
        "--page-size",
        "2",
        "--json",
    ])
    .unwrap() else {
        unreachable!()
    };
    assert_eq!(some.prefix, "orders:");
    assert!(some.semaphores && some.json);
    assert_eq!((some.limit, some.page_size), (Some(5), 2));
    for bad in [
        &["list", "a b"][..],
        &["list", "--limit", "0"],
        &["list", "--page-size", "1001"],
        &["list", "--page-size", "0"],
    ] {
        assert_eq!(refused(bad), ErrorKind::ValueValidation, "{bad:?}");
    }
}
