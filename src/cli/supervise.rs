//! How `run` and `elect` start their command, so that it does not outlive them.
//!
//! The command leads a process group of its own (its pid is the group's id, `kill -- -$$` from
//! a script reaches it all), so that a stop reaches everything it started, such as a shell
//! script's children. `run` and `elect` stop that group when the lease is lost, and pass their
//! signals on to it. What they cannot do is act on their own death: killed with SIGKILL (the
//! OOM killer, `kill -9`), a supervisor would leave its command running past its lease, beside
//! the next holder's. On Linux the kernel and a small guard process see to it:
//!
//! - **The command's first process** is started through the binary itself, `lockbroker __exec`
//!   (a hidden subcommand, [`exec`]): it sets its parent-death signal to SIGKILL
//!   (`prctl(PR_SET_PDEATHSIG)`), checks that its parent is still the supervisor (if the
//!   supervisor died before the setting took, it exits without running the command), and
//!   `exec`s the command, which keeps the setting. It dies with the supervisor.
//! - **The rest of its group**: the parent-death signal reaches that one process, not what it
//!   started. So the supervisor also starts `lockbroker __guard` ([`guard`]), in a process
//!   group of its own (no terminal or forwarded signal reaches it). It sets its parent-death
//!   signal to SIGTERM, blocks it and waits for it; when its parent is gone it sends SIGKILL to
//!   the command's whole group and exits. Each wake-up checks the parent (`getppid`), so a
//!   stray SIGTERM, SIGINT or SIGHUP sent to the guard changes nothing. The supervisor kills
//!   the guard once it is done with the command (the guard is killed when [`Supervised`] is
//!   dropped), so a command that ends by itself leaves what it started as it always did.
//! - **The main thread.** The parent-death signal follows the *thread* that forked, not the
//!   process, and tokio's worker and blocking threads come and go. Both processes are forked
//!   on the main thread, which lives as long as the process: `main` polls the command's future
//!   on it (`block_on`), and tokio's `Command::spawn` forks on the calling thread.
//!   [`Supervised::start`] asserts it.
//! - Both helpers are the running binary (`/proc/self/exe`), so they match the supervisor even
//!   after the file on disk was replaced by an upgrade.
//!
//! Other designs, and why not: the parent-death signal alone (`exec` with SIGKILL) kills the
//! group's leader, not its other processes. A helper that stays between the supervisor and the
//! command, as the command's parent, would either lead the group itself (then the command's pid
//! is no longer its group's id, and its exit status is a copy) or leave the supervisor to learn a
//! grandchild's pid. A PID namespace takes everything down with its first process, but needs
//! privileges. The guard keeps the command a direct child of the supervisor and its group's
//! leader: statuses and signals are exactly as without it.
//!
//! What still escapes: processes that leave the group (`setsid`, `setpgid`: daemons); a guard
//! killed together with its supervisor (`kill -9` on both): then the command's first process
//! still dies, but not the rest of its group. A set-user-ID command loses its parent-death
//! signal (the kernel clears it), but the guard still kills its group.
//!
//! Elsewhere (macOS and the BSDs have no parent-death signal) the command is started directly,
//! in a group of its own: a supervisor killed with SIGKILL leaves it running; stop its group
//! too (`kill -- -PGID`).

use std::ffi::OsString;
use std::io;
use std::process::{ExitCode, ExitStatus};

use nix::unistd::Pid;
use tokio::process::{Child, Command};

use super::exit;

/// The binary that is running, for the helpers: the same program even if its file was
/// replaced since it started.
#[cfg(target_os = "linux")]
const SELF: &str = "/proc/self/exe";

/// A command started by `run` or `elect` (`who`), leading a process group of its own, with
/// (on Linux) its guard.
pub(super) struct Supervised {
    child: Child,
    group: Pid,
    /// SIGKILLed when dropped (`kill_on_drop`): the supervisor is done with the command.
    #[cfg(target_os = "linux")]
    _guard: Child,
}

