//! How `run` and `elect` start their command, so that it does not outlive them.
//!
//! The command leads a process group of its own (its pid is the group's id: `kill -- -$$` from
//! a script reaches all of it), so that a stop reaches everything it started, such as a shell
//! script's children. `run` and `elect` stop that group when the lease is lost, and pass their
//! signals on to it. What they cannot do is act on their own death: killed with SIGKILL (the
//! OOM killer, `kill -9`), a supervisor would leave its command running past its lease, beside
//! the next holder's. On Linux a small process between the two sees to it, woken by the
//! kernel's parent-death signal (`prctl(PR_SET_PDEATHSIG)`):
//!
//! - **`lockbroker __supervise`** (hidden, [`supervise`]) is what `run` and `elect` start, in a
//!   process group of its own (no terminal or forwarded signal reaches it). It blocks SIGTERM,
//!   makes it its parent-death signal, checks that its parent is still the supervisor (if the
//!   supervisor died before the setting took, it starts nothing), makes itself the reaper of
//!   its orphaned descendants (`PR_SET_CHILD_SUBREAPER`) and starts the command in a group of
//!   its own, telling the supervisor the command's pid through a pipe. Then it waits. When the
//!   command ends, it exits with the command's status (`128+S` for a signal S, the code `run`
//!   reports either way). When its parent dies, it sends SIGKILL to the command's whole group
//!   at once, reaps what dies, and exits: the command's processes are gone, not left as zombies
//!   until init gets round to them. Each wake-up checks the parent (`getppid`), so a stray
//!   SIGTERM changes nothing.
//! - **`lockbroker __exec`** (hidden, [`exec`]) is how it starts the command: it sets its own
//!   parent-death signal to SIGKILL, checks its parent, and `exec`s the command, which keeps the
//!   setting (it is cleared only for a set-user-ID program). So if the process in between is
//!   itself killed with SIGKILL, the command's first process still dies, and the supervisor,
//!   seeing it killed, sends SIGKILL to the command's group.
//! - **The main thread.** The parent-death signal follows the *thread* that forked, not the
//!   process, and tokio's worker and blocking threads come and go. The supervisor forks on its
//!   main thread, which lives as long as the process: `main` polls the command's future on it
//!   (`block_on`), and tokio's `Command::spawn` forks on the calling thread;
//!   [`Supervised::start`] asserts it. The helpers are single-threaded (`main` runs them before
//!   it starts the async runtime).
//! - The helpers are the running binary (`/proc/self/exe`), so they match the supervisor even
//!   after the file on disk was replaced by an upgrade.
//!
//! Other designs, and why not: the parent-death signal alone (`exec` with SIGKILL) kills the
//! group's leader, not the other processes in the group. A guard beside the command (not its
//! parent) can kill the group but not reap it: the dead command is left a zombie of init,
//! which counts as running to `kill -0` for as long as init takes (over a second on some
//! hosts). A helper that leads the command's group itself would die of its own `killpg`, and
//! the command's pid would no longer be its group's id. A PID namespace takes everything down
//! with its first process, but needs privileges.
//!
//! What still escapes: processes that leave the group (`setsid`, `setpgid`: daemons), and, if
//! the supervisor and the process in between are both killed with SIGKILL at once (`kill -9`
//! on both), the command's group except its first process.
//!
//! Elsewhere (macOS and the BSDs have no parent-death signal) the command is started directly,
//! in a group of its own: a supervisor killed with SIGKILL leaves it running; stop its group
//! too (`kill -- -PGID`).

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::process::{ExitCode, ExitStatus};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use super::exit;

/// The binary that is running, for the helpers: the same program even if its file was
/// replaced since it started.
#[cfg(target_os = "linux")]
const SELF: &str = "/proc/self/exe";

/// A command started by `run` or `elect`, leading a process group of its own; on Linux through
/// `lockbroker __supervise`, which is the child waited for.
pub(super) struct Supervised {
    /// `run` or `elect`, for messages.
    who: &'static str,
    child: Child,
    /// The command's process group; `None` if it did not start (the child then exits saying
    /// why).
    group: Option<Pid>,
}

impl Supervised {
    /// Starts `command` (program and arguments) for `who` with `env` added to the environment, in
    /// a process group of its own. An error says why it could not start.
    pub(super) async fn start(
        who: &'static str,
        command: &[OsString],
        env: &[(&str, &str)],
    ) -> io::Result<Self> {
        let (program, args) = command.split_first().expect("clap requires a command");
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;

            use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};

            assert_eq!(
                nix::unistd::gettid(),
                nix::unistd::getpid(),
                "the command is started from the main thread: the parent-death signal follows \
                 the thread that forks"
            );
            // The helper reports the command's pid on a pipe whose writing end it inherits: the
            // one descriptor without close-on-exec, for the moment of this spawn.
            let (report, reporter) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(helper_error)?;
            fcntl(&reporter, FcntlArg::F_SETFD(FdFlag::empty())).map_err(helper_error)?;
            let mut child = Command::new(SELF)
                .arg0("lockbroker")
                .args(["__supervise", "--for", who, "--supervisor"])
                .arg(std::process::id().to_string())
                .arg("--report-fd")
                .arg(reporter.as_raw_fd().to_string())
                .arg("--")
                .arg(program)
                .args(args)
                .envs(env.iter().copied())
                .process_group(0)
                .spawn()
                .map_err(helper_error)?;
            drop(reporter);
            match read_pid(report).await {
                Ok(group) => Ok(Self { who, child, group }),
                Err(e) => {
                    // Its command, if it started, dies with it (its parent-death signal).
                    let _ = child.start_kill();
                    Err(helper_error(e))
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        {
            let child = Command::new(program)
                .args(args)
                .envs(env.iter().copied())
                .process_group(0)
                .spawn()?;
            let group = child
                .id()
                .and_then(|id| i32::try_from(id).ok())
                .map(Pid::from_raw);
            Ok(Self { who, child, group })
        }
    }

    /// Sends `signal` to the command's process group. A group that is gone already is fine.
    pub(super) fn signal(&self, signal: Signal) {
        let Some(group) = self.group else { return };
        match killpg(group, signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => self.say(format_args!("cannot send {signal} to the command: {e}")),
        }
    }

    /// Waits for the command to end: its status (on Linux, as the helper passes it on).
    pub(super) async fn wait(&mut self) -> io::Result<ExitStatus> {
        let status = self.child.wait().await;
        #[cfg(target_os = "linux")]
        if let Ok(status) = &status {
            use std::os::unix::process::ExitStatusExt;
            if let Some(signal) = status.signal() {
                // The helper itself was killed: its command's first process died with it, and
                // the rest of the group goes now.
                self.say(format_args!(
                    "the process between {} and its command got signal {signal}; sending SIGKILL \
                     to the command",
                    self.who
                ));
                self.signal(Signal::SIGKILL);
            }
        }
        status
    }

    fn say(&self, message: fmt::Arguments<'_>) {
        eprintln!("lockbroker {}: {message}", self.who);
    }
}

/// Why the helper between the supervisor and its command could not start.
#[cfg(target_os = "linux")]
fn helper_error(e: impl fmt::Display) -> io::Error {
    io::Error::other(format!("cannot start lockbroker's helper: {e}"))
}

/// The pid the helper writes on `report` before it closes it; `None` if it closed it without
/// (it could not start the command).
#[cfg(target_os = "linux")]
async fn read_pid(report: std::os::fd::OwnedFd) -> io::Result<Option<Pid>> {
    use tokio::io::AsyncReadExt;

    let mut text = String::new();
    tokio::net::unix::pipe::Receiver::from_owned_fd(report)?
        .read_to_string(&mut text)
        .await?;
    if text.is_empty() {
        return Ok(None);
    }
    text.trim()
        .parse()
        .map(|pid| Some(Pid::from_raw(pid)))
        .map_err(|_| io::Error::other(format!("an unexpected report: {text:?}")))
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
pub(crate) use self::helpers::{ExecArgs, SuperviseArgs, exec, supervise};

/// The hidden subcommands between a supervisor and its command. They run before `main` starts
/// the async runtime: one thread, no signal handlers.
#[cfg(target_os = "linux")]
mod helpers {
    use std::ffi::OsString;
    use std::fmt;
    use std::fs::OpenOptions;
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::process::CommandExt;
    use std::process::ExitCode;
    use std::time::{Duration, Instant};

    use clap::Args;
    use nix::errno::Errno;
    use nix::sys::prctl;
    use nix::sys::signal::{SigSet, Signal, killpg};
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    use nix::unistd::{Pid, getppid};

    use super::{SELF, cannot_run, exit};

    /// How long a helper whose supervisor died waits for the command's killed processes to
    /// die, reaping them: they die at once, unless one left the group.
    const REAP_LIMIT: Duration = Duration::from_secs(1);

    /// `lockbroker __exec`: the command's first process, until it `exec`s the command.
    #[derive(Debug, Args)]
    pub(crate) struct ExecArgs {
        #[command(flatten)]
        watched: Watched,
        /// The command and its arguments.
        #[arg(last = true, required = true, num_args = 1..)]
        command: Vec<OsString>,
    }

    /// `lockbroker __supervise`: starts the command, passes its status on, and kills its group
    /// if the supervisor dies.
    #[derive(Debug, Args)]
    pub(crate) struct SuperviseArgs {
        #[command(flatten)]
        watched: Watched,
        /// The inherited descriptor to write the command's pid on.
        #[arg(long)]
        report_fd: i32,
        /// The command and its arguments.
        #[arg(last = true, required = true, num_args = 1..)]
        command: Vec<OsString>,
    }

    /// The helper's parent, whose death is the command's.
    #[derive(Debug, Args)]
    struct Watched {
        /// `run` or `elect`, for messages.
        #[arg(long = "for")]
        who: String,
        /// The parent's pid.
        #[arg(long)]
        supervisor: i32,
    }

    impl Watched {
        /// Whether the parent has died: this process was handed to another.
        fn is_gone(&self) -> bool {
            getppid() != Pid::from_raw(self.supervisor)
        }

        fn say(&self, message: fmt::Arguments<'_>) {
            eprintln!("lockbroker {}: {message}", self.who);
        }
    }

    /// Arms the parent-death signal (SIGKILL), checks the parent is still there, and runs the
    /// command in this process. Returns only if the command could not be run.
    pub(crate) fn exec(args: ExecArgs) -> ExitCode {
        let ExecArgs { watched, command } = args;
        if let Err(e) = prctl::set_pdeathsig(Signal::SIGKILL) {
            watched.say(format_args!(
                "cannot set the command's parent-death signal: {e}"
            ));
            return ExitCode::from(exit::CANNOT_EXECUTE);
        }
        if watched.is_gone() {
            // It died before the setting took: nothing would stop the command.
            return ExitCode::from(exit::ERROR);
        }
        // The command starts with no signal blocked: those of `__supervise` are inherited
        // through fork and exec (a forwarded signal that is pending arrives now).
        if let Err(e) = SigSet::empty().thread_set_mask() {
            watched.say(format_args!("cannot unblock the command's signals: {e}"));
            return ExitCode::from(exit::CANNOT_EXECUTE);
        }
        let (program, args) = command.split_first().expect("clap requires a command");
        let e = std::process::Command::new(program).args(args).exec();
        watched.say(format_args!(
            "cannot run {:?}: {e}",
            program.to_string_lossy()
        ));
        cannot_run(&e)
    }

    /// Starts the command (through `__exec`) in a process group of its own, reports its pid,
    /// and waits: for its end (exits with its status) or for the supervisor's death (kills its
    /// group, reaps it and exits).
    pub(crate) fn supervise(args: SuperviseArgs) -> ExitCode {
        let SuperviseArgs {
            watched,
            report_fd,
            command,
        } = args;
        let fail = |what: &str, e: &dyn fmt::Display| {
            watched.say(format_args!("cannot {what}: {e}; the command did not run"));
            ExitCode::from(exit::CANNOT_EXECUTE)
        };
        // `ps` and `top` show this, not `exe`.
        let _ = prctl::set_name(c"lockbroker");
        let wake: SigSet = [
            Signal::SIGCHLD,
            Signal::SIGTERM,
            Signal::SIGINT,
            Signal::SIGHUP,
        ]
        .into_iter()
        .collect();
        // Blocked first, then armed: a death after this is a pending signal, not a lost one.
        if let Err(e) = wake
            .thread_block()
            .and_then(|()| prctl::set_pdeathsig(Signal::SIGTERM))
            .and_then(|()| prctl::set_child_subreaper(true))
        {
            return fail("watch over the command", &e);
        }
        if watched.is_gone() {
            return ExitCode::from(exit::ERROR);
        }
        // Opened anew with close-on-exec (and without waiting: a supervisor that died left no
        // reader), and the inherited descriptor closed, so that the command inherits neither.
        let report = OpenOptions::new()
            .write(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(format!("/proc/self/fd/{report_fd}"));
        let _ = nix::unistd::close(report_fd);
        let mut report = match report {
            Ok(report) => report,
            Err(e) => return fail("report the command's pid", &e),
        };
        let (program, args) = command.split_first().expect("clap requires a command");
        let command = match std::process::Command::new(SELF)
            .arg0("lockbroker")
            .args(["__exec", "--for", &watched.who, "--supervisor"])
            .arg(std::process::id().to_string())
            .arg("--")
            .arg(program)
            .args(args)
            .process_group(0)
            .spawn()
        {
            Ok(child) => Pid::from_raw(i32::try_from(child.id()).expect("a pid fits in an i32")),
            Err(e) => return fail("start lockbroker's helper", &e),
        };
        // A supervisor that died meanwhile finds out below.
        let _ = writeln!(report, "{command}");
        drop(report);
        loop {
            if watched.is_gone() {
                kill_and_reap(&watched, command);
                return ExitCode::from(exit::ERROR);
            }
            if let Some(code) = reap(command) {
                return ExitCode::from(code);
            }
            if let Err(e) = wake.wait() {
                // Cannot happen with this set; if it did, the command is left to the supervisor.
                watched.say(format_args!("cannot wait for the command: {e}"));
                return ExitCode::from(exit::ERROR);
            }
        }
    }

    /// Reaps every child that has ended (the command, and any of its orphans adopted here);
    /// the command's status as an exit code, once it has ended: its own, or 128 + the signal
    /// that killed it, as shells report it.
    fn reap(command: Pid) -> Option<u8> {
        let mut ended = None;
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == command => {
                    ended = Some(u8::try_from(code).unwrap_or(exit::ERROR));
                }
                Ok(WaitStatus::Signaled(pid, signal, _)) if pid == command => {
                    ended = Some(u8::try_from(128 + signal as i32).unwrap_or(exit::ERROR));
                }
                Ok(WaitStatus::StillAlive) | Err(_) => return ended,
                Ok(_) => {}
            }
        }
    }

    /// The supervisor died: SIGKILL to the command's group, then reaps its processes (the
    /// command, and its children, adopted here as they lose their parent) until none is left,
    /// within [`REAP_LIMIT`].
    fn kill_and_reap(watched: &Watched, group: Pid) {
        match killpg(group, Signal::SIGKILL) {
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
        let deadline = Instant::now() + REAP_LIMIT;
        // Signal 0: whether any process, a zombie included, is still in the group.
        while killpg(group, None).is_ok() && Instant::now() < deadline {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => std::thread::sleep(Duration::from_millis(1)),
                Ok(_) => {}
                // No child left: the rest is not ours to reap.
                Err(_) => return,
            }
        }
    }
}