impl Supervised {
    /// Starts `command` (program and arguments) with `env` added to the environment, in a process
    /// group of its own, and on Linux its guard. An error says why the command could not start.
    pub(super) fn start(
        who: &'static str,
        command: &[OsString],
        env: &[(&str, &str)],
    ) -> io::Result<Self> {
        let (program, args) = command.split_first().expect("clap requires a command");
        #[cfg(target_os = "linux")]
        let mut started = {
            assert_eq!(
                nix::unistd::gettid(),
                nix::unistd::getpid(),
                "the command is started from the main thread: its parent-death signal follows \
                 the thread that forks"
            );
            let mut exec = helper("__exec", who);
            exec.arg("--").arg(program).args(args);
            exec
        };
        #[cfg(not(target_os = "linux"))]
        let mut started = {
            let _ = who;
            let mut direct = Command::new(program);
            direct.args(args);
            direct
        };
        let child = started
            .envs(env.iter().copied())
            .process_group(0)
            .spawn()
            .map_err(|e| {
                if cfg!(target_os = "linux") {
                    io::Error::other(format!("cannot start lockbroker's helper: {e}"))
                } else {
                    e
                }
            })?;
        let group = Pid::from_raw(
            child
                .id()
                .and_then(|id| i32::try_from(id).ok())
                .expect("a child not yet waited for has a pid"),
        );
        #[cfg(target_os = "linux")]
        let guard = match helper("__guard", who)
            .arg("--group")
            .arg(group.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
        {
            Ok(guard) => guard,
            Err(e) => {
                // Unguarded, it would outlive a killed supervisor: not started after all (tokio
                // reaps the dropped child).
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
                return Err(io::Error::other(format!(
                    "cannot start lockbroker's guard: {e}"
                )));
            }
        };
        Ok(Self {
            child,
            group,
            #[cfg(target_os = "linux")]
            _guard: guard,
        })
    }

    /// The command's process group (its first process leads it).
    pub(super) fn group(&self) -> Pid {
        self.group
    }

    /// Waits for the command's first process to end.
    pub(super) async fn wait(&mut self) -> io::Result<ExitStatus> {
        self.child.wait().await
    }
}

/// `lockbroker SUBCOMMAND --for WHO --supervisor PID`: one of the hidden helpers, for this
/// process.
#[cfg(target_os = "linux")]
fn helper(subcommand: &str, who: &str) -> Command {
    let mut helper = Command::new(SELF);
    helper
        .arg0("lockbroker")
        .args([subcommand, "--for", who, "--supervisor"])
        .arg(std::process::id().to_string());
    helper
}

/// The exit code for a command that could not be started: not found, or not executable.
pub(super) fn cannot_run(e: &io::Error) -> ExitCode {
    ExitCode::from(if e.kind() == io::ErrorKind::NotFound {
        exit::NOT_FOUND
    } else {
        exit::CANNOT_EXECUTE
    })
}

#[cfg(target_os = "linux")]
pub use self::helpers::{ExecArgs, GuardArgs, exec, guard};

/// The hidden subcommands that start and guard the command. They run before `main` starts the
/// async runtime: one thread, no signal handlers.
#[cfg(target_os = "linux")]
mod helpers {
    use std::ffi::OsString;
    use std::fmt;
    use std::os::unix::process::CommandExt;
    use std::process::ExitCode;

    use clap::Args;
    use nix::errno::Errno;
    use nix::sys::prctl;
    use nix::sys::signal::{SigSet, Signal, killpg};
    use nix::unistd::{Pid, getppid};

    use super::{cannot_run, exit};

    /// `lockbroker __exec`: the command's first process, until it `exec`s the command.
    #[derive(Debug, Args)]
    pub struct ExecArgs {
        #[command(flatten)]
        watched: Watched,
        /// The command and its arguments.
        #[arg(last = true, required = true, num_args = 1..)]
        command: Vec<OsString>,
    }

    /// `lockbroker __guard`: kills the command's group when the supervisor dies.
    #[derive(Debug, Args)]
    pub struct GuardArgs {
        #[command(flatten)]
        watched: Watched,
        /// The command's process group.
        #[arg(long)]
        group: i32,
    }

    /// Whose command: the supervisor, the parent of both helpers.
    #[derive(Debug, Args)]
    struct Watched {
        /// `run` or `elect`, for messages.
        #[arg(long = "for")]
        who: String,
        /// The supervisor's pid.
        #[arg(long)]
        supervisor: i32,
    }

    impl Watched {
        /// Whether the supervisor has died: the helper was handed to another parent.
        fn is_gone(&self) -> bool {
            getppid() != Pid::from_raw(self.supervisor)
        }

        fn say(&self, message: fmt::Arguments<'_>) {
            eprintln!("lockbroker {}: {message}", self.who);
        }
    }

    /// Arms the parent-death signal (SIGKILL), checks the supervisor is still there, and runs the
    /// command in this process. Returns only if the command could not be run.
    pub fn exec(args: ExecArgs) -> ExitCode {
        let ExecArgs { watched, command } = args;
        if let Err(e) = prctl::set_pdeathsig(Signal::SIGKILL) {
            watched.say(format_args!(
                "cannot set the command's parent-death signal: {e}"
            ));
            return ExitCode::from(exit::CANNOT_EXECUTE);
        }
        if watched.is_gone() {
            // It died before the setting took: nobody would stop the command.
            return ExitCode::from(exit::ERROR);
        }
        let (program, args) = command.split_first().expect("clap requires a command");
        let e = std::process::Command::new(program).args(args).exec();
        watched.say(format_args!(
            "cannot run {:?}: {e}",
            program.to_string_lossy()
        ));
        cannot_run(&e)
    }

    /// Waits for the supervisor's death (its parent-death signal, SIGTERM), then SIGKILLs the
    /// command's process group.
    pub fn guard(args: GuardArgs) -> ExitCode {
        let GuardArgs { watched, group } = args;
        // `ps` and `top` show this, not `exe`.
        let _ = prctl::set_name(c"lockbroker");
        let wake: SigSet = [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP]
            .into_iter()
            .collect();
        // Blocked first, then armed: a death after this is a pending signal, not a lost one.
        if let Err(e) = wake
            .thread_block()
            .and_then(|()| prctl::set_pdeathsig(Signal::SIGTERM))
        {
            watched.say(format_args!(
                "cannot watch over the command (process group {group}): {e}"
            ));
            return ExitCode::from(exit::ERROR);
        }
        while !watched.is_gone() {
            if let Err(e) = wake.wait() {
                watched.say(format_args!(
                    "cannot watch over the command (process group {group}): {e}"
                ));
                return ExitCode::from(exit::ERROR);
            }
        }
        match killpg(Pid::from_raw(group), Signal::SIGKILL) {
            Ok(()) => watched.say(format_args!(
                "{} (pid {}) died; sent SIGKILL to its command (process group {group})",
                watched.who, watched.supervisor
            )),
            Err(Errno::ESRCH) => {}
            Err(e) => watched.say(format_args!(
                "{} (pid {}) died; cannot send SIGKILL to its command (process group \
                 {group}): {e}",
                watched.who, watched.supervisor
            )),
        }
        ExitCode::SUCCESS
    }
}
